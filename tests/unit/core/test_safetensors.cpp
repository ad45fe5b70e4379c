// Tests for the hand-written safetensors reader/writer: round trips of every dtype, a check of the
// written bytes by an independent reader, hand-crafted spec bytes, every malformed-header case, and
// that an atomic save that fails leaves the previous file intact.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>

#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "test_util.h"

namespace {

using ddm::SafetensorsFile;
using json = nlohmann::json;

// Little-endian u64 prefix + header text (padded to 8 with spaces) + data.
std::string make_file(const std::string& header, const std::string& data, bool pad = true) {
  std::string h = header;
  if (pad) h.append((8 - h.size() % 8) % 8, ' ');
  std::string out;
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + h + data;
}

// Expects parse_safetensors to throw ddm::Error whose message contains every one of `parts`.
void expect_error(const std::string& bytes, std::initializer_list<std::string> parts) {
  try {
    ddm::parse_safetensors(bytes, "bad.safetensors");
    ADD_FAILURE() << "no error; expected one mentioning " << *parts.begin();
  } catch (const ddm::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

SafetensorsFile every_dtype() {
  torch::manual_seed(3);
  SafetensorsFile f;
  f.tensors["f64"] = torch::randn({3, 5}, torch::kFloat64);
  f.tensors["f32"] = torch::randn({2, 3, 4});
  f.tensors["f16"] = torch::randn({7}).to(torch::kFloat16);
  f.tensors["bf16"] = torch::randn({4, 2}).to(torch::kBFloat16);
  f.tensors["i64"] = torch::randint(-(int64_t(1) << 40), int64_t(1) << 40, {6}, torch::kInt64);
  f.tensors["i32"] = torch::randint(-100000, 100000, {2, 2}, torch::kInt32);
  f.tensors["i16"] = torch::randint(-30000, 30000, {5}, torch::kInt16);
  f.tensors["i8"] = torch::randint(-128, 128, {9}, torch::kInt8);
  f.tensors["u8"] = torch::randint(0, 256, {1, 3, 3}, torch::kUInt8);
  f.tensors["bool"] = torch::randint(0, 2, {11}).to(torch::kBool);
  f.tensors["scalar"] = torch::tensor(2.5);
  f.tensors["empty"] = torch::zeros({0, 4});
  f.tensors["strided"] = torch::arange(12, torch::kFloat32).view({3, 4}).t();  // non-contiguous input
  f.metadata["format"] = "pt";
  f.metadata["step"] = "42";
  return f;
}

TEST(Safetensors, RoundTripEveryDtype) {
  const SafetensorsFile f = every_dtype();
  const SafetensorsFile g = ddm::parse_safetensors(ddm::safetensors_bytes(f), "mem");
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  EXPECT_EQ(g.metadata, f.metadata);
  for (const auto& [name, t] : f.tensors) {
    const torch::Tensor& u = g.tensors.at(name);
    EXPECT_EQ(u.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(u.sizes(), t.sizes()) << name;
    EXPECT_TRUE(u.is_contiguous()) << name;
    EXPECT_TRUE(torch::equal(u, t)) << name;
  }
}

TEST(Safetensors, ParsedTensorsOwnTheirMemory) {
  SafetensorsFile f;
  f.tensors["a"] = torch::arange(4, torch::kFloat32);
  std::string bytes = ddm::safetensors_bytes(f);
  SafetensorsFile g = ddm::parse_safetensors(bytes, "mem");
  std::fill(bytes.begin(), bytes.end(), '\0');
  bytes.clear();
  bytes.shrink_to_fit();
  EXPECT_TRUE(torch::equal(g.tensors.at("a"), torch::arange(4, torch::kFloat32)));
}

// An independent reader: only the spec and nlohmann/json, no ddm parsing code.
TEST(Safetensors, BytesMatchTheSpecByHand) {
  const SafetensorsFile f = every_dtype();
  const std::string bytes = ddm::safetensors_bytes(f);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u) << "header must be padded to 8 bytes";
  ASSERT_LE(8 + n, bytes.size());
  const std::string text = bytes.substr(8, n);
  EXPECT_EQ(text.front(), '{');
  const json header = json::parse(text);  // trailing spaces are valid JSON whitespace
  EXPECT_EQ(header.at("__metadata__").at("step"), "42");
  const std::map<std::string, size_t> width = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                                               {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  const std::string data = bytes.substr(8 + n);
  size_t covered = 0;
  for (const auto& [name, t] : f.tensors) {
    const json& e = header.at(name);
    size_t numel = 1;
    for (const auto& d : e.at("shape")) numel *= d.get<size_t>();
    const size_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
    ASSERT_EQ(end - begin, numel * width.at(e.at("dtype"))) << name;
    ASSERT_LE(end, data.size()) << name;
    const torch::Tensor c = t.contiguous();
    // An empty tensor's data_ptr() is null, which memcmp must not be given even for 0 bytes.
    if (end > begin) {
      EXPECT_EQ(std::memcmp(data.data() + begin, c.data_ptr(), end - begin), 0) << name;
    }
    covered += end - begin;
  }
  EXPECT_EQ(covered, data.size());
  EXPECT_EQ(header.at("u8").at("dtype"), "U8");
  EXPECT_EQ(header.at("bf16").at("shape"), json::array({4, 2}));
  EXPECT_EQ(header.at("scalar").at("shape"), json::array());
}

TEST(Safetensors, ParsesHandCraftedSpecBytes) {
  // I32 [2,2] = {1, 2, -1, 256} little-endian, then U8 [3] = {7, 8, 9}; no padding needed by readers.
  const std::string data("\x01\x00\x00\x00\x02\x00\x00\x00\xff\xff\xff\xff\x00\x01\x00\x00\x07\x08\x09", 19);
  const std::string header =
      R"({"__metadata__":{"foo":"bar"},"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("bytes":{"dtype":"U8","shape":[3],"data_offsets":[16,19]}})";
  for (bool pad : {true, false}) {
    const SafetensorsFile f = ddm::parse_safetensors(make_file(header, data, pad), "spec");
    EXPECT_EQ(f.metadata.at("foo"), "bar");
    EXPECT_TRUE(torch::equal(f.tensors.at("test"), torch::tensor({1, 2, -1, 256}, torch::kInt32).view({2, 2})));
    EXPECT_TRUE(torch::equal(f.tensors.at("bytes"), torch::tensor({7, 8, 9}, torch::kUInt8)));
  }
  // An empty file body: header "{}" only.
  EXPECT_TRUE(ddm::parse_safetensors(make_file("{}", ""), "spec").tensors.empty());
}

TEST(Safetensors, RejectsBadHeaders) {
  const std::string four(4, '\0'), eight(8, '\0');
  auto one = [](const std::string& entry) { return std::string(R"({"w":)") + entry + "}"; };
  expect_error("abc", {"shorter than the 8-byte"});
  {
    std::string b = make_file("{}", "");
    b[0] = 100;  // header length 100 > file
    expect_error(b, {"beyond the file size"});
  }
  expect_error(make_file("[1]", ""), {"does not start with '{'"});
  expect_error(make_file(R"({"w":{"dtype":"F32",)", ""), {"not valid JSON"});
  expect_error(make_file(one(R"({"shape":[1],"data_offsets":[0,4]})"), four), {"'w'", "missing 'dtype'"});
  expect_error(make_file(one(R"({"dtype":"F32","data_offsets":[0,4]})"), four), {"'w'", "missing 'shape'"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[1]})"), four), {"'w'", "missing 'data_offsets'"});
  expect_error(make_file(one(R"({"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]})"), four),
               {"'w'", "unknown or unsupported dtype 'F8_E4M3'"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), four), {"'w'", "negative"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})"), four),
               {"'w'", "not an integer"});
  expect_error(make_file(one(R"({"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,4]})"), four),
               {"'w'", "overflows"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})"), four),
               {"'w'", "span 4 bytes", "needs 8 bytes"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), four),
               {"'w'", "past the data buffer"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,0]})"), four), {"'w'", "begin > end"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})"), four), {"'w'", "[begin, end]"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1})"), four),
               {"'w'", "unexpected key 'extra'"});
  expect_error(make_file(one("3"), four), {"'w'", "JSON object"});
  expect_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         std::string(12, '\0')),
               {"'b'", "overlaps tensor 'a'"});
  expect_error(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         std::string(12, '\0')),
               {"gap of 4 bytes before tensor 'b'"});
  expect_error(make_file(one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})"), eight),
               {"4 bytes after the last tensor 'w'"});
  expect_error(make_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                         four),
               {"tensor 'w' appears twice"});
  expect_error(make_file(R"({"__metadata__":{"k":1}})", ""), {"'__metadata__' key 'k' must be a string"});
  expect_error(make_file(one(R"({"dtype":"BOOL","shape":[2],"data_offsets":[0,2]})"), std::string("\x01\x02", 2)),
               {"'w'", "BOOL", "must be 0 or 1"});
}

