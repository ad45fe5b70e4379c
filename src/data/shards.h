// WebDataset tar shards: the shard list a user names in data.root, and the samples
// of one shard in their order. A sample is the files of one key: a tar member's path up to the first
// dot of its file name ("train/n01440764_10026" of "train/n01440764_10026.jpg"), the rest its
// extension ("jpg", "cls", "seg.png"), so shards written by webdataset or img2dataset read
// unchanged. A key's files are consecutive members, as those writers put them.
//
// Tar reading is libarchive's (Debian's libarchive-dev): it reads ustar, pax and GNU tar, and says
// where an archive is truncated or corrupt. The brace patterns of shard lists are expanded here by
// hand (glob(3) has no numeric ranges); globs are glob(3)'s.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace ddm {

// The shard paths `spec` names, in order:
//   a brace pattern  "data/train-{000000..000127}.tar": each {A..B} a numeric range, zero-padded to
//                    A's width when A has a leading zero; several braces expand as a product, the
//                    last varying fastest; {x,y,z} lists alternatives
//   a glob           "data/*.tar" (`*`, `?`, `[...]`): the matches, sorted
//   a list file      a text file (not a .tar) of one path per line, '#' comments and blank lines
//                    skipped, relative paths taken from the file's folder
//   a record         PREFIX.shards.json, which `ddm shards write` leaves beside its shards: those
//                    it lists, from its folder
//   one shard        a path ending in .tar
//   a folder         its .tar files (not its subfolders'), sorted: the glob FOLDER/*.tar
// Every path must exist: the first missing one is named. No shard at all is an error too. `key`
// names the setting in errors (e.g. "data.root").
std::vector<std::string> expand_shards(const std::string& spec, const std::string& key);

// Only the expansion of a brace pattern, without looking at the file system (any string; a pattern
// without braces is itself). Errors for an unclosed brace, a range the wrong way round or one of more
// than 10^7 names.
std::vector<std::string> expand_braces(const std::string& pattern, const std::string& key);

struct ShardSample {
  std::string key;                           // the member path less its extensions
  std::map<std::string, std::string> files;  // extension (lower-case) -> the member's bytes
  int64_t index = 0;                         // its position in the shard (0, 1, ...)
};

// The key and extension of a member path by the WebDataset convention ("a/b.c.d" -> "a/b", "c.d").
// A member whose file name has no dot (or starts with one) has no key: {"", ""}.
std::pair<std::string, std::string> split_key(const std::string& member);

// Reads the samples of one shard in order, streaming: the whole shard is never in memory, only one
// sample's files. Directories and members without a key are skipped; a member bigger than
// kMaxMemberBytes is an error (a corrupt size field).
class TarShardReader {
 public:
  static constexpr int64_t kMaxMemberBytes = int64_t(1) << 30;
  // `name` names the shard in errors (its path). From a file, or from memory (`bytes` must outlive
  // the reader; fuzzing and tests).
  explicit TarShardReader(const std::string& path);
  TarShardReader(const char* bytes, size_t size, const std::string& name);
  ~TarShardReader();
  TarShardReader(const TarShardReader&) = delete;
  TarShardReader& operator=(const TarShardReader&) = delete;

  // The next sample, or false after the last. Throws ddm::Error naming the shard and the key for a
  // truncated or corrupt archive, or for a key whose members are not consecutive (the same key
  // again after another).
  bool next(ShardSample& out);
  const std::string& name() const { return name_; }
  // Which members' bytes next() reads: want(sample index, extension). A member not wanted is skipped
  // without reading its data (a seek, on a file) and appears in `files` empty. Default: every member.
  void set_filter(std::function<bool(int64_t, const std::string&)> want) { want_ = std::move(want); }

 private:
  struct Impl;
  bool read_member();  // the next member with a key into pending_; false at the end
  std::unique_ptr<Impl> impl_;
  std::string name_;
  bool has_pending_ = false, done_ = false;
  std::string pending_key_, pending_ext_, pending_bytes_, last_member_;
  int64_t next_index_ = 0;
  std::set<std::string> seen_;  // this shard's keys so far, to name one that comes again
  std::string building_key_;    // the key of the sample next() is assembling
  std::function<bool(int64_t, const std::string&)> want_;
};

// Writes one shard: members in the order added (a sample's files together), as a POSIX (pax) tar
// that every reader takes. Written to "<path>.partial" and renamed onto `path` by finish(), so a
// crash never leaves a truncated shard under the final name.
class TarShardWriter {
 public:
  explicit TarShardWriter(const std::string& path);
  ~TarShardWriter();  // without finish(): the partial file is removed
  TarShardWriter(const TarShardWriter&) = delete;
  TarShardWriter& operator=(const TarShardWriter&) = delete;
  // Adds KEY.EXT for each of the sample's files (keys may hold '/', not '.' in their last part).
  void add(const ShardSample& s);
  void finish();
  int64_t bytes() const { return bytes_; }  // the members' bytes so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_, partial_;
  int64_t bytes_ = 0;
  bool finished_ = false;
};

// The label of a sample: "cls" (a decimal integer, whitespace around it allowed) or "json" (an
// object with an integer "label"); -1 when it has neither (a .json without "label", as img2dataset
// writes, is no label). Errors name `what` (shard and key) and the
// bad text.
int64_t sample_label(const ShardSample& s, const std::string& what);

}  // namespace ddm
