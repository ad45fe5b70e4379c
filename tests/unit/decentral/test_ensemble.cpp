// Routers and the routed expert ensemble against closed forms: with experts that are exact for
// disjoint Gaussian clusters (trained on different paths and parameterizations) and the exact
// posterior as router, the full ensemble's velocity is the mixture's marginal velocity; top-k with
// k = K equals full; grouped batching equals a per-sample loop; strategies are deterministic under
// a seed; a missing expert is renormalized away; the data oracle finds the right cluster; the
// distillation teacher gives each sample its own cluster's expert, and the training step regresses it.
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "core/config.h"
#include "core/error.h"
#include "core/presets.h"
#include "core/rng.h"
#include "data/dataset.h"
#include "decentral/ensemble.h"
#include "diffusion/generate.h"
#include "diffusion/path.h"
#include "exact_gaussian.h"
#include "model/net.h"
#include "model/router.h"
#include "run/job.h"
#include "test_util.h"
#include "train/step.h"

using namespace ddm;

namespace {

// K isotropic Gaussian clusters N(mu_k, var_k I) with priors pi_k, on 1x2x2 images.
struct Mixture {
  std::vector<torch::Tensor> mu;  // each [1, 1, 2, 2] double
  std::vector<double> var, prior;
};

Mixture three_clusters() {
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  return {{torch::tensor({-2.0, -1.5, -2.5, -2.0}, opts).view({1, 1, 2, 2}),
           torch::tensor({0.0, 0.5, 0.0, -0.5}, opts).view({1, 1, 2, 2}),
           torch::tensor({2.0, 2.5, 1.5, 2.0}, opts).view({1, 1, 2, 2})},
          {0.05, 0.1, 0.02},
          {0.5, 0.3, 0.2}};
}

// The exact posterior p(k | x_t) on `path`: pi_k prod_d N(x_d; a mu_kd, a^2 var_k + s^2). [B, K]
torch::Tensor posterior(const Mixture& m, const NoisePath& path, const torch::Tensor& x, const torch::Tensor& t) {
  auto a = path.alpha(t).view({-1, 1, 1, 1}), s = path.sigma(t).view({-1, 1, 1, 1});
  std::vector<torch::Tensor> logp;
  for (size_t k = 0; k < m.mu.size(); ++k) {
    auto v = a * a * m.var[k] + s * s;  // [B,1,1,1]
    auto l = ((x - a * m.mu[k]).pow(2) / v + torch::log(2 * M_PI * v)).sum({1, 2, 3});  // [B]
    logp.push_back(std::log(m.prior[k]) - 0.5 * l);
  }
  return torch::softmax(torch::stack(logp, 1), 1);
}

// The mixture's marginal probability-flow velocity on `path`, from E[x0 | x_t] of each cluster.
torch::Tensor mixture_velocity(const Mixture& m, const NoisePath& path, const torch::Tensor& x, const torch::Tensor& t,
                               const std::vector<int64_t>& keep = {0, 1, 2}) {
  auto a = path.alpha(t).view({-1, 1, 1, 1}), s = path.sigma(t).view({-1, 1, 1, 1});
  auto p = posterior(m, path, x, t);  // [B, K]
  auto x0 = torch::zeros_like(x), mass = torch::zeros({x.size(0), 1, 1, 1}, x.options());
  for (int64_t k : keep) {
    auto pk = p.select(1, k).view({-1, 1, 1, 1});
    x0 = x0 + pk * (m.mu[k] + a * m.var[k] / (a * a * m.var[k] + s * s) * (x - a * m.mu[k]));
    mass = mass + pk;
  }
  x0 = x0 / mass;
  auto eps = (x - a * x0) / s;
  return path.dalpha(t).view({-1, 1, 1, 1}) * x0 + path.dsigma(t).view({-1, 1, 1, 1}) * eps;
}

// Expert k is exact for cluster k; they differ in path and parameterization on purpose.
std::vector<std::optional<Denoiser>> exact_experts(const Mixture& m) {
  const std::pair<PathKind, Prediction> kinds[] = {
      {PathKind::kFlow, Prediction::kVelocity}, {PathKind::kVpLinear, Prediction::kEps}, {PathKind::kVpCosine, Prediction::kV}};
  std::vector<std::optional<Denoiser>> out;
  for (size_t k = 0; k < m.mu.size(); ++k) {
    NoisePath path(kinds[k].first);
    auto var = torch::full({1, 1, 1, 1}, m.var[k], torch::kDouble);
    out.emplace_back(Denoiser(std::make_shared<test::ExactGaussianNet>(path, kinds[k].second, m.mu[k], var), path,
                              kinds[k].second, 0));
  }
  return out;
}

Ensemble make(const Mixture& m, const std::string& routing, std::vector<std::optional<Denoiser>> experts,
              uint64_t seed = 0) {
  const NoisePath flow(PathKind::kFlow);
  RouterFn router = [m, flow](const torch::Tensor& x, const torch::Tensor& t, const Cond&) {
    return posterior(m, flow, x, t);
  };
  std::vector<double> flops(experts.size(), 1.0);
  return Ensemble(std::move(experts), flops, router, 0.1, flow, 0, parse_routing(routing), seed);
}

// Points drawn from the mixture's noisy marginal at various times, so every cluster is visited.
std::pair<torch::Tensor, torch::Tensor> noisy_points(const Mixture& m, int64_t n, uint64_t seed) {
  auto gen = make_generator(seed);
  const NoisePath flow(PathKind::kFlow);
  auto t = 0.05 + 0.9 * torch::rand({n}, gen, torch::kDouble);
  std::vector<torch::Tensor> x0;
  for (int64_t i = 0; i < n; ++i) x0.push_back(m.mu[i % 3] + std::sqrt(m.var[i % 3]) * torch::randn({1, 1, 2, 2}, gen, torch::kDouble));
  auto x = flow.alpha(t).view({-1, 1, 1, 1}) * torch::cat(x0) +
           flow.sigma(t).view({-1, 1, 1, 1}) * torch::randn({n, 1, 2, 2}, gen, torch::kDouble);
  return {x, t};
}

}  // namespace

