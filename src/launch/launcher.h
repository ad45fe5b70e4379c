// `ddm launch`: N local workers with torchrun's environment and torchelastic's failure semantics,
// supervised by one launcher process that also hosts their rendezvous store.
//
//   - Attempt k starts N workers (ranks 0..N-1), each in its own process group, with
//     TORCHELASTIC_RESTART_COUNT = k; their output comes back line by line as "[rank r] ...".
//   - A worker that exits 0 is done; when all have, the launch succeeds (exit 0).
//   - A worker that exits non-zero or is killed by a signal fails the attempt: the launcher says
//     which rank failed and how, stops the others (SIGTERM to each group, `grace_s` to exit, then
//     SIGKILL) and, while restarts remain, starts all N again with the count incremented. A
//     trainer resumes from its last checkpoint when the count is > 0. No restarts left: exit 1.
//   - With `restart = "failed"`, a failed worker other than rank 0 is restarted alone (while restarts
//     remain), with DDM_REJOIN=1 in its environment, and the others go on: DiLoCo replicas take it
//     back at their next synchronization (docs/distributed.md). Rank 0's failure restarts all.
//   - SIGINT / SIGTERM / SIGHUP to the launcher go to every worker's group; after the grace period
//     the rest are killed; the launcher exits 128 + signal. A second signal kills at once.
//   - `timeout_s` bounds each attempt's wall-clock time (0: none): the workers are stopped and the
//     launch fails (exit 1).
//   - A ddm worker (not --no-ddm) that exits kExitBadInput (2, core/error.h) had its command line or
//     config refused before it ran: no restart (it would fail the same way); the others are
//     stopped and the launch fails with ddm::InputError (exit 2).
//   - Nothing outlives the launch: at the end of each attempt whatever is left in a worker's
//     process group is killed, and a launcher that dies (even by SIGKILL) takes its workers with
//     it (PR_SET_PDEATHSIG: each worker process gets SIGTERM; children a worker started itself
//     are its business then). What a worker started in a new session of its own is out of reach.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ddm {

struct LaunchConfig {
  int64_t nproc = 1;
  int64_t max_restarts = 0;  // restarts of all workers, or of one (restart = "failed"), together
  std::string restart = "all";  // all | failed
  double timeout_s = 0;  // per attempt; 0 = no limit
  double grace_s = 30;   // how long stopped workers get before SIGKILL
  int64_t master_port = 0;  // 0: a free port picked by the kernel
  std::string run_id = "none";
  bool no_ddm = false;  // command[0] is a program, not a ddm subcommand
  std::vector<std::string> command;
};

// Throws ddm::Error naming the bad value and what to pass instead.
void check_launch_config(const LaunchConfig& c);

// Runs the launch and returns the exit code (0, or 128 + signal); throws ddm::Error for a failed
// launch (restarts exhausted, timeout, store cannot be hosted), with the failing rank and reason,
// and ddm::InputError when a ddm worker's input was refused.
int run_launch(const LaunchConfig& c);

}  // namespace ddm
