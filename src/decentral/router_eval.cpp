// Router accuracy and calibration per noise level (see router_eval.h).
#include "decentral/router_eval.h"

#include <cmath>
#include <cstdio>
#include <iomanip>
#include <sstream>

#include <torch/torch.h>

#include "core/error.h"
#include "core/rng.h"
#include "diffusion/path.h"

namespace ddm {

namespace {
constexpr int64_t kCalibrationBins = 15;
constexpr int64_t kEvalBatch = 500;

// Expected calibration error: |accuracy - confidence| per equal-width confidence bin, weighted by
// the bin's share of the samples.
double expected_calibration_error(const torch::Tensor& conf, const torch::Tensor& correct) {
  const auto bins = (conf * kCalibrationBins).floor().clamp(0, kCalibrationBins - 1).to(torch::kLong);  // [N]
  double ece = 0;
  const double n = static_cast<double>(conf.size(0));
  for (int64_t b = 0; b < kCalibrationBins; ++b) {
    const auto in = bins.eq(b);
    const double m = in.sum().item<double>();
    if (m == 0) continue;
    const double acc = correct.masked_select(in).to(torch::kDouble).mean().item<double>();
    const double c = conf.masked_select(in).to(torch::kDouble).mean().item<double>();
    ece += m / n * std::abs(acc - c);
  }
  return ece;
}
}  // namespace

RouterReport evaluate_router(const Net& router, const RunConfig& cfg, const torch::Tensor& x0,
                             const torch::Tensor& labels, const torch::Tensor& clusters, int64_t buckets,
                             uint64_t seed, const std::string& images_note, const torch::Tensor& pooled,
                             const torch::Tensor& null_pooled) {
  DDM_CHECK(!pooled.defined() || (pooled.size(0) == x0.size(0) && null_pooled.defined()),
            "router evaluation: " << pooled.size(0) << " prompt embeddings for " << x0.size(0) << " images");
  DDM_CHECK(buckets > 0, "router evaluation needs at least one noise bucket");
  const int64_t n = x0.size(0), K = cfg.model.num_experts, classes = cfg.model.num_classes;
  DDM_CHECK(n > 0, "router evaluation needs at least one image");
  torch::NoGradGuard ng;
  const NoisePath path = make_path(cfg.diffusion);
  RouterReport r;
  r.k = K;
  r.images = n;
  r.images_note = images_note;
  r.prior_accuracy = torch::bincount(clusters, {}, K).max().item<double>() / static_cast<double>(n);
  for (int64_t b = 0; b < buckets; ++b) {
    RouterBucket out;
    out.t_lo = static_cast<double>(b) / buckets;
    out.t_hi = static_cast<double>(b + 1) / buckets;
    out.n = n;
    std::vector<torch::Tensor> conf, correct, correct_null, nll;
    for (int64_t s = 0; s < n; s += kEvalBatch) {
      const int64_t m = std::min(kEvalBatch, n - s);
      auto gen = make_generator(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kNoise), static_cast<uint64_t>(b),
                                             static_cast<uint64_t>(s)}));
      auto x = x0.narrow(0, s, m);                                                  // [m, C, H, W]
      auto t = out.t_lo + (out.t_hi - out.t_lo) * torch::rand({m}, gen);           // [m]
      auto eps = torch::randn(x.sizes(), gen);                                      // [m, C, H, W]
      auto xt = path.alpha(t).view({-1, 1, 1, 1}) * x + path.sigma(t).view({-1, 1, 1, 1}) * eps;
      auto k = clusters.narrow(0, s, m);                                            // [m]
      Cond y(classes > 0 ? labels.narrow(0, s, m) : torch::zeros({m}, torch::kLong));  // [m]
      if (pooled.defined()) y.pooled = pooled.narrow(0, s, m);                          // [m, P]
      auto logp = torch::log_softmax(router->forward(xt, t, y).to(torch::kDouble), 1);  // [m, K]
      auto [pmax, arg] = logp.exp().max(1);
      conf.push_back(pmax);
      correct.push_back(arg.eq(k));
      nll.push_back(-logp.gather(1, k.unsqueeze(1)).squeeze(1));
      Cond null_y(torch::full({m}, classes, torch::kLong));  // [m]
      if (pooled.defined()) null_y.pooled = null_pooled.expand({m, -1});  // [m, P]
      auto arg_null = classes > 0 || pooled.defined() ? router->forward(xt, t, null_y).argmax(1) : arg;
      correct_null.push_back(arg_null.eq(k));
    }
    auto c = torch::cat(conf), ok = torch::cat(correct);
    out.accuracy = ok.to(torch::kDouble).mean().item<double>();
    out.accuracy_null = torch::cat(correct_null).to(torch::kDouble).mean().item<double>();
    out.confidence = c.mean().item<double>();
    out.ece = expected_calibration_error(c, ok);
    out.nll = torch::cat(nll).mean().item<double>();
    r.buckets.push_back(out);
  }
  return r;
}

std::string RouterReport::table() const {
  std::ostringstream s;
  char line[160];
  s << "router accuracy by noise level (" << images << " " << images_note << ", K = " << k
    << "; always guessing the largest cluster: " << std::fixed << std::setprecision(4) << prior_accuracy
    << std::defaultfloat << ")\n";
  std::snprintf(line, sizeof line, "%-16s %9s %11s %11s %8s %8s\n", "t", "accuracy", "acc (null)", "confidence",
                "ECE", "NLL");
  s << line;
  for (const auto& b : buckets) {
    char t[48];  // the edges as they are (0.25, not 0.2), to 4 significant digits
    std::snprintf(t, sizeof t, "[%.4g, %.4g)", b.t_lo, b.t_hi);
    std::snprintf(line, sizeof line, "%-16s %9.3f %11.3f %11.3f %8.3f %8.3f\n", t, b.accuracy, b.accuracy_null,
                  b.confidence, b.ece, b.nll);
    s << line;
  }
  return s.str();
}

nlohmann::json RouterReport::json() const {
  nlohmann::json j = {{"k", k}, {"images", images}, {"images_note", images_note}, {"prior_accuracy", prior_accuracy}};
  for (const auto& b : buckets)
    j["buckets"].push_back({{"t_lo", b.t_lo},
                            {"t_hi", b.t_hi},
                            {"n", b.n},
                            {"accuracy", b.accuracy},
                            {"accuracy_null_label", b.accuracy_null},
                            {"confidence", b.confidence},
                            {"ece", b.ece},
                            {"nll", b.nll}});
  return j;
}

}  // namespace ddm
