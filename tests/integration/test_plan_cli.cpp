// `ddm plan` through the binary: profiling a small config, the plan table, the timeline PNG and the
// reusable profile file; planning from that file for another machine; and each bad input's message.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;
using test::expect_error;

namespace {
const char* kTiny =
    "[data]\nlimit = 64\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
    "[train]\nsteps = 3\nbatch_size = 8\nthreads = 1\n";
}  // namespace

TEST(PlanCli, ProfilesPlansAndDraws) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  const std::string base = "plan --config " + (dir / "tiny.toml") + " --rows 1 2 --repeats 1 ";
  auto r = test::run_ddm(base + "--devices 2 --save-profile " + (dir / "p.json") + " --timeline " + (dir / "t.png") +
                         " --json " + (dir / "plans.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("best:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data parallelism (2 devices"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("best pipeline, frozen work filled (2 "), std::string::npos) << r.output;  // 2 stages, or 2 ranks (V)
  EXPECT_EQ(test::read_text(dir / "t.png").substr(1, 3), "PNG");
  const auto prof = nlohmann::json::parse(test::read_text(dir / "p.json"));
  EXPECT_EQ(prof["units"].front()["name"], "in");
  EXPECT_EQ(prof["units"].back()["name"], "out");
  EXPECT_EQ(prof["units"].front()["samples"].size(), 2u);
  const auto plans = nlohmann::json::parse(test::read_text(dir / "plans.json"));
  ASSERT_GE(plans.size(), 2u);
  EXPECT_LE(plans[0]["filled_ms"].get<double>(), plans[1]["filled_ms"].get<double>());
  // The saved profile plans another machine without measuring again.
  r = test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 64 --devices 4 --stages 4 --schedule zb-h1 --speed 10");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("4 stages x 1, zb-h1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("profiling"), std::string::npos) << r.output;
  // V-shaped placement: 4 stages on 2 ranks, with the flags that train it (3 cuts).
  r = test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 64 --devices 2 --stages 2 --micro 8 --schedule 1f1b-v");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("best: 2 ranks x 1 replica, 1f1b-v"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" (r0) | "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" (r1) | "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train it: --set parallel.pp=2 parallel.schedule=1f1b-v train.grad_accum=8 parallel.cuts=["),
            std::string::npos)
      << r.output;
  // Data parallelism in 4 micro-batches: the flags that train it name them (train.grad_accum).
  r = test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 64 --devices 2 --stages 1 --micro 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train.grad_accum=4 (2 processes)"), std::string::npos) << r.output;
  // The table's one-stage names are --schedule's too: plain data parallelism in one micro-batch needs no flag.
  r = test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 64 --devices 2 --stages 1 --micro 1 --schedule data-parallel");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("best: 1 stage x 2 replicas, data-parallel, 1 micro-batch of 32 rows"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train it: 2 processes, no --set needed"), std::string::npos) << r.output;

  // Bad input.
  expect_error(test::run_ddm(base + "--profile " + (dir / "p.json")), "give --config (profile now) or --profile");
  expect_error(test::run_ddm("plan --profile " + (dir / "p.json")), "give the global batch with --batch");
  test::write_text(dir / "bad.json", "{\"format\": ");
  expect_error(test::run_ddm("plan --profile " + (dir / "bad.json") + " --batch 8"), "bad.json is not a JSON pipeline profile");
  expect_error(test::run_ddm("plan --profile " + (dir / "missing.json") + " --batch 8"), "missing.json");
  expect_error(test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 8 --devices 4 --stages 3"),
               "3 stages does not divide 4 devices");
  expect_error(test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 8 --devices 2 --stages 2 --micro 3"),
               "micro-batch count 3 does not divide a replica's batch of 8");
  expect_error(test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 8 --devices 2 --stages 2 --memory 0.000001"),
               "the smallest limit that works is");
  const auto interleaved = test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 8 --schedule interleaved");
  expect_error(interleaved, "--schedule interleaved: not a schedule; use gpipe, 1f1b, zb-h1, 1f1b-v, zb-v, or for one "
                            "stage data-parallel or dp-sharded");
  EXPECT_EQ(interleaved.exit_code, 2) << interleaved.output;
  expect_error(test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 8 --devices 64 --stages 64"),
               "needs at least 64 units");
  expect_error(test::run_ddm("plan --profile " + (dir / "p.json") + " --batch 8 --timeline " + (dir / "t.jpg")), "t.jpg");
  expect_error(test::run_ddm("plan --config " + (dir / "tiny.toml") + " --set model.preset=ae-f4 --rows 1"),
               "cannot be split into pipeline stages");
  expect_error(test::run_ddm("plan --config " + (dir / "tiny.toml") + " --device gpu"), "--device");
  if (!torch::cuda::is_available())
    expect_error(test::run_ddm("plan --config " + (dir / "tiny.toml") + " --device cuda --rows 1"),
                 "--device = cuda, but this machine has no CUDA GPU");
}

