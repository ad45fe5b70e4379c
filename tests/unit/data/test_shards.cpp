// WebDataset tar shards and image decoding (data/shards.h, data/decode.h): shard lists as brace
// patterns, globs and list files; a written shard reads back in order, bit for bit, with its keys,
// extensions and labels; a truncated shard, a sample split apart, a bad label and a missing shard
// are errors naming the shard and key; PNG and lossless WebP decode to the encoded pixels exactly,
// JPEG within its quantization; grey and colour convert both ways; a header claiming a huge image
// is refused before any allocation; crops take the centre or the drawn offset, resizing keeps a
// flat image flat. The origin of shards follows the records `ddm shards write` and `ddm encode` leave.
#include <gtest/gtest.h>

#include <turbojpeg.h>
#include <webp/encode.h>
#include <zlib.h>

#include <sys/resource.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "data/latent_shards.h"
#include "data/origin.h"
#include "data/shard_write.h"
#include "data/decode.h"
#include "data/image_folder.h"
#include "data/shards.h"
#include "eval/grid.h"
#include "test_util.h"

using namespace ddm;
namespace fs = std::filesystem;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

ShardSample sample(const std::string& key, std::map<std::string, std::string> files) {
  ShardSample s;
  s.key = key;
  s.files = std::move(files);
  return s;
}

void write_shard(const std::string& path, const std::vector<ShardSample>& samples) {
  TarShardWriter w(path);
  for (const ShardSample& s : samples) w.add(s);
  w.finish();
}

std::vector<ShardSample> read_all(const std::string& path) {
  TarShardReader r(path);
  std::vector<ShardSample> out;
  ShardSample s;
  while (r.next(s)) out.push_back(s);
  return out;
}

// A colour test image, uint8 [H, W, 3]: smooth gradients (JPEG keeps them well).
torch::Tensor gradient(int64_t h, int64_t w) {
  auto y = torch::arange(h, torch::kFloat).view({h, 1, 1}) / static_cast<double>(h);
  auto x = torch::arange(w, torch::kFloat).view({1, w, 1}) / static_cast<double>(w);
  auto c = torch::tensor({0.2f, 0.5f, 0.9f}).view({1, 1, 3});
  return (255 * (0.5 * x + 0.3 * y + 0.2 * c)).round().clamp(0, 255).to(torch::kUInt8).expand({h, w, 3}).contiguous();
}

std::string jpeg_of(const torch::Tensor& hwc, int quality) {
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  EXPECT_EQ(tjCompress2(h, hwc.data_ptr<uint8_t>(), static_cast<int>(hwc.size(1)), 0, static_cast<int>(hwc.size(0)), TJPF_RGB,
                        &buf, &size, TJSAMP_444, quality, 0),
            0);
  std::string out(reinterpret_cast<char*>(buf), size);
  tjFree(buf);
  tjDestroy(h);
  return out;
}

std::string webp_lossless_of(const torch::Tensor& hwc) {
  uint8_t* buf = nullptr;
  const size_t n = WebPEncodeLosslessRGB(hwc.data_ptr<uint8_t>(), static_cast<int>(hwc.size(1)), static_cast<int>(hwc.size(0)),
                                         static_cast<int>(hwc.size(1) * 3), &buf);
  std::string out(reinterpret_cast<char*>(buf), n);
  WebPFree(buf);
  return out;
}

// A PNG whose IHDR (CRC correct) claims w x h pixels and which has no image data.
std::string png_header_claiming(uint32_t w, uint32_t h) {
  std::string s = "\x89PNG\r\n\x1a\n";
  auto be32 = [](uint32_t v) { return std::string{char(v >> 24), char(v >> 16), char(v >> 8), char(v)}; };
  std::string chunk = "IHDR" + be32(w) + be32(h) + std::string{8, 2, 0, 0, 0};
  s += be32(13) + chunk + be32(static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(chunk.data()), static_cast<uInt>(chunk.size()))));
  return s;
}

}  // namespace

