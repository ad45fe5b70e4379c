// Noise paths, denoiser scalings and samplers checked against closed forms: alpha/sigma identities,
// derivatives, exact recovery of (x0, eps) from every prediction type, and samplers driven by the
// exact denoiser of a Gaussian data distribution reproducing its moments.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "diffusion/denoiser.h"
#include "diffusion/generate.h"
#include "diffusion/path.h"
#include "diffusion/sampler.h"
#include "exact_gaussian.h"

using namespace ddm;

namespace {
const PathKind kPaths[] = {PathKind::kFlow, PathKind::kVpLinear, PathKind::kVpCosine};

}  // namespace

TEST(Path, FlowIsLinearInterpolation) {
  NoisePath p(PathKind::kFlow);
  for (double t : {0.0, 0.3, 1.0}) {
    EXPECT_DOUBLE_EQ(p.alpha(t), 1 - t);
    EXPECT_DOUBLE_EQ(p.sigma(t), t);
  }
}

TEST(Path, VpIsVariancePreservingAndMonotone) {
  for (PathKind k : {PathKind::kVpLinear, PathKind::kVpCosine}) {
    NoisePath p(k);
    EXPECT_NEAR(p.alpha(0.0), 1.0, 1e-12);
    double prev = 2;
    for (int i = 0; i <= 100; ++i) {
      const double t = i / 100.0;
      EXPECT_NEAR(p.alpha(t) * p.alpha(t) + p.sigma(t) * p.sigma(t), 1.0, 1e-12);
      EXPECT_LT(p.alpha(t), prev);
      prev = p.alpha(t);
    }
  }
  // Linear schedule endpoint: alpha^2(1) = exp(-(b0 + (b1 - b0) / 2)) = exp(-10.05); cosine matches it.
  EXPECT_NEAR(NoisePath(PathKind::kVpLinear).alpha(1.0), std::exp(-0.5 * 10.05), 1e-12);
  EXPECT_NEAR(NoisePath(PathKind::kVpCosine).alpha(1.0), std::exp(-0.5 * 10.05), 1e-9);
}

TEST(Path, DerivativesMatchFiniteDifferencesAndTensorsMatchScalars) {
  for (PathKind k : kPaths) {
    NoisePath p(k);
    auto tt = torch::tensor({0.1, 0.5, 0.9}, torch::kDouble);
    for (int i = 0; i < 3; ++i) {
      const double t = tt[i].item<double>(), h = 1e-6;
      EXPECT_NEAR(p.dalpha(t), (p.alpha(t + h) - p.alpha(t - h)) / (2 * h), 1e-6);
      EXPECT_NEAR(p.dsigma(t), (p.sigma(t + h) - p.sigma(t - h)) / (2 * h), 1e-6);
      EXPECT_NEAR(p.alpha(tt)[i].item<double>(), p.alpha(t), 1e-12);
      EXPECT_NEAR(p.sigma(tt)[i].item<double>(), p.sigma(t), 1e-12);
      EXPECT_NEAR(p.dalpha(tt)[i].item<double>(), p.dalpha(t), 1e-12);
      EXPECT_NEAR(p.dsigma(tt)[i].item<double>(), p.dsigma(t), 1e-12);
    }
  }
}

TEST(Path, TimeSamplingRangeAndLogitNormal) {
  DiffusionConfig d;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto t = sample_time(d, 10000, gen);
  EXPECT_GE(t.min().item<double>(), 0.0);
  EXPECT_LE(t.max().item<double>(), 1.0);
  EXPECT_NEAR(t.mean().item<double>(), 0.5, 0.02);
  d.time_dist = "logit-normal";
  auto u = sample_time(d, 10000, gen);
  EXPECT_NEAR(u.mean().item<double>(), 0.5, 0.02);
  EXPECT_LT(u.std().item<double>(), t.std().item<double>());  // concentrated around 0.5
}

