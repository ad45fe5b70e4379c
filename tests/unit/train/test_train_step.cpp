// The phased training step and its objectives: per-sample draws keyed by the global position (a
// batch split anywhere draws what the whole batch draws), gradient accumulation over micro-batches
// equal to one step on the whole batch within float32 rounding, optimizer state saved by parameter
// name (and the older flat format still read), and frozen parameters kept out of the optimizer,
// the EMA and the gradient buffer while saved and loaded with the model.
#include <gtest/gtest.h>

#include "core/config.h"
#include "core/error.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "parallel/layout.h"
#include "train/step.h"

using namespace ddm;

namespace {

RunConfig tiny_config(const std::string& arch = "unet") {
  RunConfig cfg;
  cfg.model.arch = arch;
  cfg.model.channels = 8;
  cfg.model.channel_mult = {1, 2};
  cfg.model.groups = 4;
  cfg.model.width = 32;
  cfg.model.depth = 2;
  cfg.model.heads = 2;
  cfg.model.patch = 2;
  cfg.model.in_channels = 1;
  cfg.model.image_size = 8;
  cfg.model.num_classes = 3;
  cfg.train.label_dropout = 0.3;
  cfg.train.seed = 5;
  cfg.train.warmup = 0;
  return cfg;
}

Batch random_batch(int64_t n, int64_t seed) {
  torch::manual_seed(seed);
  return Batch{torch::rand({n, 1, 8, 8}) * 2 - 1, torch::randint(0, 3, {n}), torch::randint(0, 2, {n}), 0};
}

Batch slice(const Batch& b, int64_t begin, int64_t n) {
  return Batch{b.x.narrow(0, begin, n), b.y.narrow(0, begin, n), b.k.narrow(0, begin, n), b.first + begin};
}

Net net_with_seed(const RunConfig& cfg, int64_t seed) {
  torch::manual_seed(seed);
  return make_net(cfg.model);
}

}  // namespace

TEST(Objective, DrawsDependOnTheGlobalPositionNotOnTheSplit) {
  const RunConfig cfg = tiny_config();
  for (const char* time_dist : {"uniform", "logit-normal"}) {
    RunConfig c = cfg;
    c.diffusion.time_dist = time_dist;
    const Objective obj(c);
    const Batch whole = random_batch(12, 1);
    torch::NoGradGuard ng;
    const Prepared all = obj.prepare(whole, 7);
    const Prepared a = obj.prepare(slice(whole, 0, 5), 7), b = obj.prepare(slice(whole, 5, 7), 7);
    EXPECT_TRUE(torch::equal(torch::cat({a.xt, b.xt}), all.xt)) << time_dist;
    EXPECT_TRUE(torch::equal(torch::cat({a.t, b.t}), all.t)) << time_dist;
    EXPECT_TRUE(torch::equal(torch::cat({a.cond.y, b.cond.y}), all.cond.y)) << time_dist;
    EXPECT_TRUE(torch::equal(torch::cat({a.target, b.target}), all.target)) << time_dist;
    // Another step, or the same samples at other positions, draw differently.
    EXPECT_FALSE(torch::equal(obj.prepare(whole, 8).t, all.t));
    Batch shifted = whole;
    shifted.first = 12;
    EXPECT_FALSE(torch::equal(obj.prepare(shifted, 7).t, all.t));
  }
}

