// Tests of the simulator (pipeline/simulate.h) against hand-worked timelines and the schedules' closed-form bubbles; frozen tasks' cost curves.
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

TEST(PipeSimulate, HandWorkedGPipe) {
  const PipeTimeline tl = simulate(make_schedule("gpipe", 2, 2), uniform_costs(2, 1, 1, 1));
  EXPECT_DOUBLE_EQ(tl.makespan, 9);
  ASSERT_EQ(tl.ranks[0].size(), 4u);
  EXPECT_DOUBLE_EQ(tl.ranks[0][2].start, 5);
  EXPECT_DOUBLE_EQ(tl.ranks[1][2].start, 3);
  const std::vector<PipeInterval> idle = tl.idle();
  ASSERT_EQ(idle.size(), 3u);
  EXPECT_DOUBLE_EQ(idle[0].start, 2); EXPECT_DOUBLE_EQ(idle[0].end, 5);
  EXPECT_DOUBLE_EQ(idle[1].start, 0); EXPECT_DOUBLE_EQ(idle[1].end, 1);
  EXPECT_DOUBLE_EQ(idle[2].start, 7); EXPECT_DOUBLE_EQ(idle[2].end, 9);
  EXPECT_DOUBLE_EQ(tl.bubble_fraction(), 1.0 / 3);  // (p-1)/(m+p-1)
}

// Closed forms for equal stages and free links: GPipe and 1F1B idle (S-1)(F+I+W) per stage, ZB-H1
// (S-1)(F+I-W) (for W <= F+I and M >= S); the bubble fraction of GPipe is (S-1)/(M+S-1).

TEST(PipeSimulate, ClosedFormBubbles) {
  for (int S = 1; S <= 5; ++S)
    for (int M = S; M <= 9; ++M)
      for (auto [f, i, w] : {std::tuple{1.0, 1.0, 1.0}, {2.0, 1.0, 1.0}, {1.0, 2.5, 0.5}, {1.3, 1.1, 0.7}}) {
        const PipeCosts c = uniform_costs(S, f, i, w);
        for (const std::string& n : schedule_names()) {
          if (is_v_schedule(n)) continue;  // two stages per rank: PipeSchedule.VShapedPlacement
          const PipeTimeline tl = simulate(make_schedule(n, S, M), c);
          const double want = (S - 1) * (n == "zb-h1" ? f + i - w : f + i + w);
          for (int r = 0; r < S; ++r) EXPECT_NEAR(idle_of(tl, r), want, 1e-9) << n << " S=" << S << " M=" << M << " r=" << r;
          if (n == "gpipe") {
            EXPECT_NEAR(tl.bubble_fraction(), (S - 1.0) / (M + S - 1.0), 1e-12);
          }
        }
      }
}

TEST(PipeSimulate, LinksSkipsAndOptimizer) {
  // 3 stages, 1 micro-batch, F = 1, I+W = 2, links of 0.5, a skip route 0 -> 2 of 4 (2 back).
  PipeCosts c = uniform_costs(3, 1, 1, 1, 0.5);
  c.skips.push_back({0, 2, 4, 2});
  c.optimizer = {0.25, 1, 0.5};
  const PipeTimeline tl = simulate(make_schedule("1f1b", 3, 1), c);
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kForward, 1, 0), 1.5);
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kForward, 2, 0), 5);     // the skip arrives at 1 + 4
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kBackward, 1, 0), 8.5);  // B of stage 2 ends at 8
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kBackward, 0, 0), 11);   // max(10.5 + 0.5, 8 + 2 via the skip)
  EXPECT_DOUBLE_EQ(tl.makespan, 13);
  EXPECT_DOUBLE_EQ(tl.iteration, 14);  // + the slowest optimizer step
}

// Messages between two ranks share the link, one at a time in the order sent; the latency does not
// hold it. GPipe 2 x 3, F = B = 1, each message 2 (all bytes), worked by hand:
//   rank 0: F0 [0,1] F1 [1,2] F2 [2,3]; the carries leave at [1,3] [3,5] [5,7]
//   rank 1: F0 [3,4] F1 [5,6] F2 [7,8] B0 [8,9] B1 [9,10] B2 [10,11]; gradients [9,11] [11,13] [13,15]
//   rank 0: B0 [11,12] B1 [13,14] B2 [15,16]
// Without the queue (what the simulator did before) the makespan would be 12. With 1 of the 2 as
// latency, each message holds the link 1: no message waits, and that is the makespan 12.

