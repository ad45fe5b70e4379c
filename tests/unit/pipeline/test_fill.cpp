// Tests of the greedy bubble filler (pipeline/fill.h): hand-worked placements, deadlines and chains, conservation of rows and no delayed backbone on random workloads.
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

TEST(PipeFill, HandWorkedRounds) {
  PipeCosts c = uniform_costs(2, 1, 1, 1);
  c.tasks.push_back(linear_task("encoder", 1, 4));
  c.tasks[0].cross_iteration = true;
  const PipeSchedule s = make_schedule("gpipe", 2, 2);
  const PipeTimeline serial = simulate(with_serial_tasks(s, c), c);
  EXPECT_DOUBLE_EQ(serial.makespan, 17);
  const PipeFill f = fill_bubbles(s, c);
  EXPECT_TRUE(f.spread);
  EXPECT_EQ(f.rounds, 2);
  EXPECT_DOUBLE_EQ(f.timeline.makespan, 10);
  EXPECT_EQ(f.serial_rows[0], 2);
  EXPECT_EQ(f.filled_rows[0], 6);
  EXPECT_EQ(rank_text(f.schedule.ranks[0]), "T0.1x1 F0 F1 T0.0x3 B0 B1");
  EXPECT_EQ(rank_text(f.schedule.ranks[1]), "T0.1x1 T0.0x1 F0 F1 B0 B1 T0.1x2");
  EXPECT_TRUE(f.schedule.ranks[0][0].serial && f.schedule.ranks[1][0].serial && !f.schedule.ranks[1][1].serial);
}

// Work consumed by stage 1 in this iteration must end before that stage's F of the same micro-batch.

TEST(PipeFill, DeadlinesAndChains) {
  PipeCosts c = uniform_costs(2, 1, 1, 1, 0.25);
  // A control-map-like task for stage 1, only on rank 1, 2 rows at 0.25 each: m0 fits before F(1,0)
  // at 1.25, the others before their F's in rank 1's idle start only partly.
  c.tasks.push_back(linear_task("control", 0.25, 2));
  c.tasks[0].consumer = 1, c.tasks[0].ranks = {1};
  // A two-stage no-grad pass (self-conditioning): part 0 on rank 0, part 1 on rank 1 after it, both
  // consumed by stage 0's forward.
  c.tasks.push_back(linear_task("selfcond0", 0.5, 2));
  c.tasks[1].ranks = {0}, c.tasks[1].send = 0.25;
  c.tasks.push_back(linear_task("selfcond1", 0.5, 2));
  c.tasks[2].ranks = {1}, c.tasks[2].after = 1;
  const PipeSchedule s = make_schedule("1f1b", 2, 4);
  const PipeFill f = fill_bubbles(s, c);
  // Every F starts after the pieces it consumes end (plus the send across ranks); chains hold.
  std::map<std::pair<int, int>, double> done;  // (task, micro) -> latest end incl. send to rank 0/1 consumer
  for (int r = 0; r < 2; ++r)
    for (const PipeSlot& x : f.timeline.ranks[r])
      if (x.action.op == PipeOp::kTask) {
        const PipeTask& t = c.tasks[x.action.task];
        const int consumer_rank = t.consumer;
        double& d = done[{x.action.task, x.action.micro}];
        d = std::max(d, x.end + (r == consumer_rank ? 0 : t.send));
        if (t.after >= 0) {
          for (int r2 = 0; r2 < 2; ++r2)
            for (const PipeSlot& y : f.timeline.ranks[r2])
              if (y.action.op == PipeOp::kTask && y.action.task == t.after && y.action.micro == x.action.micro) {
                EXPECT_LE(y.end + (r2 == r ? 0 : c.tasks[t.after].send), x.start + 1e-12) << action_text(x.action);
              }
        }
      }
  for (const auto& [key, end] : done)
    EXPECT_LE(end, f.timeline.start_of(PipeOp::kForward, c.tasks[key.first].consumer, key.second) + 1e-12)
        << c.tasks[key.first].name << " micro " << key.second;
  int64_t rows = 0;
  for (size_t t = 0; t < c.tasks.size(); ++t) rows += f.filled_rows[t] + f.serial_rows[t];
  EXPECT_EQ(rows, 3 * 2 * 4);
  EXPECT_GT(f.filled_rows[0], 0);
  EXPECT_LE(f.timeline.iteration, simulate(with_serial_tasks(s, c), c).iteration + 1e-12);
}

