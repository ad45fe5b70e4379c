// Child processes for the launcher and the islands runner (see process.h), on POSIX fork/execve/waitid.
#include "launch/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "core/error.h"

extern char** environ;

namespace ddm {

namespace {

// Writes a whole message from the child between fork and exec (async-signal-safe calls only).
void child_say(const char* a, const char* b, const char* c) {
  for (const char* s : {a, b, c}) {
    size_t n = std::strlen(s);
    while (n > 0) {
      const ssize_t w = ::write(2, s, n);
      if (w <= 0) return;
      s += w;
      n -= static_cast<size_t>(w);
    }
  }
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace

Child spawn_child(const ChildSpec& spec) {
  DDM_CHECK(!spec.argv.empty(), "spawn_child: empty argv for " << spec.program);
  // Everything the child needs is built before fork: after fork in a multi-threaded process (the
  // launcher hosts a TCPStore with its own threads) the child may only make async-signal-safe calls.
  std::vector<char*> argv, envp;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const std::string cannot = "error: cannot run " + spec.program + ": ";
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  const int max_fd =
      files.rlim_cur == RLIM_INFINITY || files.rlim_cur > 65536 ? 65536 : static_cast<int>(files.rlim_cur);

  int fds[2];
  if (spec.output_file.empty()) {
    DDM_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "cannot start " << spec.program << ": no pipe (" << std::strerror(errno)
                                                            << "); too many open files? (ulimit -n)");
  } else {
    fds[0] = -1;
    fds[1] = ::open(spec.output_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    DDM_CHECK(fds[1] >= 0, "cannot start " << spec.program << ": cannot open its log " << spec.output_file << " ("
                                           << std::strerror(errno) << ")");
  }
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    if (fds[0] >= 0) ::close(fds[0]);
    ::close(fds[1]);
    if (devnull >= 0) ::close(devnull);
    DDM_FAIL("cannot start " << spec.program << ": fork failed (" << std::strerror(err)
                             << "); too many processes? (ulimit -u)");
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    // The worker does not outlive the launcher, even one killed by SIGKILL: it gets SIGTERM.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) _exit(1);  // the launcher died before prctl took effect
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the launcher blocks the signals it reads from a signalfd
    ::signal(SIGPIPE, SIG_DFL);  // ddm ignores SIGPIPE (apps/ddm.cpp); an ignored signal survives execve
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    if (devnull >= 0) ::dup2(devnull, 0);
    // Nothing else of the launcher's leaks into the worker (its pipes keep a worker's EOF honest,
    // and the store's listening socket must die with the launcher).
    if (::syscall(SYS_close_range, 3U, ~0U, 0U) != 0)
      for (int fd = 3; fd < max_fd; ++fd) ::close(fd);
    ::execve(spec.program.c_str(), argv.data(), envp.data());
    child_say(cannot.c_str(), std::strerror(errno), "\n");
    _exit(127);
  }
  ::setpgid(pid, pid);  // also from the parent, so the group exists before the first signal to it
  ::close(fds[1]);
  if (devnull >= 0) ::close(devnull);
  return Child{pid, fds[0]};
}

std::optional<ExitStatus> peek_exit(pid_t pid) {
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
    if (errno == EINTR) continue;
    ExitStatus gone;  // not our child (already reaped): report it as ended
    gone.code = -1;
    return gone;
  }
  if (info.si_pid == 0) return std::nullopt;
  ExitStatus s;
  if (info.si_code == CLD_EXITED) {
    s.code = info.si_status;
  } else {
    s.signal = info.si_status;
    s.core = info.si_code == CLD_DUMPED;
  }
  return s;
}

void reap(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
}

ExitStatus wait_exit(pid_t pid) {
  int status = 0;
  ExitStatus s;
  pid_t r;
  while ((r = ::waitpid(pid, &status, 0)) < 0 && errno == EINTR) {
  }
  if (r < 0) {
    s.code = -1;  // not our child: its status is lost
  } else if (WIFSIGNALED(status)) {
    s.signal = WTERMSIG(status);
    s.core = WCOREDUMP(status);
  } else {
    s.code = WEXITSTATUS(status);
  }
  return s;
}

bool signal_group(pid_t pgid, int sig) { return pgid > 0 && ::kill(-pgid, sig) == 0; }

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string describe(const ExitStatus& s) {
  if (s.signal != 0)
    return "was killed by signal " + std::to_string(s.signal) + " (" + signal_name(s.signal) + ")" +
           (s.core ? ", core dumped" : "");
  if (s.code < 0) return "ended (its status was lost)";
  return "exited with status " + std::to_string(s.code);
}

std::string resolve_program(const std::string& name) {
  DDM_CHECK(!name.empty(), "the program to run is an empty string");
  if (name.find('/') != std::string::npos) {
    DDM_CHECK(is_executable_file(name), "cannot run '" << name << "': no such executable file");
    return std::filesystem::absolute(name).string();
  }
  const char* path_env = std::getenv("PATH");
  const std::string path = path_env && *path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  std::stringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (is_executable_file(candidate)) return std::filesystem::absolute(candidate).string();
  }
  DDM_FAIL("cannot run '" << name << "': not found in PATH (" << path << "); give its full path, or install it");
}

std::string self_executable() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  DDM_CHECK(!ec, "cannot locate the ddm executable (/proc/self/exe): " << ec.message());
  return p.string();
}

std::vector<std::string> environment_with(const std::vector<std::pair<std::string, std::string>>& set,
                                          const std::vector<std::string>& unset) {
  std::set<std::string> drop(unset.begin(), unset.end());
  for (const auto& kv : set) drop.insert(kv.first);
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry(*e);
    if (!drop.count(entry.substr(0, entry.find('=')))) env.push_back(entry);
  }
  for (const auto& kv : set) env.push_back(kv.first + "=" + kv.second);
  return env;
}

}  // namespace ddm