TEST(ShardList, BracePatternsExpandInOrder) {
  EXPECT_EQ(expand_braces("a-{000..002}.tar", "k"), (std::vector<std::string>{"a-000.tar", "a-001.tar", "a-002.tar"}));
  EXPECT_EQ(expand_braces("{x,y}-{8..10}", "k"), (std::vector<std::string>{"x-8", "x-9", "x-10", "y-8", "y-9", "y-10"}));
  EXPECT_EQ(expand_braces("plain.tar", "k"), std::vector<std::string>{"plain.tar"});
  EXPECT_TRUE(has(test::error_message([] { expand_braces("a-{0..3.tar", "data.root"); }), "data.root = \"a-{0..3.tar\": the brace at position 2 is not closed"));
  EXPECT_TRUE(has(test::error_message([] { expand_braces("a-{5..3}", "k"); }), "runs backwards"));
  EXPECT_TRUE(has(test::error_message([] { expand_braces("a-{x..3}", "k"); }), "is not a numeric range"));
  EXPECT_TRUE(has(test::error_message([] { expand_braces("{0..99999}{0..99999}", "k"); }), "more than"));
}

TEST(ShardList, PatternsGlobsAndListFilesNameExistingShards) {
  test::TempDir dir;
  fs::create_directories(dir / "d");
  for (int i = 0; i < 3; ++i) write_shard(dir / ("d/s-0" + std::to_string(i) + ".tar"), {sample("k", {{"cls", "1"}})});
  const std::vector<std::string> all = {dir / "d/s-00.tar", dir / "d/s-01.tar", dir / "d/s-02.tar"};
  EXPECT_EQ(expand_shards(dir / "d/s-{00..02}.tar", "data.root"), all);
  EXPECT_EQ(expand_shards(dir / "d/*.tar", "data.root"), all);
  EXPECT_EQ(expand_shards(dir / "d/s-01.tar", "data.root"), std::vector<std::string>{all[1]});
  test::write_text(dir / "d/list.txt", "# the shards\ns-02.tar\n\n  " + all[0] + "  \n");
  EXPECT_EQ(expand_shards(dir / "d/list.txt", "data.root"), (std::vector<std::string>{(fs::path(dir / "d") / "s-02.tar").string(), all[0]}));
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "d/s-{00..03}.tar", "data.root"); }),
                  "shard " + dir / "d/s-03.tar" + " does not exist (4 shards named)"));
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "d/*.tgz", "data.root"); }), "matches no file"));
  EXPECT_TRUE(has(test::error_message([&] { expand_shards("", "data.root"); }), "data.root is empty"));
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "nope.txt", "data.root"); }), "no such list file"));
  // A folder of shards: its .tar files, sorted (the list file beside them is not one).
  EXPECT_EQ(expand_shards(dir / "d", "data.root"), all);
  EXPECT_EQ(expand_shards(dir / "d/", "data.root"), all);
  // What a user may name instead of a tar: the folder of pictures, a compressed tar; and .TAR is a tar.
  fs::create_directories(dir / "pictures");
  test::write_text(dir / "pictures/cat.png", "x");
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "pictures", "data.root"); }),
                  "is a folder without .tar files: put its pictures in a tar (tar --sort=name -cf pictures-000000.tar -C " +
                      dir / "pictures"));
  test::write_text(dir / "p.tar.gz", "x");
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "p.tar.gz", "data.root"); }), "a compressed archive"));
  fs::copy_file(dir / "d/s-00.tar", dir / "d/UPPER.TAR");
  EXPECT_EQ(expand_shards(dir / "d/UPPER.TAR", "data.root"), std::vector<std::string>{dir / "d/UPPER.TAR"});
  test::write_text(dir / "empty.txt", "# nothing\n");
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "empty.txt", "data.root"); }), "names no shard"));
  // The record `ddm shards write` leaves: the shards it lists, from its folder; another JSON is named.
  test::write_text(dir / "d/s.shards.json", R"({"format": "ddm shards", "version": 1, "samples": 2,
    "shards": [{"name": "s-01.tar", "bytes": 1}, {"name": "s-02.tar", "bytes": 1}]})");
  EXPECT_EQ(expand_shards(dir / "d/s.shards.json", "data.root"),
            (std::vector<std::string>{(fs::path(dir / "d") / "s-01.tar").string(), (fs::path(dir / "d") / "s-02.tar").string()}));
  test::write_text(dir / "d/other.shards.json", R"({"format": "something else"})");
  EXPECT_TRUE(has(test::error_message([&] { expand_shards(dir / "d/other.shards.json", "data.root"); }),
                  "not the record of `ddm shards write`"));
}

