// Islands of several processes (`[run] nproc = N`): each island a data-parallel job under ddm's own
// launcher, or one Slurm array task of N tasks. Checked here: a 2-process island trains exactly what
// `ddm launch --nproc 2 -- train ...` trains, a rank killed with -9 restarts its own island only (from
// its last checkpoint, still bit for bit), concurrent islands get their own rendezvous ports, a bad
// run.nproc is refused before anything starts, data the partition cannot read is bad input (exit
// status 2), an island whose input ddm refuses (exit status 2) is not restarted, and the Slurm
// script runs an island as 2 srun tasks (a rank killed there restarts the island inside its array
// task).
//
// Every run is bounded (polling loops with limits, `timeout` / --timeout on the commands), and the
// background runner is killed at scope exit if a check failed early (its islands die with it).
#include <gtest/gtest.h>

#include <dirent.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "local_slurm.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

// Experts of 12.5k parameters on 600 images: K = 2, split-batch (32 / 2 = 16 per expert, 8 per rank).
constexpr const char* kTiny =
    "[data]\nlimit = 600\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
    "[train]\nsteps = 120\nbatch_size = 32\nlog_every = 20\nckpt_every = 20\n";

std::string islands_file(const std::string& dir, const std::string& out, const std::string& run) {
  return "out = \"" + dir + "/" + out + "\"\nconfig = \"" + dir + "/tiny.toml\"\n" +
         "[partition]\npath = \"" + dir + "/parts/k2\"\nk = 2\nfeatures = \"pixels:16\"\n"
         "[experts]\nbudget = \"split-batch\"\n"
         "[router]\npreset = \"router-conv-tiny\"\nholdout = 100\nset = [\"train.steps=20\"]\n"
         "[run]\n" + run;
}

using test::expect_error;

bool wait_for(const std::function<bool()>& done, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The field after ") " in /proc/PID/stat: {state, ppid}; {'?', 0} when the process is gone.
std::pair<char, pid_t> stat_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line) || line.rfind(") ") == std::string::npos) return {'?', 0};
  std::istringstream rest(line.substr(line.rfind(") ") + 2));
  char state = '?';
  pid_t ppid = 0;
  rest >> state >> ppid;
  return {state, ppid};
}
bool alive(pid_t pid) {
  const char s = stat_of(pid).first;
  return s != '?' && s != 'Z';
}

std::vector<pid_t> all_pids() {
  std::vector<pid_t> out;
  DIR* proc = opendir("/proc");
  while (dirent* e = proc ? readdir(proc) : nullptr)
    if (const int pid = std::atoi(e->d_name); pid > 0) out.push_back(pid);
  if (proc) closedir(proc);
  return out;
}

// The child of `parent` whose environment has RANK=rank (a launcher's worker), or 0.
pid_t rank_of(pid_t parent, int rank) {
  for (pid_t pid : all_pids()) {
    if (stat_of(pid).second != parent) continue;
    std::string env = test::read_text("/proc/" + std::to_string(pid) + "/environ");
    for (char& ch : env)
      if (ch == '\0') ch = '\n';
    if (("\n" + env).find("\nRANK=" + std::to_string(rank) + "\n") != std::string::npos) return pid;
  }
  return 0;
}

// Live processes whose command line names `dir` (every process of these tests does).
std::vector<pid_t> strays(const std::string& dir) {
  std::vector<pid_t> out;
  for (pid_t pid : all_pids()) {
    if (pid == getpid() || !alive(pid)) continue;
    std::string cmd = test::read_text("/proc/" + std::to_string(pid) + "/cmdline");
    for (char& ch : cmd)
      if (ch == '\0') ch = ' ';
    if (cmd.find(dir) != std::string::npos) out.push_back(pid);
  }
  return out;
}

// Kills a background runner left running by a failed check (its islands get SIGTERM from the
// kernel). Only while its exit status is not written yet, and only a process that is still that
// runner (a pid can be reused once it has exited).
struct RunnerGuard {
  std::string pid_file, rc_file;
  ~RunnerGuard() {
    const int pid = std::atoi(test::read_text(pid_file).c_str());
    if (pid <= 0 || fs::exists(rc_file) || !alive(pid)) return;
    if (test::read_text("/proc/" + std::to_string(pid) + "/cmdline").find("islands") != std::string::npos)
      kill(pid, SIGKILL);
  }
};

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// The rendezvous ports a launcher log names ("store at 127.0.0.1:PORT"), in order.
std::vector<std::string> store_ports(const std::string& log) {
  std::vector<std::string> out;
  const std::string key = "store at 127.0.0.1:";
  for (size_t at = log.find(key); at != std::string::npos; at = log.find(key, at + 1))
    out.push_back(log.substr(at + key.size(), log.find(',', at) - at - key.size()));
  return out;
}

