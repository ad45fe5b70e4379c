// A pipeline stage (pipeline/stage.h), alone: two hand-made stages on two ranks (threads) driven
// by a schedule's action lists give exactly the gradients of the same model run whole in one
// process, with the skip carried through the carry or sent straight to its reader, with the whole
// backward (B) or ZB's split of it (I, then W); two stages of one rank pass everything through the
// mailbox; a stage without a loss is a clear error.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "pipeline/stage.h"
#include "test_util.h"
#include "unit/test_dist_util.h"

namespace {

using namespace ddm;
using ddm::test::error_message;
using ddm::test::has;

constexpr int kMicro = 3;
constexpr int64_t kRows = 4;

// The model: stage 0's unit h1 = tanh(x W1), which also opens a skip (h1 itself); stage 1's unit
// out = h1 W2 + the skip. Loss: the mean of out^2, over M micro-batches.
struct Weights {
  torch::Tensor w1, w2;  // [5, 6], [6, 6]
  Weights clone() const {
    return {w1.detach().clone().requires_grad_(true), w2.detach().clone().requires_grad_(true)};
  }
};

std::vector<NetUnit> units_of(const Weights& w, int stage) {
  NetUnit u;
  if (stage == 0) {
    u.name = "in";
    u.params = {w.w1};
    u.run = [w1 = w.w1](NetCarry& k, const torch::Tensor&, const Cond&) {
      k.h = torch::tanh(torch::matmul(k.h, w1));  // [rows, 6]
      k.skips.push_back(k.h);
    };
  } else {
    u.name = "out";
    u.params = {w.w2};
    u.run = [w2 = w.w2](NetCarry& k, const torch::Tensor&, const Cond&) {
      k.h = torch::matmul(k.h, w2) + k.skips.back();  // [rows, 6]
      k.skips.pop_back();
    };
  }
  return {u};
}

std::vector<Prepared> inputs() {
  torch::manual_seed(11);
  std::vector<Prepared> p(kMicro);
  for (Prepared& x : p) {
    x.xt = torch::randn({kRows, 5});
    x.t = torch::rand({kRows});
  }
  return p;
}

torch::Tensor loss_of(const torch::Tensor& out) { return (out * out).mean() * (1.0 / kMicro); }

// The reference: the two units in one process, each micro-batch's backward in turn.
Weights whole_model_grads(const Weights& init) {
  const Weights w = init.clone();
  const std::vector<NetUnit> a = units_of(w, 0), b = units_of(w, 1);
  for (const Prepared& p : inputs()) {
    NetCarry k;
    k.h = p.xt;
    a[0].run(k, p.t, p.cond);
    b[0].run(k, p.t, p.cond);
    loss_of(k.h).backward();
  }
  return {w.w1.grad(), w.w2.grad()};
}

// Routes: the skip carried with h, or sent from stage 0 straight to stage 1.
PipeSkipRoutes routes(bool direct) {
  PipeSkipRoutes r;
  r.in.assign(2, {});
  r.slots = 1;
  if (direct) {
    r.out = {{1}};
    PipeSkipRoutes::Direct d;
    d.from = 0, d.slot = 0, d.row_shape = {6};
    r.in[1].push_back(d);
  }
  return r;
}

// Runs every action of `rank`'s list of `schedule` on its stages (one, or two under a V).
void run_actions(const PipeSchedule& schedule, int rank, std::vector<PipeStage>& stages, const std::vector<Prepared>& p) {
  auto stage = [&](int s) -> PipeStage& {
    for (PipeStage& l : stages)
      if (l.stage() == s) return l;
    throw std::runtime_error("no stage " + std::to_string(s));
  };
  for (PipeStage& l : stages) l.begin_step(kMicro, 2);
  for (const PipeAction& a : schedule.ranks[static_cast<size_t>(rank)]) {
    PipeStage& l = stage(a.stage);
    if (a.op != PipeOp::kForward) {
      l.backward(a.micro, a.op);
      continue;
    }
    const torch::Tensor out = l.forward(a.micro, p[static_cast<size_t>(a.micro)]);
    if (l.last()) l.set_loss(a.micro, loss_of(out));
  }
}

// Stage s of the pipeline's gradients after one step on `ranks` ranks (1: both stages on one rank).
Weights pipeline_grads(const Weights& init, const std::string& schedule_name, int ranks, bool direct) {
  const PipeSchedule schedule = make_schedule(schedule_name, ranks, kMicro);
  EXPECT_EQ(schedule.stages, 2);
  const PipeSkipRoutes r = routes(direct);
  Weights got;
  // Drawn once, before the ranks start: ranks as threads share LibTorch's default generator, so
  // drawing on each would interleave their draws.
  const std::vector<Prepared> p = inputs();
  const auto errors = test::run_ranks(ranks, test::short_timeouts(), [&](Comm& comm) {
    std::shared_ptr<Comm> c(&comm, [](Comm*) {});  // the runner owns it
    PipeWire wire(c, schedule, r.slots, /*bf16=*/false);
    const Weights w = init.clone();
    std::vector<PipeStage> stages;
    for (int s = 0; s < 2; ++s)
      if (schedule.rank_of(s) == comm.rank()) {
        const torch::Tensor param = s == 0 ? w.w1 : w.w2;
        stages.emplace_back(s, 2, units_of(w, s), std::vector<torch::Tensor>{param}, wire, r, kRows);
      }
    run_actions(schedule, comm.rank(), stages, p);
    wire.wait_sends();
    if (schedule.rank_of(0) == comm.rank()) got.w1 = w.w1.grad();
    if (schedule.rank_of(1) == comm.rank()) got.w2 = w.w2.grad();
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  return got;
}

Weights initial() {
  torch::manual_seed(7);
  return {torch::randn({5, 6}) * 0.5, torch::randn({6, 6}) * 0.5};
}

TEST(PipeStage, TwoStagesOnTwoRanksGiveTheWholeModelsGradients) {
  const Weights init = initial();
  const Weights want = whole_model_grads(init);
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"})
    for (bool direct : {false, true}) {
      SCOPED_TRACE(std::string(schedule) + (direct ? ", skip sent straight to stage 1" : ", skip carried"));
      const Weights got = pipeline_grads(init, schedule, 2, direct);
      ASSERT_TRUE(got.w1.defined() && got.w2.defined());
      // The same operations in the same order on each tensor: the same bits.
      EXPECT_TRUE(torch::equal(got.w1, want.w1));
      EXPECT_TRUE(torch::equal(got.w2, want.w2));
    }
}

TEST(PipeStage, TwoStagesOfOneRankPassEverythingThroughTheMailbox) {
  const Weights init = initial();
  const Weights want = whole_model_grads(init);
  for (const char* schedule : {"1f1b-v", "zb-v"}) {
    SCOPED_TRACE(schedule);
    const Weights got = pipeline_grads(init, schedule, 1, /*direct=*/false);
    EXPECT_TRUE(torch::equal(got.w1, want.w1));
    EXPECT_TRUE(torch::equal(got.w2, want.w2));
  }
}

TEST(PipeStage, OnlyTheLastStageTakesALossAndABackwardNeedsItsForward) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto comm = Comm::create_for_test(store, 0, 1, test::short_timeouts());
  const PipeSchedule v = make_schedule("1f1b-v", 1, kMicro);
  const PipeSkipRoutes r = routes(false);
  PipeWire wire(comm, v, r.slots, false);
  const Weights w = initial();
  PipeStage first(0, 2, units_of(w, 0), {w.w1}, wire, r, kRows);
  first.begin_step(kMicro, 2);
  EXPECT_TRUE(has(error_message([&] { first.set_loss(0, torch::zeros({})); }), "stage 0 is not the last"));
  EXPECT_TRUE(has(error_message([&] { first.backward(1, PipeOp::kBackward); }), "backward of micro-batch 1 before its forward"));
  EXPECT_TRUE(has(error_message([&] { PipeStage(0, 3, units_of(w, 0), {w.w1}, wire, r, kRows); }),
                  "skip routes for 2 stages, not 3"));
}

}  // namespace
