// DiLoCo (parallel/diloco.h): with H = 1, outer lr 1 and momentum 0 the global weights become the mean
// of the replicas' weights after their inner step (which is not data parallel's step: AdamW is not
// linear in the gradient); the outer Nesterov step and the EMA against a hand computation; fragments
// cover every parameter exactly once and each launches once per cycle; through the real trainer
// (replicas as threads on a HashStore): a run killed and resumed is bit-identical, checkpoints hold
// the global weights and every replica's state, a checkpoint of 2 replicas resumes with 1, and the
// bytes sent are those of one all-reduce of the parameters per H steps.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "model/net.h"
#include "unit/test_dist_util.h"
#include "test_util.h"
#include "parallel/diloco.h"
#include "train/optimizer.h"
#include "unit/run/train_test_util.h"

using namespace ddm;
using namespace ddm::test;
namespace fs = std::filesystem;

namespace {

// Two linear layers: 4 parameter tensors, 14 weights, set to fixed values (no generator: ranks are
// threads).
struct Tiny {
  torch::nn::Sequential net{torch::nn::Linear(3, 2), torch::nn::Linear(2, 2)};
  FlatAdamW optim;
  Tiny() : optim(*net, AdamWOptions{}) {
    torch::NoGradGuard g;
    optim.flat_params().copy_(torch::linspace(-1, 1, optim.numel()));
    optim.flat_ema().copy_(optim.flat_params());
  }
};

DilocoConfig diloco_cfg(int64_t h, double lr, double mu, int64_t fragments = 1, int64_t overlap = 0) {
  DilocoConfig d;
  d.inner_steps = h;
  d.outer_lr = lr;
  d.outer_momentum = mu;
  d.fragments = fragments;
  d.overlap = overlap;
  return d;
}

}  // namespace

// Replica 0's gradient is +1 everywhere, replica 1's -0.5: AdamW's first step moves each by -lr and
// +lr per weight, so their mean does not move; data parallel's step on the mean gradient (+0.25)
// moves every weight by -lr.
TEST(Diloco, OneInnerStepWithOuterLrOneAndNoMomentumAveragesTheReplicas) {
  const double lr = 0.1;
  const auto errors = run_ranks(2, short_timeouts(), [&](Comm& c) {
    Tiny m;
    const torch::Tensor start = m.optim.flat_params().clone();
    auto comm = std::shared_ptr<Comm>(&c, [](Comm*) {});
    Diloco d(diloco_cfg(1, 1.0, 0.0), comm, m.optim, 0.999, 0);
    m.optim.flat_grad().fill_(c.rank() == 0 ? 1.0 : -0.5);
    m.optim.step(lr);
    torch::Tensor mean = m.optim.flat_params().clone();
    c.allreduce_sum(mean);
    mean.div_(2);
    const auto report = d.after_step(1, 10, 0);
    EXPECT_TRUE(report.synced);
    EXPECT_EQ(report.stop, 0);
    EXPECT_LE((d.global() - mean).abs().max().item<double>(), 1e-6);
    EXPECT_TRUE(torch::equal(m.optim.flat_params(), d.global()));  // every replica continues from it
    EXPECT_LE((d.global() - start).abs().max().item<double>(), 1e-6);  // here: the start
    // Data parallel: one AdamW step on the mean gradient.
    Tiny dp;
    dp.optim.flat_grad().fill_(0.25);
    dp.optim.step(lr);
    EXPECT_GT((dp.optim.flat_params() - d.global()).abs().min().item<double>(), 0.9 * lr);
  });
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
}

// One replica, H = 1: three outer steps of torch.optim.SGD(nesterov=True) computed here by hand in
// double precision, and the EMA following the global weights with the trainer's warm-up decay.
TEST(Diloco, OuterNesterovStepAndEmaMatchAHandComputation) {
  auto comm = Comm::create(DistEnv{});
  Tiny m;
  const double lr = 0.7, mu = 0.9, ema_decay = 0.5;
  Diloco d(diloco_cfg(1, lr, mu), comm, m.optim, ema_decay, 0);
  const int64_t n = m.optim.numel();
  std::vector<double> theta(n), mom(n, 0.0), ema(n);
  for (int64_t i = 0; i < n; ++i) theta[i] = ema[i] = m.optim.flat_params()[i].item<double>();
  for (int k = 1; k <= 3; ++k) {
    // The inner step, as a known displacement of the local weights.
    const torch::Tensor shift = torch::linspace(0.1 * k, -0.2, n);
    {
      torch::NoGradGuard g;
      m.optim.flat_params().add_(shift);
    }
    d.after_step(k, 100, 0);
    const double keep = std::min(ema_decay, (1.0 + k) / (10.0 + k));
    for (int64_t i = 0; i < n; ++i) {
      const double delta = -shift[i].item<double>();  // global - local
      mom[i] = mu * mom[i] + delta;
      theta[i] -= lr * (delta + mu * mom[i]);
      ema[i] = keep * ema[i] + (1 - keep) * theta[i];
    }
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(d.global()[i].item<double>(), theta[i], 1e-5) << "sync " << k << " weight " << i;
      EXPECT_NEAR(d.momentum()[i].item<double>(), mom[i], 1e-5) << "sync " << k << " weight " << i;
      EXPECT_NEAR(m.optim.flat_ema()[i].item<double>(), ema[i], 1e-5) << "sync " << k << " weight " << i;
    }
    EXPECT_TRUE(torch::equal(m.optim.flat_params(), d.global()));
  }
  EXPECT_EQ(d.syncs(), 3);
}