// Trains expert 0 as `ddm launch --nproc 2` would outside the islands, into DIR/OUT.
test::CommandResult launch_reference(const test::TempDir& dir, const std::string& out) {
  return test::run_ddm("launch --nproc 2 --timeout 240 -- train --quiet --config " + (dir / "tiny.toml") +
                       " --partition " + (dir / "parts/k2") + " --expert 0 --budget split-batch --set train.threads=1"
                       " --out " + (dir / out));
}

}  // namespace

TEST(Islands, TwoProcessIslandsTrainAsTheLauncherDoesAndAKilledRankRestartsOnlyItsIsland) {
  const test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  test::write_text(dir / "isl.toml", islands_file(dir.path, "runs", "concurrency = 2\nnproc = 2\nretries = 2\nthreads = 1\n"));
  RunnerGuard guard{dir / "runner.pid", dir / "rc"};
  test::run_command("(" + test::ddm_binary() + " islands run " + (dir / "isl.toml") + " > " + (dir / "run.log") +
                    " 2>&1 & echo $! > " + (dir / "runner.pid") + "; wait $!; echo $? > " + (dir / "rc.part") + "; mv " + (dir / "rc.part") + " " + (dir / "rc") +
                    ") > /dev/null 2>&1 &");
  // Once expert 0 has a checkpoint, kill -9 its rank 1 (a worker of the island's launcher).
  const fs::path ckpt = dir / "runs/experts/0/ckpt/step-00000020";
  ASSERT_TRUE(wait_for([&] { return fs::exists(ckpt) || fs::exists(dir / "rc"); }, 120)) << test::read_text(dir / "run.log");
  ASSERT_TRUE(fs::exists(ckpt)) << test::read_text(dir / "run.log");
  const auto running = nlohmann::json::parse(test::read_text(dir / "runs/islands.json"));
  ASSERT_EQ(running[0]["state"], "running") << running.dump();
  const pid_t launcher = running[0]["pid"].get<pid_t>();
  pid_t rank1 = 0;
  ASSERT_TRUE(wait_for([&] { return (rank1 = rank_of(launcher, 1)) != 0; }, 10)) << "no rank 1 under " << launcher;
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  ASSERT_TRUE(wait_for([&] { return fs::exists(dir / "rc"); }, 240)) << test::read_text(dir / "run.log");
  const std::string log = test::read_text(dir / "run.log");
  ASSERT_EQ(test::read_text(dir / "rc"), "0\n") << log;

  // Only expert 0 restarted, and the runner says which rank died and how.
  EXPECT_NE(log.find("expert 0: exit code 1 at step"), std::string::npos) << log;
  EXPECT_NE(log.find("rank 1 (pid " + std::to_string(rank1) + ") was killed by signal 9 (SIGKILL)"), std::string::npos)
      << log;
  EXPECT_NE(log.find("expert 0: started (attempt 2"), std::string::npos) << log;
  EXPECT_EQ(count(log, "restarting from its last checkpoint"), 1u) << log;
  const auto done = nlohmann::json::parse(test::read_text(dir / "runs/islands.json"));
  EXPECT_EQ(done[0]["attempts"], 2);
  EXPECT_EQ(done[1]["attempts"], 1);
  EXPECT_EQ(done[2]["attempts"], 1);
  for (const auto& island : done) EXPECT_EQ(island["state"], "done") << island.dump();
  EXPECT_NE(done[0]["last_error"].get<std::string>().find("rank 1 (pid"), std::string::npos) << done.dump();
  // The other islands never noticed: one launch each, no restart, 2 ranks each.
  const std::string e0 = test::read_text(dir / "runs/logs/expert0.log"), e1 = test::read_text(dir / "runs/logs/expert1.log");
  EXPECT_EQ(count(e0, "[launch] 2 workers of `ddm train"), 2u) << e0;
  EXPECT_EQ(count(e1, "[launch] 2 workers of `ddm train"), 1u) << e1;
  EXPECT_EQ(count(e1, "starting from step 0"), 1u) << e1;
  EXPECT_EQ(count(e1, "resuming from"), 0u) << e1;
  EXPECT_EQ(count(e0, "resuming from"), 1u) << e0;
  EXPECT_NE(e1.find("[rank 0] parallel: data parallel over 2 processes"), std::string::npos) << e1;
  EXPECT_NE(e1.find("[rank 0] train: 120 steps, batch 16 (2 ranks x 8)"), std::string::npos) << e1;
  EXPECT_NE(test::read_text(dir / "runs/logs/router.log").find("[launch] all 2 workers exited with status 0"),
            std::string::npos);
  // Experts 0 and 1 ran at the same time, each with its own launcher's store: their ports differ.
  const auto p0 = store_ports(e0), p1 = store_ports(e1);
  ASSERT_FALSE(p0.empty());
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_NE(p0[0], p1[0]);
  EXPECT_TRUE(fs::exists(dir / "runs/ensemble.json"));

  // The island that lost a rank and restarted ends bit for bit where `ddm launch --nproc 2` of the
  // same expert ends uninterrupted (same world size and threads: docs/determinism.md).
  const auto ref = launch_reference(dir, "ref");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  for (const char* file : {"model.safetensors", "ema.safetensors"})
    EXPECT_EQ(test::read_text(dir / ("ref/ckpt/step-00000120/" + std::string(file))),
              test::read_text(dir / ("runs/experts/0/ckpt/step-00000120/" + std::string(file))))
        << file;
  EXPECT_TRUE(wait_for([&] { return strays(dir.path).empty(); }, 10)) << "processes left behind";
}

