// Tests of the pipeline planning library: schedule generators, the simulator against hand-worked
// timelines and the schedules' closed-form bubbles, the stage-partitioning DP against brute force,
// the greedy bubble filler (hand-worked placements, conservation of rows, no delayed backbone),
// profiles (files, interpolation) and the planner's search and its errors.
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

using namespace ddm;
using ddm::test::error_message;

namespace {

PipeCosts uniform_costs(int S, double f, double i, double w, double send = 0) {
  PipeCosts c;
  c.stage.assign(S, PipeStageCost{f, i, w});
  c.send_forward.assign(S - 1, send), c.send_backward.assign(S - 1, send);
  return c;
}

double idle_of(const PipeTimeline& tl, int rank) {
  double t = 0;
  for (const PipeInterval& i : tl.idle())
    if (i.rank == rank) t += i.end - i.start;
  return t;
}

PipeTask linear_task(const std::string& name, double per_row, int64_t rows) {
  PipeTask t;
  t.name = name, t.rows = rows;
  t.cost = {{1, per_row}, {rows, per_row * rows}};
  if (rows == 1) t.cost.pop_back();
  return t;
}

// Start times of every backbone action, keyed by its text and stage.
std::map<std::string, double> backbone_starts(const PipeTimeline& tl) {
  std::map<std::string, double> m;
  for (const auto& r : tl.ranks)
    for (const PipeSlot& x : r)
      if (x.action.op != PipeOp::kTask) m[std::to_string(x.action.stage) + action_text(x.action)] = x.start;
  return m;
}

// A random model of L units for the partition DPs' brute-force tests: times and sizes drawn from
// [0.1, 3) (scaled), `carry[l]` the carry after unit l, and with `skips` 0-2 skips per unit, each read
// by a later unit or by none (read = L). cut_bytes: the carry and every skip open after the unit.
std::vector<PipeUnit> random_units(std::mt19937& rng, int L, bool skips, std::vector<double>& carry) {
  std::uniform_real_distribution<double> u(0.1, 3.0);
  std::vector<PipeUnit> units(L);
  carry.assign(L, 0);
  for (int l = 0; l < L; ++l) {
    carry[l] = u(rng) * 50;
    units[l] = {"u" + std::to_string(l), u(rng), u(rng), u(rng), u(rng) * 10, u(rng) * 20, carry[l], {}, -1};
    if (skips && l + 1 < L)
      for (int k = 0; k < static_cast<int>(rng() % 3); ++k)
        units[l].skips.push_back({l + 1 + static_cast<int>(rng() % (L - l)), u(rng) * 40});  // read by l+1..L
  }
  for (int l = 0; l < L; ++l)
    for (int m = 0; m <= l; ++m)
      for (const PipeSkip& k : units[m].skips)
        if (k.read > l) units[l].cut_bytes += k.bytes;
  return units;
}

}  // namespace

TEST(PipeSchedule, ShapesOfEachSchedule) {
  const PipeSchedule g = make_schedule("gpipe", 3, 4);
  EXPECT_EQ(rank_text(g.ranks[0]), "F0 F1 F2 F3 B0 B1 B2 B3");
  const PipeSchedule a = make_schedule("1f1b", 3, 4);
  EXPECT_EQ(rank_text(a.ranks[0]), "F0 F1 F2 B0 F3 B1 B2 B3");
  EXPECT_EQ(rank_text(a.ranks[2]), "F0 B0 F1 B1 F2 B2 F3 B3");
  const PipeSchedule z = make_schedule("zb-h1", 3, 4);
  EXPECT_EQ(rank_text(z.ranks[0]), "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3");
  EXPECT_EQ(rank_text(z.ranks[2]), "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3");
  // Activations held at the peak: GPipe all M, 1F1B S-s, ZB-H1 S on every stage.
  EXPECT_EQ(peak_in_flight(make_schedule("gpipe", 4, 8)), (std::vector<int>{8, 8, 8, 8}));
  EXPECT_EQ(peak_in_flight(make_schedule("1f1b", 4, 8)), (std::vector<int>{4, 3, 2, 1}));
  EXPECT_EQ(peak_in_flight(make_schedule("zb-h1", 4, 8)), (std::vector<int>{4, 4, 4, 4}));
  EXPECT_EQ(peak_in_flight(make_schedule("1f1b", 4, 2)), (std::vector<int>{2, 2, 2, 1}));
  for (const std::string& n : schedule_names())
    for (int S = 1; S <= 6; ++S)
      for (int M = 1; M <= 9; ++M) EXPECT_NO_THROW(validate_schedule(make_schedule(n, S, M))) << n << S << M;
}

