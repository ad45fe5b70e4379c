// Data-parallel `ddm train` as real processes on 127.0.0.1: under `ddm launch` two ranks train what
// one process trains (within float32 rounding); a worker killed with kill -9 is restarted with the
// others and the run ends bit-identical to an uninterrupted one; a run resumes under another world
// size; a hung (SIGSTOPped) worker fails the others after the collective timeout, and with three
// ranks the two that time out name it; SIGTERM to one rank stops every rank after the same step with a
// checkpoint; and every bad start (store unreachable, port taken, ranks with different configs, a
// batch that does not split) is a clear error naming the rank, with nothing left running. Pipeline
// stages (parallel.pp) face the same faults.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "test_util.h"
#include "train/checkpoint.h"

using namespace ddm;
using test::run_command;
namespace fs = std::filesystem;

namespace {

constexpr const char* kTiny = R"([data]
limit = 512
[model]
preset = "unet-tiny"
channels = 8
channel_mult = [1, 2]
groups = 4
[train]
steps = 20
batch_size = 16
lr = 2e-3
warmup = 5
threads = 1
log_every = 1
ckpt_every = 5
seed = 3
)";

std::string binary() { return test::ddm_binary(); }

struct Workdir {
  test::TempDir dir;
  std::string cfg;
  Workdir() {
    cfg = dir / "tiny.toml";
    test::write_text(cfg, kTiny);
  }
  std::string train(const std::string& out, const std::string& extra = "") const {
    return "train --quiet --config " + cfg + " --out " + (dir / out) + extra;
  }
};

