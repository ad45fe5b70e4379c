// Hand-written safetensors reader and writer (no Debian package ships a C++ implementation).
// Layout: u64 little-endian header length N, N bytes of JSON (padded with spaces so that N is a
// multiple of 8, as the reference implementation does), then the tensor bytes. Tensors are written
// in name order, back to back. Parsing validates everything the format promises: header bounds,
// JSON shape, dtypes, shapes, offsets that exactly tile the data buffer.
#include "core/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian bytes; this reader/writer assumes a little-endian host");

namespace ddm {
namespace {

using json = nlohmann::json;

struct DtypeInfo {
  const char* name;
  torch::ScalarType type;
  uint64_t size;
};

const DtypeInfo kDtypes[] = {
    {"F64", torch::kFloat64, 8}, {"F32", torch::kFloat32, 4}, {"F16", torch::kFloat16, 2},
    {"BF16", torch::kBFloat16, 2}, {"I64", torch::kInt64, 8}, {"I32", torch::kInt32, 4},
    {"I16", torch::kInt16, 2},   {"I8", torch::kInt8, 1},     {"U8", torch::kUInt8, 1},
    {"BOOL", torch::kBool, 1},
};

const DtypeInfo* dtype_by_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

const DtypeInfo* dtype_by_type(torch::ScalarType t) {
  for (const auto& d : kDtypes)
    if (t == d.type) return &d;
  return nullptr;
}

std::string supported_list() {
  std::string s;
  for (const auto& d : kDtypes) s += (s.empty() ? "" : " ") + std::string(d.name);
  return s;
}

// One parsed header entry, kept until all entries are checked against each other.
struct TensorEntry {
  std::string name;
  const DtypeInfo* dtype = nullptr;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

TensorEntry parse_entry(const std::string& name, const json& info, const std::string& origin,
                  uint64_t data_size) {
  const std::string where = origin + ": tensor '" + name + "'";
  DDM_CHECK(info.is_object(), where << ": header entry must be a JSON object with dtype, shape and "
                                    << "data_offsets, got " << info.type_name());
  for (const auto& [key, value] : info.items()) {
    (void)value;
    DDM_CHECK(key == "dtype" || key == "shape" || key == "data_offsets",
              where << ": unexpected key '" << key << "' (allowed: dtype, shape, data_offsets)");
  }
  TensorEntry e;
  e.name = name;

  DDM_CHECK(info.contains("dtype"), where << ": missing 'dtype'");
  DDM_CHECK(info["dtype"].is_string(), where << ": 'dtype' must be a string");
  const std::string dtype = info["dtype"].get<std::string>();
  e.dtype = dtype_by_name(dtype);
  DDM_CHECK(e.dtype, where << ": unknown or unsupported dtype '" << dtype << "' (supported: "
                           << supported_list() << ")");

  DDM_CHECK(info.contains("shape"), where << ": missing 'shape'");
  DDM_CHECK(info["shape"].is_array(), where << ": 'shape' must be an array of non-negative integers");
  uint64_t numel = 1;
  for (const auto& d : info["shape"]) {
    DDM_CHECK(d.is_number_integer(), where << ": shape entry " << d.dump() << " is not an integer");
    DDM_CHECK(d.is_number_unsigned() || d.get<int64_t>() >= 0,
              where << ": shape entry " << d.dump() << " is negative");
    const uint64_t dim = d.get<uint64_t>();
    DDM_CHECK(dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) &&
                  !__builtin_mul_overflow(numel, dim, &numel),
              where << ": shape " << info["shape"].dump() << " overflows the element count");
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  uint64_t nbytes = 0;
  DDM_CHECK(!__builtin_mul_overflow(numel, e.dtype->size, &nbytes),
            where << ": shape " << info["shape"].dump() << " overflows the byte size");

  DDM_CHECK(info.contains("data_offsets"), where << ": missing 'data_offsets'");
  const json& off = info["data_offsets"];
  DDM_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
            where << ": 'data_offsets' must be [begin, end] with non-negative integers, got " << off.dump());
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  DDM_CHECK(e.begin <= e.end, where << ": data_offsets " << off.dump() << " has begin > end");
  DDM_CHECK(e.end <= data_size, where << ": data_offsets " << off.dump() << " point past the data buffer ("
                                      << data_size << " bytes); the file is truncated or corrupt");
  DDM_CHECK(e.end - e.begin == nbytes,
            where << ": data_offsets " << off.dump() << " span " << (e.end - e.begin) << " bytes but dtype "
                  << dtype << " x shape " << info["shape"].dump() << " needs " << nbytes << " bytes");
  return e;
}

}  // namespace

namespace {

// Writes the file piece by piece through `put`: the 8-byte header length, the header, then each
// tensor's bytes, moved to the CPU one at a time (a model on a GPU is never copied whole).
void stream_safetensors(const SafetensorsFile& file, const PutBytes& put) {
  json header = json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : file.tensors) {
    DDM_CHECK(name != "__metadata__", "safetensors: '__metadata__' is reserved and cannot name a tensor");
    DDM_CHECK(tensor.defined(), "safetensors: tensor '" << name << "' is undefined");
    const DtypeInfo* d = dtype_by_type(tensor.scalar_type());
    DDM_CHECK(d, "safetensors: tensor '" << name << "' has dtype " << tensor.scalar_type()
                                         << ", which safetensors cannot store here (supported: "
                                         << supported_list() << ")");
    const uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * d->size;
    header[name] = {{"dtype", d->name}, {"shape", tensor.sizes().vec()}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  char length[8];
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  put(length, 8);
  put(text.data(), text.size());
  for (const auto& [name, tensor] : file.tensors) {
    torch::Tensor t = tensor;
    if (t.is_meta()) {
      DDM_CHECK(file.fetch, "safetensors: tensor '" << name << "' is a placeholder and nothing fetches it");
      t = file.fetch(name);
      DDM_CHECK(t.defined() && t.sizes() == tensor.sizes() && t.scalar_type() == tensor.scalar_type(),
                "safetensors: tensor '" << name << "' arrived as " << (t.defined() ? t.toString() : "nothing") << " "
                                        << (t.defined() ? t.sizes() : at::IntArrayRef{}) << ", but the header says "
                                        << tensor.scalar_type() << " " << tensor.sizes());
    }
    t = t.detach().to(torch::kCPU).contiguous();
    if (t.numel() > 0) put(t.data_ptr(), t.nbytes());
  }
}

}  // namespace

std::string safetensors_bytes(const SafetensorsFile& file) {
  std::string out;
  stream_safetensors(file, [&out](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); });
  return out;
}

namespace {

// The header and the entries it describes, checked whole (keys unique, entries tiling the data
// buffer of `data_size` bytes exactly).
struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<TensorEntry> entries;
};

Header parse_header(const char* text, uint64_t n, uint64_t data_size, const std::string& origin) {
  DDM_CHECK(n >= 2 && text[0] == '{', origin << ": header does not start with '{'; not a safetensors file");
  // nlohmann keeps the last of duplicate keys silently; a safetensors header must not have any.
  std::vector<std::string> top_keys;
  const json::parser_callback_t note_keys = [&top_keys](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) top_keys.push_back(parsed.get<std::string>());
    return true;
  };
  const json header = json::parse(text, text + n, note_keys, /*allow_exceptions=*/false);
  DDM_CHECK(!header.is_discarded(), origin << ": header is not valid JSON");
  std::sort(top_keys.begin(), top_keys.end());
  const auto dup = std::adjacent_find(top_keys.begin(), top_keys.end());
  DDM_CHECK(dup == top_keys.end(), origin << ": tensor '" << *dup << "' appears twice in the header");
  DDM_CHECK(header.is_object(), origin << ": header must be a JSON object");

