// Tests of schedule generators (pipeline/schedule.h): the shapes of each schedule, V-shaped placement, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "core/config.h"
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

// parallel.schedule (parsed into an enum by the config, which cannot include the planner) names
// exactly the planner's schedules, and agrees with it on which are V-shaped.
TEST(PipeSchedule, TheConfigsScheduleNamesAreThePlannersNames) {
  for (const std::string& name : ddm::schedule_names()) {
    const ddm::ScheduleKind kind = ddm::parse_config("", "t.toml", {"parallel.schedule=" + name}).parallel.schedule;
    EXPECT_EQ(ddm::name_of(kind), name);
    EXPECT_EQ(ddm::v_shaped(kind), ddm::is_v_schedule(name)) << name;
  }
  for (auto kind : {ddm::ScheduleKind::kGpipe, ddm::ScheduleKind::k1f1b, ddm::ScheduleKind::kZbH1,
                    ddm::ScheduleKind::k1f1bV, ddm::ScheduleKind::kZbV})
    EXPECT_NE(std::find(ddm::schedule_names().begin(), ddm::schedule_names().end(), ddm::name_of(kind)),
              ddm::schedule_names().end());
}
