// Launching workers: `ddm launch` (environment, output, restarts after a fault, signals, timeout,
// the store it hosts, bad input, no stray processes) and the launchers ddm's trainer will run under:
// torchrun, Slurm's srun (on a single-node Slurm from scripts/slurm-local.sh), Open MPI's mpirun.
//
// The workers are small shell scripts in the test's temporary directory. Every process a test
// starts has that directory in its command line (scripts run by path, and `sleep` is a symlink
// there), which is how a test finds processes left behind. To run the real trainer later, replace
// the Program: ddm_program({"train", "--config", ...}) runs the ddm binary under each launcher.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "local_slurm.h"
#include "test_util.h"

namespace fs = std::filesystem;
using ddm::test::CommandResult;
using ddm::test::executable;
using ddm::test::free_port;
using ddm::test::LocalSlurm;
using ddm::test::slurm_missing;
using ddm::test::read_text;
using ddm::test::run_command;
using ddm::test::TempDir;
using ddm::test::write_text;

namespace {

// The torchrun and python of the torch wheel ddm builds against (scripts/setup.sh's virtual environment).
const std::string kTorchrun = ddm::test::venv_torchrun();
const std::string kTorchPython = ddm::test::venv_python();
constexpr const char* kNoTorchrun = "no torchrun: configure with -DDDM_TORCH_VENV=<the torch virtual environment> (scripts/setup.sh does)";

// What the workers run: a ddm subcommand, or a program (a path and its arguments, shell-quoted).
struct Program {
  bool ddm = false;
  std::string args;
};
Program ddm_program(const std::string& args) { return {true, args}; }
Program script_program(const std::string& path, const std::string& args = "") {
  return {false, path + (args.empty() ? "" : " " + args)};
}

// A test's workspace: its temp dir (made searchable by all, for munged), scripts, a marked sleep.
struct Workspace {
  TempDir dir;
  Workspace() {
    fs::permissions(dir.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                  fs::perms::others_read | fs::perms::others_exec);
    fs::create_symlink("/bin/sleep", dir / "sleep");  // `DIR/sleep 100` carries DIR in its command line
  }
  std::string script(const std::string& name, const std::string& body) const {
    const std::string path = dir / name;
    write_text(path, "#!/bin/sh\nD=" + dir.path + "\n" + body);
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add);
    return path;
  }
  // Prints one line "ENV K=V K=V ..." with the variables launchers set (sorted).
  std::string env_printer() const {
    // One write per line (printf of a whole line): two ranks writing to one pipe cannot interleave
    // within it.
    return script("print_env.sh",
                  "line=$(env | grep -E '^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_[A-Z_]*|"
                  "MASTER_ADDR|MASTER_PORT|TORCHELASTIC_[A-Z_]*|DDM_LAUNCHER|OMP_NUM_THREADS|SLURM_PROCID|SLURM_NTASKS|"
                  "SLURM_LOCALID|SLURM_NODEID|SLURM_JOB_NODELIST|OMPI_COMM_WORLD_[A-Z_]*)=' | sort | tr '\\n' ' ')\n"
                  "printf 'ENV %s\\n' \"$line\"\n");
  }
  // Pids of live processes whose command line contains this workspace's directory.
  std::vector<int> strays() const {
    std::vector<int> out;
    DIR* proc = opendir("/proc");
    while (dirent* e = proc ? readdir(proc) : nullptr) {
      const int pid = std::atoi(e->d_name);
      if (pid <= 0 || pid == getpid()) continue;
      std::string cmd = read_text(std::string("/proc/") + e->d_name + "/cmdline");
      for (char& ch : cmd)
        if (ch == '\0') ch = ' ';
      if (cmd.find(dir.path) != std::string::npos) out.push_back(pid);
    }
    if (proc) closedir(proc);
    return out;
  }
  // Waits up to `seconds` for the strays to go; returns those still there.
  std::vector<int> strays_after(double seconds) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!strays().empty() && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return strays();
  }
};