TEST(Islands, BadNprocOrSlurmLinesAreClearErrorsBeforeAnythingStarts) {
  const test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  auto run = [&](const std::string& run_section, const std::string& action = "run") {
    test::write_text(dir / "bad.toml", islands_file(dir.path, "runs", run_section));
    return test::run_ddm("islands " + action + " " + (dir / "bad.toml"));
  };
  expect_error(run("nproc = 0\n"), "bad.toml: run.nproc = 0 is not a number of processes: each island needs at "
                                   "least 1; set run.nproc = 1");
  expect_error(run("nproc = -2\n"), "run.nproc = -2 is not a number of processes");
  expect_error(run("nproc = \"2\"\n"), "'run.nproc' must be an integer");
  // The experts' batch after the budget split: 32 / K = 16, which 3 does not divide.
  const std::string three = "bad.toml: run.nproc = 3 does not split the experts' batch: train.batch_size = 32 / K = 2 "
                            "(experts.budget = split-batch) = 16 is not a multiple of 3; set run.nproc to one of 1, 2, "
                            "4, 8, 16, or change train.batch_size (in " + (dir / "tiny.toml") + " or experts.set)";
  expect_error(run("nproc = 3\n"), three);
  expect_error(run("nproc = 3\n", "slurm"), three);
  // The router's batch (its own train.batch_size from router.set); the choices divide both batches.
  std::string router = islands_file(dir.path, "runs", "nproc = 4\n");
  router.replace(router.find("\"train.steps=20\""), 16, "\"train.steps=20\", \"train.batch_size=18\"");
  test::write_text(dir / "bad.toml", router);
  expect_error(test::run_ddm("islands run " + (dir / "bad.toml")),
               "run.nproc = 4 does not split the router's batch: train.batch_size = 18 is not a multiple of 4; set "
               "run.nproc to one of 1, 2, or change train.batch_size (in " + (dir / "tiny.toml") + " or router.set)");
  // Micro-batches count: 16 per expert in 4 micro-batches leaves 4, so 8 processes cannot split it.
  std::string accum = islands_file(dir.path, "runs", "nproc = 8\n");
  accum.replace(accum.find("budget = \"split-batch\""), 22, "budget = \"split-batch\"\nset = [\"train.grad_accum=4\"]");
  test::write_text(dir / "bad.toml", accum);
  expect_error(test::run_ddm("islands run " + (dir / "bad.toml")),
               "= 16, in train.grad_accum = 4 micro-batches, is not a multiple of 32; set run.nproc to one of 1, 2, 4,");
  // [slurm]: options only, one per string, never one that ddm derives itself.
  auto slurm = [&](const std::string& section) {
    test::write_text(dir / "bad.toml", islands_file(dir.path, "runs", "nproc = 2\n") + "[slurm]\n" + section);
    return test::run_ddm("islands slurm " + (dir / "bad.toml"));
  };
  expect_error(slurm("sbatch = [\"--array=0-9\"]\n"), "bad.toml: slurm.sbatch: '--array=0-9' sets --array, which ddm "
                                                         "writes itself from one array task per island");
  expect_error(slurm("sbatch = [\"-n 8\"]\n"), "'-n 8' sets -n, which ddm writes itself from run.nproc");
  expect_error(slurm("sbatch = [\"--cpus-per-task=4\"]\n"), "sets --cpus-per-task, which ddm writes itself from run.threads");
  expect_error(slurm("sbatch = [\"--output=x.log\"]\n"), "sets --output, which ddm writes itself from OUT/logs/");
  expect_error(slurm("sbatch = [\"partition=gpu\"]\n"), "slurm.sbatch holds sbatch options, each starting with '-'");
  expect_error(slurm("sbatch = [\"--time=1:00:00\\n#SBATCH --array=1\"]\n"), "one option per string; this one has a line break");
  expect_error(slurm("sbatch = \"--time=1:00:00\"\n"), "'slurm.sbatch' must be an array of strings like \"--partition=gpu\"");
  expect_error(slurm("setup = [\"a\\nb\"]\n"), "slurm.setup holds one shell line per string");
  expect_error(slurm("account = \"x\"\n"), "unknown key 'slurm.account'");
  // Which images the islands see is the config's (the partition is made from it): data keys in
  // experts.set or router.set would make every island refuse the partition, one by one.
  std::string limited = islands_file(dir.path, "runs", "");
  limited.replace(limited.find("budget = \"split-batch\""), 22, "budget = \"split-batch\"\nset = [\"data.limit=100\"]");
  test::write_text(dir / "bad.toml", limited);
  expect_error(test::run_ddm("islands run " + (dir / "bad.toml")),
               "bad.toml: experts.set sets data.limit, but which images the islands train on is the config's (" +
                   (dir / "tiny.toml") + "): the partition is made from it and every island must see the same data; "
                   "set it there");
  std::string holdout = islands_file(dir.path, "runs", "");
  holdout.replace(holdout.find("\"train.steps=20\""), 16, "\"train.steps=20\", \"data.holdout=10\"");
  test::write_text(dir / "bad.toml", holdout);
  expect_error(test::run_ddm("islands status " + (dir / "bad.toml")),
               "router.set sets data.holdout, but which images the islands train on is the config's");
  // Nothing was made or started: no partition, no run directory.
  EXPECT_FALSE(fs::exists(dir / "parts/k2"));
  EXPECT_FALSE(fs::exists(dir / "runs"));
  // Data that is not there: the partition's own ddm refuses it, and the runner's exit status says so
  // (2: bad input, as the child's), naming the log that holds the child's words. No partition is made.
  std::string nodata = kTiny;
  nodata.replace(nodata.find("limit = 600"), 11, "source = \"folder\"\nroot = \"" + (dir / "none") + "\"");
  test::write_text(dir / "nodata.toml", nodata);
  std::string file = islands_file(dir.path, "runs", "nproc = 2\n");
  file.replace(file.find("/tiny.toml"), 10, "/nodata.toml");
  test::write_text(dir / "nodata-islands.toml", file);
  for (const char* action : {"slurm", "run"}) {
    const auto r = test::run_ddm(std::string("islands ") + action + " " + (dir / "nodata-islands.toml"));
    EXPECT_EQ(r.exit_code, kExitBadInput) << r.output;
    EXPECT_NE(r.output.find("making the partition failed (exit code 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(dir / "none"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(log " + (dir / "runs/logs/partition.log") + ")"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir / "parts/k2")) << action;
  }
}