TEST(Denoiser, EveryPredictionRecoversDataAndNoiseExactly) {
  torch::manual_seed(0);
  for (PathKind k : kPaths) {
    NoisePath path(k);
    std::vector<Prediction> preds = {Prediction::kVelocity, Prediction::kEps};
    if (k != PathKind::kFlow) preds.push_back(Prediction::kV);  // v is defined for VP paths
    for (Prediction pred : preds) {
      auto x0 = torch::randn({5, 1, 3, 3}, torch::kDouble);
      auto eps = torch::randn({5, 1, 3, 3}, torch::kDouble);
      auto t = torch::tensor({0.05, 0.3, 0.5, 0.7, 0.95}, torch::kDouble);
      auto x = path.alpha(t).view({-1, 1, 1, 1}) * x0 + path.sigma(t).view({-1, 1, 1, 1}) * eps;
      auto f = training_target(path, pred, x0, eps, t);
      auto sc = scalings(path, pred, t);
      EXPECT_TRUE(torch::allclose(sc.c_skip * x + sc.c_out * f, x0, 1e-9, 1e-9)) << path.name();
      EXPECT_TRUE(torch::allclose(sc.e_skip * x + sc.e_out * f, eps, 1e-9, 1e-9)) << path.name();
    }
  }
}

TEST(Denoiser, ClassifierFreeGuidanceCombinesBranches) {
  // A net whose output is the label value: guidance w gives uncond + w (cond - uncond).
  struct LabelNet : NetImpl {
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor&, const Cond& c) override {
      return torch::ones_like(x) * c.y.to(x.scalar_type()).view({-1, 1, 1, 1});
    }
  };
  Denoiser den(std::make_shared<LabelNet>(), NoisePath(PathKind::kFlow), Prediction::kEps, 10);
  auto x = torch::zeros({2, 1, 2, 2}, torch::kDouble);
  auto t = torch::full({2}, 0.5, torch::kDouble);
  auto y = torch::tensor({3, 4}, torch::kLong);
  auto e = den.estimate(x, t, y, 2.0);  // eps = 10 + 2 (y - 10)
  EXPECT_DOUBLE_EQ(e.eps[0][0][0][0].item<double>(), 10 + 2 * (3 - 10));
  EXPECT_DOUBLE_EQ(e.eps[1][0][0][0].item<double>(), 10 + 2 * (4 - 10));
  EXPECT_DOUBLE_EQ(den.estimate(x, t, y, 0.0).eps[0][0][0][0].item<double>(), 10);
  EXPECT_DOUBLE_EQ(den.estimate(x, t, y, 1.0).eps[0][0][0][0].item<double>(), 3);
  EXPECT_EQ(den.nfe(), 3);
}