TEST(Ensemble, FullRoutingWithTheExactPosteriorIsTheMarginalVelocity) {
  const Mixture m = three_clusters();
  const Ensemble ens = make(m, "full", exact_experts(m));
  const Denoiser den = ens.denoiser();
  auto [x, t] = noisy_points(m, 48, 1);
  auto y = torch::zeros({48}, torch::kLong);
  auto v = den.velocity(x, t, y, 1.0);
  auto expected = mixture_velocity(m, NoisePath(PathKind::kFlow), x, t);
  EXPECT_LT((v - expected).abs().max().item<double>(), 1e-8);
  // One expert alone is not the marginal velocity: the comparison can fail.
  const Ensemble top1 = make(m, "top1", exact_experts(m));
  EXPECT_GT((top1.denoiser().velocity(x, t, y, 1.0) - expected).abs().max().item<double>(), 1e-3);
}

TEST(Ensemble, TopKWithKEqualToTheExpertCountEqualsFull) {
  const Mixture m = three_clusters();
  auto [x, t] = noisy_points(m, 30, 2);
  auto y = torch::zeros({30}, torch::kLong);
  auto full = make(m, "full", exact_experts(m)).estimate(x, t, y, 1.0);
  auto top3 = make(m, "topk:3", exact_experts(m)).estimate(x, t, y, 1.0);
  auto top2 = make(m, "topk:2", exact_experts(m)).estimate(x, t, y, 1.0);
  EXPECT_TRUE(torch::allclose(full.x0, top3.x0, 0, 1e-12));
  EXPECT_TRUE(torch::allclose(full.eps, top3.eps, 0, 1e-12));
  EXPECT_FALSE(torch::allclose(full.x0, top2.x0, 0, 1e-6));
}

TEST(Ensemble, GroupedBatchingEqualsAPerSampleLoop) {
  const Mixture m = three_clusters();
  auto [x, t] = noisy_points(m, 24, 3);
  auto y = torch::zeros({24}, torch::kLong);
  // Per-sample keys, as a sampler passes them: `sample` routing then draws each sample's expert from
  // its own key, in the batch as alone.
  auto keys = torch::arange(100, 124, torch::kLong);
  for (const char* routing : {"top1", "topk:2", "threshold:0.05", "sample"}) {
    const Ensemble ens = make(m, routing, exact_experts(m));
    auto batched = ens.estimate(x, t, y, 1.0, keys);
    std::vector<int64_t> counts = ens.usage().expert_evals;
    for (int64_t i = 0; i < 24; ++i) {
      auto one = ens.estimate(x.narrow(0, i, 1), t.narrow(0, i, 1), y.narrow(0, i, 1), 1.0, keys.narrow(0, i, 1));
      EXPECT_TRUE(torch::allclose(one.x0, batched.x0.narrow(0, i, 1), 0, 1e-12)) << routing << " sample " << i;
      EXPECT_TRUE(torch::allclose(one.eps, batched.eps.narrow(0, i, 1), 0, 1e-12)) << routing << " sample " << i;
    }
    // The loop evaluated each expert on exactly the samples the batch grouped onto it.
    for (size_t e = 0; e < counts.size(); ++e) EXPECT_EQ(ens.usage().expert_evals[e], 2 * counts[e]) << routing;
  }
  // Top-1 on these well-separated clusters uses every expert, each on its own group.
  const Ensemble ens = make(m, "top1", exact_experts(m));
  ens.estimate(x, t, y, 1.0);
  for (int64_t c : ens.usage().expert_evals) EXPECT_GT(c, 0);
  EXPECT_EQ(ens.usage().sample_evals, 24);
}