TEST(Objective, DrawsHaveTheRightDistribution) {
  RunConfig c = tiny_config();
  c.train.label_dropout = 0.25;
  const Objective obj(c);
  const auto t = obj.draw_time(0, 0, 20000);
  EXPECT_NEAR(t.mean().item<double>(), 0.5, 0.01);
  EXPECT_GE(t.min().item<double>(), 0.0);
  EXPECT_LT(t.max().item<double>(), 1.0);
  const auto eps = obj.draw_noise(0, 0, torch::zeros({500, 1, 8, 8}));
  EXPECT_NEAR(eps.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(eps.std().item<double>(), 1.0, 0.01);
  Batch b{torch::zeros({20000, 1, 2, 2}), torch::zeros({20000}, torch::kLong), torch::Tensor(), 0};
  torch::NoGradGuard ng;
  const double dropped = (obj.prepare(b, 0).cond.y == 3).to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(dropped, 0.25, 0.01);
}

TEST(TrainStep, MicroBatchesEqualTheWholeBatchWithinFloatRounding) {
  // Gradient accumulation over 2 and 4 micro-batches against one batch of 16, for a U-Net and a DiT.
  // Both float32 results approximate the same exact gradient; the reference for "how far float32
  // rounding moves it" is the float64 computation: a split must stay within 4x the unsplit result's
  // own float32 error. Dropping one micro-batch (a real bug) must exceed that by far.
  for (const char* arch : {"unet", "dit"}) {
    const RunConfig cfg = tiny_config(arch);
    const Batch whole = random_batch(16, 2);
    const auto objective = make_objective(cfg);
    auto grad_of = [&](const std::vector<Batch>& micro, torch::Dtype dtype) {
      Net net = net_with_seed(cfg, 9);
      net->to(dtype);
      const double scale = 1.0 / static_cast<double>(micro.size());
      for (const auto& b : micro) {
        Prepared p;
        {
          torch::NoGradGuard ng;
          p = objective->prepare(b, 0);  // drawn in float32, then the same values in dtype
          p.xt = p.xt.to(dtype);
          p.t = p.t.to(dtype);
          p.target = p.target.to(dtype);
        }
        (objective->loss(net->forward(p.xt, p.t, p.cond), p) * scale).backward();
      }
      std::vector<torch::Tensor> g;
      for (const auto& q : net->parameters()) g.push_back(q.grad().to(torch::kDouble).flatten());
      return torch::cat(g);
    };
    const auto g64 = grad_of({whole}, torch::kDouble);
    const auto g32 = grad_of({whole}, torch::kFloat);
    const double own_error = (g32 - g64).abs().max().item<double>();
    ASSERT_GT(own_error, 0.0);
    for (int64_t parts : {2, 4}) {
      std::vector<Batch> micro;
      for (int64_t i = 0; i < parts; ++i) micro.push_back(slice(whole, i * 16 / parts, 16 / parts));
      const double err = (grad_of(micro, torch::kFloat) - g64).abs().max().item<double>();
      EXPECT_LE(err, 4 * own_error) << arch << ", " << parts << " micro-batches";
      micro.pop_back();  // the bug: one micro-batch lost
      const double bug = (grad_of(micro, torch::kFloat) * parts / (parts - 1.0) - g64).abs().max().item<double>();
      EXPECT_GT(bug, 100 * own_error) << arch;
    }
  }
}

TEST(TrainStep, RunWithMicroBatchesTakesOneStepPerCall) {
  const RunConfig cfg = tiny_config();
  const Batch whole = random_batch(8, 3);
  TrainStep a(cfg, net_with_seed(cfg, 4), make_objective(cfg)), b(cfg, net_with_seed(cfg, 4), make_objective(cfg));
  for (int64_t s = 0; s < 3; ++s) {
    const StepResult ra = a.run(whole, s), rb = b.run({slice(whole, 0, 4), slice(whole, 4, 4)}, s);
    EXPECT_NEAR(ra.loss, rb.loss, 1e-5 * ra.loss);
    EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-4 * ra.grad_norm);
  }
  EXPECT_EQ(a.optim().step_count(), 3);
  EXPECT_EQ(b.optim().step_count(), 3);
}

TEST(TrainStep, PreparingTheNextStepAheadChangesNoBit) {
  // The next step's prepare phase run at the end of this one (what the training loop does with one
  // process or data parallelism) gives bit for bit what preparing it at its own start gives: with
  // self-conditioning, whose first pass reads the weights this step's update just wrote, and over 2
  // micro-batches. A batch other than the one prepared ahead (other memory) is prepared as usual.
  RunConfig cfg = tiny_config();
  cfg.train.self_cond = 0.5;
  cfg.model.self_cond = true;
  const int64_t steps = 5;
  std::vector<std::vector<Batch>> batches;
  for (int64_t s = 0; s < steps; ++s) {
    const Batch b = random_batch(8, 20 + s);
    batches.push_back({slice(b, 0, 4), slice(b, 4, 4)});
  }
  TrainStep plain(cfg, net_with_seed(cfg, 4), make_objective(cfg)), ahead(cfg, net_with_seed(cfg, 4), make_objective(cfg));
  for (int64_t s = 0; s < steps; ++s) {
    const StepResult rp = plain.run(batches[s], s);
    // Step 3 is given copies of its batches (other memory), not the batches prepared ahead at step 2.
    std::vector<Batch> micro = batches[s];
    if (s == 3)
      for (Batch& b : micro) b.x = b.x.clone();
    const StepResult ra = ahead.run(micro, s, s + 1 < steps ? batches[s + 1] : std::vector<Batch>{});
    EXPECT_EQ(rp.loss, ra.loss) << "step " << s;
    EXPECT_EQ(rp.grad_norm, ra.grad_norm) << "step " << s;
  }
  EXPECT_EQ(ahead.prepared_ahead(), steps - 2);  // steps 1, 2 and 4: not 0 (none before) nor 3 (a copy)
  EXPECT_EQ(plain.prepared_ahead(), 0);
  EXPECT_TRUE(torch::equal(plain.optim().flat_params(), ahead.optim().flat_params()));
  EXPECT_TRUE(torch::equal(plain.optim().flat_ema(), ahead.optim().flat_ema()));
}