// V-shaped placement: rank r runs stages r and 2R-1-r, in ZB-V's phases (schedule.cpp). 1F1B-V
// over 2 ranks: rank 0 warms up with 2R-1 = 3 forwards of stage 0, then pairs its last stage's F and
// B; rank 1 alternates its two stages.
TEST(PipeSchedule, VShapedPlacement) {
  const PipeSchedule v = make_schedule("1f1b-v", 2, 4);
  EXPECT_EQ(v.stages, 4);
  EXPECT_EQ(v.stage_rank, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(rank_text(v.ranks[0], true), "F0@0 F1@0 F2@0 F0@3 B0@3 F1@3 B1@3 F3@0 B0@0 F2@3 B2@3 B1@0 F3@3 B3@3 B2@0 B3@0");
  EXPECT_EQ(rank_text(v.ranks[1], true), "F0@1 F0@2 F1@1 F1@2 B0@2 F2@1 B0@1 F2@2 B1@2 F3@1 B1@1 F3@2 B2@2 B2@1 B3@2 B3@1");
  const PipeSchedule z = make_schedule("zb-v", 2, 4);  // the cooldown defers W's
  EXPECT_EQ(rank_text(z.ranks[1], true).substr(rank_text(z.ranks[1], true).find("F3@2")),
            "F3@2 I2@2 W2@2 I2@1 I3@2 I3@1 W2@1 W3@2 W3@1");
  // Every shape is valid, runs without deadlock on any costs (here random ones), keeps each rank at
  // or under 2R chunk activations, and against the linear schedule with stages twice as long (the
  // same work per rank): 1F1B-V is never idler than 1F1B and shorter once M >= 2; ZB-V is never
  // idler than ZB-H1 once M >= R.
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.2, 2.0);
  for (const std::string& n : {std::string("1f1b-v"), std::string("zb-v")})
    for (int R = 1; R <= 6; ++R)
      for (int M = 1; M <= 14; ++M) {
        const PipeSchedule s = make_schedule(n, R, M);
        ASSERT_NO_THROW(validate_schedule(s)) << n << R << M;
        ASSERT_EQ(s.ranks.size(), static_cast<size_t>(R));
        for (int r = 0; r < R; ++r) {
          int held = 0, peak = 0;
          for (const PipeAction& a : s.ranks[r]) {
            if (a.op == PipeOp::kForward) peak = std::max(peak, ++held);
            if (a.op == (s.split_backward ? PipeOp::kWeightGrad : PipeOp::kBackward)) --held;
          }
          EXPECT_LE(peak, 2 * R) << n << " R=" << R << " M=" << M << " rank " << r;
        }
        PipeCosts random;
        for (int v = 0; v < 2 * R; ++v) random.stage.push_back({u(rng), u(rng), u(rng)});
        for (int v = 0; v + 1 < 2 * R; ++v) random.send_forward.push_back(u(rng)), random.send_backward.push_back(u(rng));
        EXPECT_NO_THROW(simulate(s, random)) << n << R << M;
        const bool zb = n == "zb-v";
        if (zb && M < R) continue;
        const PipeTimeline half = simulate(s, uniform_costs(2 * R, 1, 1, 1));
        const PipeTimeline whole = simulate(make_schedule(zb ? "zb-h1" : "1f1b", R, M), uniform_costs(R, 2, 2, 2));
        for (int r = 0; r < R; ++r) EXPECT_LE(idle_of(half, r), idle_of(whole, r) + 1e-9) << n << " R=" << R << " M=" << M;
        if (!zb && R > 1 && M >= 2) {
          EXPECT_LT(half.makespan, whole.makespan) << n << " R=" << R << " M=" << M;
        }
      }
}

