// Small file helpers: whole-file read, atomic write (temporary name + fsync + rename), sha256, ddm's
// cache directory, and an exclusive lock that keeps two processes from writing one run directory.
#pragma once
#include <string>

namespace ddm {

// Reads a whole file; throws ddm::Error naming the path if it cannot.
std::string read_file(const std::string& path);
// Writes `bytes` to `path` atomically: path.tmp-PID, fsync, rename, fsync of the directory.
void write_file_atomic(const std::string& path, const std::string& bytes);
// fsync a directory (after renames inside it).
void fsync_dir(const std::string& dir);
// Lower-case hex SHA-256 of bytes / of a file's content.
std::string sha256_hex(const std::string& bytes);
std::string sha256_file(const std::string& path);
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
