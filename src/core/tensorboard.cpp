// TensorBoard event files (see tensorboard.h). The fields, from tensorboard's event.proto and
// summary.proto: Event {double wall_time = 1; int64 step = 2; string file_version = 3; Summary
// summary = 5;}, Summary {repeated Value value = 1;}, Value {string tag = 1; float simple_value = 2;
// Image image = 4;}, Image {int32 height = 1; int32 width = 2; int32 colorspace = 3; bytes
// encoded_image_string = 4;}.
#include "core/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> out{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
      out[i] = c;
    }
    return out;
  }();
  return t;
}

// Protocol buffer wire format: a key is (field << 3 | wire type); 0 varint, 1 fixed64, 2
// length-delimited, 5 fixed32; little-endian fixed widths.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void key(std::string& out, int field, int wire) { varint(out, static_cast<uint64_t>(field) << 3 | wire); }
template <class T>
void fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 and ARM64: little-endian, as the wire format is
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& b) {
  key(out, field, 2);
  varint(out, b.size());
  out += b;
}
void varint_field(std::string& out, int field, int64_t v) {
  key(out, field, 0);
  varint(out, static_cast<uint64_t>(v));
}

std::string event(int64_t step, const std::string& summary) {
  std::string e;
  key(e, 1, 1);
  fixed(e, std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  varint_field(e, 2, step);
  bytes_field(e, 5, summary);
  return e;
}

// The summary holding one value: its tag and the value's own field.
std::string summary(const std::string& tag, const std::string& value_field) {
  std::string v;
  bytes_field(v, 1, tag);
  v += value_field;
  std::string s;
  bytes_field(s, 1, v);
  return s;
}

bool read_varint(const std::string& b, size_t& at, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && at < b.size(); shift += 7) {
    const auto c = static_cast<uint8_t>(b[at++]);
    v |= static_cast<uint64_t>(c & 0x7F) << shift;
    if (!(c & 0x80)) return true;
  }
  return false;
}

// An Event's step and whether it is the file-version header; false if it is malformed.
bool parse_event(const std::string& e, int64_t& step, bool& header) {
  step = 0, header = false;
  for (size_t at = 0; at < e.size();) {
    uint64_t k = 0, v = 0;
    if (!read_varint(e, at, k)) return false;
    switch (k & 7) {
      case 0:
        if (!read_varint(e, at, v)) return false;
        if (k >> 3 == 2) step = static_cast<int64_t>(v);
        break;
      case 1: at += 8; break;
      case 5: at += 4; break;
      case 2:
        if (!read_varint(e, at, v) || v > e.size() - at) return false;
        if (k >> 3 == 3) header = true;
        at += v;
        break;
      default: return false;
    }
    if (at > e.size()) return false;
  }
  return true;
}

uint32_t load_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool is_event_file(const fs::path& p) {
  return fs::is_regular_file(p) && p.filename().string().find("tfevents") != std::string::npos;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  const auto& t = crc_table();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

std::vector<EventRecord> read_event_records(const std::string& path) {
  const std::string b = read_file(path);
  std::vector<EventRecord> out;
  for (size_t at = 0; b.size() - at >= 12;) {
    uint64_t len;
    std::memcpy(&len, b.data() + at, 8);
    if (load_u32(b.data() + at + 8) != masked_crc32c(b.data() + at, 8)) break;
    if (len > b.size() - at - 16) break;  // torn: the crash came mid-record
    const char* data = b.data() + at + 12;
    if (load_u32(data + len) != masked_crc32c(data, len)) break;
    EventRecord r;
    r.event.assign(data, len);
    if (!parse_event(r.event, r.step, r.header)) break;
    out.push_back(std::move(r));
    at += 16 + len;
  }
  return out;
}

EventWriter::EventWriter(const std::string& dir, int64_t resume_step) {
  fs::create_directories(dir);
  // The newest earlier file holds the whole history (each writer copies what it kept), so it alone is
  // read; older ones are left over from a crash between this file's rename and their removal.
  std::vector<fs::path> old;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (is_event_file(e.path())) old.push_back(e.path());
    if (e.path().filename().string().rfind("partial-", 0) == 0) fs::remove(e.path());  // a crashed writer's
  }
  std::sort(old.begin(), old.end());
  std::vector<std::string> kept;
  if (resume_step > 0 && !old.empty())
    for (const EventRecord& r : read_event_records(old.back().string()))
      if (!r.header && r.step <= resume_step) kept.push_back(r.event);

  // Named by the time in microseconds, so that names sort as the files were made.
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now).count();
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  char name[400];
  std::snprintf(name, sizeof name, "events.out.tfevents.%lld.%06lld.%s.ddm", static_cast<long long>(us / 1000000),
                static_cast<long long>(us % 1000000), host);
  path_ = (fs::path(dir) / name).string();
  // Written under a name no reader matches, then renamed: a reader never sees half the history.
  const std::string tmp = (fs::path(dir) / ("partial-" + std::to_string(getpid()))).string();
  file_ = std::fopen(tmp.c_str(), "wb");
  DDM_CHECK(file_, "cannot write the TensorBoard event file " << tmp << ": " << std::strerror(errno));
  std::string header;
  key(header, 1, 1);
  fixed(header, std::chrono::duration<double>(now).count());
  bytes_field(header, 3, "brain.Event:2");
  write_record(header);
  for (const std::string& e : kept) write_record(e);
  fsync(fileno(file_));
  fs::rename(tmp, path_);
  fsync_dir(dir);
  for (const fs::path& p : old) fs::remove(p);
}

EventWriter::~EventWriter() {
  if (file_) std::fclose(file_);
}

void EventWriter::write_record(const std::string& e) {
  std::string rec;
  fixed(rec, static_cast<uint64_t>(e.size()));
  fixed(rec, masked_crc32c(rec.data(), 8));
  rec += e;
  fixed(rec, masked_crc32c(e.data(), e.size()));
  DDM_CHECK(std::fwrite(rec.data(), 1, rec.size(), file_) == rec.size() && std::fflush(file_) == 0,
            "cannot write the TensorBoard event file " << path_ << ": " << std::strerror(errno) << " (is the disk full?)");
}

void EventWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string v;
  key(v, 2, 5);
  fixed(v, static_cast<float>(value));
  write_record(event(step, summary(tag, v)));
}

void EventWriter::image(const std::string& tag, int64_t step, const std::string& png) {
  // The PNG signature, then the IHDR chunk: length, "IHDR", width and height (big-endian), bit depth,
  // colour type (0 grey, 2 RGB, 4 grey + alpha, 6 RGBA).
  DDM_CHECK(png.size() >= 33 && png.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0 && png.compare(12, 4, "IHDR") == 0,
            "EventWriter::image: " << tag << " is not a PNG");
  const auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<uint8_t>(png[at + i]);
    return static_cast<int64_t>(v);
  };
  const int64_t width = be32(16), height = be32(20);
  const int type = static_cast<uint8_t>(png[25]);
  const int channels = type == 0 ? 1 : type == 2 ? 3 : type == 4 ? 2 : 4;
  std::string img;
  varint_field(img, 1, height);
  varint_field(img, 2, width);
  varint_field(img, 3, channels);
  bytes_field(img, 4, png);
  std::string v;
  bytes_field(v, 4, img);
  write_record(event(step, summary(tag, v)));
}

}  // namespace ddm
