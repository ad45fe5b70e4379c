// IDX reader over zlib's gz* interface (see idx.h). Memory is allocated for the data actually read,
// not for what the header promises, and every read reports zlib's own reason when the gzip stream
// is damaged.
#include "data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace ddm {
namespace {

// Owns a gzFile.
struct GzFile {
  gzFile f = nullptr;
  ~GzFile() {
    if (f) gzclose(f);
  }
};

// zlib's reason for the last error, without the "path: " prefix zlib puts in front of it.
std::string gz_reason(gzFile f, const std::string& path) {
  int code = Z_OK;
  const char* msg = gzerror(f, &code);
  if (code == Z_ERRNO) return std::strerror(errno);
  std::string s = msg && *msg ? msg : "unknown zlib error";
  if (s.compare(0, path.size() + 2, path + ": ") == 0) s.erase(0, path.size() + 2);
  return s;
}

// Reads up to n bytes; returns the count actually read (short only at end of stream). Throws on a
// zlib error, which includes a gzip stream that ends early ("unexpected end of file").
uint64_t gz_read(gzFile f, void* dst, uint64_t n, const std::string& path) {
  uint64_t done = 0;
  auto* p = static_cast<char*>(dst);
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<uint64_t>(n - done, 1u << 30));
    const int got = gzread(f, p + done, chunk);
    if (got < 0) {
      DDM_FAIL(path << ": corrupt or truncated gzip data: " << gz_reason(f, path)
                    << " (re-download or reinstall the file)");
    }
    if (got == 0) break;
    done += static_cast<uint64_t>(got);
  }
  // zlib reports a stream cut short as an error after returning what it could decode.
  int code = Z_OK;
  gzerror(f, &code);
  DDM_CHECK(code == Z_OK || code == Z_STREAM_END,
            path << ": corrupt or truncated gzip data: " << gz_reason(f, path)
                 << " (re-download or reinstall the file)");
  return done;
}

uint32_t be32(const unsigned char* b) {
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

IdxArray read_idx(const std::string& path, uint32_t expected_magic) {
  std::error_code ec;
  DDM_CHECK(std::filesystem::is_regular_file(path, ec), path << ": IDX file not found or not a regular file");
  GzFile gz;
  gz.f = gzopen(path.c_str(), "rb");
  DDM_CHECK(gz.f, path << ": cannot open: " << std::strerror(errno));
  gzbuffer(gz.f, 1 << 17);

  unsigned char head[4];
  const uint64_t got = gz_read(gz.f, head, 4, path);
  DDM_CHECK(got == 4, path << ": file too short for an IDX header (" << got << " bytes)");
  const uint32_t magic = be32(head);
  DDM_CHECK(magic == expected_magic, path << ": wrong IDX magic " << hex32(magic) << ", expected "
                                          << hex32(expected_magic) << " ("
                                          << (expected_magic == kIdxImagesMagic ? "images" : "labels")
                                          << "); is this the right file?");
  const int ndim = static_cast<int>(magic & 0xff);

  IdxArray out;
  uint64_t total = 1;
  uint64_t extent = 1;  // the product of the non-zero dimensions: with 0 images, the others still
                        // make the tensor's strides, which must not overflow
  for (int i = 0; i < ndim; ++i) {
    unsigned char b[4];
    DDM_CHECK(gz_read(gz.f, b, 4, path) == 4,
              path << ": IDX header truncated (dimension " << i << " of " << ndim << " missing)");
    const uint32_t d = be32(b);
    out.dims.push_back(static_cast<int64_t>(d));
    total *= d;
    DDM_CHECK(!__builtin_mul_overflow(extent, uint64_t(d == 0 ? 1 : d), &extent) && extent <= (uint64_t(1) << 40),
              path << ": IDX dimensions are implausibly large; the file is corrupt");
  }

  // The header's sizes do not decide the allocation: a damaged header can promise a terabyte in a
  // few bytes. Memory grows in chunks with the data that is actually there.
  std::string bytes;
  while (bytes.size() < total) {
    const size_t have = bytes.size();
    const uint64_t want = std::min<uint64_t>(total - have, uint64_t(64) << 20);
    bytes.resize(have + want);
    const uint64_t got_now = gz_read(gz.f, bytes.data() + have, want, path);
    bytes.resize(have + got_now);
    if (got_now < want) break;
  }
  DDM_CHECK(bytes.size() == total, path << ": IDX data truncated: header promises " << total << " bytes, file has "
                                        << bytes.size() << " (re-download or reinstall the file)");
  out.data = torch::empty(out.dims, torch::TensorOptions().dtype(torch::kUInt8));
  if (total > 0) std::memcpy(out.data.data_ptr(), bytes.data(), total);
  // Reading past the data also makes zlib verify the gzip trailer (CRC and length).
  unsigned char extra;
  const int r = gzread(gz.f, &extra, 1);
  DDM_CHECK(r >= 0, path << ": corrupt gzip data (checked at the end of the stream): " << gz_reason(gz.f, path)
                         << " (re-download or reinstall the file)");
  DDM_CHECK(r == 0, path << ": unexpected bytes after the " << total << " bytes of IDX data; the file is corrupt");
  return out;
}

torch::Tensor read_idx_images(const std::string& path) {
  IdxArray a = read_idx(path, kIdxImagesMagic);
  DDM_CHECK(a.dims.size() == 3, path << ": images IDX must have 3 dimensions, has " << a.dims.size());
  return a.data.unsqueeze(1);  // [N, 1, H, W]
}

torch::Tensor read_idx_labels(const std::string& path) {
  IdxArray a = read_idx(path, kIdxLabelsMagic);
  DDM_CHECK(a.dims.size() == 1, path << ": labels IDX must have 1 dimension, has " << a.dims.size());
  return a.data.to(torch::kInt64);
}

}  // namespace ddm
