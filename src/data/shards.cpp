// Shard lists and reading WebDataset tar shards (see shards.h).
#include "data/shards.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/utf8.h"

namespace ddm {
namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxNames = 10'000'000;

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

// The alternatives of one brace's inside: "A..B" a numeric range, else a comma-separated list.
std::vector<std::string> alternatives(const std::string& inside, const std::string& pattern, const std::string& key) {
  const size_t dots = inside.find("..");
  if (dots != std::string::npos) {
    const std::string a = inside.substr(0, dots), b = inside.substr(dots + 2);
    DDM_CHECK(all_digits(a) && all_digits(b), key << " = \"" << pattern << "\": {" << inside
                                                  << "} is not a numeric range {A..B} of non-negative integers");
    const int64_t lo = std::stoll(a), hi = std::stoll(b);
    DDM_CHECK(lo <= hi, key << " = \"" << pattern << "\": the range {" << inside << "} runs backwards");
    DDM_CHECK(static_cast<size_t>(hi - lo) < kMaxNames, key << " = \"" << pattern << "\": the range {" << inside
                                                             << "} names more than " << kMaxNames << " shards");
    const size_t width = a.size() > 1 && a[0] == '0' ? a.size() : 0;  // zero-padded to A's width
    std::vector<std::string> out;
    for (int64_t i = lo; i <= hi; ++i) {
      std::string n = std::to_string(i);
      if (n.size() < width) n.insert(0, width - n.size(), '0');
      out.push_back(std::move(n));
    }
    return out;
  }
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t comma; (comma = inside.find(',', at)) != std::string::npos; at = comma + 1) out.push_back(inside.substr(at, comma - at));
  out.push_back(inside.substr(at));
  return out;
}

}  // namespace

std::vector<std::string> expand_braces(const std::string& pattern, const std::string& key) {
  std::vector<std::string> names{""};
  size_t at = 0;
  while (at < pattern.size()) {
    const size_t open = pattern.find('{', at);
    const std::string literal = pattern.substr(at, open == std::string::npos ? std::string::npos : open - at);
    for (std::string& n : names) n += literal;
    if (open == std::string::npos) break;
    const size_t close = pattern.find('}', open);
    DDM_CHECK(close != std::string::npos, key << " = \"" << pattern << "\": the brace at position " << open << " is not closed");
    const std::string inside = pattern.substr(open + 1, close - open - 1);
    DDM_CHECK(inside.find('{') == std::string::npos, key << " = \"" << pattern << "\": braces do not nest");
    const std::vector<std::string> alt = alternatives(inside, pattern, key);
    DDM_CHECK(names.size() * alt.size() <= kMaxNames, key << " = \"" << pattern << "\" names more than " << kMaxNames << " shards");
    std::vector<std::string> next;
    next.reserve(names.size() * alt.size());
    for (const std::string& n : names)
      for (const std::string& x : alt) next.push_back(n + x);
    names = std::move(next);
    at = close + 1;
  }
  return names;
}

