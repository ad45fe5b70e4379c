// `ddm launch` (see launcher.h): attempts of N workers, output, signals, faults, restarts.
//
// One thread does everything: it polls a signalfd (SIGINT, SIGTERM, SIGHUP, SIGCHLD, blocked
// before the store's threads start, so they inherit the mask and only the signalfd sees them) and
// the workers' output pipes, notices exits with waitid(WNOWAIT) and reaps the workers only at the
// end of an attempt, after killing what is left in their process groups.
#include "launch/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>

#include "core/error.h"
#include "launch/output.h"
#include "launch/process.h"
#include "launch/rendezvous.h"

namespace ddm {

namespace {

using Clock = std::chrono::steady_clock;

void write_all(int fd, const std::string& s) {
  const char* p = s.data();
  size_t n = s.size();
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // a closed terminal or pipe: the output is lost, the launch goes on
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// The launcher's own messages go to stderr; the workers' prefixed output to stdout.
void say(const std::string& s) { write_all(2, "[launch] " + s + "\n"); }

std::string seconds(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t + " s";
}

// The launcher's signals, read from a signalfd for as long as this lives.
class SignalReader {
 public:
  SignalReader() {
    sigemptyset(&set_);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&set_, s);
    ::pthread_sigmask(SIG_BLOCK, &set_, &old_);
    fd_ = ::signalfd(-1, &set_, SFD_NONBLOCK | SFD_CLOEXEC);
    DDM_CHECK(fd_ >= 0, "ddm launch: cannot create a signalfd: " << std::strerror(errno));
  }
  ~SignalReader() {
    read_stop_signals();  // consumed here rather than delivered (and fatal) when unblocked
    ::close(fd_);
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SignalReader(const SignalReader&) = delete;
  SignalReader& operator=(const SignalReader&) = delete;
  int fd() const { return fd_; }
  // The stop signals (INT, TERM, HUP) that arrived since the last call, in order; SIGCHLD only wakes.
  std::vector<int> read_stop_signals() {
    std::vector<int> out;
    signalfd_siginfo info{};
    while (::read(fd_, &info, sizeof info) == static_cast<ssize_t>(sizeof info))
      if (info.ssi_signo != SIGCHLD) out.push_back(static_cast<int>(info.ssi_signo));
    return out;
  }

 private:
  sigset_t set_{}, old_{};
  int fd_ = -1;
};

struct Worker {
  int64_t rank = 0;
  Child child;
  LinePrefixer out;
  std::optional<ExitStatus> exit;
  bool reaped = false;
  bool spoke = false;  // it wrote something (stdout or stderr)
  Worker(int64_t r, Child c) : rank(r), child(c), out(LinePrefixer::for_rank(r)) {}
};

// Reads what a worker's pipe holds now; at end of file writes the held partial line and closes it.
void pump(Worker& w) {
  char buf[65536];
  while (w.child.output_fd >= 0) {
    const ssize_t n = ::read(w.child.output_fd, buf, sizeof buf);
    if (n > 0) {
      w.spoke = true;
      write_all(1, w.out.feed(buf, static_cast<size_t>(n)));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {  // end of file (or a read error: treated alike)
      write_all(1, w.out.flush());
      ::close(w.child.output_fd);
      w.child.output_fd = -1;
    }
  }
}

// Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): /proc/PID/stat's state T or t.
bool is_stopped(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(f, stat);
  const size_t close = stat.rfind(')');  // the state follows the command name, which may hold spaces
  return close != std::string::npos && close + 2 < stat.size() && (stat[close + 2] == 'T' || stat[close + 2] == 't');
}

// The workers of one attempt. Whatever happens (an exception included), the destructor leaves no
// process and no descriptor behind.
struct Attempt {
  std::vector<Worker> workers;
  ~Attempt() {
    for (auto& w : workers) {
      if (!w.reaped) {
        signal_group(w.child.pid, SIGKILL);
        reap(w.child.pid);
      }
      if (w.child.output_fd >= 0) ::close(w.child.output_fd);
    }
  }
};

struct Outcome {
  enum Kind { kSuccess, kFailed, kSignalled, kTimedOut } kind = kSuccess;
  int64_t rank = -1;
  pid_t pid = 0;
  std::string how;
  int signal = 0;
  bool refused = false;  // a ddm worker exited kExitBadInput: its input was refused, a restart fails alike
  bool spoke = true;     // the worker of `rank` wrote something: its output is above
  std::string stop_fault{};  // kSignalled by a worker's signal: another worker that failed meanwhile
};

// Output a finished worker still has in its pipe, for up to two seconds (a pipe held open by a
// process it left behind is given up).
void drain(std::vector<Worker*> workers) {
  const auto until = Clock::now() + std::chrono::seconds(2);
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Worker*> owners;
    for (Worker* w : workers)
      if (w->child.output_fd >= 0) {
        fds.push_back({w->child.output_fd, POLLIN, 0});
        owners.push_back(w);
      }
    if (fds.empty() || Clock::now() >= until) break;
    ::poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents != 0) pump(*owners[i]);
  }
}

Outcome run_attempt(const LaunchConfig& c, int64_t attempt, const ChildSpec& base, int port, SignalReader& signals,
                    int64_t& restarts_used) {
  Attempt a;
  a.workers.reserve(static_cast<size_t>(c.nproc));
  auto spawn_worker = [&](int64_t r, bool rejoin) {
    RankInfo info;
    info.rank = r;
    info.world_size = c.nproc;
    info.restart_count = attempt;
    info.max_restarts = c.max_restarts;
    info.run_id = c.run_id;
    info.master_port = port;
    auto vars = torchrun_environment(info);
    if (rejoin) vars.emplace_back("DDM_REJOIN", "1");
    ChildSpec spec = base;
    spec.env = environment_with(vars, stale_launcher_variables());
    Worker w(r, spawn_child(spec));
    ::fcntl(w.child.output_fd, F_SETFL, O_NONBLOCK);
    return w;
  };
  for (int64_t r = 0; r < c.nproc; ++r) a.workers.push_back(spawn_worker(r, false));

  const auto start = Clock::now();
  const auto grace = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(c.grace_s));
  Outcome out;
  bool stopping = false, killed = false;
  bool agreed_stop = false;  // stopping because a worker stopped on a signal; nothing forwarded yet
  Clock::time_point kill_at{};
  // A stopped worker (SIGSTOP, a debugger) cannot act on SIGTERM until it runs again: each signal
  // that asks the workers to stop is followed by SIGCONT, so it acts at once, not after the grace.
  auto signal_running = [&](int sig) {
    for (auto& w : a.workers)
      if (!w.exit) {
        signal_group(w.child.pid, sig);
        if (sig != SIGKILL) signal_group(w.child.pid, SIGCONT);
      }
  };
  auto begin_stop = [&](int sig, Outcome why) {
    out = std::move(why);
    stopping = true;
    kill_at = Clock::now() + grace;
    signal_running(sig);
  };
  // A ddm worker that exited kExitBadInput (core/error.h) stopped on bad input (its command line or
  // config before it ran, or a sample of its data): a restart would fail the same way, so it gets none.
  auto refused = [&](const ExitStatus& s) { return !c.no_ddm && s.signal == 0 && s.code == kExitBadInput; };
  // A ddm worker that exited 128 + SIGTERM or SIGINT stopped on that signal (someone sent it to that
  // worker; one that got it before it could act on it was killed by it): the ranks agree on a stop, so
  // the others stop after the same step (DiLoCo's at the next synchronization) and rank 0 writes a
  // checkpoint. A stop asked for, not a fault: no restart. Returns the signal, or 0.
  auto stop_signal_of = [&](const ExitStatus& s) {
    if (c.no_ddm) return 0;
    const int sig = s.signal != 0 ? s.signal : s.code > 128 ? s.code - 128 : 0;
    return sig == SIGTERM || sig == SIGINT ? sig : 0;
  };
  auto kill_now = [&](const std::string& why) {
    say(why + ": sending SIGKILL to the workers still running");
    signal_running(SIGKILL);
    killed = true;
  };