TEST(Ensemble, PaddedGroupsGiveTheExactGroupsEstimates) {
  // set_group_quantum (what `ddm sample --ensemble --cuda-graphs` sets): every expert is called on a
  // multiple of the quantum, its real rows give what the exact groups give (these experts compute
  // row by row, so bit for bit), and the padding is counted, not reported as samples.
  const Mixture m = three_clusters();
  auto [x, t] = noisy_points(m, 26, 4);
  auto y = torch::zeros({26}, torch::kLong);
  for (const char* routing : {"top1", "topk:2", "full"}) {
    const Ensemble exact = make(m, routing, exact_experts(m));
    Ensemble padded = make(m, routing, exact_experts(m));
    padded.set_group_quantum(7);
    const auto a = exact.estimate(x, t, y, 1.0), b = padded.estimate(x, t, y, 1.0);
    EXPECT_TRUE(torch::equal(a.x0, b.x0)) << routing;
    EXPECT_TRUE(torch::equal(a.eps, b.eps)) << routing;
    EXPECT_EQ(exact.usage().expert_evals, padded.usage().expert_evals) << routing;
    int64_t pad = 0;
    for (size_t e = 0; e < 3; ++e) {
      for (int64_t rows : padded.usage().group_sizes[e]) EXPECT_EQ(rows % 7, 0) << routing << " expert " << e;
      for (int64_t rows : exact.usage().group_sizes[e]) EXPECT_EQ(rows, exact.usage().expert_evals[e]) << routing;
      const int64_t n = padded.usage().expert_evals[e];
      pad += n == 0 ? 0 : (n + 6) / 7 * 7 - n;
    }
    EXPECT_EQ(padded.usage().padding_evals, pad) << routing;
    EXPECT_EQ(exact.usage().padding_evals, 0) << routing;
    EXPECT_NE(padded.usage_report(26).find("padded to multiples of 7 rows"), std::string::npos);
  }
}

// The quantum `ddm sample --ensemble --cuda-graphs` pads with: at most 4K sizes per expert (within
// the graphs it keeps, 4 variants of each), and for a batch shared evenly about an eighth more rows,
// where a quarter of the batch (the earlier quantum) doubled the rows of 4 even groups.
TEST(Ensemble, GraphedGroupsArePaddedToFewSizesAndLittleMore) {
  for (int64_t k : {1, 2, 4, 8})
    for (int64_t batch : {1, 7, 64, 100, 256, 1000}) {
      const int64_t q = graphed_group_quantum(batch, k);
      ASSERT_GE(q, 1);
      EXPECT_LE((batch + q - 1) / q, 4 * k) << "batch " << batch << ", K " << k;  // distinct padded sizes
      EXPECT_LE(4 * ((batch + q - 1) / q), graphed_expert_graphs(k));
      if (batch < 64) continue;
      int64_t padded = 0;  // an even split: groups of batch / k, the remainder spread
      for (int64_t e = 0; e < k; ++e) {
        const int64_t n = batch / k + (e < batch % k ? 1 : 0);
        padded += (n + q - 1) / q * q;
      }
      EXPECT_LE(padded - batch, batch / 4) << "batch " << batch << ", K " << k;
    }
  EXPECT_EQ(graphed_group_quantum(256, 4), 16);
  // The dit-b benchmark's groups on an H200 (65, 65, 62, 64 of 256): 32 padding rows, not 128.
  int64_t pad = 0;
  for (int64_t n : {65, 65, 62, 64}) pad += (n + 15) / 16 * 16 - n;
  EXPECT_EQ(pad, 32);
}