std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  std::ifstream in(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

double weight_difference(const std::string& a, const std::string& b) {
  const TensorMap wa = read_checkpoint(*latest_checkpoint(a), true).model, wb = read_checkpoint(*latest_checkpoint(b), true).model;
  double m = 0;
  for (const auto& [name, t] : wa) m = std::max(m, (t - wb.at(name)).abs().max().item<double>());
  return m;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A free port on 127.0.0.1 (the kernel's choice), for runs started without a launcher.
int free_port() {
  const auto r = run_command("/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\",0)); "
                             "print(s.getsockname()[1])'");
  return std::stoi(r.output);
}

void wait_for_checkpoints(const std::string& run, size_t n, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (list_checkpoints(run).size() < n && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// Trains `out` under `ddm launch --max-restarts 1` with 2 workers, kills worker `victim` with kill -9
// after the second checkpoint and waits for the launch to end; returns the launcher's log.
std::string killed_under_launcher(const Workdir& r, const std::string& out, const std::string& sets, int victim) {
  const std::string log = r.dir / (out + ".log");
  const pid_t launcher = test::spawn_ddm("", "launch --timeout 300 --max-restarts 1 --nproc 2 -- " + r.train(out, sets), log);
  wait_for_checkpoints(r.dir / out, 2, 120);
  auto workers = test::child_pids(launcher);
  if (workers.size() != 2u) ADD_FAILURE() << "expected 2 workers: " << test::read_text(log);
  else kill(workers[static_cast<size_t>(victim)], SIGKILL);
  if (test::wait_exit(launcher, 300) != 0) ADD_FAILURE() << "the launcher did not end: " << test::read_text(log);
  return test::read_text(log);
}

// Trains `sets` for `steps` steps with a checkpoint every 10, uninterrupted ("ref") and with worker 0
// killed by kill -9 under the launcher ("killed"): the launcher restarts both, and the run ends bit
// for bit where the uninterrupted one does. Returns the launcher's output.
std::string a_kill_changes_nothing(const Workdir& r, const std::string& sets, int steps) {
  const std::string all = sets + " --set train.steps=" + std::to_string(steps) + " --set train.ckpt_every=10";
  const auto ref = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("ref", all));
  EXPECT_EQ(ref.exit_code, 0) << ref.output;
  const std::string out = killed_under_launcher(r, "killed", all, 0);
  EXPECT_TRUE(has(out, "restarting all 2 workers (restart 1 of 1")) << out;
  char last[32];
  std::snprintf(last, sizeof last, "killed/ckpt/step-%08d", steps);
  const auto ckpts = list_checkpoints(r.dir / "killed");
  EXPECT_TRUE(!ckpts.empty() && ckpts.back() == r.dir / last) << out;
  EXPECT_EQ(weight_difference(r.dir / "ref", r.dir / "killed"), 0.0);
  EXPECT_EQ(losses(r.dir / "ref"), losses(r.dir / "killed"));
  return out;
}

// Starts 2 ranks by hand training `out` without end, sends SIGTERM to rank 1 once training runs and
// waits for both; checks that rank 0 says it stopped and wrote one checkpoint, and returns that
// checkpoint's state.json (null on failure).
nlohmann::json sigterm_to_rank_one(const Workdir& r, const std::string& out, const std::string& sets) {
  const std::string env = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port());
  const std::string args = r.train(out, " --set train.steps=100000 --set train.ckpt_every=100000" + sets);
  const pid_t r0 = test::spawn_ddm("RANK=0 " + env, args, r.dir / "r0.log"), r1 = test::spawn_ddm("RANK=1 " + env, args, r.dir / "r1.log");
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (losses(r.dir / out).size() < 3 && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(r1, SIGTERM);
  const bool exited = test::wait_exit(r0, 60) == 0 && test::wait_exit(r1, 60) == 0;
  const std::string out0 = test::read_text(r.dir / "r0.log");
  EXPECT_TRUE(exited) << out0;
  EXPECT_TRUE(has(out0, "stopped by signal 15")) << out0;
  const auto ckpts = list_checkpoints(r.dir / out);
  EXPECT_EQ(ckpts.size(), 1u) << out0;
  if (!exited || ckpts.size() != 1u) return nullptr;
  return nlohmann::json::parse(test::read_text(ckpts[0] + "/state.json"));
}

// Starts 2 ranks by hand (no launcher to stop them: srun, mpirun, hand-started) training `out`
// without end, kills rank 1 with kill -9 after the first checkpoint; the survivor itself must fail
// within seconds naming the lost rank. Checks that and returns rank 0's log.
std::string rank_one_killed(const Workdir& r, const std::string& out, const std::string& sets) {
  const std::string env = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port());
  const std::string args = r.train(out, sets + " --set train.steps=100000");
  const pid_t r0 = test::spawn_ddm("RANK=0 " + env, args, r.dir / "r0.log"), r1 = test::spawn_ddm("RANK=1 " + env, args, r.dir / "r1.log");
  wait_for_checkpoints(r.dir / out, 1, 120);
  kill(r1, SIGKILL);
  // Bounded by the wait, not timed: the message says the lost connection (not a timeout) stopped it.
  EXPECT_EQ(test::wait_exit(r0, 60), 0) << test::read_text(r.dir / "r0.log");
  const std::string log = test::read_text(r.dir / "r0.log");
  EXPECT_TRUE(has(log, "error: rank 0: lost the connection to rank 1")) << log;
  return log;
}

// A worker's RANK, from its environment (-1 if it has none).
int rank_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
  std::string var;
  while (std::getline(in, var, '\0'))
    if (var.rfind("RANK=", 0) == 0) return std::stoi(var.substr(5));
  return -1;
}

// Trains `out` under `ddm launch` with `nproc` workers and parallel.timeout = 3 (8 with more than two
// workers: their probe for the hung rank then waits 2 s, which outlasts the skew between the others'
// timeouts on a loaded machine), stops rank 1 with SIGSTOP after the first checkpoint; the others must
// fail after the timeout, well before Gloo's 30 minutes. Checks that and returns the launcher's log.
std::string worker_one_hung(const Workdir& r, const std::string& out, const std::string& sets, int nproc = 2) {
  const std::string log = r.dir / (out + ".log");
  const std::string timeout = nproc > 2 ? "8" : "3";
  const pid_t launcher = test::spawn_ddm("", "launch --timeout 200 --grace 2 --nproc " + std::to_string(nproc) + " -- " +
                                       r.train(out, sets + " --set train.steps=100000 --set parallel.timeout=" + timeout),
                               log);
  wait_for_checkpoints(r.dir / out, 1, 120);
  auto workers = test::child_pids(launcher);
  if (workers.size() != static_cast<size_t>(nproc)) {
    ADD_FAILURE() << "expected " << nproc << " workers: " << test::read_text(log);
    return "";
  }
  const auto one = std::find_if(workers.begin(), workers.end(), [](pid_t p) { return rank_of(p) == 1; });
  if (one == workers.end()) {
    ADD_FAILURE() << "no worker has RANK=1: " << test::read_text(log);
    return "";
  }
  kill(*one, SIGSTOP);
  // Bounded by the wait (Gloo's own timeout is 30 minutes), not timed: the message says which
  // timeout stopped it.
  EXPECT_EQ(test::wait_exit(launcher, 120), 0) << test::read_text(log);
  const std::string text = test::read_text(log);
  EXPECT_TRUE(has(text, "timed out after " + timeout + "s")) << text;
  return text;
}

}  // namespace

TEST(Distributed, TwoLaunchedRanksTrainWhatOneProcessTrains) {
  Workdir r;
  const auto one = test::run_ddm(r.train("one"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto two = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("two", " --set train.threads=1"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const auto l1 = losses(r.dir / "one"), l2 = losses(r.dir / "two");
  ASSERT_EQ(l1.size(), 20u);
  ASSERT_EQ(l2.size(), 20u);
  // Tolerance as in tests/unit/parallel/test_data_parallel.cpp: float32 rounding of another summation order.
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 1e-4 * l1[i]) << "step " << i + 1;
  EXPECT_LE(weight_difference(r.dir / "one", r.dir / "two"), 1e-3);
  const auto state = nlohmann::json::parse(test::read_text(*latest_checkpoint(r.dir / "two") + "/state.json"));
  EXPECT_EQ(state["world_size"], 2);
}

TEST(Distributed, AKilledWorkerIsRestartedAndTheRunEndsAsIfUninterrupted) {
  Workdir r;
  const std::string sets = " --set train.steps=150 --set train.ckpt_every=10";
  const auto ref = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("ref", sets));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string out = killed_under_launcher(r, "killed", sets, 1);
  EXPECT_TRUE(has(out, "was killed by signal 9 (SIGKILL)")) << out;
  EXPECT_TRUE(has(out, "restarting all 2 workers (restart 1 of 1")) << out;
  ASSERT_EQ(list_checkpoints(r.dir / "killed").back(), r.dir / "killed/ckpt/step-00000150");
  // Same world size and threads: the restarted run ends bit for bit where the uninterrupted one does.
  EXPECT_EQ(weight_difference(r.dir / "ref", r.dir / "killed"), 0.0);
  EXPECT_EQ(losses(r.dir / "ref").back(), losses(r.dir / "killed").back());
}

TEST(Distributed, ResumesUnderAnotherWorldSize) {
  Workdir r;
  const auto full = test::run_ddm(r.train("full"));
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const auto half = test::run_ddm(r.train("mixed", " --set train.steps=10"));
  ASSERT_EQ(half.exit_code, 0) << half.output;
  const auto rest = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("mixed", " --resume"));
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  const auto lf = losses(r.dir / "full"), lm = losses(r.dir / "mixed");
  ASSERT_EQ(lm.size(), 20u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(lm[i], lf[i]);
  for (size_t i = 10; i < 20; ++i) EXPECT_NEAR(lm[i], lf[i], 1e-4 * lf[i]) << "step " << i + 1;
  EXPECT_LE(weight_difference(r.dir / "full", r.dir / "mixed"), 1e-3);
}

TEST(Distributed, AKilledRankFailsTheOtherWithinSecondsNamingIt) {
  Workdir r;
  rank_one_killed(r, "lost", "");
  EXPECT_FALSE(list_checkpoints(r.dir / "lost").empty());
}

// Three workers: the two that time out name the stopped one.
TEST(Distributed, AHungWorkerFailsTheOthersAfterTheTimeout) {
  Workdir r;
  const std::string out = worker_one_hung(r, "hung", " --set train.batch_size=15", 3);
  // Under ddm launch an error line reads "[rank R] error: ..." (docs/distributed.md). Gloo closes a pair
  // whose operation timed out, so one survivor may lose its connection instead; the others name rank 1.
  int named = 0;
  for (const char* rank : {"[rank 0] error: ", "[rank 2] error: "}) {
    const size_t at = out.find(rank);
    if (at == std::string::npos) continue;
    const std::string line = out.substr(at, out.find('\n', at) - at);
    if (has(line, "lost the connection to a peer rank")) continue;
    ++named;
    EXPECT_TRUE(has(line, "timed out after 8s waiting for rank 1 (hung, stopped or much slower: of the 3 ranks, it "
                          "alone did not report the failure within 2s)"))
        << out;
  }
  EXPECT_GE(named, 1) << out;
  EXPECT_FALSE(list_checkpoints(r.dir / "hung").empty());
}

// A pipeline of 2 stages (parallel.pp) as real processes: a stage killed with kill -9 under the
// launcher is restarted with the other and the run ends bit for bit where the uninterrupted one
// does; without a launcher, the surviving stage fails within seconds naming the lost rank; a hung
// stage fails the other after the collective timeout.
TEST(Distributed, PipelineStagesSurviveAKillAndReportLostAndHungStages) {
  Workdir r;
  const std::string pp = " --set parallel.pp=2 --set train.grad_accum=4 --set parallel.schedule=zb-h1";
  a_kill_changes_nothing(r, pp, 60);
  rank_one_killed(r, "lost", pp);
  worker_one_hung(r, "hung", pp);
}

// The same for a V-shaped pipeline (4 stages on 2 processes, each running two; bubbles filled):
// killed and restarted under the launcher it ends bit for bit where the uninterrupted run does; a
// lost rank is named.
TEST(Distributed, AVShapedPipelineSurvivesAKill) {
  Workdir r;
  const std::string pp = " --set parallel.pp=2 --set train.grad_accum=4 --set parallel.schedule=zb-v";
  a_kill_changes_nothing(r, pp, 30);
  rank_one_killed(r, "lost", pp);
}

TEST(Distributed, SigtermToOneRankStopsEveryRankAfterTheSameStepWithACheckpoint) {
  Workdir r;
  const auto state = sigterm_to_rank_one(r, "term", "");
  ASSERT_FALSE(state.is_null());
  EXPECT_EQ(state["step"].get<size_t>(), losses(r.dir / "term").size());
  // Under `ddm launch`, restarts allowed: a stop asked for, not a fault. No restart; the launcher
  // exits as the workers did (128 + SIGTERM), saying so.
  const std::string log = r.dir / "launch.log";
  const pid_t launcher = test::spawn_ddm("", "launch --timeout 300 --max-restarts 2 --nproc 2 -- " +
                                                 r.train("launched", " --set train.steps=100000 --set train.ckpt_every=100000"),
                                         log);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (losses(r.dir / "launched").size() < 3 && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto workers = test::child_pids(launcher);
  ASSERT_EQ(workers.size(), 2u) << test::read_text(log);
  kill(workers[1], SIGTERM);
  ASSERT_EQ(test::wait_exit(launcher, 120), 0) << test::read_text(log);
  const std::string out = test::read_text(log);
  EXPECT_TRUE(has(out, "exited with status 143: the workers stop on SIGTERM, which one of them was sent; the others "
                       "are sent it too")) << out;
  EXPECT_TRUE(has(out, "[launch] the workers stopped on SIGTERM; exiting with status 143 (continue with --resume)")) << out;
  EXPECT_FALSE(has(out, "restarting")) << out;
  const auto ckpts = list_checkpoints(r.dir / "launched");
  ASSERT_EQ(ckpts.size(), 1u) << out;
  EXPECT_EQ(read_checkpoint(ckpts[0]).step, static_cast<int64_t>(losses(r.dir / "launched").size()));
}

// DiLoCo as real processes: Streaming DiLoCo (2 fragments, an overlapped all-reduce) killed with
// kill -9 and restarted by the launcher ends bit for bit where the uninterrupted run does; SIGTERM
// to one replica stops both at the next synchronization, with a checkpoint.
TEST(Distributed, DilocoKilledAndRestartedEndsAsIfUninterrupted) {
  Workdir r;
  const std::string out = a_kill_changes_nothing(
      r, " --set parallel.mode=diloco --set diloco.inner_steps=6 --set diloco.fragments=2 --set diloco.overlap=1", 40);
  // The survivor, regrouping without rank 0 (it waits for rank 0 up to parallel.timeout), stops at
  // the launcher's SIGTERM instead of outlasting its grace period until SIGKILL.
  EXPECT_TRUE(has(out, "stopped by signal 15 while regrouping")) << out;
  EXPECT_FALSE(has(out, "while regrouping (rank 1: ")) << out;  // the rank named once
  EXPECT_FALSE(has(out, "sending SIGKILL")) << out;
}

TEST(Distributed, DilocoSigtermToOneReplicaStopsBothAtTheNextSync) {
  Workdir r;
  const auto state = sigterm_to_rank_one(r, "term", " --set parallel.mode=diloco --set diloco.inner_steps=7");
  ASSERT_FALSE(state.is_null());
  const int64_t step = state["step"].get<int64_t>();
  EXPECT_EQ(step % 7, 0) << "stopped between synchronizations";
  EXPECT_EQ(state["diloco"]["last_sync"], std::vector<int64_t>{step});
  EXPECT_EQ(static_cast<int64_t>(losses(r.dir / "term").size()), step);
}

// Faults beyond restarting the world. Three replicas started by hand (rank 0 hosts the store): kill -9
// of rank 2 and the other two go on without it, after diloco.peer_wait, and finish the run; the
// checkpoints written after it died hold replicas 0 and 1 only.
TEST(Distributed, DilocoGoesOnWithoutAKilledReplica) {
  Workdir r;
  const std::string env = "WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port());
  const std::string args = r.train("lost", " --set train.steps=90 --set train.batch_size=18 --set train.ckpt_every=10 "
                                           "--set parallel.mode=diloco --set diloco.inner_steps=5 --set diloco.peer_wait=2");
  std::vector<pid_t> ranks;
  for (int k = 0; k < 3; ++k)
    ranks.push_back(test::spawn_ddm("RANK=" + std::to_string(k) + " " + env, args, r.dir / ("r" + std::to_string(k) + ".log")));
  wait_for_checkpoints(r.dir / "lost", 1, 120);
  kill(ranks[2], SIGKILL);
  ASSERT_EQ(test::wait_exit(ranks[0], 120), 0) << test::read_text(r.dir / "r0.log");
  ASSERT_EQ(test::wait_exit(ranks[1], 30), 0) << test::read_text(r.dir / "r1.log");
  const std::string out0 = test::read_text(r.dir / "r0.log");
  // Both survivors' output on failure: in two full `ctest -j2` runs (2026-11-23) rank 0 found itself
  // left out of the regrouping at its first synchronization after the kill, and in a full ctest run
  // (2026-11-24) it waited out its 120 s collective timeout. Both follow from the ring's order: only
  // rank 2's neighbours see it go, and rank 0 stayed blocked on rank 1, which had left the collective
  // to regroup. recover() now closes the failed group first (DistElastic.ARegroupingPeerUnblocks...).
  // In CI (2026-12-02) rank 0 completed the all-reduce that rank 1 failed, and the two regrouped at
  // different rounds: a round now counts only where every member completed it (DistElastic.ARound...).
  EXPECT_TRUE(has(out0, "synchronizing with 2 of 3 replicas")) << out0 << "\n--- rank 1:\n" << test::read_text(r.dir / "r1.log");
  EXPECT_TRUE(has(out0, "done: step 90")) << out0;
  const auto last = read_checkpoint(list_checkpoints(r.dir / "lost").back());
  EXPECT_EQ(last.step, 90);
  EXPECT_EQ(last.state["diloco"]["replicas"], (std::vector<int>{0, 1}));
  EXPECT_EQ(losses(r.dir / "lost").size(), 90u);
}

// Under `ddm launch --restart failed`, the killed replica is restarted alone and rejoins: the others
// went on without it (a short peer_wait), then took it back at a later synchronization; the run ends
// with both replicas on the global weights.
// In fp16 (train/loss_scale.h), started at a loss scale of 2^30 that float16 overflows at for the
// first steps: the rejoining replica goes on with its sender's scale, not from 2^30 again.
TEST(Distributed, DilocoKilledReplicaRejoins) {
  Workdir r;
  const std::string log = r.dir / "launch.log";
  const pid_t launcher = test::spawn_ddm("", "launch --timeout 300 --restart failed --max-restarts 1 --nproc 2 -- " +
                                       r.train("rejoin", " --set train.steps=150 --set train.ckpt_every=10 "
                                                         "--set parallel.mode=diloco --set diloco.inner_steps=5 "
                                                         "--set diloco.peer_wait=0.2 --set train.precision=fp16 "
                                                         "--set train.loss_scale=1073741824"),
                               log);
  wait_for_checkpoints(r.dir / "rejoin", 1, 120);
  auto workers = test::child_pids(launcher);
  ASSERT_EQ(workers.size(), 2u) << test::read_text(log);
  kill(workers[1], SIGKILL);
  ASSERT_EQ(test::wait_exit(launcher, 300), 0) << test::read_text(log);
  const std::string out = test::read_text(log);
  EXPECT_TRUE(has(out, "restarting it alone (restart 1 of 1, DDM_REJOIN=1)")) << out;
  EXPECT_TRUE(has(out, "[rank 1] rejoined at step")) << out;
  EXPECT_TRUE(has(out, "replicas, loss scale ")) << out;
  EXPECT_FALSE(has(out, "loss scale 1.07374e+09")) << out;  // 2^30: the sender's scale had come down
  EXPECT_TRUE(has(out, "all 2 workers exited with status 0 (after 1 restart)")) << out;
  const auto last = read_checkpoint(list_checkpoints(r.dir / "rejoin").back());
  EXPECT_EQ(last.step, 150);
  EXPECT_EQ(last.state["diloco"]["replicas"], (std::vector<int>{0, 1}));
  const std::string w = last.model.begin()->first;
  EXPECT_TRUE(torch::equal(last.optim.at("replica1.params." + w), last.model.at(w)));
  EXPECT_EQ(losses(r.dir / "rejoin").size(), 150u);
}

TEST(Distributed, BadStartsAreClearErrors) {
  Workdir r;
  const int port = free_port();
  // Rank 1 alone: the store (rank 0's) never appears.
  auto alone = run_command("RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " +
                           binary() + " " + r.train("alone", " --set parallel.timeout=2"));
  EXPECT_EQ(alone.exit_code, 1) << alone.output;
  EXPECT_TRUE(has(alone.output, "error: rank 1: cannot reach the rendezvous store at 127.0.0.1:" + std::to_string(port)))
      << alone.output;
  // ddm's line alone: not LibTorch's error and stack trace for each try before it.
  EXPECT_FALSE(has(alone.output, "[c10d]")) << alone.output;
  EXPECT_FALSE(has(alone.output, "frame #")) << alone.output;
  EXPECT_FALSE(fs::exists(r.dir / "alone"));
  // Rank 0's port is taken.
  const pid_t holder = test::spawn_ddm("", "launch --timeout 60 --master-port " + std::to_string(port) +
                                     " --nproc 1 --no-ddm -- sleep 30", r.dir / "holder.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto taken = run_command("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " +
                           binary() + " " + r.train("taken", " --set parallel.timeout=2"));
  kill(holder, SIGTERM);
  test::wait_exit(holder, 30);
  EXPECT_EQ(taken.exit_code, 1) << taken.output;
  EXPECT_TRUE(has(taken.output, "already in use")) << taken.output;
  // Ranks with different configs: the key and the ranks are named; nothing is written.
  auto differ = test::run_ddm("launch --timeout 120 --nproc 2 --no-ddm -- sh -c '" + binary() + " " +
                              r.train("differ", " --set train.lr=0.00$((RANK+1))") + "'");
  EXPECT_NE(differ.exit_code, 0) << differ.output;
  EXPECT_TRUE(has(differ.output, "ranks disagree on train.lr")) << differ.output;
  EXPECT_FALSE(fs::exists(r.dir / "differ/config.toml"));
  // Other presets are named as such (not the first key a preset sets), beside every other key that differs.
  auto presets = test::run_ddm("launch --timeout 120 --nproc 2 --no-ddm -- sh -c '" + binary() + " " +
                               r.train("presets", " --set model.preset=$([ $RANK = 0 ] && echo unet-tiny || echo "
                                                  "unet-32) --set model.attn_levels=[] --set train.seed=$RANK") + "'");
  EXPECT_NE(presets.exit_code, 0) << presets.output;  // (1: --no-ddm runs sh, whose status 2 the launcher does not read)
  EXPECT_TRUE(has(presets.output, "ranks disagree on model.preset: rank 0 has 'unet-tiny', rank 1 has 'unet-32'; on "))
      << presets.output;
  EXPECT_TRUE(has(presets.output, "; on train.seed: rank 0 has 0, rank 1 has 1")) << presets.output;
  // One rank given --resume, the other not: refused at once (not two ranks waiting at other
  // collectives until the timeout).
  auto resume = test::run_ddm("launch --timeout 120 --nproc 2 --no-ddm -- sh -c '" + binary() + " " +
                              r.train("resume", " --set parallel.timeout=100") + " $([ $RANK = 1 ] && echo --resume)'");
  EXPECT_NE(resume.exit_code, 0) << resume.output;
  EXPECT_TRUE(has(resume.output, "ranks disagree on --resume: rank 0 has no --resume, rank 1 has --resume (command line)"))
      << resume.output;
  EXPECT_FALSE(fs::exists(r.dir / "resume/config.toml"));
  // A global batch that does not split over the ranks.
  auto odd = test::run_ddm("launch --timeout 120 --nproc 2 -- " + r.train("odd", " --set train.batch_size=15"));
  EXPECT_NE(odd.exit_code, 0) << odd.output;
  EXPECT_TRUE(has(odd.output, "train.batch_size = 15 does not split into 2 ranks")) << odd.output;
  EXPECT_TRUE(has(odd.output, "[rank 1] error: ")) << odd.output;  // the launcher's prefix names the rank,
  EXPECT_FALSE(has(odd.output, "[rank 1] error: rank 1:")) << odd.output;  // once
  EXPECT_FALSE(fs::exists(r.dir / "odd"));
}
