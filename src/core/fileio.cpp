// Small file helpers: whole-file read, atomic write (temporary name + fsync + rename + directory
// fsync) and SHA-256 through OpenSSL's EVP interface. Every failure is a ddm::Error naming the path
// and the operating system's reason. FileLock wraps flock(2).
#include "core/fileio.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>

#include "core/error.h"

namespace ddm {
namespace {

std::string os_reason(int err) { return std::strerror(err); }

// Closes a file descriptor on scope exit unless released.
struct FdGuard {
  int fd = -1;
  explicit FdGuard(int f) : fd(f) {}
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
};

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Writes all of `bytes` to fd, retrying on short writes and EINTR.
void write_all(int fd, const void* bytes, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(bytes);
  size_t left = size;
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      DDM_FAIL("cannot write " << path << ": " << os_reason(errno)
                               << " (check free disk space and permissions)");
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxDeleter>;

MdCtx new_sha256() {
  MdCtx ctx(EVP_MD_CTX_new());
  DDM_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1,
            "OpenSSL could not initialise SHA-256");
  return ctx;
}

std::string finish_hex(EVP_MD_CTX* ctx) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  DDM_CHECK(EVP_DigestFinal_ex(ctx, digest, &len) == 1, "OpenSSL SHA-256 finalisation failed");
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(hex[digest[i] >> 4]);
    out.push_back(hex[digest[i] & 0xf]);
  }
  return out;
}

}  // namespace

std::string read_file(const std::string& path) {
  FdGuard fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  DDM_CHECK(fd.fd >= 0, "cannot open " << path << " for reading: " << os_reason(errno));
  struct stat st {};
  DDM_CHECK(::fstat(fd.fd, &st) == 0, "cannot stat " << path << ": " << os_reason(errno));
  DDM_CHECK(!S_ISDIR(st.st_mode), "cannot read " << path << ": it is a directory, expected a file");
  std::string out;
  if (st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      DDM_FAIL("cannot read " << path << ": " << os_reason(errno));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

void fsync_dir(const std::string& dir) {
  FdGuard fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  DDM_CHECK(fd.fd >= 0, "cannot open directory " << dir << " to fsync it: " << os_reason(errno));
  // Some file systems do not support fsync on directories; that is not worth failing for.
  if (::fsync(fd.fd) != 0 && errno != EINVAL && errno != ENOTSUP) {
    DDM_FAIL("cannot fsync directory " << dir << ": " << os_reason(errno));
  }
}

std::string absolute_dir(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::absolute(dir).lexically_normal();
  return (p.has_filename() ? p : p.parent_path()).string();
}

std::string dir_without_slash(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  return (p.has_filename() || !p.has_parent_path() ? p : p.parent_path()).string();
}

void create_output_dir(const std::string& dir, const std::string& what) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!ec && std::filesystem::is_directory(dir)) return;
  // The first part of the path that exists and is not a directory, if one is the reason.
  std::filesystem::path p;
  for (const auto& part : std::filesystem::path(dir)) {
    p /= part;
    std::error_code e2;
    if (std::filesystem::exists(p, e2) && !std::filesystem::is_directory(p, e2))
      DDM_FAIL(what << " " << dir << ": cannot create the directory, " << p.string()
                    << " is a file; give another path");
  }
  DDM_FAIL(what << " " << dir << ": cannot create the directory (" << (ec ? ec.message() : "not a directory")
                << "); give another path");
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  write_file_atomic(path, [&bytes](const PutBytes& put) { put(bytes.data(), bytes.size()); });
}

void write_file_atomic(const std::string& path, const std::function<void(const PutBytes& put)>& fill) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  {
    FdGuard fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    DDM_CHECK(fd.fd >= 0, "cannot create " << tmp << " (temporary file for " << path
                                           << "): " << os_reason(errno)
                                           << " (check that the directory exists and is writable)");
    try {
      fill([&](const void* bytes, size_t n) { write_all(fd.fd, bytes, n, tmp); });
      DDM_CHECK(::fsync(fd.fd) == 0, "cannot fsync " << tmp << ": " << os_reason(errno));
      const int rc = ::close(fd.fd);
      fd.fd = -1;
      DDM_CHECK(rc == 0, "cannot close " << tmp << ": " << os_reason(errno));
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    DDM_FAIL("cannot rename " << tmp << " to " << path << ": " << os_reason(err));
  }
  fsync_dir(parent_dir(path));
}

std::string sha256_hex(const std::string& bytes) {
  MdCtx ctx = new_sha256();
  DDM_CHECK(EVP_DigestUpdate(ctx.get(), bytes.data(), bytes.size()) == 1, "OpenSSL SHA-256 update failed");
  return finish_hex(ctx.get());
}

struct Sha256::Ctx {
  MdCtx md = new_sha256();
};
Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {}
Sha256::~Sha256() = default;
void Sha256::update(const void* bytes, size_t n) {
  DDM_CHECK(EVP_DigestUpdate(ctx_->md.get(), bytes, n) == 1, "OpenSSL SHA-256 update failed");
}
std::string Sha256::hex() { return finish_hex(ctx_->md.get()); }

std::string default_cache_dir() {
  namespace fs = std::filesystem;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return (fs::path(x) / "ddm").string();
  if (const char* h = std::getenv("HOME"); h && *h) return (fs::path(h) / ".cache" / "ddm").string();
  std::error_code ec;
  const fs::path tmp = fs::temp_directory_path(ec);
  return ((ec ? fs::path("/tmp") : tmp) / "ddm-cache").string();
}

std::string sha256_file(const std::string& path) {
  FdGuard fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  DDM_CHECK(fd.fd >= 0, "cannot open " << path << " to hash it: " << os_reason(errno));
  MdCtx ctx = new_sha256();
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      DDM_FAIL("cannot read " << path << " to hash it: " << os_reason(errno));
    }
    if (n == 0) break;
    DDM_CHECK(EVP_DigestUpdate(ctx.get(), buf, static_cast<size_t>(n)) == 1, "OpenSSL SHA-256 update failed");
  }
  return finish_hex(ctx.get());
}

FileLock::FileLock(const std::string& path, const std::string& who_holds) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) DDM_FAIL("cannot create the lock file " << path << ": " << os_reason(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) DDM_FAIL(who_holds << " (" << path << " is locked)");
    DDM_FAIL("cannot lock " << path << ": " << os_reason(err));
  }
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);
}

FileLock& FileLock::operator=(FileLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

}  // namespace ddm