TEST(PipeSimulate, MessagesShareTheirLink) {
  PipeCosts c = uniform_costs(2, 1, 0.5, 0.5, 2);
  const PipeTimeline tl = simulate(make_schedule("gpipe", 2, 3), c);
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kForward, 1, 1), 5);
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kForward, 1, 2), 7);
  EXPECT_DOUBLE_EQ(tl.start_of(PipeOp::kBackward, 0, 2), 15);
  EXPECT_DOUBLE_EQ(tl.makespan, 16);
  c.latency = 1;
  const PipeTimeline pipelined = simulate(make_schedule("gpipe", 2, 3), c);
  EXPECT_DOUBLE_EQ(pipelined.start_of(PipeOp::kForward, 1, 2), 5);
  EXPECT_DOUBLE_EQ(pipelined.makespan, 12);
  // Each direction is a link of its own, and a skip route shares the link to its reader's rank: 3
  // stages, 1 micro-batch, a skip 0 -> 2 of 4 and carries of 2 each way. Stage 1's carry to stage 2
  // and the skip use different links (rank 1 -> 2, rank 0 -> 2): F2 starts at max(1 + 2 + 1 + 2, 1 + 4) = 6.
  PipeCosts k = uniform_costs(3, 1, 0.5, 0.5, 2);
  k.skips.push_back({0, 2, 4, 4});
  EXPECT_DOUBLE_EQ(simulate(make_schedule("gpipe", 3, 1), k).start_of(PipeOp::kForward, 2, 0), 6);
  k.latency = -1;
  EXPECT_NE(error_message([&] { simulate(make_schedule("gpipe", 3, 1), k); }).find("latency is negative"), std::string::npos);
}

// A split backward runs I and W as the runtime does: with split_input / split_weight set they are
// I's and W's times, B stays input_grad + weight_grad. costs_of_partition sets them from the units
// on stage 0 only (pipeline/split_backward.h): I nothing, W the first unit with parameters' own pass and
// the whole backward of every unit after it. Elsewhere I and W are the units' input and weight
// gradients (the split is exact there).

TEST(PipeSimulate, SplitBackwardAsTheRuntimeRunsIt) {
  PipeCosts c = uniform_costs(2, 1, 2, 3);
  c.stage[0].split_input = 0, c.stage[0].split_weight = 4.5;
  auto duration = [](const PipeTimeline& tl, int rank, PipeOp op) {
    for (const PipeSlot& x : tl.ranks[rank])
      if (x.action.op == op) return x.end - x.start;
    return -1.0;
  };
  const PipeTimeline zb = simulate(make_schedule("zb-h1", 2, 2), c);
  EXPECT_DOUBLE_EQ(duration(zb, 0, PipeOp::kInputGrad), 0);
  EXPECT_DOUBLE_EQ(duration(zb, 0, PipeOp::kWeightGrad), 4.5);
  EXPECT_DOUBLE_EQ(duration(zb, 1, PipeOp::kInputGrad), 2);  // stage 1: the ideal split
  EXPECT_DOUBLE_EQ(duration(zb, 1, PipeOp::kWeightGrad), 3);
  EXPECT_DOUBLE_EQ(duration(simulate(make_schedule("1f1b", 2, 2), c), 0, PipeOp::kBackward), 5);

  // Units (F, I, W, act, state, cut, skips, parameter pass): a parameter-free unit, two with parameters.
  std::vector<PipeUnit> units = {{"free", 1, 1, 0, 0, 0, 0, {}, 0},
                                 {"a", 1, 2, 3, 0, 20, 0, {}, 4},
                                 {"b", 1, 5, 6, 0, 20, 0, {}, 9},
                                 {"locked", 1, 7, 0, 0, 0, 0, {}, 0}};
  PipePartition p;
  p.first = {0, 2, 3, 4};
  const PipeCosts k = costs_of_partition(units, p, PipeLink{});
  EXPECT_DOUBLE_EQ(k.stage[0].i_time(), 0);  // stage 0: no input gradient
  EXPECT_DOUBLE_EQ(k.stage[0].w_time(), 4);  // a's pass; "free" comes before any parameter
  EXPECT_DOUBLE_EQ(k.stage[1].i_time(), 5);
  EXPECT_DOUBLE_EQ(k.stage[1].w_time(), 6);
  EXPECT_DOUBLE_EQ(k.stage[2].i_time(), 7);
  EXPECT_DOUBLE_EQ(k.stage[2].w_time(), 0);  // no parameters
  p.first = {0, 1, 4};
  const PipeCosts k2 = costs_of_partition(units, p, PipeLink{});
  EXPECT_DOUBLE_EQ(k2.stage[0].w_time(), 0);  // "free" alone: nothing to do
  EXPECT_DOUBLE_EQ(k2.stage[1].i_time(), 2 + 5 + 7);
  EXPECT_DOUBLE_EQ(k2.stage[1].w_time(), 3 + 6 + 0);
  p.first = {0, 3, 4};
  EXPECT_DOUBLE_EQ(costs_of_partition(units, p, PipeLink{}).stage[0].w_time(), 4 + 5 + 6);
  units[1].weight_pass = -1;  // not profiled: a's weight gradient
  EXPECT_DOUBLE_EQ(costs_of_partition(units, p, PipeLink{}).stage[0].w_time(), 3 + 5 + 6);
}