// `ddm launch FLAGS -- PROGRAM` with a --timeout, so that no test can hang.
std::string launch_command(const std::string& flags, const Program& p) {
  return ddm::test::ddm_binary() + " launch --timeout 60 " + flags + (p.ddm ? " -- " : " --no-ddm -- ") + p.args;
}
CommandResult launch(const std::string& flags, const Program& p) { return run_command(launch_command(flags, p)); }
// The program as a plain command line, for launchers other than ddm launch.
std::string command_line(const Program& p) { return p.ddm ? ddm::test::ddm_binary() + " " + p.args : p.args; }

// The "ENV ..." lines of an output, keyed by the value of `rank_var`.
std::map<std::string, std::map<std::string, std::string>> env_lines(const std::string& output,
                                                                    const std::string& rank_var) {
  std::map<std::string, std::map<std::string, std::string>> by_rank;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    // Each "ENV " starts a record (a launcher that does not prefix lines may still mix two ranks'
    // output on one line).
    for (size_t at = line.find("ENV "); at != std::string::npos;) {
      const size_t next = line.find("ENV ", at + 4);
      std::istringstream words(line.substr(at + 4, next == std::string::npos ? std::string::npos : next - at - 4));
      std::map<std::string, std::string> vars;
      std::string w;
      while (words >> w)
        if (w.find('=') != std::string::npos) vars[w.substr(0, w.find('='))] = w.substr(w.find('=') + 1);
      if (vars.count(rank_var)) by_rank[vars[rank_var]] = vars;
      at = next;
    }
  }
  return by_rank;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(Launch, WorkersGetTorchrunsEnvironmentAndPrefixedOutput) {
  const CommandResult r =
      launch("--nproc 2", script_program("sh", "-c 'echo $RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT'"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] 0 2 0\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] 1 2 0\n")) << r.output;

  Workspace ws;
  const CommandResult e = launch("--nproc 2 --max-restarts 3 --run-id job7", script_program(ws.env_printer()));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const auto env = env_lines(e.output, "RANK");
  ASSERT_EQ(env.size(), 2u) << e.output;
  for (const auto& [rank, v] : env) {
    EXPECT_EQ(v.at("LOCAL_RANK"), rank);
    EXPECT_EQ(v.at("ROLE_RANK"), rank);
    EXPECT_EQ(v.at("WORLD_SIZE"), "2");
    EXPECT_EQ(v.at("LOCAL_WORLD_SIZE"), "2");
    EXPECT_EQ(v.at("ROLE_WORLD_SIZE"), "2");
    EXPECT_EQ(v.at("GROUP_RANK"), "0");
    EXPECT_EQ(v.at("MASTER_ADDR"), "127.0.0.1");
    EXPECT_EQ(v.at("MASTER_PORT"), env.at("0").at("MASTER_PORT"));
    EXPECT_GT(std::atoi(v.at("MASTER_PORT").c_str()), 0);
    EXPECT_EQ(v.at("TORCHELASTIC_RESTART_COUNT"), "0");
    EXPECT_EQ(v.at("TORCHELASTIC_MAX_RESTARTS"), "3");
    EXPECT_EQ(v.at("TORCHELASTIC_RUN_ID"), "job7");
    EXPECT_EQ(v.at("TORCHELASTIC_USE_AGENT_STORE"), "True");
    EXPECT_EQ(v.at("DDM_LAUNCHER"), "ddm");
  }
}

TEST(Launch, OutputKeepsPartialLinesAndProgressRedraws) {
  const CommandResult r = launch("--nproc 1", script_program("sh", "-c 'printf \"a\\rb\\rc\\n\"; printf partial'"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] c\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] partial\n")) << r.output;
}