// A shard's origin is its record's when the record lists it at its current size; one shard without
// (or changed since, or of another origin) makes the origin unknown. Latent shards carry their
// data's origin in encode.json.
TEST(ShardList, TheOriginFollowsTheRecordsOfWrittenShards) {
  test::TempDir dir;
  Dataset data;
  data.images = torch::zeros({5, 1, 4, 4}, torch::kUInt8);
  data.labels = torch::arange(5, torch::kInt64);
  data.num_classes = 5;
  const ShardsWritten w = write_shards(data, dir / "a", 2, "train");
  ASSERT_EQ(w.shards, 3);
  DataConfig shards;
  shards.source = "shards";
  shards.root = w.pattern;
  EXPECT_EQ(data_origin(shards), "shards");  // no record yet
  write_shards_record(dir / "a", "train", w, "fashion-mnist", "test images");
  EXPECT_EQ(data_origin(shards), "fashion-mnist");
  const ShardsWritten v = write_shards(data, dir / "a", 5, "val");
  write_shards_record(dir / "a", "val", v, "folder", "other images");
  test::write_text(dir / "list.txt", w.pattern.substr(0, w.pattern.find('{')) + "000001.tar\n" + dir / "a/val-000000.tar\n");
  shards.root = dir / "list.txt";
  EXPECT_EQ(data_origin(shards), "shards");  // two origins
  shards.root = dir / "a/val-000000.tar";
  EXPECT_EQ(data_origin(shards), "folder");
  {
    std::ofstream grow(dir / "a/train-000002.tar", std::ios::app);
    grow << std::string(512, '\0');  // still a valid tar, but not the recorded one
  }
  shards.root = w.pattern;
  EXPECT_EQ(data_origin(shards), "shards");
  shards.root = dir / "a/train-{000000..000001}.tar";
  EXPECT_EQ(data_origin(shards), "fashion-mnist");  // a subset of the recorded shards
  for (const char* source : {"fashion-mnist", "folder"}) {
    DataConfig d;
    d.source = source;
    EXPECT_EQ(data_origin(d), source);
  }
  LatentShardsInfo info;
  info.autoencoder = "ae", info.autoencoder_sha256 = std::string(64, 'a');
  info.latent_channels = 4, info.latent_size = 2, info.image_channels = 1, info.image_size = 8;
  info.samples = 5, info.shards = 1, info.data = "test images", info.pattern = "latents-{000000..000000}.tar";
  fs::create_directories(dir / "lat");
  test::write_text(dir / "lat/encode.json", latent_shards_json(info).dump());
  DataConfig latents;
  latents.source = "latents";
  latents.root = dir / "lat";
  EXPECT_EQ(data_origin(latents), "latents");  // not recorded
  info.origin = "fashion-mnist";
  test::write_text(dir / "lat/encode.json", latent_shards_json(info).dump());
  EXPECT_EQ(data_origin(latents), "fashion-mnist");
}