TEST(PipeSimulate, DeadlockAndBadCosts) {
  PipeSchedule s = make_schedule("gpipe", 2, 2);
  // Rank 0 waits for stage 1's B0 before sending F1; rank 1 needs F1 before its B0.
  s.ranks[0] = {s.ranks[0][0], s.ranks[0][2], s.ranks[0][1], s.ranks[0][3]};
  const std::string e = error_message([&] { simulate(s, uniform_costs(2, 1, 1, 1)); });
  EXPECT_NE(e.find("deadlocks: rank 0 waits at B0; rank 1 waits at F1;"), std::string::npos) << e;
  PipeCosts c = uniform_costs(2, 1, 1, 1);
  c.stage[1].forward = -1;
  EXPECT_NE(error_message([&] { simulate(make_schedule("1f1b", 2, 2), c); }).find("stage 1 has a negative"), std::string::npos);
  c = uniform_costs(3, 1, 1, 1);
  EXPECT_NE(error_message([&] { simulate(make_schedule("1f1b", 2, 2), c); }).find("3 stage costs for 2 stages"), std::string::npos);
  c = uniform_costs(2, 1, 1, 1);
  c.tasks.push_back(linear_task("enc", 1, 4));
  c.tasks[0].after = 0;
  EXPECT_NE(error_message([&] { simulate(make_schedule("1f1b", 2, 2), c); }).find("must name an earlier task"), std::string::npos);
}

TEST(PipeTask, CostCurve) {
  PipeTask t;
  t.name = "vae";
  t.cost = {{2, 3}, {8, 6}};
  EXPECT_DOUBLE_EQ(t.time(1), 1.5);   // proportional below the first point
  EXPECT_DOUBLE_EQ(t.time(4), 4);     // linear between points
  EXPECT_DOUBLE_EQ(t.time(16), 12);   // proportional above the last
  EXPECT_DOUBLE_EQ(t.time(0), 0);
}

// The hand-worked example of fill.h's rounds: GPipe 2 x 2 as in HandWorkedGPipe, and a
// cross-iteration encoder of 4 rows per micro-batch at 1 per row, runnable on any rank. Round 1
// fills rank 1 [0,1] (1 row of m0), rank 0 [2,5] (3 rows of m0), rank 1 [7,9] (2 rows of m1); the
// 2 rows left go to the front of rank 0 (2 units: makespan 11), and round 2 fills everything else
// into the new idle stretches: rank 1 [0,3] (3 rows of m0), rank 0 [4,7] (1 row of m0, 2 of m1).
// GPipe, 2 stages x 2 micro-batches, F = 1 and B = 2 everywhere, a cross-iteration encoder of 1 per
// row and 4 rows per micro-batch. Round 1 fills the bare schedule (makespan 9): rank 1's [0,1] takes
// a row of m0, rank 0's [2,5] the other 3, rank 1's [7,9] 2 rows of m1; m1's other 2 rows go serial.
// Spread over the ranks, 1 row each at the front: makespan 10, and round 2 places the same 6 rows
// again. On the consumer's rank alone, the 2 serial rows delay rank 1 too: makespan 11.