TEST(PipeSchedule, BadInput) {
  EXPECT_NE(error_message([] { make_schedule("interleaved", 2, 2); }).find("use gpipe, 1f1b, zb-h1, 1f1b-v or zb-v"),
            std::string::npos);
  EXPECT_NE(error_message([] { make_schedule("1f1b", 0, 2); }).find("stages must be >= 1"), std::string::npos);
  EXPECT_NE(error_message([] { make_schedule("1f1b", 2, 0); }).find("micro-batches must be >= 1"), std::string::npos);
  PipeSchedule s = make_schedule("1f1b", 2, 2);
  std::swap(s.ranks[1][0], s.ranks[1][1]);  // B0 before F0
  EXPECT_NE(error_message([&] { validate_schedule(s); }).find("out of order"), std::string::npos);
  s = make_schedule("1f1b", 2, 2);
  s.ranks[0].pop_back();
  EXPECT_NE(error_message([&] { validate_schedule(s); }).find("does not finish micro-batch 1"), std::string::npos);
}

// GPipe, 2 stages, 2 micro-batches, F = 1 and B = 2, worked by hand:
//   rank 0: F0 [0,1] F1 [1,2] . . . B0 [5,7] B1 [7,9]
//   rank 1: . F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7] . .
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
TEST(PipePartition, MatchesBruteForce) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  const PipeLink link{100.0, 0.05};
  for (int trial = 0; trial < 200; ++trial) {
    const int L = 1 + trial % 8, S = 1 + (trial / 8) % std::min(L, 4);
    std::vector<double> carry;
    std::vector<PipeUnit> units = random_units(rng, L, trial % 2, carry);
    auto sends = [&](int i, int j) {
      double b = carry[j - 1];
      for (int l = i; l < j; ++l)
        for (const PipeSkip& k : units[l].skips) b += k.read >= j ? k.bytes : 0;
      return b;
    };
    std::vector<int> in_flight(S);
    for (int s = 0; s < S; ++s) in_flight[s] = S - s;
    const double limit = 30 + u(rng) * 40;
    // Brute force over all S-1 cuts.
    double best = std::numeric_limits<double>::infinity(), smallest = best;
    std::function<void(int, int, double, double)> go = [&](int s, int i, double worst_t, double worst_m) {
      if (s == S) {
        if (i == L) {
          smallest = std::min(smallest, worst_m);
          if (worst_m <= limit) best = std::min(best, worst_t);
        }
        return;
      }
      for (int j = i + 1; j <= L - (S - s - 1); ++j) {
        double t = 0, a = 0, st = 0;
        for (int l = i; l < j; ++l) t += units[l].forward + units[l].input_grad + units[l].weight_grad, a += units[l].activation_bytes, st += units[l].state_bytes;
        if (j < L) {
          t += link.time(sends(i, j));
          EXPECT_NEAR(stage_send_bytes(units, i, j), sends(i, j), 1e-9);
        }
        go(s + 1, j, std::max(worst_t, t), std::max(worst_m, st + in_flight[s] * a));
      }
    };
    go(0, 0, 0, 0);
    if (std::isfinite(best)) {
      const PipePartition p = partition_units(units, S, in_flight, limit, link);
      EXPECT_NEAR(p.bottleneck, best, 1e-9) << "trial " << trial;
      ASSERT_EQ(p.first.size(), static_cast<size_t>(S + 1));
      for (int s = 0; s < S; ++s) {
        EXPECT_LT(p.first[s], p.first[s + 1]);
        EXPECT_LE(p.stage_memory[s], limit);
        EXPECT_LE(p.stage_time[s], p.bottleneck + 1e-12);
      }
      // The simulator's stage costs add up to the units'.
      const PipeCosts c = costs_of_partition(units, p, link);
      double total = 0;
      for (const PipeStageCost& k : c.stage) total += k.forward + k.input_grad + k.weight_grad;
      double want = 0;
      for (const PipeUnit& x : units) want += x.forward + x.input_grad + x.weight_grad;
      EXPECT_NEAR(total, want, 1e-9);
      // Each skip leaves its stage once: in the next cut's carry, or by a route past the stages between.
      auto stage_of = [&](int l) {
        int s = 0;
        while (s + 1 < S && p.first[s + 1] <= l) ++s;
        return s;
      };
      std::vector<double> carried(S > 1 ? S - 1 : 0, 0);
      std::vector<std::pair<int, int>> routes, want_routes;
      for (int s = 0; s + 1 < S; ++s) carried[s] = carry[p.first[s + 1] - 1];
      for (int l = 0; l < L; ++l)
        for (const PipeSkip& k : units[l].skips) {
          const int from = stage_of(l), to = stage_of(std::min(k.read, L - 1));
          if (to == from + 1) carried[from] += k.bytes;
          if (to > from + 1) want_routes.push_back({from, to});
        }
      for (int s = 0; s + 1 < S; ++s) EXPECT_NEAR(c.send_forward[s], link.time(carried[s]), 1e-9) << "trial " << trial;
      for (const PipeSkipRoute& k : c.skips) routes.push_back({k.from, k.to});
      std::sort(routes.begin(), routes.end()), std::sort(want_routes.begin(), want_routes.end());
      EXPECT_EQ(routes, want_routes) << "trial " << trial;
    } else {
      const std::string e = error_message([&] { partition_units(units, S, in_flight, limit, link); });
      char b[64];
      std::snprintf(b, sizeof b, "the smallest limit that works is %.3g MiB", smallest / (1 << 20));
      EXPECT_NE(e.find(b), std::string::npos) << e;
    }
  }
  const std::vector<PipeUnit> two(2);
  EXPECT_NE(error_message([&] { partition_units(two, 3, {1, 1, 1}, 1e9, link); }).find("needs at least 3 units, but the model has 2"),
            std::string::npos);
}

