// The shard scan cache (see scan_cache.h).
#include "data/scan_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

constexpr const char* kFormat = "ddm-shard-scan-2";  // 2: captions counted

}  // namespace

ScanCache::FileId ScanCache::identify(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return {static_cast<int64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + static_cast<int64_t>(st.st_mtim.tv_nsec),
          static_cast<int64_t>(st.st_ino)};
}

ScanCache::ScanCache(const std::string& dir, const std::vector<std::string>& shards, const std::string& content)
    : dir_(dir), content_(content), entries_(shards.size()) {
  std::string list = content + "\n";
  for (const std::string& s : shards) {
    std::error_code ec;
    const fs::path abs = fs::absolute(s, ec).lexically_normal();
    shards_.push_back(ec ? s : abs.string());
    list += shards_.back() + "\n";
  }
  if (dir_.empty()) return;
  path_ = (fs::path(dir_) / "shard-scans" / (sha256_hex(list).substr(0, 32) + ".json")).string();
  try {
    std::ifstream in(path_);
    if (!in) return;
    const nlohmann::json j = nlohmann::json::parse(in);
    if (j.value("format", "") != kFormat || j.value("content", "") != content_) return;
    const nlohmann::json& list_j = j.at("shards");
    if (!list_j.is_array() || list_j.size() != shards_.size()) return;
    for (size_t i = 0; i < shards_.size(); ++i) {
      const nlohmann::json& e = list_j[i];
      if (e.is_null() || e.at("path").get<std::string>() != shards_[i]) continue;
      Entry& out = entries_[i];
      out.id = {e.at("bytes").get<int64_t>(), e.at("mtime_ns").get<int64_t>(), e.at("inode").get<int64_t>()};
      out.facts.count = e.at("count").get<int64_t>();
      out.facts.labeled = e.at("labeled").get<int64_t>();
      out.facts.max_label = e.at("max_label").get<int64_t>();
      out.facts.unlabeled_key = e.at("unlabeled_key").get<std::string>();
      out.facts.labeled_key = e.at("labeled_key").get<std::string>();
      out.facts.captioned = e.at("captioned").get<int64_t>();
      out.facts.uncaptioned_key = e.at("uncaptioned_key").get<std::string>();
      out.facts.captioned_key = e.at("captioned_key").get<std::string>();
      out.valid = out.facts.count >= 0 && out.facts.labeled >= 0 && out.facts.labeled <= out.facts.count &&
                  out.facts.max_label >= -1 && out.facts.captioned >= 0 && out.facts.captioned <= out.facts.count;
    }
  } catch (const std::exception&) {  // a malformed cache is no cache
    for (Entry& e : entries_) e = Entry{};
  }
}

std::optional<ShardFacts> ScanCache::find(size_t i) const {
  const Entry& e = entries_[i];
  if (!e.valid || !(identify(shards_[i]) == e.id)) return std::nullopt;
  used_ = true;
  return e.facts;
}

void ScanCache::put(size_t i, const FileId& id, const ShardFacts& facts) {
  if (dir_.empty() || id.bytes < 0) return;
  Entry& e = entries_[i];
  if (e.valid && e.id == id) return;
  e = Entry{id, facts, true};
  changed_ = true;
}

void ScanCache::save() {
  if (!changed_) {  // a file that served: its time says it was used (pruning keeps the newest)
    std::error_code ec;
    if (used_) fs::last_write_time(path_, fs::file_time_type::clock::now(), ec);
    return;
  }
  changed_ = false;
  nlohmann::json list = nlohmann::json::array();
  for (size_t i = 0; i < shards_.size(); ++i) {
    const Entry& e = entries_[i];
    if (!e.valid) {
      list.push_back(nullptr);
      continue;
    }
    list.push_back({{"path", shards_[i]}, {"bytes", e.id.bytes}, {"mtime_ns", e.id.mtime_ns}, {"inode", e.id.inode},
                    {"count", e.facts.count},
                    {"labeled", e.facts.labeled}, {"max_label", e.facts.max_label},
                    {"unlabeled_key", e.facts.unlabeled_key}, {"labeled_key", e.facts.labeled_key},
                    {"captioned", e.facts.captioned}, {"uncaptioned_key", e.facts.uncaptioned_key},
                    {"captioned_key", e.facts.captioned_key}});
  }
  const nlohmann::json j = {{"format", kFormat}, {"content", content_}, {"shards", list}};
  std::error_code ec;
  const fs::path dir = fs::path(path_).parent_path();
  fs::create_directories(dir, ec);
  if (ec) return;
  // A unique temporary name (ranks that are threads of one process may write the same list's file),
  // renamed onto the file: a reader sees the old file or the new one, never half of one.
  std::string tmp = path_ + ".tmp-XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return;
  const std::string text = j.dump() + "\n";
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!written || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return;
  }
  // Keep the newest kMaxFiles scans (and drop temporary files a killed process left).
  std::vector<std::pair<fs::file_time_type, fs::path>> files;
  for (fs::directory_iterator f(dir, ec), end; !ec && f != end; f.increment(ec)) {
    std::error_code e2;
    const auto t = f->last_write_time(e2);
    if (e2) continue;
    const std::string name = f->path().filename().string();
    if (name.find(".tmp-") != std::string::npos) {
      if (fs::file_time_type::clock::now() - t > std::chrono::hours(1)) fs::remove(f->path(), e2);
      continue;
    }
    files.emplace_back(t, f->path());
  }
  if (files.size() <= kMaxFiles) return;
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = kMaxFiles; k < files.size(); ++k) fs::remove(files[k].second, ec);
}

}  // namespace ddm