std::vector<std::string> expand_shards(const std::string& spec, const std::string& key) {
  DDM_CHECK(!spec.empty(), key << " is empty: name the shards (a brace pattern such as train-{000000..000009}.tar, a "
                                  "glob, or a text file listing them)");
  std::vector<std::string> paths;
  std::string lower = spec;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool is_tar = lower.size() >= 4 && lower.compare(lower.size() - 4, 4, ".tar") == 0;  // Photos.TAR too
  if (spec.find('{') != std::string::npos) {
    paths = expand_braces(spec, key);
  } else if (spec.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = glob(spec.c_str(), 0, nullptr, &g);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    globfree(&g);
    DDM_CHECK(rc == 0 || rc == GLOB_NOMATCH, key << " = \"" << spec << "\": the glob could not be read");
    std::sort(paths.begin(), paths.end());
    DDM_CHECK(!paths.empty(), key << " = \"" << spec << "\" matches no file");
  } else if (std::error_code ec; fs::is_directory(spec, ec)) {
    // A folder of shards: its .tar files (not those of its subfolders), sorted, as the glob DIR/*.tar.
    for (const auto& e : fs::directory_iterator(spec)) {
      std::string name = e.path().filename().string();
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (e.is_regular_file(ec) && name.size() > 4 && name.compare(name.size() - 4, 4, ".tar") == 0)
        paths.push_back(e.path().string());
    }
    std::sort(paths.begin(), paths.end());
    DDM_CHECK(!paths.empty(),
              key << " = \"" << spec << "\" is a folder without .tar files: put its pictures in a tar (tar --sort=name -cf "
                  << fs::path(spec).lexically_normal().filename().string() << "-000000.tar -C " << spec
                  << " .) and name that, or read the folder itself with data.source = \"folder\"");
  } else if (const std::string rec = ".shards.json";
             lower.size() > rec.size() && lower.compare(lower.size() - rec.size(), rec.size(), rec) == 0) {
    // The record `ddm shards write` leaves beside its shards: the shards it lists, from its folder.
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(std::ifstream(spec));
    } catch (const std::exception& e) {
      DDM_FAIL(key << " = \"" << spec << "\": " << (fs::is_regular_file(spec) ? "not JSON (" + std::string(e.what()) + ")"
                                                                            : std::string("no such file")));
    }
    DDM_CHECK(j.is_object() && j.value("format", "") == "ddm shards" && j.contains("shards") && j["shards"].is_array(),
              key << " = \"" << spec << "\": not the record of `ddm shards write` (format \"ddm shards\" with a "
                                        "\"shards\" list); name the shards themselves");
    const fs::path dir = fs::path(spec).parent_path();
    for (const auto& e : j["shards"]) {
      DDM_CHECK(e.is_object() && e.contains("name") && e["name"].is_string(),
                key << " = \"" << spec << "\": an entry of \"shards\" has no \"name\"");
      paths.push_back((dir / e["name"].get<std::string>()).string());
    }
    DDM_CHECK(!paths.empty(), key << " = \"" << spec << "\": the record lists no shard");
  } else if (!is_tar) {
    std::error_code ec;
    for (const char* z : {".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst", ".zip"})
      DDM_CHECK(lower.size() < std::strlen(z) || lower.compare(lower.size() - std::strlen(z), std::strlen(z), z) != 0,
                key << " = \"" << spec << "\": a compressed archive; shards are plain tars (images are compressed "
                                           "already): unpack it and tar the files (tar --sort=name -cf NAME-000000.tar ...)");
    DDM_CHECK(fs::is_regular_file(spec, ec), key << " = \"" << spec << "\": no such list file (a shard list is a brace "
                                                                         "pattern, a glob, a .tar, or a text file of paths)");
    std::ifstream in(spec);
    DDM_CHECK(in, key << " = \"" << spec << "\": cannot read the list file");
    const fs::path dir = fs::path(spec).parent_path();
    std::string line;
    int64_t n = 0;
    while (std::getline(in, line)) {
      ++n;
      const size_t a = line.find_first_not_of(" \t\r"), b = line.find_last_not_of(" \t\r");
      if (a == std::string::npos || line[a] == '#') continue;
      const std::string p = line.substr(a, b - a + 1);
      DDM_CHECK(p.find('\0') == std::string::npos, key << " = \"" << spec << "\": line " << n << " is not a path");
      paths.push_back(fs::path(p).is_absolute() ? p : (dir / p).string());
    }
    DDM_CHECK(!paths.empty(), key << " = \"" << spec << "\": the list file names no shard");
  } else {
    paths.push_back(spec);
  }
  for (const std::string& p : paths) {
    std::error_code ec;
    DDM_CHECK(fs::is_regular_file(p, ec), key << " = \"" << spec << "\": shard " << p << " does not exist"
                                              << (paths.size() > 1 ? " (" + std::to_string(paths.size()) + " shards named)" : "")
                                              << (fs::path(p).is_relative() ? " (a relative path is read from the current "
                                                                               "directory, " + fs::current_path().string() + ")"
                                                                            : std::string()));
  }
  return paths;
}