TEST(Launch, RunsDdmSubcommandsWithThisBinary) {
  const CommandResult ok = launch("--nproc 2", ddm_program("--version"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(contains(ok.output, "[rank 1] ddm ")) << ok.output;
  // An unknown subcommand is refused by the launcher itself, once, before any worker starts (exit 2).
  const CommandResult bad = launch("--nproc 2 --max-restarts 2", ddm_program("no-such-subcommand"));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "error: ddm launch: `no-such-subcommand` is not a ddm command")) << bad.output;
  EXPECT_FALSE(contains(bad.output, "[rank ")) << bad.output;
  // A worker's refused command line (exit 2): the launcher reports the failed rank and makes no
  // restart, which would fail the same way (here a bad config key); the rank's error names the rank
  // once ("[rank R] error: ...", where torchrun or srun show ddm's "error: rank R: ...").
  Workspace ws;
  write_text(ws.dir / "bad.toml", "[train]\nstepz = 3\n");
  const std::string train = "train --config " + (ws.dir / "bad.toml") + " --out " + (ws.dir / "run");
  const CommandResult key = launch("--nproc 2 --max-restarts 2", ddm_program(train));
  EXPECT_EQ(key.exit_code, 2) << key.output;
  EXPECT_TRUE(contains(key.output, "] error: " + (ws.dir / "bad.toml") + ": unknown config key 'train.stepz'"))
      << key.output;
  EXPECT_FALSE(contains(key.output, "] error: rank ")) << key.output;
  EXPECT_TRUE(contains(key.output, "exited with status 2")) << key.output;
  EXPECT_TRUE(contains(key.output, "a restart would fail the same way")) << key.output;
  EXPECT_FALSE(contains(key.output, "restarting")) << key.output;
  EXPECT_FALSE(fs::exists(ws.dir / "run"));
}

TEST(Launch, RestartsAllWorkersAfterOneIsKilled) {
  Workspace ws;
  const std::string worker = ws.script(
      "worker.sh", "if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then kill -9 $$; fi\n"
                   "echo ok attempt $TORCHELASTIC_RESTART_COUNT\n");
  const CommandResult r = launch("--nproc 2 --max-restarts 1", script_program(worker));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 (pid ")) << r.output;
  EXPECT_TRUE(contains(r.output, "was killed by signal 9 (SIGKILL)")) << r.output;
  EXPECT_TRUE(contains(r.output, "restarting all 2 workers (restart 1 of 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] ok attempt 1\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] ok attempt 1\n")) << r.output;
  EXPECT_TRUE(ws.strays_after(5).empty());
}

TEST(Launch, FailsWhenNoRestartsAreLeftAndStopsTheOtherWorkers) {
  Workspace ws;
  // Rank 0 would sleep 100 s in a child of its shell: stopping it must reach the whole group.
  const std::string worker = ws.script(
      "worker.sh", "if [ $RANK = 1 ]; then sleep 0.5; kill -9 $$; fi\n$D/sleep 100\necho rank 0 woke up\n");
  const CommandResult r = launch("--nproc 2 --max-restarts 0", script_program(worker));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "error: rank 1 (pid ")) << r.output;
  EXPECT_TRUE(contains(r.output, "SIGKILL")) << r.output;
  EXPECT_TRUE(contains(r.output, "no restarts left (--max-restarts 0). It printed nothing")) << r.output;
  EXPECT_FALSE(contains(r.output, "woke up")) << r.output;
  EXPECT_TRUE(ws.strays_after(5).empty()) << "processes left behind: " << ws.strays().size();
}

TEST(Launch, ForwardsSigtermToTheWorkersAndExits143) {
  Workspace ws;
  const std::string worker = ws.script(
      "worker.sh", "trap 'echo $RANK > $D/term.$RANK; exit 0' TERM\ntouch $D/ready.$RANK\n"
                   "while :; do sleep 0.1; done\n");
  const std::string script = ws.script(
      "run.sh", launch_command("--nproc 2", script_program(worker)) + " &\npid=$!\n" +
                    "for i in $(seq 200); do [ -f $D/ready.0 ] && [ -f $D/ready.1 ] && break; sleep 0.1; done\n"
                    "kill -TERM $pid\nwait $pid\necho launcher exited $?\n");
  const CommandResult r = run_command(script);
  EXPECT_TRUE(contains(r.output, "launcher exited 143")) << r.output;
  EXPECT_TRUE(contains(r.output, "got SIGTERM: forwarding it to the workers")) << r.output;
  EXPECT_TRUE(fs::exists(ws.dir / "term.0")) << r.output;
  EXPECT_TRUE(fs::exists(ws.dir / "term.1")) << r.output;
  EXPECT_TRUE(ws.strays_after(5).empty());
}