// The V-shaped DP against every split of small random models into 2R stages (rank r holding stage r
// and stage 2R-1-r): the slowest rank (both its stages, sends without the skips its own second stage
// reads, nothing sent between the middle rank's two stages) under each rank's memory; the
// simulator's costs send nothing within a rank and route only skips between ranks.
TEST(PipePartition, VShapedMatchesBruteForce) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  const PipeLink link{100.0, 0.05};
  int feasible = 0;
  for (int trial = 0; trial < 240; ++trial) {
    const int L = 2 + trial % 8, R = 1 + (trial / 8) % std::min(L / 2, 3), S = 2 * R;
    std::vector<double> carry;
    const std::vector<PipeUnit> units = random_units(rng, L, true, carry);
    // Sends of run [i, j), without the skips read in [lo, hi).
    auto sends = [&](int i, int j, int lo, int hi) {
      double b = carry[j - 1];
      for (int l = i; l < j; ++l)
        for (const PipeSkip& k : units[l].skips) b += k.read >= j && !(lo <= k.read && k.read < hi) ? k.bytes : 0;
      return b;
    };
    auto sum = [&](int i, int j, int what) {
      double t = 0;
      for (int l = i; l < j; ++l)
        t += what == 0 ? units[l].forward + units[l].input_grad + units[l].weight_grad
             : what == 1 ? units[l].activation_bytes : units[l].state_bytes;
      return t;
    };
    std::vector<int> in_flight(S);
    for (int v = 0; v < S; ++v) in_flight[v] = 1 + static_cast<int>(rng() % 3);
    const double limit = 60 + u(rng) * 100;
    double best = std::numeric_limits<double>::infinity(), smallest = best;
    std::vector<int> first(S + 1, L);
    first[0] = 0;
    std::function<void(int)> go = [&](int v) {  // choose first[v] for v = 1..S-1
      if (v == S) {
        double worst_t = 0, worst_m = 0;
        for (int r = 0; r < R; ++r) {
          const int a = first[r], a2 = first[r + 1], b2 = first[S - 1 - r], b = first[S - r];
          double t, m = sum(a, a2, 2) + sum(b2, b, 2) + in_flight[r] * sum(a, a2, 1) + in_flight[S - 1 - r] * sum(b2, b, 1);
          if (r == R - 1)
            t = sum(a, b, 0) + (R > 1 ? link.time(sends(a, b, 0, 0)) : 0);
          else
            t = sum(a, a2, 0) + link.time(sends(a, a2, b2, b == L ? L + 1 : b)) + sum(b2, b, 0) + (r > 0 ? link.time(sends(b2, b, 0, 0)) : 0);
          worst_t = std::max(worst_t, t), worst_m = std::max(worst_m, m);
        }
        smallest = std::min(smallest, worst_m);
        if (worst_m <= limit) best = std::min(best, worst_t);
        return;
      }
      for (int j = first[v - 1] + 1; j <= L - (S - v); ++j) first[v] = j, go(v + 1);
    };
    go(1);
    if (!std::isfinite(best)) {
      const std::string e = error_message([&] { partition_units_v(units, R, in_flight, limit, link); });
      char b[64];
      std::snprintf(b, sizeof b, "the smallest limit that works is %.3g MiB", smallest / (1 << 20));
      EXPECT_NE(e.find(b), std::string::npos) << e;
      EXPECT_NE(e.find("V-shaped"), std::string::npos) << e;
      continue;
    }
    ++feasible;
    const PipePartition p = partition_units_v(units, R, in_flight, limit, link);
    EXPECT_NEAR(p.bottleneck, best, 1e-9) << "trial " << trial;
    ASSERT_EQ(p.first.size(), static_cast<size_t>(S + 1));
    ASSERT_EQ(p.stage_rank.size(), static_cast<size_t>(S));
    for (int v = 0; v < S; ++v) {
      EXPECT_LT(p.first[v], p.first[v + 1]);
      EXPECT_EQ(p.rank_of(v), v < R ? v : S - 1 - v);
    }
    for (int r = 0; r < R; ++r) {
      EXPECT_LE(p.stage_memory[r] + p.stage_memory[S - 1 - r], limit + 1e-9);
      EXPECT_LE(p.stage_time[r] + p.stage_time[S - 1 - r], p.bottleneck + 1e-9);
    }
    const PipeCosts c = costs_of_partition(units, p, link);
    double total = 0;
    for (const PipeStageCost& k : c.stage) total += k.forward + k.input_grad + k.weight_grad;
    EXPECT_NEAR(total, sum(0, L, 0), 1e-9);
    auto stage_of = [&](int l) {
      int v = 0;
      while (v + 1 < S && p.first[v + 1] <= l) ++v;
      return v;
    };
    std::vector<double> carried(S - 1, 0);
    std::vector<std::pair<int, int>> routes, want_routes;
    for (int v = 0; v + 1 < S; ++v) carried[v] = p.rank_of(v) == p.rank_of(v + 1) ? 0 : carry[p.first[v + 1] - 1];
    for (int l = 0; l < L; ++l)
      for (const PipeSkip& k : units[l].skips) {
        const int from = stage_of(l), to = stage_of(std::min(k.read, L - 1));
        if (p.rank_of(from) == p.rank_of(to)) continue;  // stays on its rank
        if (to == from + 1) carried[from] += k.bytes;
        if (to > from + 1) want_routes.push_back({from, to});
      }
    for (int v = 0; v + 1 < S; ++v) EXPECT_NEAR(c.send_forward[v], link.time(carried[v]), 1e-9) << "trial " << trial;
    for (const PipeSkipRoute& k : c.skips) routes.push_back({k.from, k.to});
    std::sort(routes.begin(), routes.end()), std::sort(want_routes.begin(), want_routes.end());
    EXPECT_EQ(routes, want_routes) << "trial " << trial;
  }
  EXPECT_GT(feasible, 100);
  const std::vector<PipeUnit> three(3);
  EXPECT_NE(error_message([&] { partition_units_v(three, 2, {1, 1, 1, 1}, 1e9, link); })
                .find("over 2 ranks has 4 stages and needs at least 4 units, but the model has 3: use at most 1 ranks"),
            std::string::npos);
}