TEST(TarShard, WrittenSamplesReadBackInOrder) {
  test::TempDir dir;
  std::vector<ShardSample> in;
  for (int i = 0; i < 50; ++i) {
    std::string bytes(static_cast<size_t>(i * 37 % 1500), '\0');
    for (size_t j = 0; j < bytes.size(); ++j) bytes[j] = static_cast<char>((i * 131 + static_cast<int>(j) * 7) & 0xff);
    in.push_back(sample("class" + std::to_string(i % 3) + "/img_" + std::to_string(1000 - i),
                        {{"png", bytes}, {"cls", std::to_string(i % 3)}, {"seg.png", "x"}}));
  }
  write_shard(dir / "s.tar", in);
  EXPECT_FALSE(fs::exists(dir / "s.tar.partial"));
  const std::vector<ShardSample> out = read_all(dir / "s.tar");
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i].key, in[i].key);
    EXPECT_EQ(out[i].files, in[i].files) << in[i].key;
    EXPECT_EQ(out[i].index, static_cast<int64_t>(i));
    EXPECT_EQ(sample_label(out[i], "s.tar " + out[i].key), static_cast<int64_t>(i % 3));
  }
  // The same samples give the same bytes (no times or owners in the headers).
  write_shard(dir / "again.tar", in);
  EXPECT_EQ(read_file(dir / "again.tar"), read_file(dir / "s.tar"));
  // From memory, as the fuzzer reads.
  const std::string bytes = read_file(dir / "s.tar");
  TarShardReader mem(bytes.data(), bytes.size(), "in memory");
  ShardSample s;
  int64_t n = 0;
  while (mem.next(s)) ++n;
  EXPECT_EQ(n, 50);
  // A writer dropped before finish() leaves nothing behind.
  {
    TarShardWriter w(dir / "dropped.tar");
    w.add(in[0]);
  }
  EXPECT_FALSE(fs::exists(dir / "dropped.tar"));
  EXPECT_FALSE(fs::exists(dir / "dropped.tar.partial"));
}

TEST(TarShard, KeysFollowTheWebDatasetConvention) {
  EXPECT_EQ(split_key("a/b.c.d"), (std::pair<std::string, std::string>{"a/b", "c.d"}));
  EXPECT_EQ(split_key("./x/img_1.JPG"), (std::pair<std::string, std::string>{"x/img_1", "jpg"}));
  EXPECT_EQ(split_key("dir.v2/img.png"), (std::pair<std::string, std::string>{"dir.v2/img", "png"}));
  EXPECT_EQ(split_key("README"), (std::pair<std::string, std::string>{"", ""}));
  EXPECT_EQ(split_key("a/.hidden"), (std::pair<std::string, std::string>{"", ""}));
}

TEST(TarShard, BadShardsAreErrorsNamingShardAndKey) {
  test::TempDir dir;
  std::vector<ShardSample> in;
  for (int i = 0; i < 4; ++i) in.push_back(sample("k" + std::to_string(i), {{"png", std::string(3000, 'a')}, {"cls", "2"}}));
  write_shard(dir / "s.tar", in);
  const std::string whole = read_file(dir / "s.tar");
  // Cut inside the third sample's image: each sample is k.cls (a header and a block) then k.png (a
  // header and 3000 bytes in 6 blocks).
  const std::string cut = whole.substr(0, 2 * (512 + 512 + 512 + 3072) + 512 + 512 + 512 + 1000);
  write_file_atomic(dir / "cut.tar", cut);
  const std::string e = test::error_message([&] { read_all(dir / "cut.tar"); });
  EXPECT_TRUE(has(e, "shard " + dir / "cut.tar")) << e;
  EXPECT_TRUE(has(e, "member k2.png is truncated")) << e;
  // Cut inside a header.
  write_file_atomic(dir / "cut2.tar", whole.substr(0, 2 * (512 + 512 + 512 + 3072) + 100));
  const std::string e2 = test::error_message([&] { read_all(dir / "cut2.tar"); });
  EXPECT_TRUE(has(e2, "shard " + dir / "cut2.tar" + ": corrupt or truncated after member k1.png")) << e2;
  // Not a tar at all.
  write_file_atomic(dir / "junk.tar", std::string(2000, 'z'));
  EXPECT_TRUE(has(test::error_message([&] { read_all(dir / "junk.tar"); }), "shard " + dir / "junk.tar"));
  // A sample whose files are apart.
  write_shard(dir / "apart.tar", {sample("a", {{"png", "1"}}), sample("b", {{"png", "2"}}), sample("a", {{"cls", "3"}})});
  EXPECT_TRUE(has(test::error_message([&] { read_all(dir / "apart.tar"); }), "sample 'a' appears twice"));
  // Labels.
  EXPECT_EQ(sample_label(sample("x", {{"json", "{\"label\": 7, \"caption\": \"a\"}"}}), "w"), 7);
  EXPECT_EQ(sample_label(sample("x", {{"png", ""}}), "w"), -1);
  EXPECT_TRUE(has(test::error_message([] { sample_label(sample("x", {{"cls", "cat"}}), "s.tar key x"); }),
                  "s.tar key x: its .cls is \"cat\", not a non-negative integer label"));
  // A .json without "label" is no label (img2dataset's: a caption, a URL); one with a bad label is an error.
  EXPECT_EQ(sample_label(sample("x", {{"json", "{\"caption\": \"a cat\", \"url\": \"http://x\"}"}}), "w"), -1);
  EXPECT_TRUE(has(test::error_message([] { sample_label(sample("x", {{"json", "{\"label\": -1}"}}), "w"); }),
                  "w: its .json's \"label\" is -1, not a non-negative integer"));
  EXPECT_TRUE(has(test::error_message([] { sample_label(sample("x", {{"json", "{"}}), "w"); }), "not a JSON object"));
}

