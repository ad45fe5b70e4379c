// Tests of costs and a fill plan from a run's measurements (pipeline/calibrate.h), self-conditioning's passes included.
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
