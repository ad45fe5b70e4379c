// Tests of the prepare phase in pieces (pipeline/prepare.h): quanta and the pieces of a filled schedule.
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

TEST(PipePrepare, QuantaAndThePiecesOfAFilledSchedule) {
  for (const auto& [rows, q] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {2, 1}, {4, 1}, {6, 1}, {7, 1}, {8, 1},
                                                                        {9, 3}, {16, 2}, {64, 8}, {128, 16}, {96, 12},
                                                                        {11, 1}})
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