// Each sampler, driven by the exact denoiser of N(mu, var), must reproduce mu and var.
TEST(Sampler, ExactGaussianDenoiserReproducesMoments) {
  auto mu = torch::tensor({0.5, -1.0, 0.0, 2.0}, torch::kDouble).view({1, 1, 2, 2});
  auto var = torch::tensor({0.25, 1.0, 0.04, 0.5}, torch::kDouble).view({1, 1, 2, 2});
  struct Case {
    PathKind path;
    Prediction pred;
    const char* sampler;
    int steps;
  };
  const Case cases[] = {
      {PathKind::kFlow, Prediction::kVelocity, "euler", 200}, {PathKind::kFlow, Prediction::kVelocity, "heun", 30},
      {PathKind::kFlow, Prediction::kVelocity, "ddim", 200},
      // DDIM / DDPM are first order in sigma/alpha and shrink the variance by about 5% at 100 VP
      // steps (a property of the method, not of this code), so they get more steps here. Ancestral
      // DDPM on the flow path still shrinks the smallest variance (0.04) by 6.5% at 200 steps
      // (measured with 200000 samples), which the 6% bound only passed by a lucky noise draw; at
      // 1000 steps the shrinkage is under 3%.
      {PathKind::kFlow, Prediction::kVelocity, "ddpm", 1000},
      {PathKind::kVpLinear, Prediction::kEps, "ddim", 1000},  {PathKind::kVpLinear, Prediction::kEps, "ddpm", 1000},
      {PathKind::kVpLinear, Prediction::kEps, "heun", 100},   {PathKind::kVpCosine, Prediction::kV, "ddim", 1000},
      {PathKind::kVpCosine, Prediction::kV, "euler", 400},
      // Stable Diffusion's discrete schedule (its grid ends at timestep 0, then steps to the data). Its
      // t = 1 keeps alpha = 0.068 of the signal (the schedule's known flaw), so these start from the
      // exact marginal there, not from N(0, I) as the others do: from N(0, I), as SD's pipelines
      // start, the mean comes out 5% short (2.0 -> 1.90), which is the schedule's doing.
      {PathKind::kDiscrete, Prediction::kV, "ddim", 200},     {PathKind::kDiscrete, Prediction::kEps, "euler", 200},
  };
  for (const Case& c : cases) {
    const NoisePath path = c.path == PathKind::kDiscrete
                               ? NoisePath::discrete(discrete_alphas_cumprod("scaled_linear", 0.00085, 0.012, 1000))
                               : NoisePath(c.path);
    Denoiser den(std::make_shared<test::ExactGaussianNet>(path, c.pred, mu, var), path, c.pred, 0);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const int64_t n = 20000;
    auto x1 = torch::randn({n, 1, 2, 2}, gen, torch::kDouble);
    if (c.path == PathKind::kDiscrete)  // x_1 = alpha(1) x0 + sigma(1) eps, x0 ~ N(mu, var)
      x1 = path.alpha(1.0) * (mu + var.sqrt() * torch::randn({n, 1, 2, 2}, gen, torch::kDouble)) + path.sigma(1.0) * x1;
    SampleOptions opt;
    opt.sampler = c.sampler;
    opt.steps = c.steps;
    opt.seed = 3;
    auto res = sample(den, x1, torch::zeros({n}, torch::kLong), opt);
    EXPECT_EQ(res.nfe, sampler_nfe(c.sampler, c.steps));
    auto m = res.x.mean(0, true), v = res.x.var(0, /*unbiased=*/true, /*keepdim=*/true);
    const std::string what = path.name() + "/" + prediction_name(c.pred) + "/" + c.sampler;
    // Sampling error of the mean ~ sqrt(var / n) <= 0.007; discretization error is smaller still.
    EXPECT_LT((m - mu).abs().max().item<double>(), 0.03) << what << " mean " << m;
    EXPECT_LT(((v - var).abs() / var).max().item<double>(), 0.06) << what << " var " << v;
  }
}

// On the straight flow path x_t = (1 - t) x0 + t eps, DDIM's deterministic update
// x_s = (1 - s) x0_hat + s eps_hat is exactly the Euler step x_t + (s - t) (eps_hat - x0_hat), so the
// two samplers give the same samples at every step count (docs/results.md shows equal FD-fmnist).
TEST(Sampler, DdimEqualsEulerOnTheFlowPath) {
  auto mu = torch::tensor({0.5, -1.0, 0.0, 2.0}, torch::kDouble).view({1, 1, 2, 2});
  auto var = torch::tensor({0.25, 1.0, 0.04, 0.5}, torch::kDouble).view({1, 1, 2, 2});
  NoisePath path(PathKind::kFlow);
  Denoiser den(std::make_shared<test::ExactGaussianNet>(path, Prediction::kVelocity, mu, var), path, Prediction::kVelocity, 0);
  auto x1 = torch::randn({500, 1, 2, 2}, at::make_generator<at::CPUGeneratorImpl>(2), torch::kDouble);
  for (int steps : {4, 8, 64, 100}) {
    SampleOptions opt;
    opt.steps = steps;
    opt.sampler = "euler";
    const auto euler = sample(den, x1, torch::zeros({500}, torch::kLong), opt).x;
    opt.sampler = "ddim";
    const auto ddim = sample(den, x1, torch::zeros({500}, torch::kLong), opt).x;
    EXPECT_LT((euler - ddim).abs().max().item<double>(), 1e-12) << steps << " steps";
    opt.sampler = "heun";
    EXPECT_GT((euler - sample(den, x1, torch::zeros({500}, torch::kLong), opt).x).abs().max().item<double>(), 1e-6);
  }
}