TEST(Decode, PngAndLosslessWebpGiveTheirPixelsJpegItsQuantization) {
  const torch::Tensor hwc = gradient(24, 40);
  const torch::Tensor chw = hwc.permute({2, 0, 1}).contiguous();
  EXPECT_TRUE(torch::equal(decode_image(encode_png(hwc), "png", 3, "t.png"), chw));
  EXPECT_TRUE(torch::equal(decode_image(webp_lossless_of(hwc), "webp", 3, "t.webp"), chw));
  const torch::Tensor j = decode_image(jpeg_of(hwc, 95), "jpg", 3, "t.jpg");
  ASSERT_EQ(j.sizes(), chw.sizes());
  EXPECT_LT((j.to(torch::kFloat) - chw.to(torch::kFloat)).abs().mean().item<double>(), 2.0);
  // Colour to grey: BT.601 luma; grey to colour: replicated.
  const torch::Tensor grey = decode_image(encode_png(hwc), "png", 1, "t.png");
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{1, 24, 40}));
  const auto f = chw.to(torch::kFloat);
  const auto luma = (0.299 * f[0] + 0.587 * f[1] + 0.114 * f[2]);
  EXPECT_LE((grey[0].to(torch::kFloat) - luma).abs().max().item<double>(), 1.0);
  const torch::Tensor flat = grey[0].unsqueeze(2).expand({24, 40, 3}).contiguous();
  const torch::Tensor back = decode_image(encode_png(flat), "png", 3, "g.png");
  EXPECT_TRUE(torch::equal(back[0], grey[0]) && torch::equal(back[2], grey[0]));
  EXPECT_TRUE(torch::equal(decode_image(encode_png(flat), "png", 1, "g.png"), grey));  // a grey image stays exact
  EXPECT_LT((decode_image(jpeg_of(flat, 95), "jpeg", 1, "g.jpg").to(torch::kFloat) - grey.to(torch::kFloat)).abs().mean().item<double>(), 2.0);
}

// A CMYK JPEG (print files; Adobe's inverted inks), written by Pillow: ddm gives Pillow's RGB of it
// within a unit (both decode the same JPEG with libjpeg; the inks to RGB round alike), not an error.
TEST(Decode, ACmykJpegGivesPillowsRgb) {
  const auto made = ddm::test::reference_outputs("tests/reference/cmyk_jpeg.py", "{dir}");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const std::string jpg = test::read_text(made.dir + "/cmyk.jpg"), rgb = test::read_text(made.dir + "/rgb.bin");
  ASSERT_EQ(rgb.size(), 24u * 40u * 3u);
  const torch::Tensor want =
      torch::from_blob(const_cast<char*>(rgb.data()), {24, 40, 3}, torch::kUInt8).permute({2, 0, 1}).to(torch::kFloat);
  const torch::Tensor got = decode_image(jpg, "jpg", 3, "cmyk.jpg");
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{3, 24, 40}));
  EXPECT_LE((got.to(torch::kFloat) - want).abs().max().item<double>(), 1.0);
  EXPECT_EQ(image_channels(jpg, "jpg", "cmyk.jpg"), 3);
}