// Random workloads: rows are conserved per instance, pieces never overlap, filling never delays the
// backbone of the schedule it filled (its last round's base) and never loses to serial work.

TEST(PipeFill, PropertiesOnRandomWorkloads) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.2, 2.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int S = 1 + trial % 4, M = 1 + (trial / 4) % 6;
    PipeCosts c;
    for (int s = 0; s < S; ++s) c.stage.push_back({u(rng), u(rng), u(rng)});
    for (int s = 0; s + 1 < S; ++s) c.send_forward.push_back(u(rng) / 4), c.send_backward.push_back(u(rng) / 4);
    for (int t = 0; t < 3; ++t) {
      PipeTask k = linear_task("t" + std::to_string(t), u(rng) / 8, 1 + trial % 5 * 3);
      k.consumer = static_cast<int>(rng() % S), k.cross_iteration = t == 0, k.send = u(rng) / 4;
      if (t == 2) k.after = 1;
      if (t == 1) k.ranks = {static_cast<int>(rng() % S)};
      if (t == 0 && k.rows % 2 == 0) k.quantum = k.rows / 2;  // pieces of whole quanta
      c.tasks.push_back(k);
    }
    const std::string name = schedule_names()[trial % 5];
    const PipeSchedule s = make_schedule(name, S, M);
    if (s.stages != S) {  // V-shaped: 2S stages on the S ranks
      c.stage.clear(), c.send_forward.clear(), c.send_backward.clear();
      for (int v = 0; v < s.stages; ++v) c.stage.push_back({u(rng), u(rng), u(rng)});
      for (int v = 0; v + 1 < s.stages; ++v) c.send_forward.push_back(u(rng) / 4), c.send_backward.push_back(u(rng) / 4);
      for (PipeTask& k : c.tasks) k.consumer = static_cast<int>(rng() % s.stages);
    }
    const PipeFill f = fill_bubbles(s, c);
    std::map<std::pair<int, int>, int64_t> rows;
    for (int r = 0; r < S; ++r) {
      double t = 0;
      for (const PipeSlot& x : f.timeline.ranks[r]) {
        EXPECT_GE(x.start, t - 1e-12);
        t = x.end;
        if (x.action.op == PipeOp::kTask) {
          rows[{x.action.task, x.action.micro}] += x.action.rows;
          EXPECT_EQ(x.action.rows % c.tasks[x.action.task].quantum, 0) << "trial " << trial;
        }
      }
    }
    for (int t = 0; t < 3; ++t)
      for (int m = 0; m < M; ++m) EXPECT_EQ((rows[{t, m}]), c.tasks[t].rows) << "trial " << trial;
    // The last round's base: the same serial rows at the front, no pieces in the bubbles.
    PipeSchedule base = f.schedule;
    for (auto& r : base.ranks) {
      std::vector<PipeAction> kept;
      for (const PipeAction& a : r)
        if (a.op != PipeOp::kTask || a.serial) kept.push_back(a);
      r = kept;
    }
    const PipeTimeline b = simulate(base, c);
    EXPECT_EQ(backbone_starts(b), backbone_starts(f.timeline)) << "trial " << trial << " " << name;
    EXPECT_LE(f.timeline.iteration, simulate(with_serial_tasks(s, c), c).iteration + 1e-9) << "trial " << trial;
  }
}

// The DP against every split of small random models, and its errors. Every other model has random
// skips (made by unit l, read by a later unit or none): a stage sends its carry without the open
// skips, plus the skips it made that a later stage reads; the simulator's costs route those read
// two or more stages on directly.