  Header out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      DDM_CHECK(info.is_object(), origin << ": '__metadata__' must be an object of string values");
      for (const auto& [k, v] : info.items()) {
        DDM_CHECK(v.is_string(), origin << ": '__metadata__' key '" << k << "' must be a string, got "
                                        << v.type_name());
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(name, info, origin, data_size));
  }

  // The entries must tile the data buffer exactly: no overlap, no gap, nothing left over.
  std::vector<const TensorEntry*> by_offset;
  for (const auto& e : out.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expect = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry* e : by_offset) {
    DDM_CHECK(e->begin >= expect, origin << ": tensor '" << e->name << "' (bytes " << e->begin << ".." << e->end
                                         << ") overlaps tensor '" << (prev ? prev->name : "") << "'");
    DDM_CHECK(e->begin == expect, origin << ": gap of " << (e->begin - expect) << " bytes before tensor '"
                                         << e->name << "' (data_offsets must be contiguous)");
    expect = e->end;
    prev = e;
  }
  DDM_CHECK(expect == data_size, origin << ": " << (data_size - expect) << " bytes after the last tensor"
                                        << (prev ? " '" + prev->name + "'" : std::string())
                                        << " are not described by the header");
  return out;
}

uint64_t header_length(const char* first8) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<unsigned char>(first8[i])) << (8 * i);
  return n;
}

// An empty tensor of the entry's dtype and shape, for its bytes to be copied or read into.
torch::Tensor empty_for(const TensorEntry& e) { return torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype->type)); }