// A sample must not depend on the batch it is generated in: its initial noise and every later draw
// (ddpm's ancestral noise) are keyed by (seed, the sample's index, step), never by its batch. The
// exact Gaussian denoiser on the flow path is itself exactly batch-independent (alpha = 1 - t,
// sigma = t: only elementwise +, -, *, /, each correctly rounded per element whatever the batch), so
// here the samples must agree bit for bit; a trained network agrees only to within float32 rounding
// across batch sizes (docs/determinism.md).
TEST(Generate, SamplesDoNotDependOnBatchSize) {
  auto mu = torch::tensor({0.2f, -0.2f, 0.0f, 0.1f}).view({1, 1, 2, 2});
  auto var = torch::ones({1, 1, 2, 2}) * 0.05;
  NoisePath path(PathKind::kFlow);
  Denoiser den(std::make_shared<test::ExactGaussianNet>(path, Prediction::kVelocity, mu, var), path,
               Prediction::kVelocity, 0);
  for (const char* sampler : {"euler", "heun", "ddim", "ddpm"}) {
    GenerateOptions whole;
    whole.n = 13;
    whole.seed = 11;
    whole.sample.steps = 5;
    whole.sample.sampler = sampler;
    whole.batch_size = 13;
    const auto all = generate(den, 1, 2, whole).images;  // [13, 1, 2, 2]
    ASSERT_LT(all.abs().max().item<float>(), 1.0f) << "a clamped sample would hide differences";
    for (int64_t batch : {1, 4, 5}) {
      GenerateOptions split = whole;
      split.batch_size = batch;
      const auto parts = generate(den, 1, 2, split).images;
      EXPECT_TRUE(torch::equal(all, parts)) << sampler << ", batches of " << batch << ": max difference "
                                            << (all - parts).abs().max().item<float>();
    }
    // The comparison can fail: another seed gives other samples.
    GenerateOptions other = whole;
    other.seed = 12;
    EXPECT_GT((all - generate(den, 1, 2, other).images).abs().max().item<float>(), 0.1f) << sampler;
  }
  // ddpm draws fresh noise at every step: with the same initial noise its samples differ from ddim's.
  GenerateOptions a;
  a.n = 13;
  a.sample.steps = 5;
  a.sample.sampler = "ddim";
  const auto ddim = generate(den, 1, 2, a).images;
  a.sample.sampler = "ddpm";
  EXPECT_GT((ddim - generate(den, 1, 2, a).images).abs().max().item<float>(), 0.1f);
}

TEST(Generate, LabelsCycleByRow) {
  auto y = sample_labels(30, 10, -1, 3);
  EXPECT_EQ(y[0].item<int64_t>(), 0);
  EXPECT_EQ(y[2].item<int64_t>(), 0);
  EXPECT_EQ(y[3].item<int64_t>(), 1);
  EXPECT_EQ(y[29].item<int64_t>(), 9);
  EXPECT_TRUE(torch::all(sample_labels(5, 10, 7, 1) == 7).item<bool>());
  EXPECT_THROW(sample_labels(5, 10, 12, 1), ddm::Error);
  EXPECT_THROW(sample_labels(5, 0, 2, 1), ddm::Error);  // unconditional model, explicit class
  EXPECT_TRUE(torch::all(sample_labels(4, 0, -1, 1) == 0).item<bool>());
}

TEST(Sampler, TimeGridsRunFromOneToZero) {
  for (PathKind k : kPaths)
    for (int64_t steps : {1, 2, 10, 50}) {
      auto g = time_grid(NoisePath(k), steps);
      ASSERT_EQ(g.size(), static_cast<size_t>(steps + 1));
      EXPECT_DOUBLE_EQ(g.front(), 1.0);
      EXPECT_DOUBLE_EQ(g.back(), 0.0);
      for (size_t i = 1; i < g.size(); ++i) EXPECT_LT(g[i], g[i - 1]);
    }
}
