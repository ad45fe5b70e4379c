// Training on tar shards end to end with the real `ddm` binary: `ddm shards write` turns Fashion-MNIST
// into shards; a run on them killed with kill -9 and resumed ends with the bytes of the uninterrupted
// run; two launched replicas, each reading shards of its own, resume exactly too; a damaged image
// stops the run naming shard and key (exit 2, with a checkpoint of the last step done, which --resume
// with data.skip_bad goes on from exactly; two replicas, or a filled pipeline's two stages, stop
// together), or with data.skip_bad is skipped and counted in the metrics; a resume over data that lost
// samples says so;
// bad shard lists are clear errors; shards are re-sharded; an expert of a partition made with
// --reshard trains on its cluster's shards; a router (with samples held out) and a distilled student
// train on shards; an autoencoder and a latent model train on shards, `ddm encode` writes the
// latents of the shards once, and a latent model trains on those as on fresh encodes; the latent
// shards are partitioned, and latent experts, a router and a student train on them. A run that a
// test starts caches its shard scans in the build's test cache, not the user's.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "core/config.h"
#include "core/fileio.h"
#include "data/dataset.h"
#include "data/latent_shards.h"
#include "data/origin.h"
#include "data/scan_cache.h"
#include "data/shard_loader.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "decentral/partition.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/latent.h"
#include "train/encode_shards.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string numbered_key(int64_t i) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08lld", static_cast<long long>(i));
  return buf;
}

// A tiny model on 512 Fashion-MNIST images written as 8 shards of 64, resized to 24 x 24.
struct ShardRun {
  test::TempDir dir;
  std::string pattern;
  ShardRun() {
    const auto w = test::run_ddm("shards write --set data.limit=512 --shard-size 64 --out " + (dir / "shards"));
    EXPECT_EQ(w.exit_code, 0) << w.output;
    EXPECT_TRUE(has(w.output, "wrote 512 samples in 8 shards")) << w.output;
    pattern = dir / "shards/train-{000000..000007}.tar";
    test::write_text(dir / "tiny.toml", R"(
[data]
source = "shards"
resolution = 24
hflip = true
shuffle_buffer = 50
[model]
preset = "unet-tiny"
channels = 8
channel_mult = [1, 2]
groups = 4
[train]
batch_size = 16
lr = 2e-3
threads = 1
log_every = 1
ckpt_every = 10
seed = 3
)");
  }
  std::string train(const std::string& out, const std::string& sets, bool quiet = true) const {
    return std::string(quiet ? "train --quiet" : "train") + " --config " + (dir / "tiny.toml") + " --set \"data.root=" + pattern + "\"" + sets + " --out " +
           (dir / out);
  }
};

std::string file_bytes(const std::string& path) { return test::read_text(path); }

std::vector<nlohmann::json> metrics(const std::string& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A 4-step autoencoder on r's shards at 24 x 24 (r.dir/ae.toml, run r.dir/ae), its report on the
// first n and stats_n samples. Returns the [data] section naming the shards.
std::string train_autoencoder(const ShardRun& r, int n, int stats_n) {
  const std::string data = "[data]\nsource = \"shards\"\nresolution = 24\nroot = \"" + r.pattern + "\"\n";
  test::write_text(r.dir / "ae.toml", data + "[model]\npreset = \"ae-f4\"\nchannels = 8\ngroups = 4\n"
                                             "[train]\nsteps = 4\nbatch_size = 16\nthreads = 1\nlog_every = 2\n");
  auto ae = test::run_ddm("train-autoencoder --quiet --config " + (r.dir / "ae.toml") + " --out " + (r.dir / "ae") +
                          " --n " + std::to_string(n) + " --stats-n " + std::to_string(stats_n));
  EXPECT_EQ(ae.exit_code, 0) << ae.output;
  return data;
}

// r.dir/isl.toml: islands writing r.dir/isl, experts of r.dir/CONFIG, the partition r.dir/PART (K = 2,
// made if missing), 50 samples held out; the experts' and the router's --set lists as TOML items.
void write_islands(const ShardRun& r, const std::string& config, const std::string& part, const std::string& expert_sets,
                   const std::string& router_sets) {
  test::write_text(r.dir / "isl.toml", "out = \"" + (r.dir / "isl") + "\"\nconfig = \"" + (r.dir / config) +
                                         "\"\n[partition]\npath = \"" + (r.dir / part) + "\"\nk = 2\n[experts]\nset = [" +
                                         expert_sets + "]\n[router]\nholdout = 50\nset = [" + router_sets + "]\n");
}

}  // namespace

TEST(ShardsTrain, ResumeAfterKillIsBitIdentical) {
  ShardRun r;
  const std::string sets = " --set train.steps=80";  // 80 x 16 = 1280 samples: past two epochs of 512
  auto ref = test::run_ddm(r.train("ref", sets));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string out = r.dir / "killed";
  auto pid_res = test::run_command(test::ddm_binary() + " " + r.train("killed", sets) + " >/dev/null 2>&1 & echo $!");
  const int pid = std::stoi(pid_res.output);
  for (int i = 0; i < 1200 && list_checkpoints(out).size() < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  test::run_command("kill -9 " + std::to_string(pid));
  test::run_command("while kill -0 " + std::to_string(pid) + " 2>/dev/null; do sleep 0.05; done");
  const auto at_kill = latest_checkpoint(out);
  ASSERT_TRUE(at_kill.has_value());
  auto res = test::run_ddm(r.train("killed", sets, /*quiet=*/false) + " --resume");
  ASSERT_EQ(res.exit_code, 0) << res.output;
  if (*at_kill != out + "/ckpt/step-00000080") {
    EXPECT_TRUE(has(res.output, "resuming from")) << res.output;
  }
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"}) {
    const std::string want = file_bytes(r.dir / ("ref/ckpt/step-00000080/" + std::string(file)));
    ASSERT_FALSE(want.empty()) << file;
    EXPECT_TRUE(want == file_bytes(out + "/ckpt/step-00000080/" + file)) << file << " differs";
  }
  const auto m = metrics(r.dir / "ref");
  ASSERT_EQ(m.size(), 80u);
  EXPECT_EQ(m.back()["epoch"], 2);  // 1280 samples drawn from 512
  for (const auto& rec : m) {  // the share of each interval spent waiting for data
    EXPECT_GE(rec["data_wait"].get<double>(), 0.0) << rec.dump();
    EXPECT_LE(rec["data_wait"].get<double>(), 1.0) << rec.dump();
  }
}