TEST(Launch, WorkersDieWithALauncherKilledBySigkill) {
  Workspace ws;
  // The workers exec the marked sleep: PR_SET_PDEATHSIG reaches a worker itself, not what it starts.
  const std::string worker = ws.script("worker.sh", "touch $D/ready.$RANK\nexec $D/sleep 100\n");
  const std::string script = ws.script(
      "run.sh", launch_command("--nproc 2", script_program(worker)) + " &\npid=$!\n" +
                    "for i in $(seq 200); do [ -f $D/ready.0 ] && [ -f $D/ready.1 ] && break; sleep 0.1; done\n"
                    "sleep 0.2\nkill -9 $pid\nwait $pid\necho launcher exited $?\n");
  const CommandResult r = run_command(script);
  EXPECT_TRUE(contains(r.output, "launcher exited 137")) << r.output;
  EXPECT_TRUE(fs::exists(ws.dir / "ready.1")) << "the workers never started: " << r.output;
  EXPECT_TRUE(ws.strays_after(10).empty()) << "workers outlived their launcher";
}

TEST(Launch, TimeoutStopsAHangingAttempt) {
  Workspace ws;
  const CommandResult r =
      run_command(ddm::test::ddm_binary() + " launch --nproc 2 --timeout 1 --no-ddm -- " + ws.dir.path + "/sleep 100");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "ran past --timeout 1 s")) << r.output;
  EXPECT_TRUE(ws.strays_after(5).empty());
}

TEST(Launch, KillsWorkersThatIgnoreSigtermAfterTheGracePeriod) {
  Workspace ws;
  // An ignored signal stays ignored across exec: neither the shell nor its sleep reacts to SIGTERM.
  const std::string worker = ws.script("worker.sh", "trap '' TERM\n$D/sleep 100\n");
  const CommandResult r = run_command(ddm::test::ddm_binary() + " launch --nproc 2 --timeout 1 --grace 1 --no-ddm -- " +
                                      worker);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "workers still running 1 s after the stop: sending SIGKILL")) << r.output;
  EXPECT_TRUE(ws.strays_after(5).empty());
}

// A stopped process cannot act on SIGTERM: the launcher continues the workers it stops (SIGCONT after
// the SIGTERM), so a SIGSTOPped worker ends at once when another fails, not after the grace period.
TEST(Launch, AStoppedWorkerEndsWithTheOthersNotAfterTheGracePeriod) {
  Workspace ws;
  const std::string worker = ws.script("worker.sh",
                                       "if [ \"$RANK\" = 1 ]; then touch $D/stopping; kill -STOP $$; $D/sleep 100; fi\n"
                                       "for i in $(seq 200); do [ -f $D/stopping ] && break; sleep 0.1; done\n"
                                       "sleep 0.5\nexit 1\n");
  const CommandResult r = run_command(ddm::test::ddm_binary() + " launch --nproc 2 --timeout 120 --grace 20 --no-ddm -- " +
                                      worker);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 0 (pid")) << r.output;
  // ... and names the stopped one as what the others waited for.
  EXPECT_TRUE(contains(r.output, ") is stopped (SIGSTOP or a debugger) and has not run since")) << r.output;
  EXPECT_FALSE(contains(r.output, "sending SIGKILL")) << r.output;
  EXPECT_TRUE(ws.strays_after(5).empty());
}

TEST(Launch, HostsTheStoreWhileWorkersRun) {
  if (!executable("/bin/bash")) GTEST_SKIP() << "needs /bin/bash (for /dev/tcp)";
  const CommandResult r = launch(
      "--nproc 2", script_program("bash", "-c 'exec 3<>/dev/tcp/127.0.0.1/$MASTER_PORT && echo reached the store'"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] reached the store")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] reached the store")) << r.output;
}