TEST(Ensemble, StrategiesAreDeterministicUnderASeed) {
  torch::manual_seed(16);  // the same draws in every run: LibTorch seeds its default generator anew per process
  const Mixture m = three_clusters();
  auto [x, t] = noisy_points(m, 64, 4);
  auto xt = x * 0 + torch::randn_like(x);  // pure noise at t = 1: the posterior is the prior
  auto t1 = torch::ones_like(t) * 0.999;
  auto y = torch::zeros({64}, torch::kLong);
  for (const char* routing : {"top1", "topk:2", "full", "threshold:0.2", "sample"}) {
    auto a = make(m, routing, exact_experts(m), 7).estimate(xt, t1, y, 1.0);
    auto b = make(m, routing, exact_experts(m), 7).estimate(xt, t1, y, 1.0);
    EXPECT_TRUE(torch::equal(a.x0, b.x0)) << routing;
  }
  auto a = make(m, "sample", exact_experts(m), 7);
  auto b = make(m, "sample", exact_experts(m), 8);
  a.estimate(xt, t1, y, 1.0);
  b.estimate(xt, t1, y, 1.0);
  EXPECT_NE(a.usage().expert_evals, b.usage().expert_evals);  // another seed draws other experts
  // Drawing from the prior 0.5 / 0.3 / 0.2 over 64 samples picks every expert.
  for (int64_t c : a.usage().expert_evals) EXPECT_GT(c, 0);
}

// `--routing sample` draws an expert for every sample at every step. The draw is keyed by the
// sample's number and the solver's evaluation, not by the batch, so a sample is routed through the
// same experts, and ends in the same place, whatever batch it is generated in. Here the experts are
// float32 flow-path experts (as generate() feeds float32 noise), whose output is exactly
// batch-independent (elementwise +, -, *, / only), and sampled routing weighs the chosen expert by
// exactly 1: so the samples must agree bit for bit. (A draw could flip only if its uniform fell
// within rounding of a boundary of the router's float64 cumulative probabilities.)
TEST(Ensemble, SampledRoutingDoesNotDependOnTheBatch) {
  // Three clusters inside [-1, 1], so that generate()'s clamp hides no difference.
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const Mixture m{{torch::tensor({-0.6, -0.5, -0.7, -0.6}, opts).view({1, 1, 2, 2}),
                   torch::tensor({0.0, 0.1, 0.0, -0.1}, opts).view({1, 1, 2, 2}),
                   torch::tensor({0.6, 0.7, 0.5, 0.6}, opts).view({1, 1, 2, 2})},
                  {0.004, 0.008, 0.003},
                  {0.5, 0.3, 0.2}};
  const NoisePath flow(PathKind::kFlow);
  auto experts = [&] {
    std::vector<std::optional<Denoiser>> out;
    for (size_t k = 0; k < m.mu.size(); ++k)
      out.emplace_back(Denoiser(std::make_shared<test::ExactGaussianNet>(flow, Prediction::kVelocity,
                                                                         m.mu[k].to(torch::kFloat32),
                                                                         torch::full({1, 1, 1, 1}, m.var[k])),
                                flow, Prediction::kVelocity, 0));
    return out;
  };
  RouterFn router = [m, flow](const torch::Tensor& x, const torch::Tensor& t, const Cond&) {
    return posterior(m, flow, x, t).to(torch::kFloat32);  // float32, as a trained router's
  };
  auto run = [&](int64_t batch, uint64_t seed, const char* routing = "sample") {
    const Ensemble ens(experts(), {1.0, 1.0, 1.0}, router, 0.1, flow, 0, parse_routing(routing), seed);
    GenerateOptions g;
    g.n = 24;
    g.seed = 3;
    g.sample.steps = 6;
    g.sample.sampler = "euler";
    g.batch_size = batch;
    return generate(ens.denoiser(), 1, 2, g).images;  // [24, 1, 2, 2] float32
  };
  const auto whole = run(24, 5);
  ASSERT_LT(whole.abs().max().item<float>(), 1.0f);
  for (int64_t batch : {1, 5, 7}) {
    const auto split = run(batch, 5);
    EXPECT_TRUE(torch::equal(whole, split)) << "batches of " << batch << ": max difference "
                                            << (whole - split).abs().max().item<float>();
  }
  // The draw matters, so the comparison can fail: another routing seed, or top-1, moves samples.
  EXPECT_GT((whole - run(24, 6)).abs().max().item<float>(), 0.1f);
  EXPECT_GT((whole - run(24, 5, "top1")).abs().max().item<float>(), 0.1f);
}