  for (;;) {
    bool all_exited = true;
    for (auto& w : a.workers) {
      if (w.exit) continue;
      w.exit = peek_exit(w.child.pid);
      if (!w.exit) {
        all_exited = false;
        continue;
      }
      pump(w);  // its last lines come before the news of its exit
      if (const int sig = stopping ? 0 : stop_signal_of(*w.exit)) {
        // (The first to exit, not necessarily the one that was sent the signal: the ranks stop together.)
        say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.child.pid) + ") " + describe(*w.exit) +
            ": the workers stop on " + signal_name(sig) + ", which " + (c.nproc > 1 ? "one of them" : "it") +
            " was sent" +
            (c.nproc > 1 ? "; the others are sent it too (killed if still running after " + seconds(c.grace_s) + ")" : "") +
            "; no restart");
        out = Outcome{Outcome::kSignalled, w.rank, w.child.pid, describe(*w.exit), sig};
        stopping = agreed_stop = true;
        kill_at = Clock::now() + grace;
        signal_running(sig);  // ranks that agree stop anyway; a command that does not, or a rank in a collective, too
        continue;
      }
      // A worker that fails while the others stop on a signal (rank 0 writing the checkpoint): said,
      // and the launch fails (no restart: a stop was asked for).
      if (out.kind == Outcome::kSignalled && out.rank >= 0 && !w.exit->ok() && !stop_signal_of(*w.exit) &&
          !(killed && w.exit->signal == SIGKILL) && out.stop_fault.empty()) {
        out.stop_fault = "rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.child.pid) + ") " +
                         describe(*w.exit) + " while the workers stopped";
        say(out.stop_fault);
      }
      // A worker that stops on bad input after another failed waiting for it (the bad rank exits a moment
      // after its peers see it leave): the cause, and no restart.
      if (stopping && out.kind == Outcome::kFailed && !out.refused && refused(*w.exit)) {
        out = Outcome{Outcome::kFailed, w.rank, w.child.pid, describe(*w.exit), 0, true};
        say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.child.pid) + ") " + out.how +
            ": it stopped on bad input, the cause");
      }
      if (!w.exit->ok() && !stopping && c.restart == "failed" && w.rank != 0 && restarts_used < c.max_restarts &&
          !refused(*w.exit)) {
        ++restarts_used;
        say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.child.pid) + ") " + describe(*w.exit) +
            "; restarting it alone (restart " + std::to_string(restarts_used) + " of " +
            std::to_string(c.max_restarts) + ", DDM_REJOIN=1); the other workers go on");
        signal_group(w.child.pid, SIGKILL);  // whatever it left in its group
        drain({&w});
        if (w.child.output_fd >= 0) {
          write_all(1, w.out.flush());
          ::close(w.child.output_fd);
        }
        reap(w.child.pid);
        w = spawn_worker(w.rank, true);
        all_exited = false;
        continue;
      }
      if (!w.exit->ok() && !stopping) {
        const std::string how = describe(*w.exit);
        say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.child.pid) + ") " + how +
            (c.nproc > 1 ? "; stopping the other workers" : ""));
        // A rank that fails waiting for a stopped one: the stopped one is the cause.
        for (const auto& other : a.workers)
          if (!other.exit && is_stopped(other.child.pid))
            say("rank " + std::to_string(other.rank) + " (pid " + std::to_string(other.child.pid) +
                ") is stopped (SIGSTOP or a debugger) and has not run since: the others cannot finish a step "
                "without it");
        begin_stop(SIGTERM, Outcome{Outcome::kFailed, w.rank, w.child.pid, how, 0, refused(*w.exit)});
      }
    }
    if (all_exited) break;
    const auto now = Clock::now();
    if (!stopping && c.timeout_s > 0 && now - start >= std::chrono::duration<double>(c.timeout_s)) {
      say("attempt " + std::to_string(attempt + 1) + " ran past --timeout " + seconds(c.timeout_s) +
          ": stopping the workers (SIGTERM, then SIGKILL after " + seconds(c.grace_s) + ")");
      begin_stop(SIGTERM, Outcome{Outcome::kTimedOut, -1, 0, "", 0});
    }
    if (stopping && !killed && Clock::now() >= kill_at)
      kill_now("workers still running " + seconds(c.grace_s) + " after the stop");

    std::vector<pollfd> fds{{signals.fd(), POLLIN, 0}};
    std::vector<Worker*> owners{nullptr};
    for (auto& w : a.workers)
      if (w.child.output_fd >= 0) {
        fds.push_back({w.child.output_fd, POLLIN, 0});
        owners.push_back(&w);
      }
    const int ready = ::poll(fds.data(), fds.size(), 200);
    if (ready < 0 && errno != EINTR) DDM_FAIL("ddm launch: poll failed: " << std::strerror(errno));
    for (int sig : signals.read_stop_signals()) {
      if (!stopping) {
        say("got " + signal_name(sig) + ": forwarding it to the workers; waiting up to " + seconds(c.grace_s) +
            " for them to exit (a second signal kills them at once)");
        begin_stop(sig, Outcome{Outcome::kSignalled, -1, 0, "", sig});
      } else if (agreed_stop) {  // the workers are stopping already: this is the first signal the launcher got
        agreed_stop = false;
        say("got " + signal_name(sig) + ": forwarding it to the workers (a second signal kills them at once)");
        out.signal = sig;
        signal_running(sig);
      } else if (out.kind != Outcome::kSignalled) {  // stopping after a fault or timeout: no restart now
        say("got " + signal_name(sig) + ": forwarding it to the workers; no restart");
        out = Outcome{Outcome::kSignalled, -1, 0, "", sig};
        signal_running(sig);
      } else if (!killed) {
        kill_now("got " + signal_name(sig) + " again");
      }
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents != 0) pump(*owners[i]);
  }

  // All workers have exited (and are not reaped yet, so their group ids are still theirs): kill
  // what they left in their groups, take the rest of their output, then reap them.
  for (auto& w : a.workers) signal_group(w.child.pid, SIGKILL);
  std::vector<Worker*> all;
  for (auto& w : a.workers) all.push_back(&w);
  drain(all);
  for (auto& w : a.workers) {
    if (w.child.output_fd >= 0) write_all(1, w.out.flush());
    reap(w.child.pid);
    w.reaped = true;
    if (w.rank == out.rank) out.spoke = w.spoke;
  }
  return out;
}