// A folder (data.source = "folder") decodes JPEG and WebP files as shards do: the same pixels as
// decode_image, CMYK JPEGs as Pillow gives them, the type read from the bytes (a JPEG named .png),
// and a damaged JPEG names its file. stb, which folders used for every type, read no WebP and no CMYK.
TEST(Decode, AFolderDecodesJpegWebpAndCmykAsShardsDo) {
  const auto made = ddm::test::reference_outputs("tests/reference/cmyk_jpeg.py", "{dir}");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  const std::string cmyk = test::read_text(made.dir + "/cmyk.jpg"), rgb = test::read_text(made.dir + "/rgb.bin");
  const std::string jpg = jpeg_of(gradient(24, 40), 90), webp = webp_lossless_of(gradient(24, 40));
  test::TempDir dir;
  fs::create_directories(dir / "imgs/a");
  test::write_text(dir / "imgs/a/1.jpg", jpg);
  test::write_text(dir / "imgs/a/2.WEBP", webp);
  test::write_text(dir / "imgs/a/3.jpeg", cmyk);
  test::write_text(dir / "imgs/a/4.png", jpg);  // a JPEG by its bytes
  test::write_text(dir / "imgs/a/5.png", encode_png(gradient(24, 40)));
  const Dataset d = load_image_folder(dir / "imgs");
  ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{5, 3, 24, 40}));
  EXPECT_TRUE(torch::equal(d.images[0], decode_image(jpg, "jpg", 3, "1.jpg")));
  EXPECT_TRUE(torch::equal(d.images[1], gradient(24, 40).permute({2, 0, 1})));
  EXPECT_TRUE(torch::equal(d.images[2], decode_image(cmyk, "jpg", 3, "3.jpeg")));
  const torch::Tensor pillow =
      torch::from_blob(const_cast<char*>(rgb.data()), {24, 40, 3}, torch::kUInt8).permute({2, 0, 1}).to(torch::kFloat);
  EXPECT_LE((d.images[2].to(torch::kFloat) - pillow).abs().max().item<double>(), 1.0);
  EXPECT_TRUE(torch::equal(d.images[3], d.images[0]));
  EXPECT_TRUE(torch::equal(d.images[4], gradient(24, 40).permute({2, 0, 1})));
  // A phone's HEIC or a scanner's TIFF is not read: left out, and said.
  test::write_text(dir / "imgs/a/6.HEIC", "x");
  fs::create_directories(dir / "imgs/a/deep");
  test::write_text(dir / "imgs/a/deep/8.tiff", "x");
  testing::internal::CaptureStderr();
  EXPECT_EQ(load_image_folder(dir / "imgs").images.size(0), 5);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(has(said, "note: " + (dir / "imgs") + ": 2 files are images of a format ddm does not read, left out (" +
                            (dir / "imgs/a/6.HEIC") + ", ...): convert them to PNG or JPEG"))
      << said;
  test::write_text(dir / "imgs/a/7.jpg", jpg.substr(0, 200));
  const std::string e = test::error_message([&] { load_image_folder(dir / "imgs"); });
  EXPECT_TRUE(has(e, "imgs/a/7.jpg: ")) << e;
  EXPECT_TRUE(has(e, "JPEG")) << e;
}

