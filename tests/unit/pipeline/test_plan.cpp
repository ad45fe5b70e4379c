// Tests of profiles (pipeline/profile.h: files, interpolation) and the planner's search and its errors (pipeline/plan.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "pipeline/calibrate.h"
#include "pipeline/fill.h"
#include "pipeline/partition.h"
#include "pipeline/plan.h"
#include "pipeline/prepare.h"
#include "pipeline/profile.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"
#include "pipeline/timeline.h"
#include "test_util.h"
#include "unit/pipeline/pipe_test_util.h"

using namespace ddm;
using namespace ddm::test;

TEST(PipeProfile, RoundTripAndBadFiles) {
  ddm::test::TempDir dir;
  PipeProfile p = synthetic_profile(3, 2.5);
  p.self_cond = true;
  p.units[0].skips = {{2, 100}};  // unit 0 makes a skip of 100 bytes a row, unit 2 reads it
  write_profile(p, dir / "p.json");
  const PipeProfile q = read_profile(dir / "p.json");
  EXPECT_EQ(q.model, p.model);
  EXPECT_TRUE(q.self_cond);
  ASSERT_EQ(q.units.size(), 3u);
  EXPECT_EQ(q.units[1].samples[1].rows, 16);
  EXPECT_DOUBLE_EQ(q.units[1].samples[1].activation_bytes, 1.6e5);
  EXPECT_DOUBLE_EQ(q.tasks[0].cost[1].second, 5);
  EXPECT_DOUBLE_EQ(q.tasks[0].output_bytes_per_row, 4096);
  // Interpolation: 12 rows is half-way; 4 rows proportional to 8; 32 proportional to 16.
  EXPECT_DOUBLE_EQ(q.units_at(12)[0].forward, 1.5);
  EXPECT_DOUBLE_EQ(q.units_at(4)[0].forward, 0.5);
  EXPECT_DOUBLE_EQ(q.units_at(32, 2)[0].input_grad, 2);  // at twice the speed
  EXPECT_DOUBLE_EQ(q.units_at(8)[0].state_bytes, 20 * 1000);
  ASSERT_EQ(q.units_at(8)[0].skips.size(), 1u);
  EXPECT_EQ(q.units_at(8)[0].skips[0].read, 2);
  EXPECT_DOUBLE_EQ(q.units_at(8)[0].skips[0].bytes, 800);
  EXPECT_TRUE(q.units[1].skips.empty());
  EXPECT_DOUBLE_EQ(q.units_at(8)[0].weight_pass, 8 * 0.25);
  std::string skips = ddm::test::read_text(dir / "p.json");
  skips.replace(skips.find("\"read_by\": 2"), 12, "\"read_by\": 0");
  ddm::test::write_text(dir / "skip.json", skips);
  const std::string k = error_message([&] { read_profile(dir / "skip.json"); });
  EXPECT_NE(k.find("unit 'u0': a skip's read_by must be a later unit's index"), std::string::npos) << k;
  // A non-integer, or one out of range, where an integer belongs (3e81 as a count of rows was
  // undefined behaviour in the conversion, found by the fuzzer).
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"read_by\": 2", "\"read_by\": 3e81"}, {"\"read_by\": 2", "\"read_by\": 4294967298"},
           {"\"rows\": 8", "\"rows\": 8.5"}}) {
    std::string t = ddm::test::read_text(dir / "p.json");
    ASSERT_NE(t.find(from), std::string::npos) << from;
    t.replace(t.find(from), from.size(), to);
    ddm::test::write_text(dir / "int.json", t);
    const std::string m = error_message([&] { read_profile(dir / "int.json"); });
    EXPECT_NE(m.find("is not an integer in ["), std::string::npos) << to << ": " << m;
  }
  ddm::test::write_text(dir / "bad.json", "{\"format\": \"ddm pipeline profile 1\", \"model\": 3");
  EXPECT_NE(error_message([&] { read_profile(dir / "bad.json"); }).find("bad.json is not a JSON pipeline profile"), std::string::npos);
  std::string text = ddm::test::read_text(dir / "p.json");
  text.replace(text.find("\"forward_ms\""), 12, "\"forwards\"");
  ddm::test::write_text(dir / "key.json", text);
  const std::string e = error_message([&] { read_profile(dir / "key.json"); });
  EXPECT_NE(e.find("key \"units.u0\" is missing or of the wrong type"), std::string::npos) << e;
  ddm::test::write_text(dir / "other.json", "{\"format\": \"something else\"}");
  EXPECT_NE(error_message([&] { read_profile(dir / "other.json"); }).find("not a ddm pipeline profile"), std::string::npos);
}