// BOOL tensors must hold only 0 and 1.
void check_bools(const TensorEntry& e, const torch::Tensor& t, const std::string& origin) {
  if (e.dtype->type != torch::kBool) return;
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  for (uint64_t i = 0; i < e.end - e.begin; ++i)
    DDM_CHECK(bytes[i] <= 1, origin << ": tensor '" << e.name << "' is BOOL but byte " << i << " is "
                                    << static_cast<int>(bytes[i]) << " (must be 0 or 1)");
}

}  // namespace

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& origin) {
  DDM_CHECK(bytes.size() >= 8, origin << ": not a safetensors file: " << bytes.size()
                                      << " bytes, shorter than the 8-byte header length");
  const uint64_t n = header_length(bytes.data());
  DDM_CHECK(n <= bytes.size() - 8, origin << ": header length " << n << " goes beyond the file size ("
                                          << bytes.size() << " bytes); the file is truncated or not safetensors");
  const Header header = parse_header(bytes.data() + 8, n, bytes.size() - 8 - n, origin);
  SafetensorsFile out;
  out.metadata = header.metadata;
  const char* data = bytes.data() + 8 + n;
  for (const auto& e : header.entries) {
    torch::Tensor t = empty_for(e);
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    check_bools(e, t, origin);
    out.tensors[e.name] = t;
  }
  return out;
}

std::string save_safetensors(const std::string& path, const SafetensorsFile& file) {
  Sha256 hash;
  write_file_atomic(path, [&](const PutBytes& put) {
    stream_safetensors(file, [&](const void* p, size_t n) {
      hash.update(p, n);
      put(p, n);
    });
  });
  return hash.hex();
}

SafetensorsFile load_safetensors(const std::string& path) { return parse_safetensors(read_file(path), path); }

namespace {

// A safetensors file opened for reading tensor by tensor: its header read and checked whole; the
// stream then stands at the first tensor's bytes. `hash`, if given, has taken the bytes read so far.
struct OpenedFile {
  std::ifstream in;
  uint64_t header_bytes = 0;  // n: the tensors' bytes start at 8 + n
  Header header;
};

OpenedFile open_safetensors(const std::string& path, Sha256* hash) {
  OpenedFile f;
  f.in.open(path, std::ios::binary);
  DDM_CHECK(f.in, path << ": cannot open (" << std::strerror(errno) << ")");
  f.in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(f.in.tellg());
  DDM_CHECK(size >= 8, path << ": not a safetensors file: " << size << " bytes, shorter than the 8-byte header length");
  char first8[8];
  f.in.seekg(0);
  f.in.read(first8, 8);
  const uint64_t n = header_length(first8);
  DDM_CHECK(n <= size - 8, path << ": header length " << n << " goes beyond the file size (" << size
                                << " bytes); the file is truncated or not safetensors");
  std::string text(n, '\0');
  f.in.read(text.data(), static_cast<std::streamsize>(n));
  DDM_CHECK(f.in, path << ": cannot read the header (" << std::strerror(errno) << ")");
  if (hash) {
    hash->update(first8, 8);
    hash->update(text.data(), n);
  }
  f.header_bytes = n;
  f.header = parse_header(text.data(), n, size - 8 - n, path);
  return f;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path, std::string& sha256) {
  Sha256 hash;
  OpenedFile f = open_safetensors(path, &hash);
  // The entries tile the data buffer (parse_header checks it): read in file order, every byte of
  // the file passes through the hash once, straight into its tensor.
  std::vector<const TensorEntry*> by_offset;
  for (const auto& e : f.header.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  SafetensorsFile out;
  out.metadata = f.header.metadata;
  for (const TensorEntry* e : by_offset) {
    torch::Tensor t = empty_for(*e);
    f.in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e->end - e->begin));
    DDM_CHECK(f.in, path << ": cannot read tensor '" << e->name << "' (" << std::strerror(errno) << ")");
    hash.update(t.data_ptr(), e->end - e->begin);
    check_bools(*e, t, path);
    out.tensors[e->name] = t;
  }
  sha256 = hash.hex();
  return out;
}

SafetensorsFile load_safetensors(const std::string& path, const std::function<bool(const std::string&)>& keep) {
  OpenedFile f = open_safetensors(path, nullptr);
  std::ifstream& in = f.in;
  const uint64_t n = f.header_bytes;
  SafetensorsFile out;
  out.metadata = f.header.metadata;
  for (const auto& e : f.header.entries) {
    if (!keep(e.name)) continue;
    torch::Tensor t = empty_for(e);
    in.seekg(static_cast<std::streamoff>(8 + n + e.begin));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    DDM_CHECK(in, path << ": cannot read tensor '" << e.name << "' (" << std::strerror(errno) << ")");
    check_bools(e, t, path);
    out.tensors[e.name] = t;
  }
  return out;
}

}  // namespace ddm