TEST(Safetensors, WriterRejectsUnsupportedDtypes) {
  SafetensorsFile f;
  f.tensors["z"] = torch::zeros({2}, torch::kComplexFloat);
  try {
    ddm::safetensors_bytes(f);
    FAIL() << "complex tensor was accepted";
  } catch (const ddm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'z'"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, FileRoundTripAndAtomicFailureKeepsOldFile) {
  ddm::test::TempDir dir;
  const std::string path = dir / "w.safetensors";
  SafetensorsFile f;
  f.tensors["w"] = torch::arange(10, torch::kFloat32);
  ddm::save_safetensors(path, f);
  EXPECT_TRUE(torch::equal(ddm::load_safetensors(path).tensors.at("w"), f.tensors.at("w")));
  const std::string before = ddm::read_file(path);
  const std::string hash = ddm::sha256_file(path);
  // No temporary file is left behind after a successful save.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator()), 1);

  // Block the temporary name with a directory: the write fails even for root, and must not touch
  // the existing file.
  std::filesystem::create_directory(path + ".tmp-" + std::to_string(::getpid()));
  SafetensorsFile g;
  g.tensors["w"] = torch::ones({10});
  EXPECT_THROW(ddm::save_safetensors(path, g), ddm::Error);
  EXPECT_EQ(ddm::read_file(path), before);
  EXPECT_EQ(ddm::sha256_file(path), hash);

  // A directory that does not exist: clear error naming the path.
  try {
    ddm::save_safetensors(dir / "missing/w.safetensors", g);
    FAIL() << "save into a missing directory succeeded";
  } catch (const ddm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing/w.safetensors"), std::string::npos) << e.what();
  }
  // Loading a missing file names it.
  try {
    ddm::load_safetensors(dir / "nope.safetensors");
    FAIL() << "loading a missing file succeeded";
  } catch (const ddm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  // A truncated file names itself.
  ddm::test::write_text(dir / "cut.safetensors", before.substr(0, before.size() - 3));
  try {
    ddm::load_safetensors(dir / "cut.safetensors");
    FAIL() << "truncated file accepted";
  } catch (const ddm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cut.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, SelectiveLoadReadsTheChosenTensorsAndChecksTheWholeHeader) {
  ddm::test::TempDir dir;
  const std::string path = dir / "all.safetensors";
  const SafetensorsFile f = every_dtype();
  ddm::save_safetensors(path, f);
  const SafetensorsFile some = ddm::load_safetensors(path, [](const std::string& k) { return k[0] == 'f' || k == "bool"; });
  EXPECT_EQ(some.metadata, f.metadata);
  ASSERT_EQ(some.tensors.size(), 4u);  // f64 f32 f16 bool
  for (const auto& [name, t] : some.tensors) EXPECT_TRUE(torch::equal(t, f.tensors.at(name))) << name;
  // The same malformed files as the whole reader refuses, even when no tensor is wanted.
  const auto none = [](const std::string&) { return false; };
  ddm::test::write_text(dir / "cut.safetensors", ddm::read_file(path).substr(0, 100));
  EXPECT_NE(ddm::test::error_message([&] { ddm::load_safetensors(dir / "cut.safetensors", none); }).find("cut.safetensors"),
            std::string::npos);
  ddm::test::write_text(dir / "gap.safetensors", make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                                           std::string(12, '\0')));
  EXPECT_NE(ddm::test::error_message([&] { ddm::load_safetensors(dir / "gap.safetensors", none); })
                .find("gap of 4 bytes before tensor 'b'"),
            std::string::npos);
  ddm::test::write_text(dir / "bool.safetensors", make_file(R"({"w":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})",
                                                            std::string("\x01\x02", 2)));
  EXPECT_NE(ddm::test::error_message([&] { ddm::load_safetensors(dir / "bool.safetensors", [](const std::string&) { return true; }); })
                .find("must be 0 or 1"),
            std::string::npos);
  EXPECT_NE(ddm::test::error_message([&] { ddm::load_safetensors(dir / "nope.safetensors", none); }).find("No such file"),
            std::string::npos);
}

TEST(FileIo, Sha256KnownVectors) {
  EXPECT_EQ(ddm::sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(ddm::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  ddm::test::TempDir dir;
  ddm::write_file_atomic(dir / "abc", "abc");
  EXPECT_EQ(ddm::read_file(dir / "abc"), "abc");
  EXPECT_EQ(ddm::sha256_file(dir / "abc"), ddm::sha256_hex("abc"));
  ddm::Sha256 pieces;  // the same digest over pieces as over their concatenation
  pieces.update("a", 1);
  pieces.update("", 0);
  pieces.update("bc", 2);
  EXPECT_EQ(pieces.hex(), ddm::sha256_hex("abc"));
  ddm::write_file_atomic(dir / "abc", "replaced");
  EXPECT_EQ(ddm::read_file(dir / "abc"), "replaced");
  EXPECT_THROW(ddm::read_file(dir.path), ddm::Error);
  EXPECT_THROW(ddm::sha256_file(dir / "none"), ddm::Error);
}

// Tests keep off the user's cache (test_util.h): a test process, and every program it starts, has
// XDG_CACHE_HOME = the build's test-cache/, so ddm's cache directory is there, not ~/.cache/ddm.
TEST(FileIo, TestProcessesUseTheBuildsCacheDirectoryNotTheUsers) {
  const std::string home = ddm::test::cache_home();
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  ASSERT_NE(xdg, nullptr);
  EXPECT_EQ(std::string(xdg), home);
  EXPECT_TRUE(std::filesystem::path(home).is_absolute()) << home;
  EXPECT_EQ(ddm::default_cache_dir(), (std::filesystem::path(home) / "ddm").string());
  if (const char* user = std::getenv("HOME"); user && *user) {
    EXPECT_NE(ddm::default_cache_dir(), (std::filesystem::path(user) / ".cache" / "ddm").string());
  }
  const auto child = ddm::test::run_command("printenv XDG_CACHE_HOME");
  EXPECT_EQ(child.output, home + "\n");
}

}  // namespace
