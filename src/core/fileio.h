// Small file helpers: whole-file read, atomic write (temporary name + fsync + rename), sha256, ddm's
// cache directory, and an exclusive lock that keeps two processes from writing one run directory.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace ddm {

// Reads a whole file; throws ddm::Error naming the path if it cannot.
std::string read_file(const std::string& path);
// Writes `bytes` to `path` atomically: path.tmp-PID, fsync, rename, fsync of the directory.
void write_file_atomic(const std::string& path, const std::string& bytes);
// The same for content made piece by piece: `fill` calls `put` for each piece, in order, so a large
// file (a checkpoint's tensors) is never held whole in memory.
using PutBytes = std::function<void(const void* bytes, size_t n)>;
void write_file_atomic(const std::string& path, const std::function<void(const PutBytes& put)>& fill);
// fsync a directory (after renames inside it).
void fsync_dir(const std::string& dir);
// Creates the directory `dir` and its parents for an output option (`what`: "--out"), or fails naming
// the option, the path and why (a file where a directory should be, no permission). An empty dir
// (the current directory) is left alone. Called before the work whose results go there.
void create_output_dir(const std::string& dir, const std::string& what);
// A directory named on the command line, absolute, in normal form and without a trailing separator
// ("runs/x/" and "runs/./x" give "/cwd/runs/x"), so that its name and the names built beside it
// (DIR.tmp-PID, renamed to DIR when complete) are what they look like.
std::string absolute_dir(const std::string& dir);
// The same without a trailing separator, relative where it was ("out/" -> "out"), for names built
// beside it (OUT.partial).
std::string dir_without_slash(const std::string& dir);
// Lower-case hex SHA-256 of bytes / of a file's content.
std::string sha256_hex(const std::string& bytes);
std::string sha256_file(const std::string& path);
// SHA-256 over several pieces without joining them (a model's tensors: no copy of the weights).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* bytes, size_t n);
  std::string hex();  // lower-case; finishes the digest (call once)

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};
// ddm's cache directory (evaluation references, shard scans): $XDG_CACHE_HOME/ddm, else
// ~/.cache/ddm, else ddm-cache in the system's temporary directory.
std::string default_cache_dir();

// An exclusive advisory lock (flock) on a file, held until destruction. The operating system drops
// it when the process dies, even by kill -9, so a stale lock never blocks a resume; children do not
// inherit it. If another process holds it, the constructor throws ddm::Error with
// "<who_holds> (<path> is locked)".
class FileLock {
 public:
  FileLock() = default;
  FileLock(const std::string& path, const std::string& who_holds);
  ~FileLock();
  FileLock(FileLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  FileLock& operator=(FileLock&& o) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace ddm