TEST(Launch, StoreServesC10dClientsUnderTheAttemptPrefix) {
  if (!executable(kTorchPython) || run_command(std::string(kTorchPython) + " -c 'import torch.distributed'").exit_code != 0)
    GTEST_SKIP() << "needs the python of the torch virtual environment for a c10d client (" << kNoTorchrun << ")";
  Workspace ws;
  const std::string client = ws.dir / "client.py";
  write_text(client,
             "import os, torch.distributed as d\n"
             "s = d.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), None, False)\n"
             "p = '/worker/attempt_' + os.environ['TORCHELASTIC_RESTART_COUNT'] + '/'\n"
             "s.set(p + 'rank' + os.environ['RANK'], 'here')\n"
             "s.wait([p + 'rank0', p + 'rank1'])\n"
             "print('saw both ranks')\n");
  const CommandResult r = launch("--nproc 2", script_program(kTorchPython, client));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] saw both ranks")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] saw both ranks")) << r.output;
}

TEST(Launch, SaysWhenTheStorePortIsTaken) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  const CommandResult r = launch("--nproc 1 --master-port " + std::to_string(port), script_program("true"));
  close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "port " + std::to_string(port) + " is already in use; pass --master-port")) << r.output;
}

TEST(Launch, RejectsBadInputClearly) {
  struct Case {
    std::string args, message;
  };
  for (const Case& c : std::vector<Case>{
           {"launch --nproc 0 -- --version", "--nproc must be at least 1"},
           {"launch --nproc 2", "put the command after `--`"},
           {"launch --nproc 2 --", "no command to launch"},
           {"launch --nproc 2 --max-restarts -1 -- --version", "--max-restarts must be >= 0"},
           {"launch --nproc 2 --timeout -5 -- --version", "--timeout must be a number of seconds >= 0"},
           {"launch --nproc 2 -- ddm train", "not `-- ddm train ...`"},
           {"launch --nproc 2 --no-ddm -- no-such-program-4711", "cannot run 'no-such-program-4711': not found in PATH"},
           {"launch --nproc 1 --master-port 70000 -- --version", "is not a TCP port"},
       }) {
    const CommandResult r = ddm::test::run_ddm(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args << "\n" << r.output;
    // The launcher's own flags are bad input (exit 2); a program it cannot start fails the launch (1).
    if (!contains(c.args, "no-such-program")) {
      EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    }
    EXPECT_TRUE(contains(r.output, c.message)) << c.args << "\n" << r.output;
  }
}

// ---- other launchers: the environment ddm's trainer will find under each ----

TEST(Launchers, TorchrunSetsWhatDdmLaunchSets) {
  if (!executable(kTorchrun)) GTEST_SKIP() << kNoTorchrun;
  Workspace ws;
  const std::string printer = ws.env_printer();
  const CommandResult t = run_command("timeout 120 " + std::string(kTorchrun) + " --no_python --nproc_per_node 2 --master_port " +
                                      std::to_string(free_port()) + " " + printer);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const auto torchrun = env_lines(t.output, "RANK");
  const auto ours = env_lines(launch("--nproc 2", script_program(printer)).output, "RANK");
  ASSERT_EQ(torchrun.size(), 2u) << t.output;
  ASSERT_EQ(ours.size(), 2u);
  for (const auto& [rank, vars] : ours)
    for (const auto& [key, value] : vars) {
      if (key == "DDM_LAUNCHER") continue;
      ASSERT_TRUE(torchrun.at(rank).count(key)) << key << " is set by ddm launch but not by torchrun";
      if (key != "MASTER_PORT") {
        EXPECT_EQ(torchrun.at(rank).at(key), value) << key << " of rank " << rank;
      }
    }
}

TEST(Launchers, SrunOnALocalSlurmSetsTheSlurmVariables) {
  const std::string missing = slurm_missing();
  if (!missing.empty()) GTEST_SKIP() << "a local Slurm needs " << missing;
  Workspace ws;
  LocalSlurm slurm(ws.dir.path);
  ASSERT_EQ(slurm.started.exit_code, 0) << slurm.started.output;
  const CommandResult r = run_command(slurm.env + "timeout 120 srun -n 2 " + command_line(script_program(ws.env_printer())));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto env = env_lines(r.output, "SLURM_PROCID");
  ASSERT_EQ(env.size(), 2u) << r.output;
  for (const auto& [rank, v] : env) {
    EXPECT_EQ(v.at("SLURM_NTASKS"), "2");
    EXPECT_EQ(v.at("SLURM_LOCALID"), rank);  // one node
    EXPECT_EQ(v.at("SLURM_NODEID"), "0");
    EXPECT_FALSE(v.at("SLURM_JOB_NODELIST").empty());
  }
  // A two-task job array, as `ddm islands slurm` writes one.
  const std::string job = ws.script("array.sh", "echo task $SLURM_ARRAY_TASK_ID > $D/task.$SLURM_ARRAY_TASK_ID\n");
  const CommandResult a = run_command(slurm.env + "timeout 120 sbatch --wait --array=0-1 --output=" + ws.dir.path +
                                      "/slurm-%a.out " + job);
  EXPECT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(read_text(ws.dir / "task.0"), "task 0\n");
  EXPECT_EQ(read_text(ws.dir / "task.1"), "task 1\n");
}

TEST(Launchers, MpirunSetsTheOpenMpiVariables) {
  if (!executable("/usr/bin/mpirun")) GTEST_SKIP() << "/usr/bin/mpirun is absent (Debian: openmpi-bin)";
  Workspace ws;
  const CommandResult r = run_command("timeout 120 /usr/bin/mpirun --allow-run-as-root --oversubscribe -n 2 " +
                                      command_line(script_program(ws.env_printer())));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto env = env_lines(r.output, "OMPI_COMM_WORLD_RANK");
  ASSERT_EQ(env.size(), 2u) << r.output;
  for (const auto& [rank, v] : env) {
    EXPECT_EQ(v.at("OMPI_COMM_WORLD_SIZE"), "2");
    EXPECT_EQ(v.at("OMPI_COMM_WORLD_LOCAL_RANK"), rank);
  }
}

// ---- the real trainer under every launcher ----

namespace {
constexpr const char* kTinyTrain = R"([data]
limit = 512
[model]
preset = "unet-tiny"
channels = 8
channel_mult = [1, 2]
groups = 4
[train]
steps = 10
batch_size = 16
warmup = 2
threads = 1
log_every = 5
ckpt_every = 10
seed = 3
)";

// `train ...` of the tiny config into DIR/OUT.
std::string train_args(const Workspace& ws, const std::string& out) {
  const std::string cfg = ws.dir / "tiny.toml";
  if (!fs::exists(cfg)) write_text(cfg, kTinyTrain);
  return "train --config " + cfg + " --out " + (ws.dir / out);
}

// The sha256 of a run's final weights, and the world size its checkpoint records.
std::pair<std::string, int> final_weights(const Workspace& ws, const std::string& out) {
  const std::string ck = ws.dir / (out + "/ckpt/step-00000010");
  const std::string state = read_text(ck + "/state.json");
  const size_t at = state.find("\"world_size\": ");
  const int world = at == std::string::npos ? 0 : std::atoi(state.c_str() + at + 14);
  return {run_command("sha256sum " + ck + "/model.safetensors | cut -c1-64").output, world};
}
}  // namespace

