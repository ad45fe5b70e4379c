// Self-conditioning's first pass through a pipeline (pipeline/first_pass.h), alone: two hand-made
// stages of one rank (a V: the messages go through the mailbox) give the same estimates bit for bit
// however the pass is cut into pieces, the objective's estimate of the chosen rows (within float32
// rounding of the rows run together), zeros for the rows not chosen; a piece that skips rows is a
// clear error.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "pipeline/first_pass.h"
#include "test_util.h"
#include "unit/test_dist_util.h"

namespace {

using namespace ddm;
using ddm::test::error_message;
using ddm::test::has;

constexpr int kMicro = 2;
constexpr int64_t kRows = 8, kQuantum = 2;

// Stage 0: h = tanh(h * a), opening a skip (h); stage 1: h = h * b + the skip. Tensors [n, 1, 2, 3].
std::vector<NetUnit> units_of(const torch::Tensor& a, const torch::Tensor& b, int stage) {
  NetUnit u;
  u.name = stage == 0 ? "in" : "out";
  if (stage == 0)
    u.run = [a](NetCarry& k, const torch::Tensor&, const Cond&) {
      k.h = torch::tanh(k.h * a);
      k.skips.push_back(k.h);
    };
  else
    u.run = [b](NetCarry& k, const torch::Tensor&, const Cond&) {
      k.h = k.h * b + k.skips.back();
      k.skips.pop_back();
    };
  return {u};
}

struct Inputs {
  std::shared_ptr<Objective> objective;
  torch::Tensor a, b;
  std::vector<Batch> micro;
  std::vector<Prepared> prep;
};

Inputs inputs() {
  RunConfig cfg;
  cfg.train.self_cond = 0.5;
  Inputs s;
  s.objective = make_objective(cfg);
  torch::manual_seed(4);
  s.a = torch::randn({1, 2, 3}), s.b = torch::randn({1, 2, 3});
  for (int m = 0; m < kMicro; ++m) {
    Batch batch;
    batch.first = m * kRows;
    s.micro.push_back(batch);
    Prepared p;
    p.xt = torch::randn({kRows, 1, 2, 3});
    p.t = torch::rand({kRows}) * 0.9 + 0.05;
    s.prep.push_back(p);
  }
  return s;
}

// Every micro-batch's self_cond after the pass, each stage's pieces cut at `cuts` (positions).
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> pass(Inputs& s, const std::vector<std::vector<int64_t>>& cuts) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto comm = Comm::create_for_test(store, 0, 1, test::short_timeouts());
  const PipeSchedule v = make_schedule("1f1b-v", 1, kMicro);
  PipeSkipRoutes routes;
  routes.in.assign(2, {});
  PipeWire wire(comm, v, 0, false);
  std::vector<PipeStage> stages;
  for (int st = 0; st < 2; ++st) stages.emplace_back(st, 2, units_of(s.a, s.b, st), std::vector<torch::Tensor>{}, wire, routes, kRows);
  PipeFirstPass first(*s.objective, wire, 2, kRows, kQuantum);
  wire.begin_step();
  first.begin_step(s.micro, /*step=*/3);
  for (int st = 0; st < 2; ++st)
    for (int m = 0; m < kMicro; ++m) {
      int64_t from = 0;
      for (int64_t to : cuts[static_cast<size_t>(st)]) {
        first.run(stages[static_cast<size_t>(st)], m, s.prep[static_cast<size_t>(m)], from, to - from);
        from = to;
      }
    }
  std::vector<torch::Tensor> est, rows;
  for (int m = 0; m < kMicro; ++m) {
    Prepared p = s.prep[static_cast<size_t>(m)];
    first.estimate(m, p);
    est.push_back(p.cond.self_cond);
    rows.push_back(first.rows_of(m));
  }
  return {est, rows};
}

TEST(PipeFirstPass, AnyCutIntoPiecesGivesTheSameEstimatesAsTheRowsRunTogether) {
  Inputs s = inputs();
  const auto [whole, rows] = pass(s, {{kRows}, {kRows}});
  const auto [cut, rows2] = pass(s, {{2, 6, 8}, {4, 8}});
  const auto [quanta, rows3] = pass(s, {{2, 4, 6, 8}, {2, 4, 6, 8}});
  int64_t chosen = 0;
  for (int m = 0; m < kMicro; ++m) {
    EXPECT_TRUE(torch::equal(cut[static_cast<size_t>(m)], whole[static_cast<size_t>(m)]));
    EXPECT_TRUE(torch::equal(quanta[static_cast<size_t>(m)], whole[static_cast<size_t>(m)]));
    EXPECT_TRUE(torch::equal(rows[static_cast<size_t>(m)], rows2[static_cast<size_t>(m)]));
    // The objective's estimate from the model run on the chosen rows at once; zeros elsewhere.
    const torch::Tensor idx = rows[static_cast<size_t>(m)];
    chosen += idx.numel();
    const Prepared& p = s.prep[static_cast<size_t>(m)];
    const torch::Tensor x = p.xt.index_select(0, idx), t = p.t.index_select(0, idx);
    NetCarry k;
    k.h = x;
    for (int st = 0; st < 2; ++st) units_of(s.a, s.b, st)[0].run(k, t, Cond{});
    torch::Tensor want = torch::zeros_like(p.xt);
    want.index_copy_(0, idx, s.objective->self_cond_estimate(x, t, k.h));
    EXPECT_TRUE(torch::allclose(whole[static_cast<size_t>(m)], want, 1e-6, 1e-6));
    const torch::Tensor others = torch::ones({kRows}, torch::kBool).index_fill_(0, idx, false);
    const double unchosen = whole[static_cast<size_t>(m)].index({others}).abs().sum().item<double>();
    EXPECT_EQ(unchosen, 0.0);
  }
  EXPECT_GT(chosen, 0);                   // self_cond = 0.5 of 16 rows: some chosen,
  EXPECT_LT(chosen, kMicro * kRows);      // and some not
}

TEST(PipeFirstPass, APieceThatSkipsRowsIsAClearError) {
  Inputs s = inputs();
  EXPECT_EQ(error_message([&] { pass(s, {{2, 8}, {4, 8}}); }), "");  // a valid cut
  const std::string e = error_message([&] {
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto comm = Comm::create_for_test(store, 0, 1, test::short_timeouts());
    PipeWire wire(comm, make_schedule("1f1b-v", 1, kMicro), 0, false);
    PipeSkipRoutes routes;
    routes.in.assign(2, {});
    PipeStage stage(0, 2, units_of(s.a, s.b, 0), {}, wire, routes, kRows);
    PipeFirstPass first(*s.objective, wire, 2, kRows, kQuantum);
    first.begin_step(s.micro, 3);
    first.run(stage, 0, s.prep[0], 0, 2);
    first.run(stage, 0, s.prep[0], 4, 2);  // rows 2..3 skipped
  });
  EXPECT_TRUE(has(e, "stage 0's first-pass piece of micro-batch 0 covers rows [4, 6), expected whole quanta of 2 from row 2"))
      << e;
  EXPECT_TRUE(has(error_message([&] {
                    auto store = c10::make_intrusive<c10d::HashStore>();
                    const auto comm = Comm::create_for_test(store, 0, 1, test::short_timeouts());
                    PipeWire wire(comm, make_schedule("1f1b-v", 1, kMicro), 0, false);
                    PipeFirstPass(*s.objective, wire, 2, kRows, 3);
                  }),
                  "a first pass of 8 rows in quanta of 3"));
}

}  // namespace