TEST(ShardsTrain, TwoLaunchedReplicasResumeAsTheyWouldHaveGoneOn) {
  ShardRun r;
  auto whole = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("whole", " --set train.steps=20"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  auto first = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("split", " --set train.steps=10"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto rest = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("split", " --set train.steps=20") + " --resume");
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_TRUE(file_bytes(r.dir / "whole/ckpt/step-00000020/model.safetensors") ==
              file_bytes(r.dir / "split/ckpt/step-00000020/model.safetensors"));
  // Each replica's own position: 20 steps x 8 rows each.
  const auto state = nlohmann::json::parse(file_bytes(r.dir / "whole/ckpt/step-00000020/state.json"));
  EXPECT_EQ(state["data_cursor"]["replicas"], nlohmann::json::parse("[[0, 160], [0, 160]]")) << state.dump();
  // Resumed as one process: the shards are dealt anew, from the next epoch, and it says so.
  auto alone = test::run_ddm(r.train("split", " --set train.steps=25", /*quiet=*/false) + " --resume");
  ASSERT_EQ(alone.exit_code, 0) << alone.output;
  EXPECT_TRUE(has(alone.output, "are for 2 replica(s), this run has 1")) << alone.output;
  EXPECT_TRUE(has(alone.output, "starts epoch 1 from its beginning")) << alone.output;
}

// DiLoCo replicas on shards under `ddm launch --restart failed`: the killed replica rejoins and goes
// on from its own data position at the last checkpoint that recorded it (not from the beginning of
// its shards), and the checkpoints after it rejoined gather the positions in the regrouped group.
TEST(ShardsTrain, ARejoiningDilocoReplicaGoesOnFromItsCheckpointedPosition) {
  ShardRun r;
  const std::string log = r.dir / "launch.log", out = r.dir / "rejoin";
  const int launcher = test::spawn_ddm("", "launch --timeout 300 --restart failed --max-restarts 1 --nproc 2 -- " +
                                               r.train("rejoin", " --set train.steps=300 --set train.keep_ckpts=100 "
                                                                 "--set parallel.mode=diloco --set diloco.inner_steps=5 "
                                                                 "--set diloco.peer_wait=2"),
                                       log);
  for (int i = 0; i < 2400 && list_checkpoints(out).size() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto workers = test::child_pids(launcher);
  ASSERT_EQ(workers.size(), 2u) << test::read_text(log);
  kill(workers[1], SIGKILL);
  ASSERT_EQ(test::wait_exit(launcher, 300), 0) << test::read_text(log);
  const std::string text = test::read_text(log);
  ASSERT_TRUE(has(text, "[rank 1] rejoined at step")) << text;
  // "replica 1's shards go on from epoch E, sample I: its position at the checkpoint of step S"
  const size_t said = text.find("replica 1's shards go on from epoch ");
  ASSERT_NE(said, std::string::npos) << text;
  int64_t epoch = -1, index = -1, ckpt = -1, joined = -1;
  ASSERT_EQ(std::sscanf(text.c_str() + said, "replica 1's shards go on from epoch %ld, sample %ld: its position at "
                                             "the checkpoint of step %ld", &epoch, &index, &ckpt), 3) << text;
  ASSERT_EQ(std::sscanf(text.c_str() + text.find("[rank 1] rejoined at step "), "[rank 1] rejoined at step %ld", &joined), 1);
  char name[32];
  std::snprintf(name, sizeof name, "/ckpt/step-%08ld", static_cast<long>(ckpt));
  const auto at_ckpt = read_checkpoint(out + name).state["data_cursor"]["replicas"][1];
  EXPECT_EQ(at_ckpt, nlohmann::json::array({epoch, index})) << text;
  EXPECT_GT(ckpt, 0);
  // Checkpoints written while it was away keep that position for it.
  for (const std::string& c : list_checkpoints(out)) {
    const auto st = read_checkpoint(c).state;
    if (st["diloco"]["replicas"] == std::vector<int>{0}) {
      EXPECT_EQ(st["data_cursor"]["replicas"][1], at_ckpt) << c;
    }
  }
  // From there it drew 8 samples (its half of a batch of 16) at each step after it rejoined; each
  // replica's epoch is its 4 shards of 64.
  const auto last = read_checkpoint(list_checkpoints(out).back());
  EXPECT_EQ(last.step, 300);
  EXPECT_EQ(last.state["diloco"]["replicas"], (std::vector<int>{0, 1}));
  const auto end = last.state["data_cursor"]["replicas"][1];
  EXPECT_EQ(end[0].get<int64_t>() * 256 + end[1].get<int64_t>(), epoch * 256 + index + 8 * (300 - joined))
      << end.dump() << "\n" << text;
}

TEST(ShardsTrain, ADamagedImageStopsTheRunOrWithSkipBadIsSkippedAndCounted) {
  ShardRun r;
  // Shard 3 again, its sample 00000200's PNG replaced by bytes that are not a PNG.
  const std::string bad = r.dir / "shards/train-000003.tar";
  {
    TarShardReader in(bad);
    std::vector<ShardSample> samples;
    ShardSample s;
    while (in.next(s)) samples.push_back(s);
    ASSERT_EQ(samples.size(), 64u);
    samples[8].files["png"] = "this is not a png";
    ASSERT_EQ(samples[8].key, "00000200");
    TarShardWriter out(bad);
    for (const ShardSample& x : samples) out.add(x);
    out.finish();
  }
  // 32 x 16 rows: the whole epoch (the bad sample once) and one sample of the next (never it: it is a
  // shard's ninth, and without a shuffle buffer an epoch starts with a shard's first).
  const std::string sets = " --set train.steps=32 --set data.shuffle_buffer=0";
  auto strict = test::run_ddm(r.train("strict", sets));
  EXPECT_EQ(strict.exit_code, 2) << strict.output;  // bad input: a supervisor's restart would meet it again
  EXPECT_TRUE(has(strict.output, "shard " + bad + ", sample '00000200'")) << strict.output;
  EXPECT_TRUE(has(strict.output, "not a PNG")) << strict.output;
  // The steps since the last checkpoint are kept: a checkpoint of the last step done, at the data
  // position before the bad batch.
  std::smatch at;
  ASSERT_TRUE(std::regex_search(strict.output, at, std::regex("the checkpoint of step ([0-9]+) is written: --resume goes on from it")))
      << strict.output;
  char stopped[32];
  std::snprintf(stopped, sizeof stopped, "strict/ckpt/step-%08d", std::stoi(at[1]));
  EXPECT_TRUE(fs::is_directory(r.dir / stopped)) << strict.output;
  auto lenient = test::run_ddm(r.train("lenient", sets + " --set data.skip_bad=true", /*quiet=*/false));
  ASSERT_EQ(lenient.exit_code, 0) << lenient.output;
  EXPECT_TRUE(has(lenient.output, "skipped 1 bad sample so far; the last: shard " + bad + ", sample '00000200'"))
      << lenient.output;
  const auto m = metrics(r.dir / "lenient");
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(m.back()["skipped_samples"], 1) << m.back().dump();
  const auto skipped_at = [&](const std::string& ckpt) {
    return nlohmann::json::parse(file_bytes(r.dir / (ckpt + "/state.json")))["skipped_samples"];
  };
  EXPECT_EQ(skipped_at("lenient/ckpt/step-00000032")["total"], 1);
  // The stopped run goes on past it with data.skip_bad (a key a resume may change, said), to the
  // weights of the run that skipped it from the start, bit for bit.
  auto resumed = test::run_ddm(r.train("strict", sets + " --set data.skip_bad=true", /*quiet=*/false) + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(has(resumed.output, "note: --resume: data.skip_bad changes from false to true")) << resumed.output;
  EXPECT_EQ(file_bytes(r.dir / "strict/ckpt/step-00000032/model.safetensors"),
            file_bytes(r.dir / "lenient/ckpt/step-00000032/model.safetensors"));
  // Resumed over fewer shards (one left out): the epoch goes on in another order, which is said.
  const std::string seven = r.dir / "shards/train-{000000..000006}.tar";
  auto fewer = test::run_ddm("train --config " + (r.dir / "tiny.toml") + " --set \"data.root=" + seven + "\"" + sets +
                             " --set train.steps=34 --set data.skip_bad=true --resume --out " + (r.dir / "strict"));
  ASSERT_EQ(fewer.exit_code, 0) << fewer.output;
  EXPECT_TRUE(has(fewer.output, "note: --resume: the data holds 448 samples, the run's had 512 at the checkpoint: the "
                                "rest of this epoch is drawn in an order of the new data"))
      << fewer.output;
  // The count goes on across a resume: 64 steps straight, or 32 and 32 more, skip alike (the
  // second epoch meets the bad sample again).
  const std::string more = " --set train.steps=64 --set data.shuffle_buffer=0 --set data.skip_bad=true";
  ASSERT_EQ(test::run_ddm(r.train("lenient", more) + " --resume").exit_code, 0);
  ASSERT_EQ(test::run_ddm(r.train("straight", more)).exit_code, 0);
  EXPECT_EQ(metrics(r.dir / "lenient").back()["skipped_samples"], 2);
  EXPECT_EQ(metrics(r.dir / "straight").back()["skipped_samples"], 2);
  // Two replicas: the one that meets it names it; each checkpoint holds the total of both.
  auto two = test::run_ddm("launch --timeout 300 --nproc 2 -- " +
                           r.train("two", sets + " --set data.skip_bad=true", /*quiet=*/false));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_TRUE(has(two.output, ": skipped 1 bad sample so far; the last: shard " + bad)) << two.output;
  const auto both = skipped_at("two/ckpt/step-00000032");
  EXPECT_EQ(both["total"], 1) << both.dump();
  EXPECT_EQ(both["replicas"].size(), 2u) << both.dump();
  // Two replicas without it: they stop together after the same step, with its checkpoint (the one
  // that met the sample names it, the other names that rank), exit 2 and are not restarted; resumed
  // with data.skip_bad, the run ends bit-identical to the one that skipped it from the start.
  auto strict_two = test::run_ddm("launch --timeout 300 --nproc 2 -- " + r.train("strict2", sets, /*quiet=*/false));
  EXPECT_EQ(strict_two.exit_code, 2) << strict_two.output;
  EXPECT_TRUE(has(strict_two.output, "stopped on bad input")) << strict_two.output;
  EXPECT_TRUE(has(strict_two.output, "sample '00000200'")) << strict_two.output;
  EXPECT_TRUE(has(strict_two.output, "met a sample it cannot use in its next batch")) << strict_two.output;
  ASSERT_TRUE(std::regex_search(strict_two.output, at,
                                std::regex("the checkpoint of step ([0-9]+) is written: --resume goes on from it")))
      << strict_two.output;
  std::snprintf(stopped, sizeof stopped, "strict2/ckpt/step-%08d", std::stoi(at[1]));
  EXPECT_TRUE(fs::is_directory(r.dir / stopped)) << strict_two.output;
  auto resumed_two = test::run_ddm("launch --timeout 300 --nproc 2 -- " +
                                   r.train("strict2", sets + " --set data.skip_bad=true", /*quiet=*/false) + " --resume");
  ASSERT_EQ(resumed_two.exit_code, 0) << resumed_two.output;
  EXPECT_EQ(file_bytes(r.dir / "strict2/ckpt/step-00000032/model.safetensors"),
            file_bytes(r.dir / "two/ckpt/step-00000032/model.safetensors"));
  // A pipeline of two stages, its bubbles filled: each stage reads the same rows and meets the sample;
  // they stop together after the same step with its checkpoint (no stage waits for the other's pieces).
  auto piped = test::run_ddm("launch --timeout 300 --nproc 2 -- " +
                             r.train("piped", sets + " --set parallel.pp=2 --set train.grad_accum=4", /*quiet=*/false));
  EXPECT_EQ(piped.exit_code, 2) << piped.output;
  EXPECT_TRUE(has(piped.output, "[rank 0] parallel.fill after step")) << piped.output;
  ASSERT_TRUE(std::regex_search(piped.output, at, std::regex("\\[rank 0\\] error: .*sample '00000200'.* \\(the checkpoint of "
                                                             "step ([0-9]+) is written: --resume goes on from it\\)")))
      << piped.output;
  EXPECT_TRUE(has(piped.output, "[rank 1] error: ")) << piped.output;
  std::snprintf(stopped, sizeof stopped, "piped/ckpt/step-%08d", std::stoi(at[1]));
  EXPECT_TRUE(fs::is_directory(r.dir / stopped)) << piped.output;
}

// `ddm shards write` records where its shards come from, so a model trained on shards of
// Fashion-MNIST is one to `ddm eval`; shards without that record (anyone's) are refused by name.
TEST(ShardsTrain, AModelOnShardsOfFashionMnistIsEvaluable) {
  ShardRun r;
  const auto record = nlohmann::json::parse(test::read_text(r.dir / "shards/train.shards.json"));
  EXPECT_EQ(record["origin"], "fashion-mnist");
  EXPECT_EQ(record["shards"].size(), 8u);
  // ... and the classes' names: a model trained on them and its samples' labels name them (they
  // were "class 9" once), as do shards re-sharded from them.
  ASSERT_EQ(record["class_names"].size(), 10u) << record.dump();
  EXPECT_EQ(record["class_names"][9], "Ankle boot");
  ASSERT_EQ(test::run_ddm(r.train("run", " --set train.steps=2 --set data.resolution=28")).exit_code, 0);
  const auto state = nlohmann::json::parse(test::read_text(r.dir / "run/ckpt/step-00000002/state.json"));
  EXPECT_EQ(state["class_names"], record["class_names"]);
  ASSERT_EQ(test::run_ddm("shards write --from '" + r.pattern + "' --shard-size 300 --out " + (r.dir / "re")).exit_code, 0);
  EXPECT_EQ(nlohmann::json::parse(test::read_text(r.dir / "re/train.shards.json"))["class_names"], record["class_names"]);
  auto scored = test::run_ddm("eval --ckpt " + (r.dir / "run") + " --n 200 --steps 2 --out " + (r.dir / "ok"));
  ASSERT_EQ(scored.exit_code, 0) << scored.output;
  EXPECT_TRUE(has(scored.output, "Ankle boot")) << scored.output;  // its class accuracies, by name
  const std::string raw = r.dir / "s.safetensors";
  const std::string sample = "sample --ckpt " + (r.dir / "run") + " --n 10 --steps 2 --out " + (r.dir / "s.png") +
                             " --raw " + raw;
  ASSERT_EQ(test::run_ddm(sample).exit_code, 0);
  EXPECT_EQ(load_safetensors(raw).metadata.at("data_source"), "fashion-mnist");
  fs::remove(r.dir / "shards/train.shards.json");
  ASSERT_EQ(test::run_ddm(sample).exit_code, 0);
  EXPECT_EQ(load_safetensors(raw).metadata.at("data_source"), "shards");
  test::expect_error(test::run_ddm("eval --samples " + raw + " --out " + (r.dir / "eval")), "PREFIX.shards.json");
  test::expect_error(test::run_ddm("eval --ckpt " + (r.dir / "run") + " --n 200 --out " + (r.dir / "eval")),
                     "not Fashion-MNIST");
}

// Tests keep off the user's cache (test_util.h): a ddm that a test starts keeps its shard scans in the
// build's test-cache/, the directory the test's own default_cache_dir() names, not in ~/.cache/ddm.
TEST(ShardsTrain, ARunStartedByATestCachesItsShardScanInTheBuildNotTheUsersCache) {
  ShardRun r;
  const std::string cache = default_cache_dir();
  EXPECT_EQ(cache, (fs::path(test::cache_home()) / "ddm").string());
  const std::string file = ScanCache(cache, expand_shards(r.pattern, "data.root"), "image").path();
  fs::remove(file);
  const auto run = test::run_ddm(r.train("run", " --set train.steps=1"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(fs::exists(file)) << file;
}

TEST(ShardsTrain, BadShardListsAndKeysAreClearErrors) {
  ShardRun r;
  auto missing = test::run_ddm("train --quiet --config " + (r.dir / "tiny.toml") + " --set \"data.root=" +
                               (r.dir / "shards/train-{000000..000009}.tar") + "\" --out " + (r.dir / "m"));
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_TRUE(has(missing.output, r.dir / "shards/train-000008.tar")) << missing.output;
  EXPECT_FALSE(fs::exists(r.dir / "m/config.toml"));
  auto no_res = test::run_ddm("train --quiet --config " + (r.dir / "tiny.toml") + " --set \"data.root=" + r.pattern +
                              "\" --set data.resolution=0 --out " + (r.dir / "n"));
  EXPECT_NE(no_res.exit_code, 0);
  EXPECT_TRUE(has(no_res.output, "needs data.resolution")) << no_res.output;
  auto too_few = test::run_ddm("launch --timeout 120 --nproc 2 -- train --quiet --config " + (r.dir / "tiny.toml") +
                               " --set \"data.root=" + (r.dir / "shards/train-000000.tar") + "\" --out " + (r.dir / "f"));
  EXPECT_NE(too_few.exit_code, 0);
  EXPECT_TRUE(has(too_few.output, "1 shard for 2 data-parallel replicas")) << too_few.output;
  // Re-sharding: into shards of 100 (the samples unchanged: test_shard_loader), never over its input.
  auto again = test::run_ddm("shards write --from \"" + r.pattern + "\" --shard-size 100 --out " + (r.dir / "w"));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(has(again.output, "wrote 512 samples in 6 shards")) << again.output;
  // Into a folder that holds shards of the prefix: refused (a glob would read the old beside the new);
  // --force replaces them, and never deletes an input.
  auto stale = test::run_ddm("shards write --from \"" + r.pattern + "\" --shard-size 200 --out " + (r.dir / "w"));
  EXPECT_EQ(stale.exit_code, 2) << stale.output;
  EXPECT_TRUE(has(stale.output, "holds 6 shards named train-NNNNNN.tar already")) << stale.output;
  fs::copy_file(r.dir / "w/train-000000.tar", r.dir / "w/train-val-000000.tar");  // another dataset's: kept
  auto forced = test::run_ddm("shards write --from \"" + r.pattern + "\" --shard-size 200 --force --out " + (r.dir / "w"));
  ASSERT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_EQ(expand_shards(r.dir / "w/train-[0-9]*.tar", "data.root").size(), 3u);
  EXPECT_TRUE(fs::exists(r.dir / "w/train-val-000000.tar"));
  auto over = test::run_ddm("shards write --from \"" + r.pattern + "\" --force --out " + (r.dir / "shards"));
  EXPECT_EQ(over.exit_code, 2) << over.output;
  EXPECT_TRUE(has(over.output, "an input shard of the re-sharding")) << over.output;
  EXPECT_EQ(test::run_command("tar tf " + (r.dir / "shards/train-000000.tar") + " | wc -l").output, "128\n");
  // Bad input to `shards write` exits 2 and leaves no --out: a folder that is not there, a shard that
  // is not a tar, a --prefix with a slash. The record of written shards names them as data.root.
  auto no_folder = test::run_ddm("shards write --set data.source=folder --set data.root=" + (r.dir / "nothere") +
                                 " --out " + (r.dir / "x1"));
  EXPECT_EQ(no_folder.exit_code, 2) << no_folder.output;
  EXPECT_TRUE(has(no_folder.output, "image folder not found")) << no_folder.output;
  test::write_text(r.dir / "notatar.tar", "this is not a tar");
  auto not_tar = test::run_ddm("shards write --from " + (r.dir / "notatar.tar") + " --out " + (r.dir / "x2"));
  EXPECT_EQ(not_tar.exit_code, 2) << not_tar.output;
  auto prefix = test::run_ddm("shards write --from \"" + r.pattern + "\" --prefix a/b --out " + (r.dir / "x3"));
  EXPECT_EQ(prefix.exit_code, 2) << prefix.output;
  // A source shard cut short between two members (a copy that stopped) reads as a shorter tar: it is
  // refused before anything is written. One damaged further on (a tar header's checksum) is met while
  // re-sharding: the shards written before it are removed with --out, so that nothing of a failed
  // write is read as data.
  fs::create_directories(r.dir / "cut");
  for (const std::string& in : expand_shards(r.pattern, "data.root"))
    fs::copy_file(in, r.dir / "cut" / fs::path(in).filename());
  const fs::path last = r.dir / "cut/train-000007.tar";
  const std::string whole = file_bytes(last);
  const size_t header = whole.find("ustar", whole.size() / 2) - 257;  // a member's header, half-way in
  ASSERT_EQ(header % 512, 0u);
  fs::resize_file(last, header);
  auto cut = test::run_ddm("shards write --from " + (r.dir / "cut") + " --shard-size 100 --out " + (r.dir / "x4"));
  EXPECT_EQ(cut.exit_code, 2) << cut.output;
  EXPECT_TRUE(has(cut.output, "train-000007.tar ends without a tar's end-of-archive blocks")) << cut.output;
  std::string damaged = whole;
  damaged.replace(header + 148, 8, "garbage!");  // its checksum
  test::write_text(last, damaged);
  auto bad = test::run_ddm("shards write --from " + (r.dir / "cut") + " --shard-size 100 --out " + (r.dir / "x5"));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(has(bad.output, "train-000007.tar: corrupt or truncated")) << bad.output;
  EXPECT_TRUE(has(bad.output, "(the 4 shards this write made before it are removed: nothing of it is left)")) << bad.output;
  for (const char* x : {"x1", "x2", "x3", "x4", "x5"}) EXPECT_FALSE(fs::exists(r.dir / x)) << x;
  EXPECT_EQ(expand_shards(r.dir / "w/train.shards.json", "data.root").size(), 3u);
}

// Decentralized diffusion over shards: `ddm partition --reshard` on the shards, then an expert
// trains on its cluster's own shards (and resumes); its config keeps the shards it was given. A
// partition without --reshard is a clear error.
TEST(ShardsTrain, AnExpertTrainsOnItsClustersShards) {
  ShardRun r;
  test::write_text(r.dir / "p.toml", "[data]\nsource = \"shards\"\nresolution = 24\nroot = \"" + r.pattern + "\"\n");
  auto part = test::run_ddm("partition --config " + (r.dir / "p.toml") + " --k 2 --fine 8 --reshard --shard-size 100 "
                            "--out " + (r.dir / "p"));
  ASSERT_EQ(part.exit_code, 0) << part.output;
  EXPECT_TRUE(has(part.output, "partition of 512 images into 2 clusters: sizes 256 to 256")) << part.output;
  EXPECT_TRUE(fs::exists(r.dir / "p/shards/cluster-1-000002.tar"));  // 256 samples in shards of 100
  // Each cluster's shards keep the source's record: its origin (eval's FD-fmnist) and class names.
  const auto cluster1 = expand_shards(r.dir / "p/shards/cluster-1-{000000..000002}.tar", "test");
  EXPECT_EQ(recorded_class_names(cluster1), recorded_class_names(expand_shards(r.pattern, "test")));
  EXPECT_EQ(recorded_class_names(cluster1).at(0), "T-shirt/top");
  DataConfig cluster_data;
  cluster_data.source = "shards";
  cluster_data.root = r.dir / "p/shards/cluster-1-{000000..000002}.tar";
  EXPECT_EQ(data_origin(cluster_data), "fashion-mnist");
  const std::string expert = " --partition " + (r.dir / "p") + " --expert 1 --set train.steps=12";
  auto e = test::run_ddm(r.train("e1", expert, /*quiet=*/false));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_TRUE(has(e.output, "expert: cluster 1 of 2 (256 samples in its own shards)")) << e.output;
  EXPECT_TRUE(has(test::read_text(r.dir / "e1/config.toml"), r.pattern));
  auto more = test::run_ddm(r.train("e1", " --partition " + (r.dir / "p") + " --expert 1 --set train.steps=20") +
                            " --resume");
  ASSERT_EQ(more.exit_code, 0) << more.output;
  EXPECT_TRUE(fs::exists(r.dir / "e1/ckpt/step-00000020/model.safetensors"));
  // Clusters by class (a features file: 1 for classes 5-9): each expert still takes all 10 classes.
  DataConfig dc;
  dc.limit = 512;
  SafetensorsFile f;
  f.tensors["features"] = load_dataset(dc).labels.ge(5).to(torch::kFloat32).unsqueeze(1);  // [512, 1]
  save_safetensors(r.dir / "f.safetensors", f);
  // --min-shards 3 (what `ddm islands run` asks for islands of 3 processes): the default 10000 samples
  // a shard shrink until the smaller cluster has 3 shards.
  auto by_class = test::run_ddm("partition --config " + (r.dir / "p.toml") + " --k 2 --fine 2 --unbalanced --reshard "
                                "--min-shards 3 --features file:" + (r.dir / "f.safetensors") + " --out " + (r.dir / "c"));
  ASSERT_EQ(by_class.exit_code, 0) << by_class.output;
  EXPECT_TRUE(has(by_class.output, "in at least 3 (--min-shards)")) << by_class.output;
  for (const char* k : {"0", "1"})
    EXPECT_TRUE(fs::exists(r.dir / ("c/shards/cluster-" + std::string(k) + "-000002.tar"))) << k;
  int told = 0;  // the cluster of classes 0-4 says its expert takes all 10
  for (const char* k : {"0", "1"}) {
    auto ek = test::run_ddm(r.train(std::string("c") + k, " --partition " + (r.dir / "c") + " --expert " + k +
                                                            " --set train.steps=1", /*quiet=*/false));
    ASSERT_EQ(ek.exit_code, 0) << ek.output;
    told += has(ek.output, "5 classes, streamed (the expert takes all 10 classes of the data)");
    EXPECT_TRUE(has(test::read_text(r.dir / ("c" + std::string(k) + "/config.toml")), "num_classes = 10")) << k;
  }
  EXPECT_EQ(told, 1);
  auto lists = test::run_ddm("partition --config " + (r.dir / "p.toml") + " --k 2 --fine 8 --out " + (r.dir / "q"));
  ASSERT_EQ(lists.exit_code, 0) << lists.output;
  auto no_shards = test::run_ddm(r.train("e2", " --partition " + (r.dir / "q") + " --expert 0"));
  EXPECT_NE(no_shards.exit_code, 0);
  EXPECT_TRUE(has(no_shards.output, "again with --reshard")) << no_shards.output;
  EXPECT_FALSE(fs::exists(r.dir / "e2/config.toml"));
}

// A router trains over the shards themselves (no --reshard needed), each sample's cluster taken from
// the partition by its position in shard order, with --holdout samples never drawn and its report
// made on exactly those; it resumes after a kill as it would have gone on. Then the experts and the
// router make an ensemble, and a student distils it from the same shards.
TEST(ShardsTrain, ARouterAndADistilledStudentTrainOnShards) {
  ShardRun r;
  test::write_text(r.dir / "p.toml", "[data]\nsource = \"shards\"\nresolution = 24\nroot = \"" + r.pattern + "\"\n");
  auto part = test::run_ddm("partition --config " + (r.dir / "p.toml") + " --k 2 --fine 8 --reshard --out " + (r.dir / "p"));
  ASSERT_EQ(part.exit_code, 0) << part.output;
  std::string full = test::read_text(r.dir / "tiny.toml");
  full.insert(full.find("[data]\n") + 7, "root = \"" + r.pattern + "\"\n");
  test::write_text(r.dir / "full.toml", full);
  const std::string router = "train-router --config " + (r.dir / "full.toml") + " --partition " + (r.dir / "p") +
                             " --holdout 100 --set model.patch=6 --set train.ckpt_every=5 --set train.log_every=1";
  auto whole = test::run_ddm(router + " --set train.steps=10 --out " + (r.dir / "r"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_TRUE(has(whole.output, "trains on 412 images, 100 held out at random")) << whole.output;
  const auto report = nlohmann::json::parse(test::read_text(r.dir / "r/router_eval.json"));
  EXPECT_EQ(report["images"], 100);
  EXPECT_TRUE(has(report["images_note"].get<std::string>(), "never trained on"));
  EXPECT_EQ(nlohmann::json::parse(test::read_text(r.dir / "r/router.json"))["holdout"], 100);
  // Stopped after step 5 and resumed: the bytes of the uninterrupted run.
  ASSERT_EQ(test::run_ddm(router + " --set train.steps=5 --out " + (r.dir / "r5")).exit_code, 0);
  auto rest = test::run_ddm(router + " --set train.steps=10 --resume --out " + (r.dir / "r5"));
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_EQ(file_bytes(r.dir / "r/ckpt/step-00000010/model.safetensors"),
            file_bytes(r.dir / "r5/ckpt/step-00000010/model.safetensors"));
  EXPECT_EQ(file_bytes(r.dir / "r/router_eval.json").substr(0, 400), file_bytes(r.dir / "r5/router_eval.json").substr(0, 400));
  // A partition made in memory is refused, naming what to do.
  auto mem = test::run_ddm("partition --limit 512 --k 2 --out " + (r.dir / "m"));
  ASSERT_EQ(mem.exit_code, 0) << mem.output;
  auto wrong = test::run_ddm("train-router --config " + (r.dir / "full.toml") + " --partition " + (r.dir / "m") +
                             " --out " + (r.dir / "rm"));
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_TRUE(has(wrong.output, "made on in-memory data")) << wrong.output;

  for (const char* k : {"0", "1"})
    ASSERT_EQ(test::run_ddm(r.train(std::string("e") + k, " --partition " + (r.dir / "p") + " --expert " + k +
                                                            " --set train.steps=4")).exit_code, 0);
  auto ens = test::run_ddm("ensemble --out " + (r.dir / "ens") + " --partition " + (r.dir / "p") + " --router " +
                           (r.dir / "r") + " --expert " + (r.dir / "e0") + " --expert " + (r.dir / "e1"));
  ASSERT_EQ(ens.exit_code, 0) << ens.output;
  // The exact posterior needs every training image in memory: over shards, refused saying so.
  test::expect_error(test::run_ddm("sample --ensemble " + (r.dir / "ens") + " --routing oracle --n 4 --out " +
                                   (r.dir / "o.png")),
                     "--routing oracle computes each step's exact posterior over every training image");
  auto student = test::run_ddm("distill --ensemble " + (r.dir / "ens") + " --set train.steps=4 --out " + (r.dir / "s"));
  ASSERT_EQ(student.exit_code, 0) << student.output;
  EXPECT_TRUE(has(student.output, "512 samples in 8 shards")) << student.output;
  EXPECT_TRUE(has(test::read_text(r.dir / "s/config.toml"), r.pattern));

  // ddm islands over shards: it makes its partition with --reshard, so each expert reads its own.
  write_islands(r, "full.toml", "ip", "\"train.steps=3\"", "\"train.steps=3\", \"model.patch=6\"");
  auto isl = test::run_ddm("islands run " + (r.dir / "isl.toml"));
  ASSERT_EQ(isl.exit_code, 0) << isl.output;
  EXPECT_TRUE(fs::exists(r.dir / "ip/shards/cluster-1-000000.tar"));
  EXPECT_TRUE(has(test::read_text(r.dir / "isl/logs/expert1.log"), "samples in its own shards"));
  EXPECT_TRUE(fs::exists(r.dir / "isl/ensemble.json"));
}

// Latent diffusion over shards: an autoencoder trains on them and reports on their first images
// (the latent statistics a latent model needs), then a latent model trains on the shards through it.
TEST(ShardsTrain, AnAutoencoderAndALatentModelTrainOnShards) {
  ShardRun r;
  const std::string data = train_autoencoder(r, 32, 100);
  ASSERT_TRUE(fs::exists(r.dir / "ae/autoencoder.json"));
  const auto j = nlohmann::json::parse(test::read_text(r.dir / "ae/autoencoder.json"));
  EXPECT_EQ(j["latent_shape"], (std::vector<int64_t>{4, 6, 6}));
  EXPECT_GT(j["latent_scale"].get<double>(), 0);
  test::write_text(r.dir / "latent.toml", data + "[model]\npreset = \"latent-dit\"\nwidth = 32\ndepth = 2\nheads = 2\n"
                                                 "[train]\nsteps = 3\nbatch_size = 16\nthreads = 1\nlog_every = 1\n");
  auto latent = test::run_ddm("train --quiet --config " + (r.dir / "latent.toml") + " --set model.latent=" +
                              (r.dir / "ae") + " --out " + (r.dir / "latent"));
  ASSERT_EQ(latent.exit_code, 0) << latent.output;
  EXPECT_EQ(metrics(r.dir / "latent").size(), 3u);

  // `ddm encode`: every sample's posterior once, in shard order, in shards of the source's sizes,
  // labels kept, the encoder's own output for the same images (up to float32 rounding across processes).
  const std::string encode = "encode --threads 1 --ae " + (r.dir / "ae") + " --config " + (r.dir / "ae.toml");
  auto enc = test::run_ddm(encode + " --out " + (r.dir / "lat"));
  ASSERT_EQ(enc.exit_code, 0) << enc.output;
  EXPECT_TRUE(has(enc.output, "wrote the latents of 512 samples in 8 shards")) << enc.output;
  const LatentShardsInfo info = read_latent_shards_info(r.dir / "lat");
  EXPECT_EQ(info.samples, 512);
  EXPECT_EQ(info.shards, 8);
  EXPECT_EQ(info.latent_channels, 4);
  EXPECT_EQ(info.latent_size, 6);
  EXPECT_EQ(info.image_size, 24);
  EXPECT_EQ(info.num_classes, 10);
  EXPECT_EQ(info.autoencoder_sha256, j["weights_sha256"].get<std::string>());
  EXPECT_EQ(info.latent_scale, j["latent_scale"].get<double>());
  EXPECT_FALSE(fs::exists(r.dir / "lat.partial"));
  const auto latent_shards = expand_shards(info.pattern, "pattern");
  const auto source_shards = expand_shards(r.pattern, "pattern");
  ASSERT_EQ(latent_shards.size(), 8u);
  std::vector<torch::Tensor> means, logvars;
  int64_t i = 0;
  for (size_t s = 0; s < latent_shards.size(); ++s) {
    TarShardReader in(latent_shards[s]), src(source_shards[s]);
    ShardSample smp, orig;
    int64_t in_shard = 0;
    while (in.next(smp)) {
      ASSERT_TRUE(src.next(orig));
      EXPECT_EQ(smp.key, numbered_key(i)) << latent_shards[s];
      EXPECT_EQ(std::stoll(smp.files.at("cls")), std::stoll(orig.files.at("cls"))) << smp.key;
      const auto t = parse_safetensors(smp.files.at("safetensors"), smp.key).tensors;
      ASSERT_EQ(t.at("mean").sizes(), (std::vector<int64_t>{4, 6, 6}));
      ASSERT_EQ(t.at("logvar").sizes(), (std::vector<int64_t>{4, 6, 6}));
      means.push_back(t.at("mean"));
      logvars.push_back(t.at("logvar"));
      ++i, ++in_shard;
    }
    EXPECT_EQ(in_shard, 64) << latent_shards[s];
  }
  ASSERT_EQ(i, 512);
  {
    const RunConfig cfg = load_config(r.dir / "ae.toml");
    const Dataset opened = open_shards(cfg.data, 1, /*quiet=*/true);
    ModelConfig m;
    m.latent = r.dir / "ae";
    resolve_latent(m, opened);
    const auto ls = LatentSpace::load(m);
    const torch::Tensor mean = torch::stack(means), logvar = torch::stack(logvars);  // [512, 4, 6, 6]
    for_each_in_order(opened, cfg.data, 512, 1, [&](const torch::Tensor& x, const torch::Tensor&, int64_t first) {
      torch::NoGradGuard no_grad;
      const Posterior q = ls->posterior(x);  // [b, 4, 6, 6] each
      EXPECT_TRUE(torch::allclose(mean.narrow(0, first, x.size(0)), q.mean, 1e-4, 1e-5)) << first;
      EXPECT_TRUE(torch::allclose(logvar.narrow(0, first, x.size(0)), q.logvar, 1e-4, 1e-5)) << first;
    });
  }
  // Bad input loses nothing: an existing --out, flips, an autoencoder of other images.
  test::expect_error(test::run_ddm(encode + " --out " + (r.dir / "lat")), "already exists");
  test::expect_error(test::run_ddm(encode + " --set data.hflip=true --out " + (r.dir / "lat2")), "data.hflip");
  test::expect_error(test::run_ddm(encode + " --set data.resolution=32 --out " + (r.dir / "lat2")),
               "trained on 1x24x24 images");
  test::expect_error(test::run_ddm("encode --ae " + (r.dir / "nothing") + " --out " + (r.dir / "lat2")),
               "no such directory");
  EXPECT_FALSE(fs::exists(r.dir / "lat2"));
  EXPECT_EQ(read_latent_shards_info(r.dir / "lat").samples, 512);
}


// data.source = "latents": a latent model trains on the shards `ddm encode` wrote as it trains on
// the images' shards through the frozen encoder: the same samples in the same order and the same
// keyed posterior noise, so the same losses up to the encoder's float32 rounding over other batches.
// A run on them resumes from a checkpoint to the bytes of an uninterrupted one (across an epoch),
// and each bad input is a clear error.
TEST(ShardsTrain, ALatentModelTrainsOnEncodedShardsAsOnFreshEncodes) {
  ShardRun r;
  const std::string data = train_autoencoder(r, 16, 64);
  ASSERT_TRUE(fs::exists(r.dir / "ae/autoencoder.json"));
  auto enc = test::run_ddm("encode --threads 1 --ae " + (r.dir / "ae") + " --config " + (r.dir / "ae.toml") +
                           " --out " + (r.dir / "lat"));
  ASSERT_EQ(enc.exit_code, 0) << enc.output;
  EXPECT_TRUE(has(enc.output, "--set data.source=latents --set data.root=" + (r.dir / "lat"))) << enc.output;
  test::write_text(r.dir / "latent.toml", data + "[model]\npreset = \"latent-dit\"\nwidth = 32\ndepth = 2\nheads = 2\n"
                                                 "[train]\nsteps = 40\nbatch_size = 16\nthreads = 1\nlog_every = 1\n"
                                                 "ckpt_every = 20\n");
  const std::string train = "train --quiet --config " + (r.dir / "latent.toml") + " --set model.latent=" + (r.dir / "ae");
  const std::string latents = " --set data.source=latents --set data.root=" + (r.dir / "lat");
  auto fresh = test::run_ddm(train + " --set train.steps=12 --out " + (r.dir / "fresh"));
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  auto ref = test::run_ddm(train + latents + " --out " + (r.dir / "ref"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto mf = metrics(r.dir / "fresh"), ml = metrics(r.dir / "ref");
  ASSERT_EQ(mf.size(), 12u);
  ASSERT_EQ(ml.size(), 40u);
  for (size_t s = 0; s < mf.size(); ++s) {
    const double a = mf[s]["loss"].get<double>(), b = ml[s]["loss"].get<double>();
    EXPECT_NEAR(a, b, 1e-4 * std::abs(a)) << "step " << s + 1;
  }
  EXPECT_EQ(ml.back()["epoch"], 1);  // 640 samples drawn from 512
  const RunConfig resolved = load_config(r.dir / "ref/config.toml");
  EXPECT_EQ(resolved.data.source, "latents");
  EXPECT_EQ(resolved.model.in_channels, 4);
  EXPECT_EQ(resolved.model.image_size, 6);
  EXPECT_EQ(resolved.model.num_classes, 10);
  EXPECT_EQ(resolved.model.latent_sha256, read_latent_shards_info(r.dir / "lat").autoencoder_sha256);

  // Resumed from its step-20 checkpoint, a run ends with the uninterrupted run's bytes.
  auto half = test::run_ddm(train + latents + " --set train.steps=20 --out " + (r.dir / "resumed"));
  ASSERT_EQ(half.exit_code, 0) << half.output;
  auto rest = test::run_ddm(train + latents + " --resume --out " + (r.dir / "resumed"));
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"}) {
    const std::string want = file_bytes(r.dir / ("ref/ckpt/step-00000040/" + std::string(file)));
    ASSERT_FALSE(want.empty()) << file;
    EXPECT_TRUE(want == file_bytes(r.dir / ("resumed/ckpt/step-00000040/" + std::string(file)))) << file << " differs";
  }

  // Bad input: each a clear error, naming the key or the shard and the key.
  const std::string bad = train + latents + " --set train.steps=2";
  test::expect_error(test::run_ddm("train --quiet --config " + (r.dir / "latent.toml") + latents + " --out " +
                                   (r.dir / "x")),
                     "set model.latent to the autoencoder that encoded them");
  test::expect_error(test::run_ddm(bad + " --set data.hflip=true --out " + (r.dir / "x")), "data.hflip");
  test::expect_error(test::run_ddm(bad + " --set data.resolution=32 --out " + (r.dir / "x")),
                     "holds the latents of 1x24x24 images");
  test::expect_error(test::run_ddm(train + " --set data.source=latents --set data.root=" + (r.dir / "ae") +
                                   " --out " + (r.dir / "x")),
                     "is not a `ddm encode` output");
  test::expect_error(test::run_ddm("encode --ae " + (r.dir / "ae") + latents + " --out " + (r.dir / "x")),
                     "the data is a `ddm encode` directory already; give the config of the data it was encoded from");
  // Another autoencoder's latents (encode.json's pin changed), a missing shard, a damaged posterior.
  const auto copy_latents = [&](const std::string& name) {
    fs::copy(r.dir / "lat", r.dir / name, fs::copy_options::recursive);
    return " --set data.source=latents --set data.root=" + (r.dir / name);
  };
  const std::string other = copy_latents("other");
  auto j = nlohmann::json::parse(test::read_text(r.dir / "other/encode.json"));
  j["autoencoder_sha256"] = std::string(64, '0');
  test::write_text(r.dir / "other/encode.json", j.dump());
  test::expect_error(test::run_ddm(train + other + " --set train.steps=2 --out " + (r.dir / "x")),
                     "is not the autoencoder that encoded the latent shards");
  const std::string missing = copy_latents("missing");
  fs::remove(r.dir / "missing/latents-000005.tar");
  test::expect_error(test::run_ddm(train + missing + " --set train.steps=2 --out " + (r.dir / "x")),
                     "latents-000005.tar does not exist");
  const std::string damaged = copy_latents("damaged");
  {
    const std::string shard = r.dir / "damaged/latents-000000.tar";
    std::vector<ShardSample> samples;
    TarShardReader in(shard);
    for (ShardSample s; in.next(s);) samples.push_back(s);
    samples[7].files["safetensors"] = "not a safetensors file";
    TarShardWriter out(shard);
    for (const ShardSample& s : samples) out.add(s);
    out.finish();
  }
  // (8 batches of 64 draw the whole epoch, so sample 7 of shard 0 is read whatever the shard order.)
  const std::string all = " --set data.shuffle_buffer=0 --set train.batch_size=64";
  auto broken = test::run_ddm(train + damaged + all + " --set train.steps=8 --out " + (r.dir / "x"));
  test::expect_error(broken, "latents-000000.tar, sample '00000007'");
  auto skipped = test::run_ddm(train + damaged + all + " --set train.steps=8 --set data.skip_bad=true --out " +
                               (r.dir / "skip"));
  ASSERT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_EQ(metrics(r.dir / "skip").back()["skipped_samples"], 1);
}

// Decentralized latent diffusion on latent shards: `ddm partition` clusters the shards' own latents
// (the clusters latent:AE gives on the images they were encoded from) and with --reshard writes each
// cluster's latents as a `ddm encode` directory of its own; an expert trains on it with the losses
// of the expert of the images' shards; a router (holding samples out) and a distilled student train
// over all the latent shards; the ensemble samples images; and the bad pairings are named.
TEST(ShardsTrain, LatentExpertsARouterAndAStudentTrainOnLatentShards) {
  ShardRun r;
  const std::string data = train_autoencoder(r, 16, 64);
  auto enc = test::run_ddm("encode --threads 1 --ae " + (r.dir / "ae") + " --config " + (r.dir / "ae.toml") +
                           " --out " + (r.dir / "lat"));
  ASSERT_EQ(enc.exit_code, 0) << enc.output;
  const std::string model = "[model]\npreset = \"latent-dit\"\nwidth = 32\ndepth = 2\nheads = 2\nlatent = \"" +
                            (r.dir / "ae") + "\"\n[train]\nsteps = 12\nbatch_size = 16\nthreads = 1\nlog_every = 1\n";
  test::write_text(r.dir / "img.toml", data + model);
  test::write_text(r.dir / "lat.toml", "[data]\nsource = \"latents\"\nroot = \"" + (r.dir / "lat") + "\"\n" + model);
  const std::string k2 = " --k 2 --fine 8 --threads 1 --reshard --shard-size 100 --out ";
  auto lp = test::run_ddm("partition --config " + (r.dir / "lat.toml") + k2 + (r.dir / "lp"));
  ASSERT_EQ(lp.exit_code, 0) << lp.output;
  EXPECT_TRUE(has(lp.output, "latents of " + (r.dir / "ae"))) << lp.output;
  EXPECT_TRUE(has(lp.output, "each cluster's latents as a `ddm encode` directory")) << lp.output;
  EXPECT_TRUE(has(lp.output, " latents into 2 clusters: sizes") && !has(lp.output, " images into ")) << lp.output;
  auto ip = test::run_ddm("partition --config " + (r.dir / "img.toml") + " --features latent:" + (r.dir / "ae") + k2 +
                          (r.dir / "ip"));
  ASSERT_EQ(ip.exit_code, 0) << ip.output;
  EXPECT_TRUE(has(ip.output, " images into 2 clusters: sizes")) << ip.output;
  const Partition on_latents = load_partition(r.dir / "lp"), on_images = load_partition(r.dir / "ip");
  EXPECT_TRUE(on_latents.labels.equal(on_images.labels));
  const int64_t size1 = on_latents.sizes[1].item<int64_t>();
  const LatentShardsInfo own = read_latent_shards_info(r.dir / "lp/shards/cluster-1");
  EXPECT_EQ(own.samples, size1);
  EXPECT_EQ(own.shards, (size1 + 99) / 100);
  EXPECT_EQ(own.autoencoder_sha256, read_latent_shards_info(r.dir / "lat").autoencoder_sha256);
  EXPECT_EQ(own.origin, "fashion-mnist");  // from the image shards' record, through encode.json
  EXPECT_TRUE(fs::exists(r.dir / "lp/clusters.png"));

  // Expert 1 on its cluster's latents: the losses of expert 1 on its cluster's image shards.
  const std::string latent = "train --quiet --config " + (r.dir / "lat.toml");
  auto e1 = test::run_ddm(latent + " --partition " + (r.dir / "lp") + " --expert 1 --out " + (r.dir / "e1"));
  ASSERT_EQ(e1.exit_code, 0) << e1.output;
  auto i1 = test::run_ddm("train --quiet --config " + (r.dir / "img.toml") + " --partition " + (r.dir / "ip") +
                          " --expert 1 --out " + (r.dir / "i1"));
  ASSERT_EQ(i1.exit_code, 0) << i1.output;
  const auto me = metrics(r.dir / "e1"), mi = metrics(r.dir / "i1");
  ASSERT_EQ(me.size(), mi.size());
  for (size_t s = 0; s < me.size(); ++s) {
    const double a = mi[s]["loss"].get<double>(), b = me[s]["loss"].get<double>();
    EXPECT_NEAR(a, b, 1e-4 * std::abs(a)) << "step " << s + 1;
  }
  EXPECT_EQ(load_config(r.dir / "e1/config.toml").data.root, r.dir / "lat");  // as written, not the cluster's
  ASSERT_EQ(test::run_ddm(latent + " --partition " + (r.dir / "lp") + " --expert 0 --set train.steps=4 --out " +
                          (r.dir / "e0")).exit_code, 0);

  // A router over all the latent shards, 100 samples held out and reported on.
  auto router = test::run_ddm("train-router --quiet --config " + (r.dir / "lat.toml") + " --partition " + (r.dir / "lp") +
                              " --holdout 100 --set train.steps=4 --out " + (r.dir / "r"));
  ASSERT_EQ(router.exit_code, 0) << router.output;
  EXPECT_EQ(nlohmann::json::parse(test::read_text(r.dir / "r/router_eval.json"))["images"], 100);
  auto ens = test::run_ddm("ensemble --out " + (r.dir / "ens") + " --partition " + (r.dir / "lp") + " --router " +
                           (r.dir / "r") + " --expert " + (r.dir / "e0") + " --expert " + (r.dir / "e1"));
  ASSERT_EQ(ens.exit_code, 0) << ens.output;
  auto grid = test::run_ddm("sample --ensemble " + (r.dir / "ens") + " --n 10 --steps 4 --out " + (r.dir / "g.png"));
  ASSERT_EQ(grid.exit_code, 0) << grid.output;
  EXPECT_TRUE(fs::exists(r.dir / "g.png"));
  auto student = test::run_ddm("distill --ensemble " + (r.dir / "ens") + " --set train.steps=3 --out " + (r.dir / "s"));
  ASSERT_EQ(student.exit_code, 0) << student.output;
  EXPECT_TRUE(has(student.output, "latent shards " + (r.dir / "lat"))) << student.output;
  // ddm islands over latent shards: its partition (of the latents, with --reshard) and every island.
  write_islands(r, "lat.toml", "isp", "\"train.steps=2\"", "\"train.steps=2\"");
  auto isl = test::run_ddm("islands run " + (r.dir / "isl.toml"));
  ASSERT_EQ(isl.exit_code, 0) << isl.output;
  EXPECT_TRUE(fs::exists(r.dir / "isp/shards/cluster-1/encode.json"));
  EXPECT_TRUE(has(test::read_text(r.dir / "isl/logs/expert1.log"), "latent shards " + (r.dir / "isp/shards/cluster-1")));
  EXPECT_TRUE(fs::exists(r.dir / "isl/ensemble.json"));

  // Bad pairings, each named: a partition of the images for latent shards (and the reverse), one
  // without --reshard, pixel features of latents.
  test::expect_error(test::run_ddm(latent + " --partition " + (r.dir / "ip") + " --expert 0 --out " + (r.dir / "x")),
                     "was made on image shards");
  test::expect_error(test::run_ddm("train --quiet --config " + (r.dir / "img.toml") + " --partition " + (r.dir / "lp") +
                                   " --expert 0 --out " + (r.dir / "x")),
                     "was made on latent shards");
  ASSERT_EQ(test::run_ddm("partition --config " + (r.dir / "lat.toml") + " --k 2 --fine 8 --out " + (r.dir / "nr"))
                .exit_code, 0);
  test::expect_error(test::run_ddm(latent + " --partition " + (r.dir / "nr") + " --expert 0 --out " + (r.dir / "x")),
                     "again with --reshard");
  test::expect_error(test::run_ddm("partition --config " + (r.dir / "lat.toml") + " --k 2 --features pixels --out " +
                                   (r.dir / "x")),
                     "hold no images");
  EXPECT_FALSE(fs::exists(r.dir / "x"));
}