// Where the failed worker's words are.
std::string output_of(const Outcome& o) {
  return o.spoke ? "Its output is above, prefixed [rank " + std::to_string(o.rank) + "]"
                 : "It printed nothing (its exit status is all there is)";
}

}  // namespace

void check_launch_config(const LaunchConfig& c) {
  DDM_CHECK(c.nproc >= 1, "--nproc must be at least 1 (the number of workers), got " << c.nproc);
  DDM_CHECK(c.max_restarts >= 0, "--max-restarts must be >= 0 (0: a failure ends the launch), got " << c.max_restarts);
  DDM_CHECK(c.timeout_s >= 0 && std::isfinite(c.timeout_s),
            "--timeout must be a number of seconds >= 0 (0: no limit), got " << c.timeout_s);
  DDM_CHECK(c.grace_s >= 0 && std::isfinite(c.grace_s), "--grace must be a number of seconds >= 0, got " << c.grace_s);
  DDM_CHECK(c.master_port >= 0 && c.master_port <= 65535,
            "--master-port " << c.master_port << " is not a TCP port (1..65535, or 0 to pick a free one)");
  DDM_CHECK(!c.run_id.empty(), "--run-id must not be empty");
  DDM_CHECK(c.restart == "all" || c.restart == "failed",
            "--restart must be `all` (every worker restarts after a failure) or `failed` (only the failed worker, "
            "for DiLoCo), got '" << c.restart << "'");
  DDM_CHECK(!c.command.empty(), "no command to launch: put it after `--`, e.g. `ddm launch --nproc 2 -- train "
                                "--config c.toml --out runs/x` (or `--no-ddm -- PROGRAM ARGS` for another program)");
  if (!c.no_ddm) {
    const std::string& first = c.command[0];
    DDM_CHECK(first != "ddm" && (first.size() < 4 || first.compare(first.size() - 4, 4, "/ddm") != 0),
              "the command after `--` is a ddm subcommand, run by this ddm binary: write `-- train ...`, not `-- "
                  << first << " train ...` (or pass --no-ddm to run another program)");
  }
}