// A fresh start refused because --out holds another run (no --resume, no --force) is bad input:
// `ddm launch --max-restarts` does not restart it, and a launcher that restarts it anyway (torchrun)
// does not turn the restart into a resume of that other run. The run is left as it was.
TEST(Launchers, ARefusedFreshStartIsNeverRestartedIntoAResumeOfAnotherRun) {
  Workspace ws;
  ASSERT_EQ(run_command(command_line(ddm_program(train_args(ws, "old") + " --quiet --set train.ckpt_every=5"))).exit_code, 0);
  const std::string config = read_text(ws.dir / "old/config.toml");
  const auto before = final_weights(ws, "old");
  const std::string again = train_args(ws, "old") + " --set train.steps=20 --set train.lr=0.001";
  const CommandResult r = launch("--nproc 2 --max-restarts 2", ddm_program(again));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "already holds a run")) << r.output;
  EXPECT_FALSE(contains(r.output, "restarting")) << r.output;
  const auto unchanged = [&](const std::string& how) {
    EXPECT_EQ(read_text(ws.dir / "old/config.toml"), config) << how;
    EXPECT_EQ(final_weights(ws, "old"), before) << how;
    EXPECT_TRUE(fs::exists(ws.dir / "old/ckpt/step-00000005")) << how;
    EXPECT_FALSE(fs::exists(ws.dir / "old/ckpt/step-00000020")) << how;
  };
  unchanged("ddm launch");
  if (!executable(kTorchrun)) GTEST_SKIP() << kNoTorchrun;
  const CommandResult t = run_command("timeout 300 " + std::string(kTorchrun) + " --no_python --nproc_per_node 2 " +
                                      "--max_restarts 1 --master_port " + std::to_string(free_port()) + " " +
                                      command_line(ddm_program(again)));
  EXPECT_NE(t.exit_code, 0) << t.output;
  EXPECT_TRUE(contains(t.output, "restart of this job: " + ws.dir / "old" + " holds a run with another config than "
                                 "this job's")) << t.output;
  unchanged("torchrun");
}