TEST(PipePlan, SearchesSplitsSchedulesAndFilling) {
  const PipeProfile p = synthetic_profile(8, 6.0);  // frozen work: 6 ms per 8 rows against 24 ms of backbone
  PipeMachine m;
  m.devices = 2;
  PipePlanOptions o;
  o.batch = 64;
  const std::vector<PipePlan> plans = plan_pipeline(p, m, o);
  bool saw_dp = false, saw_pipe = false;
  for (size_t i = 0; i < plans.size(); ++i) {
    const PipePlan& x = plans[i];
    EXPECT_EQ(x.stages * x.replicas, 2);
    EXPECT_EQ(x.rows * x.micro * x.replicas, 64);
    EXPECT_LE(x.filled_iteration(), x.serial_iteration() + 1e-9);
    if (i) {
      EXPECT_GE(x.filled_iteration(), plans[i - 1].filled_iteration());
    }
    saw_dp = saw_dp || (x.stages == 1 && x.schedule == "data-parallel");
    saw_pipe = saw_pipe || x.stages == 2;
    if (x.stages == 2 && is_v_schedule(x.schedule)) {
      EXPECT_EQ(x.cuts_text(), "u0..u1 (r0) | u2..u3 (r1) | u4..u5 (r1) | u6..u7 (r0)");  // ties broken to even stages
    } else if (x.stages == 2) {
      EXPECT_EQ(x.cuts_text(), "u0..u3 | u4..u7");  // equal units split evenly
    }
  }
  EXPECT_TRUE(saw_dp && saw_pipe);
  // V-shaped: 4 stages on 2 ranks, nothing sent between rank 1's two stages, one optimizer per rank.
  o.stages = {2}, o.micro = {8}, o.schedules = {"zb-v"};
  const PipePlan v = plan_pipeline(p, m, o).front();
  EXPECT_EQ(v.actions.stages, 4);
  EXPECT_EQ(v.partition.first, (std::vector<int>{0, 2, 4, 6, 8}));
  ASSERT_EQ(v.costs.send_forward.size(), 3u);
  EXPECT_EQ(v.costs.optimizer.size(), 2u);
  EXPECT_LE(v.filled_iteration(), v.serial_iteration() + 1e-9);
  o.first = {0, 1, 4, 7, 8};  // a fixed V split: rank 0 holds u0 and u7, rank 1 u1..u6
  PipeMachine linked = m;
  linked.link = PipeLink{1e6, 0.01};
  const PipePlan fixed = plan_pipeline(p, linked, o).front();
  EXPECT_EQ(fixed.partition.first, o.first);
  EXPECT_EQ(fixed.partition.stage_rank, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_GT(fixed.costs.send_forward[0], 0);
  // Activations in bfloat16 (parallel.pipe_wire): half the bytes of every carry, the latency alike;
  // the prepared rows still travel as float32.
  PipeMachine narrow = linked;
  narrow.activation_bytes = 0.5;
  const PipePlan half = plan_pipeline(p, narrow, o).front();
  EXPECT_DOUBLE_EQ(half.costs.send_forward[0] - 0.01, (fixed.costs.send_forward[0] - 0.01) / 2);
  EXPECT_DOUBLE_EQ(half.costs.tasks[0].send, fixed.costs.tasks[0].send);
  narrow.activation_bytes = 0;
  EXPECT_NE(error_message([&] { plan_pipeline(p, narrow, o); }).find("activation_bytes must be in (0, 1]"), std::string::npos);
  EXPECT_EQ(fixed.costs.send_forward[1], 0);  // the turn, on rank 1
  EXPECT_GT(fixed.costs.send_forward[2], 0);
  EXPECT_GT(fixed.filled_iteration(), plan_pipeline(p, linked, [&] {
    PipePlanOptions dp_split = o;
    dp_split.first.clear();
    return dp_split;
  }()).front().filled_iteration());  // less even than the DP's split
  o.first.clear();
  // Filling pays in a pipeline with many bubbles: 1F1B with 2 micro-batches.
  o.stages = {2}, o.micro = {2}, o.schedules = {"1f1b"};
  const PipePlan one = plan_pipeline(p, m, o).front();
  EXPECT_LT(one.filled_iteration(), one.serial_iteration() - 1);
  // A self-conditioned model adds a no-grad pass per stage, chained, in partial batches where a
  // bubble holds only part (like the prepare tasks), stage 0's after this iteration's prepared rows.
  PipeProfile sc = p;
  sc.self_cond = true;
  const PipePlan s = plan_pipeline(sc, m, o).front();
  ASSERT_EQ(s.costs.tasks.size(), 3u);
  EXPECT_EQ(s.costs.tasks[1].after, 0);
  EXPECT_EQ(s.costs.tasks[2].after, 1);
  EXPECT_EQ(s.costs.tasks[2].ranks, std::vector<int>{1});
  EXPECT_EQ(s.costs.tasks[1].quantum, prepare_quantum(s.rows));  // the pieces a run can place, as it cuts them
  EXPECT_EQ(s.costs.tasks[0].quantum, prepare_quantum(s.rows));
  EXPECT_GT(s.costs.tasks[0].quantum, 1) << "micro-batches of " << s.rows << " rows";
  EXPECT_EQ(s.costs.tasks[1].rows, s.rows);
  EXPECT_FALSE(s.costs.tasks[1].cross_iteration);
  // ... on the rank of each stage under the V: stages 0..3 on ranks 0, 1, 1, 0.
  o.schedules = {"1f1b-v"};
  const PipePlan sv = plan_pipeline(sc, m, o).front();
  ASSERT_EQ(sv.costs.tasks.size(), 5u);
  for (int v = 0; v < 4; ++v) EXPECT_EQ(sv.costs.tasks[1 + v].ranks, std::vector<int>{v == 1 || v == 2 ? 1 : 0});
  EXPECT_EQ(sv.costs.tasks[2].send, 0);  // stage 1 hands stage 2 its input on rank 1
}

TEST(PipePlan, BadOptions) {
  const PipeProfile p = synthetic_profile(4, 1.0);
  PipeMachine m;
  m.devices = 4;
  PipePlanOptions o;
  o.batch = 64;
  o.stages = {3};
  EXPECT_NE(error_message([&] { plan_pipeline(p, m, o); }).find("3 stages does not divide 4 devices"), std::string::npos);
  m.devices = 8, o.stages = {8};
  EXPECT_NE(error_message([&] { plan_pipeline(p, m, o); }).find("needs at least 8 units, but the model has 4"), std::string::npos);
  m.devices = 4, o.stages = {4}, o.schedules = {"zb-v"};
  EXPECT_NE(error_message([&] { plan_pipeline(p, m, o); }).find("a V-shaped pipeline over 4 ranks needs 8 units; the model has 4"),
            std::string::npos);
  o.schedules = {};
  m.devices = 2, o.stages = {2}, o.micro = {3};
  EXPECT_NE(error_message([&] { plan_pipeline(p, m, o); }).find("micro-batch count 3 does not divide a replica's batch of 64"),
            std::string::npos);
  o.micro = {4}, m.memory = 1000;
  EXPECT_NE(error_message([&] { plan_pipeline(p, m, o); }).find("the smallest limit that works is"), std::string::npos);
  m.memory = std::numeric_limits<double>::infinity(), o.batch = 63, o.stages = {1};
  EXPECT_NE(error_message([&] { plan_pipeline(p, m, o); }).find("global batch 63 does not split over 2"), std::string::npos);
}

// Data parallelism with its optimizer state sharded (parallel.shard_optimizer) beside the plain one:
// 2 + 3/d of the state's 5 float32 copies on each device, AdamW on 1/d of the parameters, and the
// all-gather of the updated weights after it (not overlapped); under a memory limit between the two,
// only the sharded one fits.
TEST(PipePlan, ShardedDataParallelismHoldsLessStateAndGathersTheWeights) {
  const PipeProfile p = synthetic_profile(8, 6.0);  // 8 units of 1000 parameters
  PipeMachine m;
  m.devices = 2;
  m.link = PipeLink{1e3, 0.01};  // 1000 bytes per ms
  PipePlanOptions o;
  o.batch = 64, o.stages = {1}, o.micro = {1};
  std::map<std::string, PipePlan> by;
  for (const PipePlan& x : plan_pipeline(p, m, o)) by.emplace(x.schedule, x);
  ASSERT_EQ(by.size(), 2u);
  const PipePlan& plain = by.at("data-parallel");
  const PipePlan& sharded = by.at("dp-sharded");
  const double params = 8000, state = 20 * params;
  EXPECT_DOUBLE_EQ(plain.partition.stage_memory[0] - sharded.partition.stage_memory[0], state * 1.5 / 5);
  // Half the optimizer's work (1 ms per million parameters), then 4 bytes of half the weights over
  // the link and one latency.
  EXPECT_NEAR(sharded.sync - plain.sync, -params / 2 / 1e6 + 4 * params / 2 / 1e3 + 0.01, 1e-9);
  EXPECT_GT(sharded.serial_iteration(), plain.serial_iteration());
  m.memory = (plain.partition.stage_memory[0] + sharded.partition.stage_memory[0]) / 2;
  const std::vector<PipePlan> fits = plan_pipeline(p, m, o);
  ASSERT_EQ(fits.size(), 1u);
  EXPECT_EQ(fits[0].schedule, "dp-sharded");
  // One device: neither, a single process.
  m.devices = 1, m.memory = std::numeric_limits<double>::infinity();
  const std::vector<PipePlan> one = plan_pipeline(p, m, o);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].schedule, "single");
}

// The rows prepared per call, and which rows each prepare piece of a filled schedule covers: the
// pieces in bubbles (the next step's) from row 0, ranks in order; the serial ones (this step's) after.