TEST(Ensemble, RoutingWeights) {
  auto p = torch::tensor({0.6, 0.3, 0.1, 0.34, 0.33, 0.33}).view({2, 3});
  EXPECT_TRUE(torch::equal(routing_weights(p, parse_routing("top1")),
                           torch::tensor({1.f, 0.f, 0.f, 1.f, 0.f, 0.f}).view({2, 3})));
  EXPECT_TRUE(torch::allclose(routing_weights(p, parse_routing("topk:2")),
                              torch::tensor({2 / 3.f, 1 / 3.f, 0.f, 0.34f / 0.67f, 0.33f / 0.67f, 0.f}).view({2, 3})));
  // Threshold 0.35: row 0 keeps 0.6 only; row 1 has nothing above it and falls back to top-1.
  EXPECT_TRUE(torch::equal(routing_weights(p, parse_routing("threshold:0.35")),
                           torch::tensor({1.f, 0.f, 0.f, 1.f, 0.f, 0.f}).view({2, 3})));
  EXPECT_TRUE(torch::allclose(routing_weights(p, parse_routing("threshold:0.2")),
                              torch::tensor({2 / 3.f, 1 / 3.f, 0.f, 0.34f, 0.33f, 0.33f}).view({2, 3})));
  // Sampling inverts the CDF at the given uniforms: row 0 (cdf 0.6, 0.9, 1) at 0.55 and 0.95, row 1
  // (cdf 0.34, 0.67, 1) at 0.5 and 0.999.
  auto s = routing_weights(p, parse_routing("sample"), torch::tensor({0.55, 0.5}, torch::kDouble));
  EXPECT_TRUE(torch::equal(s, torch::tensor({1.f, 0.f, 0.f, 0.f, 1.f, 0.f}).view({2, 3})));
  s = routing_weights(p, parse_routing("sample"), torch::tensor({0.95, 0.999}, torch::kDouble));
  EXPECT_TRUE(torch::equal(s, torch::tensor({0.f, 0.f, 1.f, 0.f, 0.f, 1.f}).view({2, 3})));
  // An expert of probability 0 is never drawn, not even at u = 0.
  s = routing_weights(torch::tensor({0.0, 1.0}).view({1, 2}), parse_routing("sample"), torch::zeros({1}, torch::kDouble));
  EXPECT_TRUE(torch::equal(s, torch::tensor({0.f, 1.f}).view({1, 2})));
  // Drawn over many uniforms, experts come with their probabilities.
  auto u = (torch::arange(10000, torch::kDouble) + 0.5) / 10000;
  auto counts = routing_weights(p.narrow(0, 0, 1).expand({10000, 3}), parse_routing("sample"), u).sum(0);
  EXPECT_TRUE(torch::equal(counts, torch::tensor({6000.f, 3000.f, 1000.f})));

  EXPECT_TRUE(parse_routing("oracle").oracle);
  EXPECT_EQ(parse_routing("topk:4").k, 4);
  for (const char* bad : {"top2", "topk", "topk:0", "topk:1.5", "threshold:1", "threshold:x", "full:2", ""})
    EXPECT_NE(test::error_message([&] { parse_routing(bad); }).find("--routing"), std::string::npos) << bad;
  // Found by fuzzing islands files: a K beyond int64 was cast to int64 before it was checked, which
  // is undefined behaviour (UBSan stops there; a Release build happened to reject it).
  for (const char* bad : {"topk:1e300", "topk:-1e300", "topk:9.3e18", "topk:inf", "topk:nan"})
    EXPECT_NE(test::error_message([&] { parse_routing(bad); }).find("K must be a whole number"), std::string::npos)
        << bad;
}

TEST(Ensemble, AMissingExpertIsRenormalizedAway) {
  const Mixture m = three_clusters();
  auto experts = exact_experts(m);
  experts[1].reset();
  const Ensemble ens = make(m, "full", std::move(experts));
  auto [x, t] = noisy_points(m, 30, 5);
  auto y = torch::zeros({30}, torch::kLong);
  auto v = ens.denoiser().velocity(x, t, y, 1.0);
  EXPECT_LT((v - mixture_velocity(m, NoisePath(PathKind::kFlow), x, t, {0, 2})).abs().max().item<double>(), 1e-8);
  EXPECT_EQ(ens.usage().expert_evals[1], 0);
  const Ensemble top1 = make(m, "top1", [&] {
    auto e = exact_experts(m);
    e[1].reset();
    return e;
  }());
  top1.estimate(x, t, y, 1.0);
  EXPECT_EQ(top1.usage().expert_evals[1], 0);
  EXPECT_EQ(top1.usage().expert_evals[0] + top1.usage().expert_evals[2], 30);
}