// A pipelined run (2 stages under `ddm launch`) leaves its measured step, which `ddm plan --measured`
// simulates with the run's split, schedule and micro-batches and draws beside the measurement; a
// filled run (parallel.fill, the default) also beside the plan it made from its own measurements.
TEST(PlanCli, ComparesAMeasuredPipelineWithTheSimulator) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  const std::string train = "launch --timeout 300 --nproc 2 -- train --quiet --config " + (dir / "tiny.toml") +
                            " --set parallel.pp=2 parallel.cuts=[3] train.grad_accum=4 train.steps=6 --out ";
  auto r = test::run_ddm(train + (dir / "pp"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto tl = nlohmann::json::parse(test::read_text(dir / "pp/pipeline-timeline.json"));
  ASSERT_EQ(tl["ranks"].size(), 2u);
  EXPECT_EQ(tl["first_units"], nlohmann::json({0, 3, tl["units"].size()}));
  // Whether the plan the run made from its own timings fills a bubble depends on this machine's
  // speed (tests/unit/pipeline/test_pipeline_train.cpp runs fixed plans): what follows holds either way.
  const bool used = tl["fill"]["used"].get<bool>();
  EXPECT_EQ(tl["ranks"][1]["step"], used ? 5 : 6);  // with a plan, the last step that prepared rows of a next one
  EXPECT_EQ(tl["ranks"][1]["filled"].get<bool>(), used);
  int backbone = 0, pieces = 0;
  for (const auto& r : tl["ranks"])
    for (const auto& e : r["events"]) (e[0] == "T" ? pieces : backbone) += 1;
  EXPECT_EQ(backbone, 16);  // F and B of 4 micro-batches on each stage
  EXPECT_EQ(pieces > 0, used);
  r = test::run_ddm("plan --measured " + (dir / "pp") + " --repeats 1 --timeline " + (dir / "m.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(used ? "predicted from the profile (frozen work filled into the bubbles, as the run)"
                               : "predicted from the profile (frozen work serial, as the run)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("planned in the run from the costs it measured") != std::string::npos, used) << r.output;
  EXPECT_NE(r.output.find("train it: --set parallel.pp=2 parallel.schedule=1f1b train.grad_accum=4 parallel.cuts=[3]"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(test::read_text(dir / "m.png").substr(1, 3), "PNG");
  // Unfilled: against the serial prediction alone.
  r = test::run_ddm(train + (dir / "serial") + " --set parallel.fill=false");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_ddm("plan --measured " + (dir / "serial") + " --repeats 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("predicted from the profile (frozen work serial, as the run)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("planned in the run"), std::string::npos) << r.output;
  expect_error(test::run_ddm("plan --measured " + (dir / "nothing")), "pipeline-timeline.json does not exist");
  // A saved profile compared with the run must be of its model, threads and machine.
  const std::string save = "plan --config " + (dir / "tiny.toml") + " --rows 2 --repeats 1 --save-profile ";
  ASSERT_EQ(test::run_ddm(save + (dir / "same.json")).exit_code, 0);
  r = test::run_ddm("plan --measured " + (dir / "serial") + " --profile " + (dir / "same.json"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(test::run_ddm(save + (dir / "other.json") + " --set model.channel_mult=[1,2,2]").exit_code, 0);
  expect_error(test::run_ddm("plan --measured " + (dir / "serial") + " --profile " + (dir / "other.json")),
               "other.json is of another model");
  ASSERT_EQ(test::run_ddm(save + (dir / "threads.json") + " --set train.threads=2").exit_code, 0);
  expect_error(test::run_ddm("plan --measured " + (dir / "serial") + " --profile " + (dir / "threads.json")),
               "threads.json was taken with 2 thread(s), the run");
}

// With data-parallel replicas (parallel.dp = 2: two pipelines of 2 stages, 4 processes) each pipeline
// runs its share of the global batch: the timeline records those micro-batches (each replica's 4 rows
// in 2 of 2), and `ddm plan --measured` profiles and simulates them, with the run's replicas, not
// micro-batches of the global batch's rows (8 / 2).
TEST(PlanCli, SimulatesTheMicroBatchesEachReplicaRan) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);  // batch 8, 3 steps
  auto r = test::run_ddm("launch --timeout 300 --nproc 4 -- train --quiet --config " + (dir / "tiny.toml") +
                         " --set parallel.pp=2 parallel.dp=2 parallel.cuts=[3] train.grad_accum=2 parallel.fill=false --out " +
                         (dir / "hybrid"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto tl = nlohmann::json::parse(test::read_text(dir / "hybrid/pipeline-timeline.json"));
  EXPECT_EQ(tl["stages"], 2);
  EXPECT_EQ(tl["replicas"], 2);
  EXPECT_EQ(tl["micro"], 2);
  EXPECT_EQ(tl["rows"], 2);
  r = test::run_ddm("plan --measured " + (dir / "hybrid") + " --repeats 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("at micro-batches of 2 rows"), std::string::npos) << r.output;  // the profile's
  EXPECT_NE(r.output.find("batch     8 (global)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("best: 2 stages x 2 replicas, 1f1b, 2 micro-batches of 2 rows"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("parallel.dp=2 (4 processes)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("predicted from the profile (frozen work serial, as the run)"), std::string::npos) << r.output;
}