namespace {

// A synthetic profile: `n` equal units (forward 1 ms, I 1 ms, W 1 ms per 8 rows, linear in rows),
// and one frozen task of `task_ms` per 8 rows.
PipeProfile synthetic_profile(int n, double task_ms, bool uses_weights = false) {
  PipeProfile p;
  p.model = "synthetic", p.workload = "a frozen encoder", p.machine = "test", p.threads = 1;
  p.optimizer_ms_per_mparam = 1, p.x_bytes_per_row = 1024;
  for (int l = 0; l < n; ++l) {
    PipeUnitProfile u;
    u.name = "u" + std::to_string(l), u.params = 1000;
    for (int64_t r : {8, 16}) u.samples.push_back({r, r / 8.0, r / 8.0, r / 8.0, r / 16.0, 1e4 * r, 1e3 * r, r / 4.0});
    p.units.push_back(u);
  }
  p.tasks.push_back({"encoder", {{8, task_ms}, {16, 2 * task_ms}}, uses_weights, 4096});
  return p;
}

}  // namespace

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
  EXPECT_EQ(s.costs.tasks[1].quantum, 1);
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

// The rows prepared per call, and which rows each prepare piece of a filled schedule covers: the
// pieces in bubbles (the next step's) from row 0, ranks in order; the serial ones (this step's) after.
TEST(PipePrepare, QuantaAndThePiecesOfAFilledSchedule) {
  for (const auto& [rows, q] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {2, 2}, {4, 4}, {6, 3}, {7, 1}, {8, 4},
                                                                        {16, 4}, {64, 8}, {128, 16}, {96, 12}})
    EXPECT_EQ(prepare_quantum(rows), q) << rows;
  auto piece = [](int micro, int64_t rows, bool serial) {
    PipeAction a;
    a.op = PipeOp::kTask, a.stage = -1, a.task = 0, a.micro = micro, a.rows = rows, a.serial = serial;
    return a;
  };
  PipeSchedule s = make_schedule("1f1b", 2, 2);
  s.ranks[0].insert(s.ranks[0].begin(), piece(0, 4, true));
  s.ranks[0].push_back(piece(1, 2, false));
  s.ranks[1].insert(s.ranks[1].begin(), piece(0, 4, false));
  s.ranks[1].push_back(piece(1, 6, false));
  const std::vector<PrepPiece> p = prep_pieces(s, 8);
  ASSERT_EQ(p.size(), 4u);
  auto text = [](const PrepPiece& x) {
    return std::to_string(x.rank) + "@" + std::to_string(x.position) + " m" + std::to_string(x.micro) + " [" +
           std::to_string(x.first) + "," + std::to_string(x.first + x.rows) + ")" + (x.ahead ? " ahead" : "");
  };
  EXPECT_EQ(text(p[0]), "0@0 m0 [4,8)");
  EXPECT_EQ(text(p[1]), "0@" + std::to_string(s.ranks[0].size() - 1) + " m1 [0,2) ahead");
  EXPECT_EQ(text(p[2]), "1@0 m0 [0,4) ahead");
  EXPECT_EQ(text(p[3]), "1@" + std::to_string(s.ranks[1].size() - 1) + " m1 [2,8) ahead");
  s.ranks[1].pop_back();
  EXPECT_NE(error_message([&] { prep_pieces(s, 8); }).find("the pieces of micro-batch 1 cover 2 of its 8 rows"), std::string::npos);
}