TEST(Diloco, FragmentsCoverEveryParameterOnceAndEachLaunchesOncePerCycle) {
  RunConfig cfg = tiny("unet");
  cfg.model.in_channels = 1;
  cfg.model.image_size = 8;
  cfg.model.num_classes = 3;
  Net net = make_net(cfg.model);
  FlatAdamW optim(*net, AdamWOptions{});
  const auto& params = optim.params();
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<int64_t> boundaries{0};
  for (const auto& p : params) boundaries.push_back(boundaries.back() + p.numel());
  for (int64_t f : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{7}, n}) {
    const auto frags = Diloco::split_fragments(params, f);
    ASSERT_EQ(static_cast<int64_t>(frags.size()), f);
    int64_t at = 0;
    for (const auto& [b, e] : frags) {
      EXPECT_EQ(b, at);  // contiguous: each weight in exactly one fragment
      EXPECT_LT(b, e);
      EXPECT_NE(std::find(boundaries.begin(), boundaries.end(), e), boundaries.end()) << "not on a tensor boundary";
      at = e;
    }
    EXPECT_EQ(at, optim.numel());
  }
  // Balanced: with 3 fragments none holds more than half the weights on this model.
  for (const auto& [b, e] : Diloco::split_fragments(params, 3)) EXPECT_LE(e - b, optim.numel() / 2);
  EXPECT_NE(error_message([&] { Diloco::split_fragments(params, n + 1); })
                .find("diloco.fragments = " + std::to_string(n + 1) + " but the model has only " + std::to_string(n)),
            std::string::npos);

  auto comm = Comm::create(DistEnv{});
  for (auto [h, f] : {std::pair<int64_t, int64_t>{12, 5}, {8, 2}, {5, 5}, {7, 1}}) {
    Diloco d(diloco_cfg(h, 0.7, 0.9, f), comm, optim, 0.999, 0);
    for (int64_t cycle = 0; cycle < 3; ++cycle) {
      std::vector<int> launches(f, 0);
      std::vector<int64_t> at;
      for (int64_t s = cycle * h + 1; s <= (cycle + 1) * h; ++s)
        for (int64_t k = 0; k < f; ++k)
          if (d.launches_after(k, s)) {
            ++launches[k];
            at.push_back(s);
          }
      EXPECT_EQ(launches, std::vector<int>(f, 1)) << "H " << h << " F " << f;
      EXPECT_EQ(std::set<int64_t>(at.begin(), at.end()).size(), static_cast<size_t>(f)) << "staggered";
    }
  }
}

// Streaming: 2 fragments synchronize at alternating steps, each touching only its own weights.
TEST(Diloco, EachFragmentSyncTouchesOnlyItsWeights) {
  auto comm = Comm::create(DistEnv{});
  Tiny m;
  Diloco d(diloco_cfg(2, 0.7, 0.9, 2), comm, m.optim, 0.999, 0);
  const auto frags = d.fragments();
  for (int64_t s = 1; s <= 4; ++s) {
    const torch::Tensor before = d.global().clone();
    {
      torch::NoGradGuard g;
      m.optim.flat_params().add_(0.01);
    }
    d.after_step(s, 100, 0);
    for (int64_t f = 0; f < 2; ++f) {
      const auto [b, e] = frags[f];
      const bool moved = !torch::equal(d.global().slice(0, b, e), before.slice(0, b, e));
      EXPECT_EQ(moved, d.launches_after(f, s)) << "step " << s << " fragment " << f;
    }
  }
}

namespace {

RunConfig diloco_run(int64_t h, int64_t fragments, int64_t overlap) {
  RunConfig cfg = tiny("unet");
  cfg.parallel.mode = SyncMode::kDiloco;
  cfg.diloco.inner_steps = h;
  cfg.diloco.fragments = fragments;
  cfg.diloco.overlap = overlap;
  return cfg;
}

}  // namespace