int run_launch(const LaunchConfig& c) {
  as_input_error([&] { check_launch_config(c); });  // its flags: exit 2
  ChildSpec base;
  if (c.no_ddm) {
    base.program = resolve_program(c.command[0]);
    base.argv = c.command;
  } else {
    base.program = self_executable();
    base.argv = {base.program};
    base.argv.insert(base.argv.end(), c.command.begin(), c.command.end());
  }
  std::string shown = c.no_ddm ? "" : "ddm";
  for (const auto& a : c.command) shown += (shown.empty() ? "" : " ") + a;

  SignalReader signals;  // before the store: its threads inherit the blocked signals
  StoreHost store(static_cast<int>(c.master_port));
  say(std::to_string(c.nproc) + " worker" + (c.nproc > 1 ? "s" : "") + " of `" + shown + "`; store at 127.0.0.1:" +
      std::to_string(store.port()) + ", run id " + c.run_id + ", up to " + std::to_string(c.max_restarts) +
      " restart" + (c.max_restarts == 1 ? "" : "s") + (c.timeout_s > 0 ? ", --timeout " + seconds(c.timeout_s) : ""));

  int64_t restarts_used = 0;  // of max_restarts: whole attempts and single workers together
  for (int64_t attempt = 0;; ++attempt) {
    for (int sig : signals.read_stop_signals()) {  // arrived between attempts
      say("got " + signal_name(sig) + " before attempt " + std::to_string(attempt + 1) + " started: not starting it");
      return 128 + sig;
    }
    const Outcome o = run_attempt(c, attempt, base, store.port(), signals, restarts_used);
    if (o.kind == Outcome::kSuccess) {
      say((c.nproc == 1 ? std::string("the worker") : "all " + std::to_string(c.nproc) + " workers") +
          " exited with status 0" +
          (restarts_used > 0 ? " (after " + std::to_string(restarts_used) + " restart" + (restarts_used > 1 ? "s" : "") + ")"
                             : ""));
      return 0;
    }
    DDM_CHECK(o.kind != Outcome::kSignalled || o.stop_fault.empty(),
              "the workers stopped on " << signal_name(o.signal) << ", but " << o.stop_fault
                                        << " (its output is above); no restart, as a stop was asked for: check its "
                                        << "run, then go on with --resume");
    if (o.kind == Outcome::kSignalled) {
      say(std::string(o.rank >= 0 ? "the workers stopped on " : "stopped by ") + signal_name(o.signal) +
          "; exiting with status " + std::to_string(128 + o.signal) + (c.no_ddm ? "" : " (continue with --resume)"));
      return 128 + o.signal;
    }
    DDM_CHECK(o.kind != Outcome::kTimedOut,
              "attempt " << attempt + 1 << " ran past --timeout " << seconds(c.timeout_s)
                         << " and its workers were stopped; raise --timeout (0: no limit) if the job needs longer");
    if (o.refused)
      throw InputError("rank " + std::to_string(o.rank) + " (pid " + std::to_string(o.pid) + ") " + o.how +
                       " in attempt " + std::to_string(attempt + 1) +
                       ": ddm stopped on bad input (its command line, its config or its data), and a restart "
                       "would fail the same way, so none was made; fix the input and launch again. " + output_of(o));
    DDM_CHECK(restarts_used < c.max_restarts,
              "rank " << o.rank << " (pid " << o.pid << ") " << o.how << " in attempt " << attempt + 1
                      << "; no restarts left (--max-restarts " << c.max_restarts << "). " << output_of(o));
    ++restarts_used;
    say("restarting all " + std::to_string(c.nproc) + " workers (restart " + std::to_string(restarts_used) + " of " +
        std::to_string(c.max_restarts) + ", TORCHELASTIC_RESTART_COUNT=" + std::to_string(attempt + 1) + ")");
  }
}

}  // namespace ddm