TEST(FlatAdamW, OptimizerStateIsSavedByParameterName) {
  const RunConfig cfg = tiny_config();
  TrainStep a(cfg, net_with_seed(cfg, 4), make_objective(cfg));
  a.run(random_batch(8, 3), 0);
  const TensorMap state = a.optim().optimizer_state();
  const TensorMap params = a.optim().named_params();
  ASSERT_EQ(state.size(), 2 * params.size());
  for (const auto& [name, p] : params) {
    ASSERT_TRUE(state.count("exp_avg." + name)) << name;
    EXPECT_EQ(state.at("exp_avg_sq." + name).sizes(), p.sizes());
  }
  // Loads into a fresh optimizer, and the older format (two flat tensors) still loads.
  TrainStep b(cfg, net_with_seed(cfg, 5), make_objective(cfg));
  b.optim().load(a.optim().named_params(), a.optim().named_ema(), state, 1, "test");
  EXPECT_TRUE(torch::equal(b.optim().optimizer_state().at("exp_avg_sq.out_conv.weight"),
                           state.at("exp_avg_sq.out_conv.weight")));
  TensorMap legacy;
  legacy["exp_avg"] = torch::cat([&] {
    std::vector<torch::Tensor> v;
    for (const auto& p : a.optim().params()) v.push_back(state.at("exp_avg." + [&] {
      for (const auto& [n, q] : params) if (q.data_ptr() == p.data_ptr()) return n;
      return std::string();
    }()).flatten());
    return v;
  }());
  legacy["exp_avg_sq"] = torch::zeros_like(legacy["exp_avg"]);
  TrainStep c(cfg, net_with_seed(cfg, 5), make_objective(cfg));
  c.optim().load(a.optim().named_params(), a.optim().named_ema(), legacy, 1, "test");
  EXPECT_TRUE(torch::equal(c.optim().optimizer_state().at("exp_avg.out_conv.weight"), state.at("exp_avg.out_conv.weight")));
  // A missing moment names the tensor.
  TensorMap broken = state;
  broken.erase("exp_avg.out_conv.bias");
  TrainStep d(cfg, net_with_seed(cfg, 5), make_objective(cfg));
  EXPECT_NE(test::error_message([&] { d.optim().load(a.optim().named_params(), a.optim().named_ema(), broken, 1, "ck"); })
                .find("exp_avg.out_conv.bias"),
            std::string::npos);
}

TEST(FlatAdamW, FrozenParametersStayOutOfOptimizerEmaAndGradients) {
  const RunConfig cfg = tiny_config();
  Net net = net_with_seed(cfg, 4);
  std::vector<std::string> frozen;
  for (auto& p : net->named_parameters(true)) {
    if (p.key().rfind("out_conv", 0) == 0) continue;  // keep the output layer trainable
    if (frozen.size() < 4) {
      p.value().set_requires_grad(false);
      frozen.push_back(p.key());
    }
  }
  ASSERT_EQ(frozen.size(), 4u);
  const TensorMap before = module_state(*net);
  TrainStep step(cfg, net, make_objective(cfg));
  for (int64_t s = 0; s < 3; ++s) ASSERT_TRUE(step.run(random_batch(8, 3), s).finite);
  const TensorMap after = module_state(*net);
  for (const auto& name : frozen) {
    EXPECT_TRUE(torch::equal(before.at(name), after.at(name))) << name;
    EXPECT_FALSE(step.optim().named_ema().count(name)) << name;
    EXPECT_FALSE(step.optim().optimizer_state().count("exp_avg." + name)) << name;
    EXPECT_FALSE(net->named_parameters()[name].grad().defined()) << name;
  }
  EXPECT_FALSE(torch::equal(before.at("out_conv.weight"), after.at("out_conv.weight")));
  // The model file holds the frozen weights and loads; the EMA loads over the trainable ones only.
  Net other = net_with_seed(cfg, 11);
  for (const auto& name : frozen) other->named_parameters()[name].set_requires_grad(false);
  load_module_state(*other, after, "model");
  load_module_state(*other, step.optim().named_ema(), "ema", LoadScope::kTrainable);
  for (const auto& name : frozen) EXPECT_TRUE(torch::equal(other->named_parameters()[name], before.at(name)));
  EXPECT_NE(test::error_message([&] { load_module_state(*other, step.optim().named_ema(), "ema"); }).find(frozen[0]),
            std::string::npos);
}

