// Features files: .npy and .npz read by hand and with libarchive, .safetensors (see features_file.h).
#include "decentral/features_file.h"

#include <archive.h>
#include <archive_entry.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>

#include <torch/torch.h>

#include "core/error.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// Bytes in order from a file or an .npz member, `size` of them in all.
struct Source {
  std::function<size_t(char*, size_t)> read;  // up to n bytes; fewer only at the end
  int64_t size = 0;
  // Bytes that surely exist: the file's size (an .npz member's recorded size may be corrupt).
  int64_t trusted = 0;
  std::string name;  // in errors: "f.npy", or "f.npz, array 'keys'"
};

size_t read_up_to(const Source& in, char* dst, size_t n) {
  size_t got = 0;
  while (got < n) {
    const size_t r = in.read(dst + got, n - got);
    if (r == 0) break;
    got += r;
  }
  return got;
}

// One .npy array: floats as a tensor, strings decoded to UTF-8.
struct Npy {
  std::vector<int64_t> dims;
  torch::Tensor values;              // float32/float64 arrays
  std::vector<std::string> strings;  // '<U' / '|S' arrays
};

void append_utf8(std::string& out, uint32_t u) {
  if (u < 0x80) {
    out += static_cast<char>(u);
  } else if (u < 0x800) {
    out += static_cast<char>(0xC0 | (u >> 6));
    out += static_cast<char>(0x80 | (u & 0x3F));
  } else if (u < 0x10000) {
    out += static_cast<char>(0xE0 | (u >> 12));
    out += static_cast<char>(0x80 | ((u >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (u & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (u >> 18));
    out += static_cast<char>(0x80 | ((u >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((u >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (u & 0x3F));
  }
}

// .npy: magic "\x93NUMPY", version (1|2|3).x, header length (u16 for v1, u32 after), then a Python
// dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (N, D), }, then the data.
Npy read_npy(const Source& in) {
  const std::string& name = in.name;
  char head[12];
  DDM_CHECK(read_up_to(in, head, 10) == 10 && std::memcmp(head, "\x93NUMPY", 6) == 0,
            name << ": not a .npy array (bad magic); save features with numpy.save or numpy.savez");
  const int major = static_cast<unsigned char>(head[6]);
  DDM_CHECK(major >= 1 && major <= 3, name << ": unsupported .npy version " << major);
  size_t header_len = 0, start = 10;
  if (major == 1) {
    header_len = static_cast<unsigned char>(head[8]) | (static_cast<unsigned char>(head[9]) << 8);
  } else {
    DDM_CHECK(read_up_to(in, head + 10, 2) == 2, name << ": truncated .npy header");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(head[8 + i])) << (8 * i);
    start = 12;
  }
  // (numpy writes headers of under 10 kB and reads none over 10 kB unless told: a bigger length is a
  // damaged file, whose recorded size in an .npz may be damaged too; nothing that size is allocated.)
  DDM_CHECK(header_len <= (size_t{1} << 20), name << ": a .npy header of " << header_len
                                                  << " bytes, which numpy never writes; the file is damaged");
  DDM_CHECK(static_cast<int64_t>(start + header_len) <= in.size, name << ": truncated .npy header");
  std::string header(header_len, '\0');
  DDM_CHECK(read_up_to(in, header.data(), header_len) == header_len, name << ": truncated .npy header");
  auto value_of = [&](const std::string& key) -> std::string {
    const size_t k = header.find("'" + key + "'");
    DDM_CHECK(k != std::string::npos, name << ": .npy header lacks '" << key << "': " << header);
    size_t v = header.find(':', k);
    DDM_CHECK(v != std::string::npos, name << ": malformed .npy header: " << header);
    ++v;
    while (v < header.size() && header[v] == ' ') ++v;
    DDM_CHECK(v < header.size(), name << ": malformed .npy header: " << header);
    const char open = header[v];
    const bool quoted = open == '(' || open == '\'';
    const char close = open == '(' ? ')' : open == '\'' ? '\'' : ',';
    const size_t end = header.find(close, v + 1);
    DDM_CHECK(end != std::string::npos, name << ": malformed .npy header: " << header);
    return header.substr(quoted ? v + 1 : v, end - (quoted ? v + 1 : v));
  };
  const std::string descr = value_of("descr"), fortran = value_of("fortran_order"), shape = value_of("shape");
  DDM_CHECK(fortran.find("False") != std::string::npos,
            name << ": Fortran-ordered arrays are not supported; save numpy.ascontiguousarray(features)");
  Npy out;
  size_t pos = 0;
  while (pos < shape.size()) {
    while (pos < shape.size() && (shape[pos] == ' ' || shape[pos] == ',')) ++pos;
    if (pos >= shape.size()) break;
    int64_t d = -1;
    const auto [end, ec] = std::from_chars(shape.data() + pos, shape.data() + shape.size(), d);
    DDM_CHECK(ec == std::errc() && d >= 0,
              name << ": malformed .npy shape (" << shape << "): expected non-negative integers");
    out.dims.push_back(d);
    pos = static_cast<size_t>(end - shape.data());
  }
  // The element: a float, or a string of `chars` UTF-32 code points ('<U') or bytes ('|S').
  torch::ScalarType dtype = torch::kFloat32;
  size_t elem = 0, chars = 0;
  bool unicode = false;
  if (descr == "<f4" || descr == "=f4") {
    dtype = torch::kFloat32, elem = 4;
  } else if (descr == "<f8" || descr == "=f8") {
    dtype = torch::kFloat64, elem = 8;
  } else if (descr.size() > 2 && (descr.compare(0, 2, "<U") == 0 || descr.compare(0, 2, "|S") == 0)) {
    unicode = descr[1] == 'U';
    const auto [end, ec] = std::from_chars(descr.data() + 2, descr.data() + descr.size(), chars);
    DDM_CHECK(ec == std::errc() && end == descr.data() + descr.size() && chars >= 1 && chars <= 4096,
              name << ": .npy dtype '" << descr << "' is not a string type ddm reads (up to 4096 characters)");
    elem = unicode ? 4 * chars : chars;
  } else if (descr == "|O") {
    DDM_FAIL(name << ": an object array (dtype=object) is stored as a Python pickle, which ddm does not read; save "
                     "keys as numpy.array(keys, dtype=str)");
  } else {
    DDM_FAIL(name << ": .npy dtype '" << descr << "' is not supported; features must be little-endian float32 or "
                     "float64, keys strings");
  }
  uint64_t count = 1, need = 0;
  for (int64_t d : out.dims)
    DDM_CHECK(!__builtin_mul_overflow(count, static_cast<uint64_t>(d), &count),
              name << ": .npy shape (" << shape << ") is implausibly large; the file is corrupt");
  DDM_CHECK(!__builtin_mul_overflow(count, static_cast<uint64_t>(elem), &need),
            name << ": .npy shape (" << shape << ") is implausibly large; the file is corrupt");
  const uint64_t have = static_cast<uint64_t>(in.size) - start - header_len;
  DDM_CHECK(have == need, name << ": holds " << have << " data bytes, but shape (" << shape << ") of " << descr
                               << " needs " << need << "; the file is "
                               << (have < need ? "truncated" : "corrupt (bytes after the data)"));
  if (chars == 0) {  // floats
    const auto allocate = [&](uint64_t elems) {
      try {
        return torch::empty({static_cast<int64_t>(elems)}, dtype);
      } catch (const std::exception&) {
        DDM_FAIL(name << ": shape (" << shape << ") of " << descr << " needs " << need << " bytes, more than this "
                      << "machine can hold; the file is corrupt or too large");
      }
    };
    const auto truncated = [&] { return name + ": the data ends before its " + std::to_string(need) +
                                        " bytes; the file is truncated"; };
    if (need <= static_cast<uint64_t>(std::max<int64_t>(in.trusted, 0))) {  // straight into the tensor
      out.values = allocate(count);
      DDM_CHECK(read_up_to(in, static_cast<char*>(out.values.data_ptr()), need) == need, truncated());
    } else {  // a size that only the archive's record vouches for: in pieces, as the data arrives
      constexpr uint64_t kPiece = uint64_t(1) << 24;  // elements
      std::vector<torch::Tensor> pieces;
      for (uint64_t done = 0; done < count; done += kPiece) {
        pieces.push_back(allocate(std::min(kPiece, count - done)));
        const size_t bytes = static_cast<size_t>(pieces.back().numel()) * elem;
        DDM_CHECK(read_up_to(in, static_cast<char*>(pieces.back().data_ptr()), bytes) == bytes, truncated());
      }
      out.values = pieces.empty() ? allocate(0) : pieces.size() == 1 ? pieces[0] : torch::cat(pieces);
    }
    out.values = out.values.view(out.dims);
    return out;
  }
  // Strings one at a time, so that memory grows only with the data that is there.
  std::string item(elem, '\0');
  for (uint64_t i = 0; i < count; ++i) {
    DDM_CHECK(read_up_to(in, item.data(), elem) == elem,
              name << ": the data ends before its " << need << " bytes; the file is truncated");
    const char* p = item.data();
    std::string& s = out.strings.emplace_back();
    for (size_t c = 0; c < chars; ++c) {  // numpy pads each string with NULs to the full width
      if (!unicode) {
        if (p[c] == '\0') break;
        s += p[c];
        continue;
      }
      uint32_t u = 0;
      for (int b = 0; b < 4; ++b) u |= static_cast<uint32_t>(static_cast<unsigned char>(p[4 * c + b])) << (8 * b);
      if (u == 0) break;
      DDM_CHECK(u <= 0x10FFFF && (u < 0xD800 || u > 0xDFFF),
                name << ": string " << i << " holds 0x" << std::hex << u << ", which is not a Unicode code point");
      append_utf8(s, u);
    }
  }
  return out;
}

Source file_source(const std::string& path, std::shared_ptr<std::ifstream>& keep) {
  keep = std::make_shared<std::ifstream>(path, std::ios::binary);
  DDM_CHECK(*keep, "cannot read features file '" << path << "'");
  Source s;
  s.size = static_cast<int64_t>(fs::file_size(path));
  s.trusted = s.size;
  s.name = path;
  std::ifstream* in = keep.get();
  s.read = [in](char* dst, size_t n) {
    in->read(dst, static_cast<std::streamsize>(n));
    return static_cast<size_t>(in->gcount());
  };
  return s;
}

const char* reason(archive* a) {
  const char* e = archive_error_string(a);
  return e ? e : "no reason given";
}

// An array of an .npz: parsed, or why it could not be (raised only if the array is used).
struct NpzArray {
  Npy npy;
  std::string error;
};

// The arrays of an .npz (numpy.savez / savez_compressed: a zip of NAME.npy members), by NAME.
std::map<std::string, NpzArray> read_npz(const std::string& path) {
  std::unique_ptr<archive, decltype(&archive_read_free)> a(archive_read_new(), &archive_read_free);
  DDM_CHECK(a, "libarchive could not allocate a reader");
  archive_read_support_format_zip(a.get());
  DDM_CHECK(archive_read_open_filename(a.get(), path.c_str(), 1 << 16) == ARCHIVE_OK,
            path << ": cannot open it as an .npz (zip) archive (" << reason(a.get()) << ")");
  const int64_t archive_bytes = static_cast<int64_t>(fs::file_size(path));
  std::map<std::string, NpzArray> arrays;
  for (;;) {
    archive_entry* e = nullptr;
    const int rc = archive_read_next_header(a.get(), &e);
    if (rc == ARCHIVE_EOF) break;
    DDM_CHECK(rc == ARCHIVE_OK || rc == ARCHIVE_WARN, path << ": corrupt .npz archive (" << reason(a.get()) << ")");
    if (archive_entry_filetype(e) != AE_IFREG) continue;
    const std::string member = archive_entry_pathname(e) ? archive_entry_pathname(e) : "";
    DDM_CHECK(member.size() > 4 && member.compare(member.size() - 4, 4, ".npy") == 0,
              path << ": member '" << member << "' is not an .npy array; write the file with numpy.savez");
    const std::string array = member.substr(0, member.size() - 4);
    DDM_CHECK(!arrays.count(array), path << ": holds array '" << array << "' twice");
    Source src;
    src.name = path + ", array '" + array + "'";
    src.trusted = archive_bytes;  // a stored member is no larger; a deflated one is read in pieces
    archive* ar = a.get();
    src.read = [ar, name = src.name](char* dst, size_t n) {
      const la_ssize_t r = archive_read_data(ar, dst, n);
      DDM_CHECK(r >= 0, name << ": corrupt data (" << reason(ar) << ")");
      return static_cast<size_t>(r);
    };
    std::string whole;  // a member whose size the archive does not record, read first
    if (archive_entry_size_is_set(e)) {
      src.size = archive_entry_size(e);
      DDM_CHECK(src.size >= 0, src.name << ": records a negative size; the archive is corrupt");
    } else {
      char buf[1 << 16];
      for (size_t r; (r = read_up_to(src, buf, sizeof buf)) > 0;) whole.append(buf, r);
      src.size = src.trusted = static_cast<int64_t>(whole.size());
      src.read = [&whole, at = size_t(0)](char* dst, size_t n) mutable {
        const size_t r = std::min(n, whole.size() - at);
        std::memcpy(dst, whole.data() + at, r);
        at += r;
        return r;
      };
    }
    NpzArray& out = arrays[array];
    try {
      out.npy = read_npy(src);
      // The member's checksum is checked when its end is read: there must be nothing more.
      char extra = 0;
      DDM_CHECK(read_up_to(src, &extra, 1) == 0, src.name << ": holds bytes after its data; the archive is corrupt");
    } catch (const Error& err) {
      out.error = err.what();
    }
  }
  return arrays;
}

}  // namespace

FeaturesFile read_features_file(const std::string& path) {
  DDM_CHECK(fs::is_regular_file(path), "features file '" << path << "' does not exist");
  const std::string ext = fs::path(path).extension().string();
  FeaturesFile f;
  bool keyed = false;    // an .npz with keys
  std::string what = path;  // the array the rows come from, in errors
  const auto rows_of = [&](const Npy& a) {
    DDM_CHECK(a.values.defined(), what << ": features must be float32 or float64, not strings");
    return a.values;
  };
  if (ext == ".npy") {
    std::shared_ptr<std::ifstream> keep;
    f.rows = rows_of(read_npy(file_source(path, keep)));
  } else if (ext == ".npz") {
    const std::map<std::string, NpzArray> arrays = read_npz(path);
    std::string names;
    for (const auto& [name, a] : arrays) names += (names.empty() ? "'" : ", '") + name + "'";
    keyed = arrays.count("features") && arrays.count("keys") && arrays.size() == 2;
    DDM_CHECK(keyed || arrays.size() == 1,
              path << ": holds the arrays " << (names.empty() ? "(none)" : names) << "; an .npz needs 'features' and "
                   << "'keys' (numpy.savez(PATH, features=F, keys=K)) or one array alone");
    const auto array = [&](const std::string& name) -> const Npy& {
      const NpzArray& a = arrays.at(name);
      if (!a.error.empty()) throw Error(a.error);
      return a.npy;
    };
    if (keyed) {
      what = path + ", array 'features'";
      f.rows = rows_of(array("features"));
      const Npy& k = array("keys");
      DDM_CHECK(!k.values.defined() && k.dims.size() == 1,
                path << ", array 'keys': must be a 1-D array of strings (numpy.array(keys, dtype=str)), got "
                     << (k.values.defined() ? "numbers" : std::to_string(k.dims.size()) + "-D strings"));
      f.keys = k.strings;
    } else {
      what = path + ", array '" + arrays.begin()->first + "'";
      f.rows = rows_of(array(arrays.begin()->first));
    }
  } else if (ext == ".safetensors") {
    const SafetensorsFile s = load_safetensors(path);
    if (s.tensors.count("features")) {
      f.rows = s.tensors.at("features");
    } else if (s.tensors.count("pooled") && s.tensors.count("states") && s.metadata.count("encoder")) {
      // `ddm text encode`'s output: one pooled embedding per caption is the caption's feature row.
      what = path + ", tensor 'pooled' (ddm text encode's pooled embedding)";
      f.rows = s.tensors.at("pooled");
    } else {
      DDM_CHECK(s.tensors.size() == 1, path << ": holds " << s.tensors.size()
                                            << " tensors; name the features tensor 'features' or store only one");
      f.rows = s.tensors.begin()->second;
    }
    DDM_CHECK(f.rows.is_floating_point(), path << ": features must be floating point, got " << f.rows.scalar_type());
  } else {
    DDM_FAIL("features file '" << path << "': use a .npy, .npz or .safetensors file");
  }
  DDM_CHECK(f.rows.dim() == 2, what << ": features must be 2-D [N, D], got " << f.rows.sizes());
  f.rows = f.rows.to(torch::kFloat32).contiguous();
  DDM_CHECK(f.rows.size(0) > 0 && f.rows.size(1) > 0, what << ": features are empty " << f.rows.sizes());
  DDM_CHECK(torch::isfinite(f.rows).all().item<bool>(), what << ": features contain NaN or infinity");
  if (keyed) {
    DDM_CHECK(static_cast<int64_t>(f.keys.size()) == f.rows.size(0),
              path << ": has " << f.keys.size() << " keys for " << f.rows.size(0) << " rows of features; it needs one "
                   << "key per row");
    std::unordered_map<std::string, size_t> first;
    for (size_t i = 0; i < f.keys.size(); ++i) {
      const auto [at, fresh] = first.emplace(f.keys[i], i);
      DDM_CHECK(fresh, path << ": the key '" << f.keys[i] << "' names rows " << at->second << " and " << i
                            << "; each sample needs one row");
    }
  }
  return f;
}

torch::Tensor rows_by_key(const FeaturesFile& file, const std::vector<std::string>& keys, const std::string& path,
                          const std::string& data) {
  // Sample keys never start with "./" (shards.h's split_key drops it); a file's keys may, as webdataset
  // gives the members of `tar -C dir .` shards.
  const auto bare = [](const std::string& k) { return k.rfind("./", 0) == 0 ? k.substr(2) : k; };
  std::unordered_map<std::string, int64_t> row;
  row.reserve(file.keys.size());
  for (size_t i = 0; i < file.keys.size(); ++i) row.emplace(bare(file.keys[i]), static_cast<int64_t>(i));
  std::unordered_map<std::string, int64_t> seen;  // a sample key -> its position in the data
  seen.reserve(keys.size());
  auto index = torch::empty({static_cast<int64_t>(keys.size())}, torch::kInt64);
  auto* out = index.data_ptr<int64_t>();
  int64_t missing = 0;
  std::string named;
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto [at, fresh] = seen.emplace(keys[i], static_cast<int64_t>(i));
    DDM_CHECK(fresh, path << ": rows are matched to samples by key, but the key '" << keys[i] << "' names samples "
                          << at->second << " and " << i << " (in shard order) of " << data << "; give the features "
                          << "in shard order instead (an .npy, or an .npz without keys)");
    const auto r = row.find(keys[i]);
    if (r == row.end()) {
      if (missing++ < 3) named += (named.empty() ? "'" : ", '") + keys[i] + "'";
      continue;
    }
    out[i] = r->second;
  }
  DDM_CHECK(missing == 0, path << ": has no row for " << missing << " of the " << keys.size() << " samples of " << data
                               << " (keys " << named << (missing > 3 ? ", ..." : "") << "); it needs a row for every "
                               << "sample");
  return file.rows.index_select(0, index);  // [N, D]
}

}  // namespace ddm
