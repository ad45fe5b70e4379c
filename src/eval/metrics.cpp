// FD, KID and precision/recall on feature vectors (see metrics.h).
#include "eval/metrics.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "core/error.h"
#include "core/rng.h"

namespace ddm {

namespace {

torch::Tensor as_f64_rows(const torch::Tensor& f, const char* what) {
  DDM_CHECK(f.defined() && f.dim() == 2 && f.size(0) > 0 && f.size(1) > 0,
            what << ": expected features [N, D] with N, D > 0, got " << (f.defined() ? f.sizes() : at::IntArrayRef{}));
  auto x = f.to(torch::kFloat64).contiguous();
  DDM_CHECK(torch::isfinite(x).all().item<bool>(), what << ": features contain NaN or infinity");
  return x;
}

// S^1/2 of a symmetric positive semi-definite matrix (eigenvalues clamped at 0).
torch::Tensor sqrtm_psd(const torch::Tensor& s) {
  auto [ev, v] = torch::linalg_eigh(s, "L");
  return (v * ev.clamp_min(0).sqrt().unsqueeze(0)).mm(v.t());
}

// Rows per block of pairwise distances: 256 x 10000 float64 = 20 MB stays under glibc's 32 MiB
// mmap ceiling, so blocks are reused from the heap instead of page-faulted in each time.
constexpr int64_t kChunk = 256;

// Squared distances [a rows, b rows].
torch::Tensor sq_dist(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& b_sq) {
  return (a.pow(2).sum(1, true) + b_sq.unsqueeze(0) - 2.0 * a.mm(b.t())).clamp_min(0);
}

// Squared distance from each row to its k-th nearest other row of the same set.
torch::Tensor kth_nn_sq_radius(const torch::Tensor& x, int64_t k) {
  const int64_t n = x.size(0);
  const auto x_sq = x.pow(2).sum(1);
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < n; i += kChunk) {
    auto d = sq_dist(x.narrow(0, i, std::min(kChunk, n - i)), x, x_sq);  // [c, n]; includes self (0)
    out.push_back(std::get<0>(d.topk(k + 1, 1, /*largest=*/false, /*sorted=*/true)).select(1, k));
  }
  return torch::cat(out);  // [n]
}

// Fraction of rows of `query` within the k-NN ball of at least one row of `ref`.
double coverage(const torch::Tensor& query, const torch::Tensor& ref, const torch::Tensor& ref_sq_radius) {
  const int64_t n = query.size(0);
  const auto ref_sq = ref.pow(2).sum(1);
  int64_t inside = 0;
  for (int64_t i = 0; i < n; i += kChunk) {
    auto d = sq_dist(query.narrow(0, i, std::min(kChunk, n - i)), ref, ref_sq);  // [c, n_ref]
    inside += d.le(ref_sq_radius.unsqueeze(0)).any(1).sum().item<int64_t>();
  }
  return static_cast<double>(inside) / static_cast<double>(n);
}

}  // namespace

GaussianStats gaussian_stats(const torch::Tensor& features) {
  auto x = as_f64_rows(features, "gaussian_stats");
  const int64_t n = x.size(0), d = x.size(1);
  DDM_CHECK(n > d, "FD needs more samples than feature dimensions: got " << n << " samples of dimension " << d
                                                                         << " (the covariance would be singular "
                                                                            "and FD undefined); use at least "
                                                                         << d + 1 << ", and 10000 for results you "
                                                                                     "report");
  GaussianStats s;
  s.n = n;
  s.mu = x.mean(0);                            // [D]
  auto xc = x - s.mu.unsqueeze(0);             // [N, D]
  s.sigma = xc.t().mm(xc) / static_cast<double>(n - 1);  // [D, D]
  return s;
}