// An island whose input ddm refuses before it runs (exit status 2) would fail the same way on every
// restart, so it is reported failed at once, naming the island and the error, while the others go
// on. Here the router's holdout takes all 600 images: the runner's own checks (the configs, the
// batches) pass, and the router's data check refuses it. The experts train 2 steps.
TEST(Islands, AnIslandWhoseInputIsRefusedFailsOnceWithoutRestarts) {
  const test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  std::string file = islands_file(dir.path, "runs", "concurrency = 3\nretries = 2\nthreads = 1\n");
  file.replace(file.find("holdout = 100"), 13, "holdout = 600");
  file.replace(file.find("budget = \"split-batch\""), 22, "budget = \"split-batch\"\nset = [\"train.steps=2\"]");
  test::write_text(dir / "isl.toml", file);
  const auto r = test::run_command("timeout 300 " + test::ddm_binary() + " islands run " + (dir / "isl.toml"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  const std::string error = "data.holdout = 600 leaves no training images (the data has 600)";
  EXPECT_EQ(count(r.output, "router: started (attempt"), 1u) << r.output;
  EXPECT_EQ(count(r.output, "restarting from its last checkpoint"), 0u) << r.output;
  EXPECT_EQ(count(r.output, "[islands] router: failed (exit code 2: its config or input was refused before it ran; "
                            "not restarted"), 1u) << r.output;
  EXPECT_NE(r.output.find(error), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not done: router (failed);"), std::string::npos) << r.output;
  const auto state = nlohmann::json::parse(test::read_text(dir / "runs/islands.json"));
  ASSERT_EQ(state.size(), 3u) << state.dump();
  EXPECT_EQ(state[0]["state"], "done") << state.dump();
  EXPECT_EQ(state[1]["state"], "done") << state.dump();
  EXPECT_EQ(state[2]["name"], "router");
  EXPECT_EQ(state[2]["state"], "failed");
  EXPECT_EQ(state[2]["attempts"], 1);
  EXPECT_EQ(state[2]["last_exit"], "exit code 2");
  EXPECT_NE(state[2]["last_error"].get<std::string>().find(error), std::string::npos) << state.dump();
  EXPECT_FALSE(fs::exists(dir / "runs/ensemble.json"));
  EXPECT_FALSE(fs::exists(dir / "runs/router/config.toml"));  // refused before its run directory was made
}

TEST(Islands, SlurmRunsATwoProcessIslandAsOneArrayTaskOfTwoTasks) {
  const test::TempDir dir;
  fs::permissions(dir.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                fs::perms::others_read | fs::perms::others_exec);  // for munged and slurmd
  // The experts write a grid at their last step; the router made from the same config does not
  // (it samples nothing, and `islands slurm` builds its config before writing the script).
  test::write_text(dir / "tiny.toml", std::string(kTiny) + "sample_every = 120\nsample_n = 4\n[sample]\nsteps = 2\n");
  // [slurm]: extra #SBATCH lines (a job name of the user's replaces ddm's) and shell lines each
  // array task runs first, here one the log shows.
  test::write_text(dir / "isl.toml", islands_file(dir.path, "runs", "nproc = 2\nretries = 1\nthreads = 1\n") +
                                         "[slurm]\nsbatch = [\"--time=00:20:00\", \"--job-name=isl-test\"]\n"
                                         "setup = [\"setup_word=ready\", \"echo \\\"slurm.setup ran: $setup_word\\\"\"]\n");
  auto r = test::run_ddm("islands slurm " + (dir / "isl.toml") + " --script " + (dir / "job.sbatch"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("each island 2 Slurm tasks"), std::string::npos) << r.output;
  const std::string script = test::read_text(dir / "job.sbatch");
  EXPECT_EQ(script.find("--job-name=ddm-islands"), std::string::npos) << script;
  for (const char* line : {"#SBATCH --array=0-2\n", "#SBATCH --ntasks=2\n", "#SBATCH --cpus-per-task=1\n",
                           "#SBATCH --time=00:20:00\n", "#SBATCH --job-name=isl-test\n", "setup_word=ready\n",
                           "echo \"slurm.setup ran: $setup_word\"\n",
                           "for attempt in $(seq 0 1); do\n",
                           "  srun --ntasks=2 --cpus-per-task=1 --kill-on-bad-exit=0 --wait=60 \"${island[@]}\" || rc=$?\n"})
    EXPECT_NE(script.find(line), std::string::npos) << line << " not in:\n" << script;
  EXPECT_EQ(test::run_command("bash -n " + (dir / "job.sbatch")).exit_code, 0);
  r = test::run_command("env -u SLURM_ARRAY_TASK_ID bash " + (dir / "job.sbatch"));
  expect_error(r, "run this script with sbatch");

  const std::string missing = test::slurm_missing();
  if (!missing.empty()) GTEST_SKIP() << "the script's text was checked; running it needs a local Slurm, which needs " << missing;
  test::LocalSlurm slurm(dir.path);
  ASSERT_EQ(slurm.started.exit_code, 0) << slurm.started.output;
  // Array task 0 (expert 0) only: one job step of 2 ranks. Once it has a checkpoint, rank 1
  // (SLURM_PROCID=1) is killed with -9: the step fails and the script restarts the island.
  test::run_command("(" + slurm.env + "timeout 300 sbatch --wait --array=0 " + (dir / "job.sbatch") + " > " +
                    (dir / "sbatch.out") + " 2>&1; echo $? > " + (dir / "rc.part") + "; mv " + (dir / "rc.part") + " " + (dir / "rc") + ") > /dev/null 2>&1 &");
  auto logs = [&] {
    std::string text;
    for (const auto& e : fs::directory_iterator(dir / "runs/logs"))
      if (e.path().filename().string().rfind("slurm-", 0) == 0) text += test::read_text(e.path().string());
    return text;
  };
  const fs::path ckpt = dir / "runs/experts/0/ckpt/step-00000020";
  ASSERT_TRUE(wait_for([&] { return fs::exists(ckpt) || fs::exists(dir / "rc"); }, 240)) << logs();
  ASSERT_TRUE(fs::exists(ckpt)) << test::read_text(dir / "sbatch.out") << logs();
  pid_t rank1 = 0;
  auto find_rank1 = [&] {
    for (pid_t pid : strays(dir.path)) {
      std::string env = test::read_text("/proc/" + std::to_string(pid) + "/environ");
      for (char& ch : env)
        if (ch == '\0') ch = '\n';
      if (("\n" + env).find("\nSLURM_PROCID=1\n") != std::string::npos &&
          test::read_text("/proc/" + std::to_string(pid) + "/cmdline").find("train") != std::string::npos)
        rank1 = pid;
    }
    return rank1 != 0;
  };
  ASSERT_TRUE(wait_for(find_rank1, 10)) << logs();
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  ASSERT_TRUE(wait_for([&] { return fs::exists(dir / "rc"); }, 280)) << logs();
  const std::string log = logs();
  ASSERT_EQ(test::read_text(dir / "rc"), "0\n") << test::read_text(dir / "sbatch.out") << log;
  EXPECT_NE(log.find("slurm.setup ran: ready"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(dir / "runs/experts/0/grids/step-00000120.png")) << log;
  EXPECT_NE(log.find("parallel: data parallel over 2 processes"), std::string::npos) << log;
  EXPECT_NE(log.find("train: 120 steps, batch 16 (2 ranks x 8)"), std::string::npos) << log;
  EXPECT_NE(log.find("[islands] array task 0: restarting the island from its last checkpoint (restart 1 of 1)"),
            std::string::npos) << log;
  EXPECT_NE(log.find("resuming from"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(dir / "runs/experts/1")) << "array task 0 trains expert 0 only";
  // Killed and restarted, it still ends with the weights `ddm launch --nproc 2` gives uninterrupted
  // (same world size and threads).
  const auto ref = launch_reference(dir, "ref");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  EXPECT_EQ(test::read_text(dir / "ref/ckpt/step-00000120/ema.safetensors"),
            test::read_text(dir / "runs/experts/0/ckpt/step-00000120/ema.safetensors"));
  // An island whose input ddm refuses (exit 2: here a config key it does not know) fails at once:
  // restarting would fail alike.
  test::write_text(dir / "tiny.toml", std::string(kTiny) + "\nno_such_key = 1\n");
  r = test::run_command(slurm.env + "timeout 120 sbatch --wait --array=1 " + (dir / "job.sbatch"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  const std::string refused = logs();
  EXPECT_NE(refused.find("[islands] array task 1: the island refused its input (exit 2"), std::string::npos) << refused;
  EXPECT_EQ(refused.find("array task 1: restarting"), std::string::npos) << refused;
  EXPECT_NE(refused.find("no_such_key"), std::string::npos) << refused;
}