// Streaming DiLoCo with an overlapped all-reduce: the checkpoint due at step 10 waits for the
// fragment in flight and lands at step 11; resuming from it reproduces the uninterrupted run.
TEST(Diloco, ResumeIsBitIdenticalAndCheckpointsHoldEveryReplica) {
  TempDir dir;
  const RunConfig cfg = diloco_run(4, 2, 1);
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "a"), (std::vector<std::string>{"", ""}));
  const auto ckpts = list_checkpoints(dir / "a");
  ASSERT_EQ(ckpts.size(), 2u);
  EXPECT_EQ(fs::path(ckpts[0]).filename(), "step-00000011");
  fs::copy(dir / "a", dir / "b", fs::copy_options::recursive);
  fs::remove_all(dir / "b/ckpt/step-00000020");  // as if killed after step 11's checkpoint
  ASSERT_EQ(list_checkpoints(dir / "b").size(), 1u);
  std::vector<TrainSummary> resumed;
  ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / "b", true, &resumed), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(resumed[0].first_step, 11);
  EXPECT_EQ(resumed[1].first_step, 11);
  EXPECT_EQ(losses(dir / "a"), losses(dir / "b"));
  EXPECT_EQ(max_weight_difference(final_weights(dir / "a"), final_weights(dir / "b")), 0.0);
  const Checkpoint a = read_checkpoint(*latest_checkpoint(dir / "a")), b = read_checkpoint(*latest_checkpoint(dir / "b"));
  EXPECT_EQ(max_weight_difference(a.ema, b.ema), 0.0);
  EXPECT_EQ(max_weight_difference(a.optim, b.optim), 0.0);
  // The mid-run checkpoint holds both replicas' different local weights, the outer momentum and the
  // global weights as the model; the final one ends on the global weights everywhere.
  const Checkpoint mid = read_checkpoint(ckpts[0]);
  EXPECT_EQ(mid.state["diloco"]["world_size"], 2);
  EXPECT_EQ(mid.state["diloco"]["last_sync"], (std::vector<int64_t>{8, 10}));
  const std::string w = mid.model.begin()->first;
  ASSERT_TRUE(mid.optim.count("replica1.params." + w) && mid.optim.count("outer_momentum." + w));
  EXPECT_FALSE(torch::equal(mid.optim.at("replica0.params." + w), mid.optim.at("replica1.params." + w)));
  EXPECT_TRUE(torch::equal(a.optim.at("replica0.params." + w), a.model.at(w)));
  EXPECT_TRUE(torch::equal(a.optim.at("replica1.params." + w), a.model.at(w)));

  // Another world size: 1 replica continues from replica 0's state, and finishes.
  fs::copy(dir / "b", dir / "c", fs::copy_options::recursive);
  RunConfig more = cfg;
  more.train.steps = 24;
  ASSERT_EQ(train_ranks(1, {more}, dir / "c", true, &resumed), std::vector<std::string>{""});
  EXPECT_EQ(resumed[0].first_step, 20);
  EXPECT_EQ(losses(dir / "c").size(), 24u);
}

// Bytes: data parallel all-reduces the gradient (4 P bytes from each of 2 ranks) plus the loss and the
// stop flag (8 bytes each) every step; DiLoCo the pseudo-gradient (4 P) plus its stop flags and
// contributor count (24) once per H = 4 steps.
TEST(Diloco, SendsOneParameterAllReducePerInnerStepsAndReportsIt) {
  TempDir dir;
  RunConfig dp = tiny("unet");
  dp.train.steps = 8;
  dp.train.log_every = 4;
  RunConfig dl = diloco_run(4, 1, 0);
  dl.train.steps = 8;
  dl.train.log_every = 4;
  ASSERT_EQ(train_ranks(2, {dp, dp}, dir / "dp"), (std::vector<std::string>{"", ""}));
  ASSERT_EQ(train_ranks(2, {dl, dl}, dir / "dl"), (std::vector<std::string>{"", ""}));
  int64_t params = 0;
  for (const auto& [name, t] : read_checkpoint(*latest_checkpoint(dir / "dp")).optim)
    if (name.rfind("exp_avg.", 0) == 0) params += t.numel();
  auto per_step = [](const std::string& run) {
    std::vector<int64_t> out;
    std::ifstream in(run + "/metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["sent_bytes_per_step"].get<int64_t>());
    return out;
  };
  const auto a = per_step(dir / "dp"), b = per_step(dir / "dl");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  const int64_t params_bytes = 4 * params;
  EXPECT_EQ(a[0], params_bytes + 16);
  EXPECT_EQ(a[1], params_bytes + 16);
  EXPECT_EQ(b[0], (params_bytes + 24) / 4);
  EXPECT_EQ(b[1], (params_bytes + 24) / 4);
}