std::pair<std::string, std::string> split_key(const std::string& member) {
  const size_t slash = member.rfind('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = member.find('.', base);
  if (dot == std::string::npos || dot == base || dot + 1 == member.size()) return {"", ""};
  std::string ext = member.substr(dot + 1);
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string key = member.substr(0, dot);
  if (key.rfind("./", 0) == 0) key.erase(0, 2);  // `tar -C dir .` writes ./a.jpg
  return {key, ext};
}

struct TarShardReader::Impl {
  archive* a = nullptr;
  ~Impl() {
    if (a) archive_read_free(a);
  }
};

namespace {
archive* open_reader() {
  archive* a = archive_read_new();
  DDM_CHECK(a, "libarchive could not allocate a reader");
  archive_read_support_format_tar(a);  // ustar, pax, GNU tar
  archive_read_support_filter_none(a);
  return a;
}
}  // namespace

TarShardReader::TarShardReader(const std::string& path) : impl_(std::make_unique<Impl>()), name_(path) {
  impl_->a = open_reader();
  DDM_CHECK(archive_read_open_filename(impl_->a, path.c_str(), 1 << 16) == ARCHIVE_OK,
            "shard " << path << ": cannot open it as a tar archive (" << archive_error_string(impl_->a) << ")");
}

TarShardReader::TarShardReader(const char* bytes, size_t size, const std::string& name)
    : impl_(std::make_unique<Impl>()), name_(name) {
  impl_->a = open_reader();
  DDM_CHECK(archive_read_open_memory(impl_->a, bytes, size) == ARCHIVE_OK,
            "shard " << name << ": cannot open it as a tar archive (" << archive_error_string(impl_->a) << ")");
}

TarShardReader::~TarShardReader() = default;

bool TarShardReader::read_member() {
  archive* a = impl_->a;
  for (;;) {
    archive_entry* e = nullptr;
    const int rc = archive_read_next_header(a, &e);
    if (rc == ARCHIVE_EOF) return false;
    const std::string after = last_member_.empty() ? std::string("at its start") : "after member " + last_member_;
    DDM_CHECK(rc == ARCHIVE_OK || rc == ARCHIVE_WARN,
              "shard " << name_ << ": corrupt or truncated " << after << " (" << archive_error_string(a) << ")");
    const char* path = archive_entry_pathname(e);
    if (!path || archive_entry_filetype(e) != AE_IFREG) continue;  // directories, links
    last_member_ = path;
    auto [key, ext] = split_key(path);
    if (key.empty()) continue;
    const int64_t size = archive_entry_size(e);
    DDM_CHECK(size >= 0 && size <= kMaxMemberBytes,
              "shard " << name_ << ": member " << path << " claims " << size << " bytes (more than " << kMaxMemberBytes << ")");
    const int64_t sample = key == building_key_ ? next_index_ - 1 : next_index_;
    if (want_ && !want_(sample, ext)) {
      DDM_CHECK(archive_read_data_skip(a) == ARCHIVE_OK,
                "shard " << name_ << ": member " << path << " is truncated (" << archive_error_string(a) << ")");
      pending_key_ = std::move(key), pending_ext_ = std::move(ext), pending_bytes_.clear();
      return true;
    }
    // Read in chunks, so that what is allocated is what the shard holds, not what a header claims.
    constexpr int64_t kChunk = int64_t(1) << 20;
    std::string bytes;
    int64_t got = 0;
    while (got < size) {
      bytes.resize(static_cast<size_t>(std::min(size, got + kChunk)));
      const la_ssize_t n = archive_read_data(a, bytes.data() + got, static_cast<size_t>(std::min(size - got, kChunk)));
      DDM_CHECK(n > 0, "shard " << name_ << ": member " << path << " is truncated (" << got << " of " << size << " bytes"
                                << (n < 0 ? std::string(": ") + archive_error_string(a) : std::string()) << ")");
      got += n;
    }
    bytes.resize(static_cast<size_t>(got));
    pending_key_ = std::move(key), pending_ext_ = std::move(ext), pending_bytes_ = std::move(bytes);
    return true;
  }
}

bool TarShardReader::next(ShardSample& out) {
  if (done_) return false;
  if (!has_pending_) {
    has_pending_ = read_member();
    if (!has_pending_) return done_ = true, false;
  }
  out = ShardSample{};
  out.key = building_key_ = pending_key_;
  out.index = next_index_++;
  DDM_CHECK(seen_.insert(out.key).second, "shard " << name_ << ": sample '" << out.key
                                                   << "' appears twice, its files apart; a sample's files must be consecutive "
                                                      "members (tar the files in sorted order)");
  for (;;) {
    DDM_CHECK(out.files.emplace(pending_ext_, std::move(pending_bytes_)).second,
              "shard " << name_ << ": sample '" << out.key << "' has two ." << pending_ext_ << " files");
    has_pending_ = read_member();
    if (!has_pending_) {
      done_ = true;
      return true;
    }
    if (pending_key_ != out.key) return true;
  }
}

struct TarShardWriter::Impl {
  archive* a = nullptr;
  archive_entry* e = nullptr;
  ~Impl() {
    if (e) archive_entry_free(e);
    if (a) archive_write_free(a);
  }
};

namespace {

// Why a write failed: libarchive's text ("Write error") with the system's reason ("No space left on
// device"), and where to look.
std::string write_failure(archive* a) {
  std::string why = archive_error_string(a) ? archive_error_string(a) : "unknown error";
  const int e = archive_errno(a);
  if (e > 0 && why.find(std::strerror(e)) == std::string::npos) why += std::string(": ") + std::strerror(e);
  return why + "; check free disk space and permissions";
}

}  // namespace

TarShardWriter::TarShardWriter(const std::string& path)
    : impl_(std::make_unique<Impl>()), path_(path), partial_(path + ".partial") {
  impl_->a = archive_write_new();
  impl_->e = archive_entry_new();
  DDM_CHECK(impl_->a && impl_->e, "libarchive could not allocate a writer");
  archive_write_set_format_pax_restricted(impl_->a);  // ustar headers, pax extensions only where needed
  DDM_CHECK(archive_write_open_filename(impl_->a, partial_.c_str()) == ARCHIVE_OK,
            "cannot write shard " << partial_ << " (" << write_failure(impl_->a) << ")");
}

TarShardWriter::~TarShardWriter() {
  if (!finished_) {
    impl_.reset();
    std::error_code ec;
    fs::remove(partial_, ec);
  }
}

void TarShardWriter::add(const ShardSample& s) {
  const size_t slash = s.key.rfind('/');
  DDM_CHECK(!s.key.empty() && s.key.find('.', slash == std::string::npos ? 0 : slash + 1) == std::string::npos,
            "shard " << path_ << ": key '" << s.key << "' is empty or has a dot in its file name (the extension starts at the first dot)");
  for (const auto& [ext, bytes] : s.files) {
    const std::string member = s.key + "." + ext;
    archive_entry_clear(impl_->e);
    archive_entry_set_pathname(impl_->e, member.c_str());
    archive_entry_set_filetype(impl_->e, AE_IFREG);
    archive_entry_set_perm(impl_->e, 0644);
    archive_entry_set_size(impl_->e, static_cast<la_int64_t>(bytes.size()));
    archive_entry_set_mtime(impl_->e, 0, 0);  // the same bytes for the same samples
    DDM_CHECK(archive_write_header(impl_->a, impl_->e) == ARCHIVE_OK,
              "shard " << partial_ << ": cannot write " << member << " (" << write_failure(impl_->a) << ")");
    DDM_CHECK(archive_write_data(impl_->a, bytes.data(), bytes.size()) == static_cast<la_ssize_t>(bytes.size()),
              "shard " << partial_ << ": cannot write " << member << " (" << write_failure(impl_->a) << ")");
    bytes_ += static_cast<int64_t>(bytes.size());
  }
}

void TarShardWriter::finish() {
  DDM_CHECK(!finished_, "shard " << path_ << " finished twice");
  DDM_CHECK(archive_write_close(impl_->a) == ARCHIVE_OK,
            "shard " << partial_ << ": cannot finish it (" << write_failure(impl_->a) << ")");
  impl_.reset();
  const int fd = ::open(partial_.c_str(), O_RDONLY);  // on disk before it takes its final name
  const bool synced = fd >= 0 && ::fsync(fd) == 0;
  if (fd >= 0) ::close(fd);
  DDM_CHECK(synced, "cannot flush shard " << partial_ << " to disk");
  std::error_code ec;
  fs::rename(partial_, path_, ec);
  DDM_CHECK(!ec, "cannot rename " << partial_ << " to " << path_ << ": " << ec.message());
  finished_ = true;
}

int64_t sample_label(const ShardSample& s, const std::string& what) {
  auto cls = s.files.find("cls");
  if (cls != s.files.end()) {
    const std::string& t = cls->second;
    const size_t a = t.find_first_not_of(" \t\r\n"), b = t.find_last_not_of(" \t\r\n");
    const std::string v = a == std::string::npos ? std::string() : t.substr(a, b - a + 1);
    DDM_CHECK(all_digits(v), what << ": its .cls is \"" << v.substr(0, 40) << "\", not a non-negative integer label");
    return std::stoll(v);
  }
  auto js = s.files.find("json");
  if (js != s.files.end()) {
    utf8_to_u32(js->second, what + ": its .json");  // bytes that are not UTF-8: named as such, not as bad JSON
    const nlohmann::json j = nlohmann::json::parse(js->second, nullptr, /*allow_exceptions=*/false);
    DDM_CHECK(!j.is_discarded() && j.is_object(), what << ": its .json is not a JSON object");
    auto it = j.find("label");
    if (it == j.end()) return -1;  // img2dataset's .json: a caption, a URL, sizes; no label
    DDM_CHECK(it->is_number_integer() && it->get<int64_t>() >= 0,
              what << ": its .json's \"label\" is " << it->dump().substr(0, 40) << ", not a non-negative integer");
    return it->get<int64_t>();
  }
  return -1;
}

}  // namespace ddm