// train.precision = bf16 on the CPU: the step runs its forward under bfloat16 autocast (8 significant
// bits, relative rounding 2^-9 per input), so its loss and gradient differ from fp32's, by little;
// the weights, gradients and AdamW state stay float32.
TEST(TrainStep, Bf16AutocastChangesTheArithmeticNotTheState) {
  for (const char* arch : {"unet", "dit"}) {
    RunConfig cfg = tiny_config(arch);
    const Batch batch = random_batch(16, 4);
    auto run = [&](Precision p) {
      cfg.train.precision = p;
      Net net = net_with_seed(cfg, 9);
      {
        torch::NoGradGuard ng;  // away from the zero initializations, so every parameter has a gradient
        for (auto& q : net->parameters()) q.normal_(0.0, 0.05);
      }
      TrainStep step(cfg, net, make_objective(cfg));
      const StepResult r = step.run(batch, 0);
      for (const torch::Tensor& t : step.optim().state_buffers()) EXPECT_EQ(t.scalar_type(), torch::kFloat);
      return std::make_pair(r, step.optim().flat_grad().clone());
    };
    const auto [f, gf] = run(Precision::kFp32);
    const auto [b, gb] = run(Precision::kBf16);
    ASSERT_TRUE(b.finite) << arch;
    const double loss_diff = std::abs(b.loss - f.loss) / f.loss;
    const double grad_diff = ((gb - gf).abs().max() / gf.abs().max()).item<double>();
    EXPECT_GT(loss_diff, 0.0) << arch << ": bf16 computed exactly what fp32 did: autocast was not on";
    EXPECT_LE(loss_diff, 2e-2) << arch;
    EXPECT_LE(grad_diff, 1e-1) << arch;
    std::printf("%s: bf16 loss %.2e from fp32's (relative), gradient %.2e of its largest element\n", arch, loss_diff,
                grad_diff);
  }
}

TEST(TrainStep, PrecisionIsCheckedAsTheConfigIsRead) {
  EXPECT_EQ(parse_config("", "t.toml").train.precision, Precision::kFp32);
  EXPECT_EQ(parse_config("", "t.toml", {"train.precision=bf16"}).train.precision, Precision::kBf16);
  EXPECT_NE(test::error_message([] { parse_config("[train]\nprecision = \"fp8\"\n", "t.toml"); })
                .find("t.toml: train.precision = \"fp8\" is not one of: fp32, bf16, fp16"),
            std::string::npos);
  EXPECT_EQ(parse_config("", "t.toml", {"train.precision=fp16"}).train.precision, Precision::kFp16);
  validate(parse_config("", "t.toml", {"train.precision=bf16", "parallel.pp=2"}));  // every mode trains in bf16
  validate(parse_config("", "t.toml", {"train.precision=fp16", "parallel.pp=2"}));  // and in fp16
}

// train.cuda_graphs (train/step_graph.cpp) captures one process's step on a GPU; everywhere else it is
// refused by name before any step runs. (tests/gpu/test_cuda.cpp trains with it on a GPU.)
TEST(TrainStep, CudaGraphsAreRefusedWhereTheyCannotRun) {
  RunConfig cfg = tiny_config();
  cfg.train.cuda_graphs = true;
  EXPECT_NE(test::error_message([&] { TrainStep step(cfg, make_net(cfg.model), make_objective(cfg)); })
                .find("train.cuda_graphs needs a CUDA GPU, but this run's model is on cpu"),
            std::string::npos);
  EXPECT_NO_THROW(derive_layout(cfg, 1, 0));
  EXPECT_NE(test::error_message([&] { derive_layout(cfg, 2, 1); })
                .find("rank 1: train.cuda_graphs captures one process's whole step, but the job has 2 processes"),
            std::string::npos);
  RunConfig pp = cfg;
  pp.parallel.pp = 2;
  EXPECT_NE(test::error_message([&] { derive_layout(pp, 2, 0); }).find("turn train.cuda_graphs off"), std::string::npos);
  EXPECT_EQ(parse_config("", "t.toml", {"train.cuda_graphs=true"}).train.cuda_graphs, true);
  // As the config is read (the CLI exits 2): on the CPU by name, and with activation checkpointing.
  EXPECT_NE(test::error_message([] { validate(parse_config("", "t.toml", {"train.cuda_graphs=true", "train.device=cpu"})); })
                .find("train.cuda_graphs captures the step on a CUDA GPU, but train.device = cpu"),
            std::string::npos);
  EXPECT_NE(test::error_message([] {
              validate(parse_config("", "t.toml", {"train.cuda_graphs=true", "train.checkpoint_activations=true"}));
            }).find("train.cuda_graphs with train.checkpoint_activations is not supported"),
            std::string::npos);
  validate(parse_config("", "t.toml", {"train.cuda_graphs=true", "train.device=cuda"}));  // checked against a GPU later
}