TEST(Ensemble, DataOracleFindsTheClusterAndTheClassPrior) {
  torch::manual_seed(17);  // the same draws in every run: LibTorch seeds its default generator anew per process
  Dataset d;
  // Cluster 0: two dark images; cluster 1: two bright ones. Classes 0, 1, 1, 1.
  d.images = torch::tensor({10, 20, 10, 20, 30, 0, 30, 0, 240, 250, 240, 250, 200, 255, 200, 255}, torch::kUInt8)
                 .view({4, 1, 2, 2});
  d.labels = torch::tensor({0, 1, 1, 1}, torch::kLong);
  d.num_classes = 2;
  const auto clusters = torch::tensor({0, 0, 1, 1}, torch::kLong);
  const NoisePath flow(PathKind::kFlow);
  RouterFn oracle = oracle_router(d, clusters, 2, flow);
  auto x0 = to_unit_range(d.images);
  auto t = torch::full({4}, 0.2);
  auto x = 0.8 * x0 + 0.2 * torch::randn({4, 1, 2, 2}, make_generator(0));
  auto null = torch::full({4}, 2, torch::kLong);
  auto p = oracle(x, t, null);  // [4, 2]
  EXPECT_TRUE(torch::equal(p.argmax(1), clusters));
  // At t = 1 nothing of x0 is left: the posterior is the prior, given the class or not.
  auto p1 = oracle(torch::randn({4, 1, 2, 2}), torch::ones({4}), torch::tensor({2, 0, 1, 2}, torch::kLong));
  EXPECT_TRUE(torch::allclose(p1, torch::tensor({0.5f, 0.5f, 1.f, 0.f, 1 / 3.f, 2 / 3.f, 0.5f, 0.5f}).view({4, 2})));
}

TEST(Path, MatchingTimesHaveEqualSignalToNoiseRatios) {
  const NoisePath flow(PathKind::kFlow), cosine(PathKind::kVpCosine), linear(PathKind::kVpLinear);
  auto t = torch::tensor({0.0, 0.1, 0.4, 0.8, 0.95}, torch::kDouble);
  for (const NoisePath* to : {&cosine, &linear}) {
    const PathMatch m = match_path(flow, t, *to);
    for (int64_t i = 1; i < 5; ++i) {
      const double ti = t[i].item<double>(), tt = m.t[i].item<double>(), sc = m.scale[i].item<double>();
      EXPECT_NEAR(to->alpha(tt) / to->sigma(tt), flow.alpha(ti) / flow.sigma(ti), 1e-9) << to->name() << " t " << ti;
      EXPECT_NEAR(sc * flow.alpha(ti), to->alpha(tt), 1e-9);
      EXPECT_NEAR(sc * flow.sigma(ti), to->sigma(tt), 1e-9);
    }
    EXPECT_DOUBLE_EQ(m.t[0].item<double>(), 0.0);
    EXPECT_DOUBLE_EQ(m.scale[0].item<double>(), 1.0);
    // And back: the round trip is the identity.
    const PathMatch back = match_path(*to, m.t, flow);
    EXPECT_TRUE(torch::allclose(back.t, t, 0, 1e-9));
  }
  // The flow path's pure-noise end maps to the VP path's noisiest point.
  const PathMatch end = match_path(flow, torch::ones({1}, torch::kDouble), cosine);
  EXPECT_DOUBLE_EQ(end.t[0].item<double>(), 1.0);
}