// A run's measurements become the simulator's costs: each stage's compute, the link's time for each
// cut's carry, every rank's optimizer, and the prepare task in quanta (the stages' mean time per
// quantum, its output sent at the link's speed); every stage plans alike from them.
TEST(PipeCalibrate, CostsAndPlanFromMeasurements) {
  std::vector<PipeStageMeasure> m(2);
  m[0] = {2, 3, 0, 0.5, 0.4, 5000, {1000, 600}, 0.1, 1000, {0, 0}};
  m[1] = {1.5, 2.5, 0, 0.7, 0.6, 0, {1000, 600}, 0, 0, {0, 0}};
  const PipeCosts c = costs_from_measures(m, 16, 4);
  EXPECT_DOUBLE_EQ(c.stage[0].forward, 2);
  EXPECT_DOUBLE_EQ(c.stage[1].input_grad, 2.5);
  EXPECT_DOUBLE_EQ(c.send_forward.at(0), 0.1 + 5);
  EXPECT_DOUBLE_EQ(c.send_backward.at(0), 0.1 + 5);
  EXPECT_EQ(c.optimizer, (std::vector<double>{0.5, 0.7}));
  ASSERT_EQ(c.tasks.size(), 1u);
  EXPECT_EQ(c.tasks[0].quantum, 4);
  EXPECT_TRUE(c.tasks[0].cross_iteration);
  EXPECT_DOUBLE_EQ(c.tasks[0].time(16), 4 * 0.5);
  EXPECT_DOUBLE_EQ(c.tasks[0].send, 0.1 + 1);
  // V-shaped: 4 stages on 2 ranks; nothing crosses the link at the turn, one optimizer per rank.
  std::vector<PipeStageMeasure> v = {m[0], m[1], m[1], m[0]};
  v[2].optimizer = v[3].optimizer = 0;  // a rank measures it on its first stage
  const PipeCosts vc = costs_from_measures(v, 16, 4, {0, 1, 1, 0});
  EXPECT_GT(vc.send_forward.at(0), 0);
  EXPECT_EQ(vc.send_forward.at(1), 0);
  EXPECT_EQ(vc.optimizer, (std::vector<double>{0.5, 0.7}));
  const PipeStageMeasure back = measure_from_json(measure_json(m[0]));
  EXPECT_EQ(measure_json(back), measure_json(m[0]));
  const PipeSchedule s = make_schedule("1f1b", 2, 4);
  const PipeFillPlan p = plan_fill(s, m, 16, 4);
  EXPECT_TRUE(p.used);
  EXPECT_EQ(p.fill.filled_rows[0] + p.fill.serial_rows[0], 4 * 16);
  EXPECT_LT(p.fill.timeline.iteration, p.serial.iteration);
  EXPECT_NE(p.summary.find("fills the bubbles"), std::string::npos) << p.summary;
  EXPECT_EQ(fill_plan_json(p), fill_plan_json(plan_fill(s, m, 16, 4)));  // the same numbers, the same plan
  size_t pieces = 0;
  for (const auto& r : p.fill.schedule.ranks) pieces += static_cast<size_t>(std::count_if(r.begin(), r.end(), [](const PipeAction& a) { return a.op == PipeOp::kTask; }));
  EXPECT_EQ(prep_pieces(p.fill.schedule, 16).size(), pieces);
  // A quantum longer than every bubble: nothing is placed, the prepare phase stays serial.
  std::vector<PipeStageMeasure> slow = m;
  slow[0].prepare_quantum = slow[1].prepare_quantum = 100;
  const PipeFillPlan none = plan_fill(s, slow, 16, 4);
  EXPECT_FALSE(none.used);
  EXPECT_NE(none.summary.find("stays serial"), std::string::npos) << none.summary;
  // Bad measurements.
  EXPECT_NE(error_message([] { measure_from_json("{\"forward_ms\": 1}"); }).find("not what this ddm sends"), std::string::npos);
  EXPECT_NE(error_message([] { PipeStageMeasure bad; bad.forward = -1; measure_from_json(measure_json(bad)); }).find("negative or non-finite"),
            std::string::npos);
  std::vector<PipeStageMeasure> short_list = m;
  short_list[1].prepared_bytes = {1};
  EXPECT_NE(error_message([&] { costs_from_measures(short_list, 16, 4); }).find("prepared bytes of 1 ranks"), std::string::npos);
  EXPECT_NE(error_message([&] { costs_from_measures({m[0]}, 16, 4); }).find("at least 2 stages"), std::string::npos);
}