TEST(Decode, BadBytesAreErrorsNamingTheSample) {
  const std::string png = encode_png(gradient(8, 8));
  for (const auto& [bytes, ext] : std::vector<std::pair<std::string, std::string>>{
           {"not an image", "png"}, {"not an image", "jpg"}, {"not an image", "webp"}, {png.substr(0, png.size() / 2), "png"},
           {jpeg_of(gradient(64, 64), 90).substr(0, 300), "jpg"}, {png, "gif"}, {"", "png"}}) {
    const std::string e = test::error_message([&, &bytes = bytes, &ext = ext] { decode_image(bytes, ext, 3, "s-003.tar key img_7"); });
    EXPECT_TRUE(has(e, "s-003.tar key img_7")) << ext << ": " << e;
  }
  // A header claiming 100000 x 100000 pixels is refused before decoding allocates anything.
  EXPECT_TRUE(has(test::error_message([] { decode_image(png_header_claiming(100000, 100000), "png", 3, "big"); }),
                  "claims 100000 x 100000 pixels"));
  EXPECT_TRUE(has(test::error_message([&] { decode_image(png, "png", 2, "w"); }), "1 or 3 channels"));
}

// Found by fuzz_decode: a 1342-byte lossless WebP of the largest size allowed (5792 x 5792, one
// colour) decoded to grey made a 400 MB int32 copy and as much again in temporaries. Grey costs only
// its output now. The high-water mark of this process's memory is read before and after; the decode
// itself needs the RGB buffer (100 MB) and the grey output (34 MB).
TEST(Decode, TheLargestImageDecodesToGreyWithoutCopiesOfItsPixels) {
  const std::string file = test::read_text(test::source_dir() + "/fuzz/corpus/decode/crash-grey-webp-of-the-largest-size.bin");
  const std::string webp = file.substr(1);  // the fuzzer's first byte picked webp and grey
  const auto peak_mb = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_maxrss / 1024.0;  // kB on Linux
  };
  const double before = peak_mb();
  const torch::Tensor grey = decode_image(webp, "webp", 1, "big.webp");
  const double grew = peak_mb() - before;
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{1, 5792, 5792}));
  // BT.601 luma of (200, 100, 50), by the same integer weights: (200*77 + 100*150 + 50*29 + 128) >> 8.
  EXPECT_EQ(grey.min().item<int>(), 124);
  EXPECT_EQ(grey.max().item<int>(), 124);
  EXPECT_LT(grew, 400.0) << "decoding to grey raised this process's peak memory by " << grew << " MB";
}

TEST(Decode, CropsAndResizes) {
  // A 2 x 5 image of columns 0..4: centre crop to 2 takes columns 1..2, random u = 0 the first, u -> 1 the last.
  const torch::Tensor img = torch::arange(5, torch::kUInt8).view({1, 1, 5}).expand({1, 2, 5}).contiguous();
  EXPECT_TRUE(torch::equal(crop_resize(img, 2, CropMode::kCenter)[0][0], torch::tensor({1, 2}, torch::kUInt8)));
  EXPECT_TRUE(torch::equal(crop_resize(img, 2, CropMode::kRandom, 0.0)[0][0], torch::tensor({0, 1}, torch::kUInt8)));
  EXPECT_TRUE(torch::equal(crop_resize(img, 2, CropMode::kRandom, 0.999)[0][0], torch::tensor({3, 4}, torch::kUInt8)));
  // Resizing a flat image keeps it flat, down and up; a gradient stays ordered.
  const torch::Tensor flat = torch::full({3, 30, 40}, 77, torch::kUInt8);
  for (int64_t size : {8, 64}) {
    const torch::Tensor r = crop_resize(flat, size, CropMode::kCenter);
    EXPECT_EQ(r.sizes(), (std::vector<int64_t>{3, size, size}));
    EXPECT_EQ(r.min().item<int>(), 77);
    EXPECT_EQ(r.max().item<int>(), 77);
  }
  const torch::Tensor g = crop_resize(gradient(64, 64).permute({2, 0, 1}).contiguous(), 16, CropMode::kCenter);
  EXPECT_TRUE((g[0].select(0, 8).slice(0, 1).to(torch::kInt) >= g[0].select(0, 8).slice(0, 0, 15).to(torch::kInt)).all().item<bool>());
}
