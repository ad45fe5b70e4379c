// Child processes for `ddm launch` and the islands runner: start a program with a given
// environment, its stdout and stderr on one pipe (or appended to a log file), stdin on /dev/null, in
// its own process group, and tied to the parent's life (PR_SET_PDEATHSIG); notice its exit without
// reaping it; describe how it ended.
//
// Why a process group per child: a stop signal sent to the group reaches what the worker itself
// started (a shell's children), and a worker is not hit by the terminal's Ctrl-C directly: the
// launcher decides (it forwards the signal to every group).
// Why exits are noticed without reaping (waitid WNOWAIT): while an exited child is an unreaped
// zombie its pid, and so its process-group id, cannot be reused, so the launcher can still kill
// what the child left behind in its group without hitting an unrelated process.
#pragma once
#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddm {

struct ChildSpec {
  std::string program;            // an absolute path (see resolve_program / self_executable)
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> env;   // the child's whole environment, "KEY=value"
  // Empty: stdout + stderr go to a pipe (Child::output_fd). Else they are appended to this file
  // (created if missing; its directory must exist) and there is no pipe.
  std::string output_file;
};

struct Child {
  pid_t pid = -1;      // also its process-group id
  int output_fd = -1;  // read end of the pipe with the child's stdout + stderr (close-on-exec); -1 with output_file
};

// Forks and execs. Must be called from the thread that lives as long as the child should (the
// death signal follows the forking thread). Throws ddm::Error when no pipe or process can be made;
// a failing exec shows as exit status 127 with the reason on the child's output.
Child spawn_child(const ChildSpec& spec);

struct ExitStatus {
  int code = 0;    // the exit status when signal == 0
  int signal = 0;  // the signal that killed it, or 0
  bool core = false;
  bool ok() const { return signal == 0 && code == 0; }
};
// The child's status if it has ended, without reaping it; std::nullopt while it runs.
std::optional<ExitStatus> peek_exit(pid_t pid);
// Reaps an ended child (blocks until it has ended).
void reap(pid_t pid);
// Blocks until the child ends, reaps it and returns how it ended.
ExitStatus wait_exit(pid_t pid);
// Sends sig to the child's whole process group; false when the group is gone.
bool signal_group(pid_t pgid, int sig);

// "exited with status 1", "was killed by signal 9 (SIGKILL)".
std::string describe(const ExitStatus& s);
// "SIGKILL" for 9 ("signal 64" when unnamed).
std::string signal_name(int sig);

// The absolute path of a program as the shell finds it: as given when it contains a '/', else the
// first executable file of that name in $PATH. Throws ddm::Error naming the program when none.
std::string resolve_program(const std::string& name);
// The running executable (/proc/self/exe).
std::string self_executable();

// This process's environment with `set` applied (replacing existing keys) and `unset` removed.
std::vector<std::string> environment_with(const std::vector<std::pair<std::string, std::string>>& set,
                                          const std::vector<std::string>& unset = {});

}  // namespace ddm