// Self-conditioning's first passes in a run's fill plan: one task per stage (1 + s), in whole quanta,
// on the stage's rank, chained stage after stage (stage 0's after this step's prepared rows: the
// serial pieces of the cross-iteration prepare task), consumed by stage 0's forward. Where the link
// leaves room, passes move into bubbles, some in partial batches, and every dependency holds in the
// filled timeline (a stage's pass starts after every piece of the previous stage's).
TEST(PipeCalibrate, SelfConditioningPassesFillBubbles) {
  std::vector<PipeStageMeasure> m(2);
  m[0] = {2, 3, 0, 0.5, 0.4, 5000, {1000, 600}, 0.1, 1000, {0, 0}, 1.6, 2000};
  m[1] = {1.5, 2.5, 0, 0.7, 0.6, 0, {1000, 600}, 0, 0, {0, 0}, 0.3, 2000};
  const PipeCosts c = costs_from_measures(m, 16, 4);
  ASSERT_EQ(c.tasks.size(), 3u);
  for (int s = 0; s < 2; ++s) {
    const PipeTask& k = c.tasks[1 + s];
    EXPECT_EQ(k.quantum, 4);
    EXPECT_EQ(k.ranks, std::vector<int>{s});
    EXPECT_EQ(k.after, s);  // stage 0's after the prepare task
    EXPECT_EQ(k.consumer, 0);
    EXPECT_FALSE(k.cross_iteration);
    EXPECT_DOUBLE_EQ(k.time(16), s == 0 ? 1.6 : 0.3);
    EXPECT_DOUBLE_EQ(k.send, 0.1 + 2);  // on to stage 1, and back to stage 0
  }
  std::vector<PipeStageMeasure> without = m;
  without[1].first_pass = -1;  // not measured on every stage: no passes planned
  EXPECT_EQ(costs_from_measures(without, 16, 4).tasks.size(), 1u);

  const PipeSchedule s = make_schedule("1f1b", 2, 4);
  const PipeFillPlan p = plan_fill(s, m, 16, 4);
  EXPECT_TRUE(p.used);
  EXPECT_GE(p.first_pass_rows, 4);
  EXPECT_NE(p.summary.find("of the rows of the self-conditioning first passes (2 stages x 4 micro-batches) run in bubbles"),
            std::string::npos) << p.summary;
  EXPECT_LE(p.fill.timeline.iteration, p.serial.iteration + 1e-9);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(p.fill.filled_rows[t] + p.fill.serial_rows[t], 4 * 16) << t;
  // Each pass whole on its stage's rank; after its predecessor; before stage 0's forward.
  std::map<std::pair<int, int>, double> end_of;  // (task, micro) -> its end plus the send to the next rank
  std::map<int, double> prepared;                // micro -> the end of this step's serial prepare pieces
  std::map<std::pair<int, int>, int64_t> pass_rows;  // (task, micro) -> rows of its pieces
  bool partial = false;
  for (int r = 0; r < 2; ++r)
    for (const PipeSlot& x : p.fill.timeline.ranks[r]) {
      const PipeAction& a = x.action;
      if (a.op != PipeOp::kTask) continue;
      if (a.task == 0) {
        if (a.serial) prepared[a.micro] = std::max(prepared[a.micro], x.end + (r == 0 ? 0 : c.tasks[0].send));
        continue;
      }
      EXPECT_EQ(r, a.task - 1);
      EXPECT_EQ(a.rows % 4, 0);
      double& e = end_of[{a.task, a.micro}];
      e = std::max(e, x.end + c.tasks[a.task].send);
      pass_rows[{a.task, a.micro}] += a.rows;
      partial = partial || a.rows < 16;
    }
  for (const auto& [instance, n] : pass_rows) EXPECT_EQ(n, 16) << instance.first << "." << instance.second;
  EXPECT_TRUE(partial);  // some pass ran in partial batches
  for (int r = 0; r < 2; ++r)
    for (const PipeSlot& x : p.fill.timeline.ranks[r]) {
      const PipeAction& a = x.action;
      if (a.op == PipeOp::kTask && a.task == 1) {
        EXPECT_GE(x.start + 1e-9, prepared[a.micro]) << action_text(a);
      } else if (a.op == PipeOp::kTask && a.task == 2) {
        EXPECT_GE(x.start + 1e-9, end_of.at({1, a.micro})) << action_text(a);
      } else if (a.op == PipeOp::kForward && a.stage == 0) {
        EXPECT_GE(x.start + 1e-9, end_of.at({2, a.micro})) << a.micro;
      }
    }
  // The prepare phase's pieces alone are prepared rows; the passes are the runtime's first passes.
  size_t prepare_pieces = 0;
  for (const auto& r : p.fill.schedule.ranks)
    for (const PipeAction& a : r) prepare_pieces += a.op == PipeOp::kTask && a.task == 0;
  EXPECT_EQ(prep_pieces(p.fill.schedule, 16).size(), prepare_pieces);
  // The events of its timeline name each piece's task.
  const nlohmann::json j = nlohmann::json::parse(fill_plan_json(p));
  bool pass_in_bubble = false;
  for (const auto& r : j.at("ranks"))
    for (const auto& e : r)
      if (e.at(0) == "T" && e.at(6).get<int>() > 0 && e.at(5).get<bool>()) pass_in_bubble = true;
  EXPECT_TRUE(pass_in_bubble);
}