TEST(Launchers, TheTrainerRunsUnderEveryLauncherWithIdenticalResults) {
  // Same config, seed, world size (2) and threads: every launcher's run ends bit for bit the same.
  Workspace ws;
  const CommandResult ours = launch("--nproc 2", ddm_program(train_args(ws, "launch")));
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  EXPECT_TRUE(contains(ours.output, "[rank 0] parallel: data parallel over 2 processes")) << ours.output;
  const auto ref = final_weights(ws, "launch");
  ASSERT_EQ(ref.second, 2);
  std::vector<std::string> skipped;

  if (executable(kTorchrun)) {
    const CommandResult t = run_command("timeout 300 " + std::string(kTorchrun) + " --no_python --nproc_per_node 2 --master_port " +
                                        std::to_string(free_port()) + " " + command_line(ddm_program(train_args(ws, "torchrun"))));
    ASSERT_EQ(t.exit_code, 0) << t.output;
    EXPECT_EQ(final_weights(ws, "torchrun"), ref) << t.output;
  } else {
    skipped.push_back(kNoTorchrun);
  }
  if (executable("/usr/bin/mpirun")) {
    const CommandResult m = run_command("timeout 300 /usr/bin/mpirun --allow-run-as-root --oversubscribe -n 2 -x "
                                        "MASTER_ADDR=127.0.0.1 -x MASTER_PORT=" + std::to_string(free_port()) + " " +
                                        command_line(ddm_program(train_args(ws, "mpirun"))));
    ASSERT_EQ(m.exit_code, 0) << m.output;
    EXPECT_EQ(final_weights(ws, "mpirun"), ref) << m.output;
  } else {
    skipped.push_back("mpirun (openmpi-bin)");
  }
  const std::string missing = slurm_missing();
  if (missing.empty()) {
    LocalSlurm slurm(ws.dir.path);
    ASSERT_EQ(slurm.started.exit_code, 0) << slurm.started.output;
    const CommandResult s = run_command(slurm.env + "timeout 300 srun -n 2 " +
                                        command_line(ddm_program(train_args(ws, "srun"))));
    ASSERT_EQ(s.exit_code, 0) << s.output;
    EXPECT_EQ(final_weights(ws, "srun"), ref) << s.output;
  } else {
    skipped.push_back("srun (a local Slurm needs " + missing + ")");
  }
  EXPECT_TRUE(ws.strays_after(10).empty());
  if (!skipped.empty()) {
    std::string s;
    for (const auto& k : skipped) s += (s.empty() ? "" : ", ") + k;
    GTEST_SKIP() << "the launch run passed; not run: " << s;
  }
}
