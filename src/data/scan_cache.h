// What the scan of a shard found (scan_shards, shard_stream.h), kept between runs: a run over shards
// scanned before (a resume, the next run of an experiment, the ranks of a job after the first run)
// reads one small file instead of every tar header of every shard, which over thousands of shards on
// a network file system takes minutes.
//
// The file lives in ddm's cache directory (core/fileio.h), shard-scans/, one per shard list and
// content (images or posteriors). A shard's entry holds for the shard file of that absolute path,
// size, modification time and inode only; a changed shard is scanned again. Only clean scans are kept (no
// corrupt member, no bad sample skipped), so that a cached shard is one that a scan would pass
// whatever data.skip_bad says. The cache is an optimization: a missing, unreadable or malformed file
// is ignored and a write that fails is skipped, never an error. The directory keeps the kMaxFiles
// files written or used last. data.scan_cache = false turns it off.
#pragma once
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ddm {

// One shard's part of the index (what scan_shards needs of it).
struct ShardFacts {
  int64_t count = 0, labeled = 0, max_label = -1, captioned = 0;
  std::string unlabeled_key, labeled_key;      // one of each, to name in the mixed-labels error
  std::string uncaptioned_key, captioned_key;  // the same for captions
};

class ScanCache {
 public:
  static constexpr size_t kMaxFiles = 256;
  // The cached scans of `shards` holding `content` ("image" or "posterior") in `dir`; dir "": none
  // (find finds nothing, save writes nothing).
  ScanCache(const std::string& dir, const std::vector<std::string>& shards, const std::string& content);
  // A file as it is now: its size, modification time and inode (bytes -1: it cannot be stat'ed).
  struct FileId {
    int64_t bytes = -1, mtime_ns = 0, inode = 0;
    bool operator==(const FileId& o) const { return bytes == o.bytes && mtime_ns == o.mtime_ns && inode == o.inode; }
  };
  static FileId identify(const std::string& path);
  // Shard i's facts if its file is the one they were recorded for. Safe from several threads.
  std::optional<ShardFacts> find(size_t i) const;
  // Records shard i's facts: a clean scan of the file that was `id` (identified before the scan
  // read it, so that a shard rewritten meanwhile is not recorded as the new file).
  void put(size_t i, const FileId& id, const ShardFacts& facts);
  // Writes the file if put added anything, then prunes the directory (else marks it used).
  void save();
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    FileId id;
    ShardFacts facts;
    bool valid = false;
  };
  std::string dir_, path_, content_;
  std::vector<std::string> shards_;  // absolute paths
  std::vector<Entry> entries_;
  bool changed_ = false;
  mutable std::atomic<bool> used_{false};  // find served an entry
};

}  // namespace ddm
