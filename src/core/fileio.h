// Small file helpers: whole-file read, atomic write (temporary name + fsync + rename), sha256.
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

}  // namespace ddm