double frechet_distance(const GaussianStats& a, const GaussianStats& b) {
  DDM_CHECK(a.mu.defined() && b.mu.defined() && a.mu.numel() == b.mu.numel(),
            "frechet_distance: feature dimensions differ (" << (a.mu.defined() ? a.mu.numel() : 0) << " vs "
                                                            << (b.mu.defined() ? b.mu.numel() : 0) << ")");
  const auto diff = a.mu - b.mu;
  const auto sa = sqrtm_psd(a.sigma);
  auto m = sa.mm(b.sigma).mm(sa);  // symmetric PSD, same eigenvalues as S1 S2
  m = 0.5 * (m + m.t());
  const double tr_covmean = torch::linalg_eigvalsh(m, "L").clamp_min(0).sqrt().sum().item<double>();
  const double fd = diff.dot(diff).item<double>() + a.sigma.trace().item<double>() +
                    b.sigma.trace().item<double>() - 2.0 * tr_covmean;
  return std::max(fd, 0.0);  // rounding can leave -1e-13 for identical inputs
}

KidResult kernel_inception_distance(const torch::Tensor& x_in, const torch::Tensor& y_in, int64_t subsets,
                                    int64_t subset_size, uint64_t seed) {
  const auto x = as_f64_rows(x_in, "KID"), y = as_f64_rows(y_in, "KID");
  DDM_CHECK(x.size(1) == y.size(1), "KID: feature dimensions differ (" << x.size(1) << " vs " << y.size(1) << ")");
  DDM_CHECK(subsets >= 1 && subset_size >= 2, "KID: needs >= 1 subset of >= 2 rows");
  const int64_t m = std::min({subset_size, x.size(0), y.size(0)});
  DDM_CHECK(m >= 2, "KID: needs at least 2 samples in each set, got " << x.size(0) << " and " << y.size(0));
  const double inv_d = 1.0 / static_cast<double>(x.size(1)), md = static_cast<double>(m);
  auto gen = make_generator(seed);
  auto kernel = [&](const torch::Tensor& a, const torch::Tensor& b) { return (a.mm(b.t()) * inv_d + 1.0).pow(3); };
  std::vector<double> est;
  for (int64_t s = 0; s < subsets; ++s) {
    auto xs = x.index_select(0, torch::randperm(x.size(0), gen, torch::kLong).narrow(0, 0, m));  // [m, D]
    auto ys = y.index_select(0, torch::randperm(y.size(0), gen, torch::kLong).narrow(0, 0, m));  // [m, D]
    const auto kxx = kernel(xs, xs), kyy = kernel(ys, ys);
    const double sxx = (kxx.sum() - kxx.diagonal().sum()).item<double>();
    const double syy = (kyy.sum() - kyy.diagonal().sum()).item<double>();
    const double sxy = kernel(xs, ys).sum().item<double>();
    est.push_back((sxx + syy) / (md * (md - 1)) - 2.0 * sxy / (md * md));
  }
  KidResult r;
  r.subsets = subsets;
  r.subset_size = m;
  for (double e : est) r.mean += e;
  r.mean /= static_cast<double>(est.size());
  for (double e : est) r.std += (e - r.mean) * (e - r.mean);
  r.std = std::sqrt(r.std / static_cast<double>(est.size()));
  return r;
}

PrecisionRecall precision_recall(const torch::Tensor& real_in, const torch::Tensor& fake_in, int64_t k) {
  const auto real = as_f64_rows(real_in, "precision/recall"), fake = as_f64_rows(fake_in, "precision/recall");
  DDM_CHECK(real.size(1) == fake.size(1),
            "precision/recall: feature dimensions differ (" << real.size(1) << " vs " << fake.size(1) << ")");
  DDM_CHECK(k >= 1 && real.size(0) > k && fake.size(0) > k,
            "precision/recall: k = " << k << " needs more than k samples in each set, got " << real.size(0) << " and "
                                     << fake.size(0));
  PrecisionRecall r;
  r.k = k;
  r.precision = coverage(fake, real, kth_nn_sq_radius(real, k));
  r.recall = coverage(real, fake, kth_nn_sq_radius(fake, k));
  return r;
}

}  // namespace ddm