// Discrete paths (Stable Diffusion's experts): the same table is the same path, so times pass
// unchanged, in the caller's dtype; two different tables meet where their ratios agree, computed
// on the host whatever the times' device (the result goes back to it).
TEST(Path, DiscretePathsMatchTheirOwnKindByTheirTables) {
  const NoisePath sd = NoisePath::discrete(discrete_alphas_cumprod("scaled_linear", 0.00085, 0.012, 1000));
  const NoisePath sd_again = NoisePath::discrete(discrete_alphas_cumprod("scaled_linear", 0.00085, 0.012, 1000));
  const NoisePath ddpm = NoisePath::discrete(discrete_alphas_cumprod("linear", 0.0001, 0.02, 1000));
  EXPECT_TRUE(sd.same_as(sd_again));
  EXPECT_FALSE(sd.same_as(ddpm));
  EXPECT_FALSE(sd.same_as(NoisePath(PathKind::kFlow)));
  EXPECT_TRUE(NoisePath(PathKind::kVpCosine).same_as(NoisePath(PathKind::kVpCosine)));
  const auto t = torch::tensor({0.05f, 0.3f, 0.7f, 0.99f});
  const PathMatch same = match_path(sd, t, sd_again);
  EXPECT_TRUE(torch::equal(same.t, t));
  EXPECT_TRUE(torch::equal(same.scale, torch::ones_like(t)));
  const PathMatch m = match_path(sd, t, ddpm);
  EXPECT_EQ(m.t.scalar_type(), torch::kFloat);
  EXPECT_FALSE(torch::allclose(m.t, t, 0, 1e-3));  // another table: other times
  for (int64_t i = 0; i < 4; ++i) {
    const double ti = t[i].item<double>(), tt = m.t[i].item<double>();
    EXPECT_NEAR(ddpm.alpha(tt) / ddpm.sigma(tt), sd.alpha(ti) / sd.sigma(ti),
                1e-5 * sd.alpha(ti) / sd.sigma(ti)) << ti;
  }
}

// The data sets a model's image size; a DiT's patch must divide it. A router's patch comes with its
// preset (router-dit-tiny's 7 is for 28 px): on 32 px data it becomes 8. A model's is refused, naming a
// divisor to use, before anything is built.
TEST(Router, ARoutersPatchFitsTheDataAndAModelsIsRefusedWithADivisor) {
  Dataset d;
  d.images = torch::zeros({4, 3, 32, 32}, torch::kUInt8);
  d.description = "32 px pictures";
  RunConfig router = parse_config("[data]\npartition = \"parts\"\n[model]\npreset = \"router-dit-tiny\"\n", "router.toml", {});
  ASSERT_EQ(router.model.patch, 7);
  resolve_data_shape(router, d);
  EXPECT_EQ(router.model.image_size, 32);
  EXPECT_EQ(router.model.patch, 8);
  RunConfig dit = parse_config("[model]\npreset = \"dit-tiny\"\npatch = 3\n", "dit.toml", {});
  const std::string e = test::error_message([&] { resolve_data_shape(dit, d); });
  EXPECT_NE(e.find("model.image_size = 32 (the data's) is not divisible by model.patch = 3: set model.patch to a "
                   "divisor of it, e.g. 4"),
            std::string::npos)
      << e;
}

TEST(Router, BothArchitecturesStartUniformAndLearn) {
  for (const char* preset : {"router-dit-tiny", "router-conv-tiny"}) {
    ModelConfig cfg;
    apply_preset(preset, cfg);
    cfg.in_channels = 1;
    cfg.image_size = 28;
    cfg.num_classes = 10;
    cfg.num_experts = 3;
    torch::manual_seed(0);
    Net net = make_net(cfg);
    auto gen = make_generator(1);
    auto x = torch::randn({12, 1, 28, 28}, gen);
    auto k = torch::arange(12, torch::kLong).remainder(3);
    x = x * 0.3 + k.to(torch::kFloat).view({-1, 1, 1, 1}) - 1.0;  // the cluster shows in the mean
    auto t = torch::rand({12}, gen) * 0.5;
    auto y = torch::arange(12, torch::kLong).remainder(11);  // includes the null class 10
    auto logits = net->forward(x, t, y);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{12, 3})) << preset;
    EXPECT_EQ(logits.abs().max().item<float>(), 0.f) << preset;  // zero head: uniform
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(3e-3));
    double first = 0, last = 0;
    for (int i = 0; i < 40; ++i) {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(net->forward(x, t, y), k);
      if (i == 0) first = loss.item<double>();
      last = loss.item<double>();
      loss.backward();
      opt.step();
    }
    EXPECT_NEAR(first, std::log(3.0), 1e-5) << preset;
    EXPECT_LT(last, 0.3 * first) << preset;
    EXPECT_GT(forward_flops_per_image(cfg), 1e6) << preset;
    EXPECT_LT(forward_flops_per_image(cfg), 0.1 * 203e6) << preset;  // a few percent of unet-tiny
  }
  ModelConfig cfg;
  apply_preset("router-dit-tiny", cfg);
  cfg.in_channels = 1;
  cfg.image_size = 28;
  cfg.num_classes = 10;
  cfg.num_experts = 1;
  EXPECT_NE(test::error_message([&] { make_net(cfg); }).find("model.num_experts must be >= 2"), std::string::npos);
}

TEST(Distill, AssignedExpertsGiveEachSampleItsOwnClustersPosteriorMean) {
  // The teacher of distillation: sample i is evaluated by expert k_i alone, whatever its path. With
  // exact experts that is E[x0 | x_t, cluster k_i] in closed form.
  const Mixture m = three_clusters();
  const Ensemble ens = make(m, "top1", exact_experts(m));
  auto [x, t] = noisy_points(m, 30, 7);
  auto y = torch::zeros({30}, torch::kLong);
  auto k = torch::arange(30, torch::kLong).remainder(3).flip(0);  // not the router's choice
  auto est = ens.estimate_assigned(x, t, y, k);
  const NoisePath flow(PathKind::kFlow);
  auto a = flow.alpha(t).view({-1, 1, 1, 1}), s = flow.sigma(t).view({-1, 1, 1, 1});
  for (int64_t i = 0; i < 30; ++i) {
    const int64_t c = k[i].item<int64_t>();
    auto ai = a[i], si = s[i];
    auto x0 = m.mu[c] + ai * m.var[c] / (ai * ai * m.var[c] + si * si) * (x[i] - ai * m.mu[c]);  // [1,1,2,2]
    EXPECT_LT((est.x0[i] - x0.squeeze(0)).abs().max().item<double>(), 1e-8) << "sample " << i << ", expert " << c;
  }
  EXPECT_TRUE(torch::allclose(x, a * est.x0 + s * est.eps, 0, 1e-9));
  EXPECT_EQ(ens.usage().expert_evals, (std::vector<int64_t>{10, 10, 10}));

  auto experts = exact_experts(m);
  experts[1].reset();
  const Ensemble missing = make(m, "top1", std::move(experts));
  // Structured bindings cannot be captured by a lambda in C++17 (clang rejects it): capture copies.
  EXPECT_NE(test::error_message([&, x = x, t = t] { missing.estimate_assigned(x, t, y, k); }).find("expert 1 is missing"),
            std::string::npos);
}

TEST(Distill, TheTrainingStepRegressesTheTeachersPrediction) {
  // A teacher that returns the true (x0, eps) behind x_t must give exactly the data loss, and a
  // wrong teacher a different one: the step trains on the teacher, not on the data.
  RunConfig cfg;
  cfg.model.preset = "unet-tiny";
  cfg.model.channels = 8;
  cfg.model.channel_mult = {1, 2};
  cfg.model.groups = 4;
  cfg.model.in_channels = 1;
  cfg.model.image_size = 8;
  cfg.model.num_classes = 2;
  torch::manual_seed(1);  // the batch: unseeded, it varied between processes, and for some the two losses were close
  Batch batch{torch::rand({6, 1, 8, 8}) * 2 - 1, torch::randint(0, 2, {6}), torch::randint(0, 3, {6})};
  const NoisePath path = make_path(cfg.diffusion);
  auto loss_with = [&](TeacherFn teacher) {
    torch::manual_seed(3);
    TrainStep step(cfg, make_net(cfg.model),
                   teacher ? std::make_shared<DistillObjective>(cfg, teacher) : make_objective(cfg));
    return step.run(batch, 0).loss;
  };
  torch::Tensor seen_k;
  auto truth = [&](const torch::Tensor& xt, const torch::Tensor& t, const Cond&, const torch::Tensor& k) {
    seen_k = k;
    auto eps = (xt - path.alpha(t).view({-1, 1, 1, 1}) * batch.x) / path.sigma(t).view({-1, 1, 1, 1});
    return Denoiser::Estimate{batch.x, eps};
  };
  auto blurred = [&](const torch::Tensor& xt, const torch::Tensor& t, const Cond& y, const torch::Tensor& k) {
    auto e = truth(xt, t, y, k);
    auto x0 = 0.5 * e.x0;
    return Denoiser::Estimate{x0, (xt - path.alpha(t).view({-1, 1, 1, 1}) * x0) / path.sigma(t).view({-1, 1, 1, 1})};
  };
  const double data = loss_with(nullptr), taught = loss_with(truth), wrong = loss_with(blurred);
  EXPECT_NEAR(taught, data, 1e-5 * data);
  EXPECT_TRUE(torch::equal(seen_k, batch.k));
  EXPECT_GT(std::abs(wrong - data), 1e-3 * data);
}
