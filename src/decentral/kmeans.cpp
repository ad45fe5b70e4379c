// k-means (see kmeans.h). Written by hand: no Debian-packaged C++ library offers seeded, chunked,
// weighted and capacity-constrained k-means on LibTorch tensors.
#include "decentral/kmeans.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"
#include "core/rng.h"

namespace ddm {
namespace {

// Rows per block of distances: 4096 x 1024 float32 = 16 MB stays under glibc's 32 MiB mmap
// ceiling, so the block is reused from the heap.
constexpr int64_t kChunk = 4096;

// Uniform double in [0, 1) from a 64-bit engine, identical on every platform.
double uniform01(std::mt19937_64& gen) { return static_cast<double>(gen() >> 11) * 0x1.0p-53; }

torch::Tensor normalize_rows(const torch::Tensor& c) {
  return c / c.norm(2, 1, true).clamp_min(1e-12);
}

// k-means++ seeding (Arthur & Vassilvitskii 2007), weighted: each next centroid is a row drawn with
// probability proportional to weight x squared distance to the nearest centroid chosen so far.
torch::Tensor kmeanspp(const torch::Tensor& x, const torch::Tensor& w, const KMeansConfig& cfg) {
  const int64_t n = x.size(0), k = cfg.k;
  std::mt19937_64 gen(derive_seed({cfg.seed, 0x6b6d2b2bULL}));
  const int64_t limit = cfg.init_sample > 0 ? cfg.init_sample : std::max<int64_t>(4096, 32 * k);
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  if (n > limit) {  // a seeded subset: the first `limit` entries of a partial Fisher-Yates shuffle
    for (int64_t i = 0; i < limit; ++i) {
      const int64_t j = i + static_cast<int64_t>(gen() % static_cast<uint64_t>(n - i));
      std::swap(rows[i], rows[j]);
    }
    rows.resize(static_cast<size_t>(limit));
    std::sort(rows.begin(), rows.end());
  }
  const auto idx = torch::tensor(rows, torch::kInt64);
  const auto xs = x.index_select(0, idx).contiguous();                 // [S, D]
  const auto ws = w.index_select(0, idx).to(torch::kFloat64).contiguous();  // [S]
  const auto xs_sq = xs.pow(2).sum(1);                                 // [S]
  const int64_t s = xs.size(0);
  const double* wp = ws.data_ptr<double>();

  auto draw = [&](const std::vector<double>& score) -> int64_t {
    double total = 0;
    for (int64_t i = 0; i < s; ++i) total += score[i];
    if (!(total > 0)) return -1;
    const double r = uniform01(gen) * total;
    double acc = 0;
    for (int64_t i = 0; i < s; ++i) {
      acc += score[i];
      if (acc > r && score[i] > 0) return i;
    }
    for (int64_t i = s - 1; i >= 0; --i)
      if (score[i] > 0) return i;
    return -1;
  };

  std::vector<double> score(wp, wp + s), mind(static_cast<size_t>(s), 0.0);
  std::vector<char> taken(static_cast<size_t>(s), 0);
  auto centroids = torch::empty({k, x.size(1)}, torch::kFloat32);
  for (int64_t j = 0; j < k; ++j) {
    int64_t pick = draw(score);
    if (pick < 0)  // every remaining row coincides with a centroid: take the next unused row
      for (int64_t i = 0; i < s && pick < 0; ++i)
        if (!taken[i]) pick = i;
    DDM_CHECK(pick >= 0, "k-means: cannot seed " << k << " centroids from " << s << " rows");
    taken[pick] = 1;
    centroids[j].copy_(xs[pick]);
    const auto c = xs[pick];
    const auto d = (xs_sq + c.pow(2).sum() - 2.0 * xs.mv(c)).clamp_min(0).to(torch::kFloat64).contiguous();
    const double* dp = d.data_ptr<double>();
    for (int64_t i = 0; i < s; ++i) {
      mind[i] = j == 0 ? dp[i] : std::min(mind[i], dp[i]);
      score[i] = taken[i] ? 0.0 : wp[i] * mind[i];
    }
  }
  return centroids;
}

struct Assignment {
  torch::Tensor labels;      // int64 [N]
  torch::Tensor dist;        // float64 [N]: squared distance to the assigned centroid
  torch::Tensor allocation;  // balanced only
  double inertia = 0;
};

Assignment assign(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& c, const KMeansConfig& cfg) {
  Assignment a;
  if (cfg.capacity.defined()) {
    const auto cost = squared_distances(x, c);                       // [N, k] float64
    a.allocation = greedy_capacity_assign(cost, w.to(torch::kInt64), cfg.capacity);
    a.labels = a.allocation.argmax(1);
    a.dist = cost.gather(1, a.labels.unsqueeze(1)).squeeze(1);
    a.inertia = (a.allocation.to(torch::kFloat64) * cost).sum().item<double>();
  } else {
    auto [labels, dist] = nearest_centroid(x, c);
    a.labels = labels;
    a.dist = dist.to(torch::kFloat64);
    a.inertia = (a.dist * w.to(torch::kFloat64)).sum().item<double>();
  }
  return a;
}

// New centroids: weighted means of the rows assigned to each cluster (float64 sums). A cluster left
// empty is re-seeded at the row farthest from its centroid (deterministic).
torch::Tensor update(const torch::Tensor& x, const torch::Tensor& w, const Assignment& a, const torch::Tensor& old,
                     const KMeansConfig& cfg) {
  const int64_t k = cfg.k, d = x.size(1);
  auto sums = torch::zeros({k, d}, torch::kFloat64);
  torch::Tensor counts;
  if (a.allocation.defined()) {
    const auto alloc = a.allocation.to(torch::kFloat64);  // [N, k]
    sums = alloc.t().mm(x.to(torch::kFloat64));
    counts = alloc.sum(0);
  } else {
    const auto wd = w.to(torch::kFloat64);
    for (int64_t i = 0; i < x.size(0); i += kChunk) {
      const int64_t m = std::min(kChunk, x.size(0) - i);
      sums.index_add_(0, a.labels.narrow(0, i, m), x.narrow(0, i, m).to(torch::kFloat64) * wd.narrow(0, i, m).unsqueeze(1));
    }
    counts = torch::zeros({k}, torch::kFloat64).index_add_(0, a.labels, wd);
  }
  auto c = (sums / counts.clamp_min(1e-300).unsqueeze(1)).to(torch::kFloat32);
  auto far = (a.dist * w.to(torch::kFloat64)).clone();
  const auto cnt = counts.accessor<double, 1>();
  for (int64_t j = 0; j < k; ++j) {
    if (cnt[j] > 0) continue;
    if (a.allocation.defined() && cfg.capacity[j].item<int64_t>() == 0) {
      c[j].copy_(old[j]);  // a cluster with no capacity keeps its place
      continue;
    }
    const int64_t row = far.argmax().item<int64_t>();
    c[j].copy_(x[row]);
    far[row] = -1.0;
  }
  return cfg.cosine ? normalize_rows(c) : c;
}

}  // namespace

torch::Tensor equal_capacities(int64_t total, int64_t k) {
  DDM_CHECK(k >= 1 && total >= 0, "equal_capacities: bad total " << total << " or k " << k);
  auto cap = torch::full({k}, total / k, torch::kInt64);
  if (total % k) cap.narrow(0, 0, total % k).add_(1);
  return cap;
}

torch::Tensor squared_distances(const torch::Tensor& x, const torch::Tensor& centroids) {
  const auto a = x.to(torch::kFloat64), b = centroids.to(torch::kFloat64);
  return (a.pow(2).sum(1, true) + b.pow(2).sum(1).unsqueeze(0) - 2.0 * a.mm(b.t())).clamp_min(0);  // [N, k]
}

std::pair<torch::Tensor, torch::Tensor> nearest_centroid(const torch::Tensor& x, const torch::Tensor& centroids) {
  DDM_CHECK(x.dim() == 2 && centroids.dim() == 2 && x.size(1) == centroids.size(1),
            "nearest_centroid: rows " << x.sizes() << " and centroids " << centroids.sizes() << " do not match");
  const auto c = centroids.to(torch::kFloat32).contiguous();
  const auto c_sq = c.pow(2).sum(1).unsqueeze(0);  // [1, k]
  const int64_t n = x.size(0);
  auto labels = torch::empty({n}, torch::kInt64);
  auto dist = torch::empty({n}, torch::kFloat32);
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t m = std::min(kChunk, n - i);
    const auto xc = x.narrow(0, i, m).to(torch::kFloat32);
    auto d = torch::addmm(c_sq, xc, c.t(), /*beta=*/1, /*alpha=*/-2);  // [m, k]: |c|^2 - 2 x.c
    auto [best, arg] = d.min(1);
    labels.narrow(0, i, m).copy_(arg);
    dist.narrow(0, i, m).copy_((best + xc.pow(2).sum(1)).clamp_min(0));
  }
  return {labels, dist};
}

torch::Tensor greedy_capacity_assign(const torch::Tensor& cost, const torch::Tensor& weight,
                                     const torch::Tensor& capacity) {
  DDM_CHECK(cost.dim() == 2 && weight.dim() == 1 && capacity.dim() == 1 && cost.size(0) == weight.size(0) &&
                cost.size(1) == capacity.size(0),
            "greedy_capacity_assign: cost " << cost.sizes() << ", weight " << weight.sizes() << ", capacity "
                                            << capacity.sizes() << " do not match");
  const int64_t m = cost.size(0), k = cost.size(1);
  const auto cs = cost.to(torch::kFloat64).contiguous();
  const auto ws = weight.to(torch::kInt64).contiguous();
  auto rem = capacity.to(torch::kInt64).contiguous().clone();
  DDM_CHECK(rem.sum().item<int64_t>() >= ws.sum().item<int64_t>(),
            "greedy_capacity_assign: total capacity " << rem.sum().item<int64_t>() << " is below the total weight "
                                                      << ws.sum().item<int64_t>());
  const double* cp = cs.data_ptr<double>();
  const int64_t* wp = ws.data_ptr<int64_t>();
  int64_t* rp = rem.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> order(static_cast<size_t>(m));
  std::vector<double> regret(static_cast<size_t>(m), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    auto& o = order[i];
    o.resize(static_cast<size_t>(k));
    std::iota(o.begin(), o.end(), 0);
    const double* row = cp + i * k;
    std::stable_sort(o.begin(), o.end(), [&](int64_t a, int64_t b) { return row[a] < row[b]; });
    regret[i] = k > 1 ? row[o[1]] - row[o[0]] : 0.0;
  }
  std::vector<int64_t> rows(static_cast<size_t>(m));
  std::iota(rows.begin(), rows.end(), 0);
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return regret[a] > regret[b]; });
  auto alloc = torch::zeros({m, k}, torch::kInt64);
  int64_t* ap = alloc.data_ptr<int64_t>();
  for (int64_t i : rows) {
    int64_t left = wp[i];
    for (int64_t j : order[i]) {
      if (left == 0) break;
      const int64_t take = std::min(left, rp[j]);
      ap[i * k + j] += take;
      rp[j] -= take;
      left -= take;
    }
  }
  return alloc;
}

KMeansResult kmeans(const torch::Tensor& x_in, const torch::Tensor& weights, const KMeansConfig& cfg) {
  DDM_CHECK(x_in.defined() && x_in.dim() == 2 && x_in.size(0) > 0 && x_in.size(1) > 0,
            "k-means: expected rows [N, D], got " << (x_in.defined() ? x_in.sizes() : at::IntArrayRef{}));
  const int64_t n = x_in.size(0);
  DDM_CHECK(cfg.k >= 1 && cfg.k <= n, "k-means: k = " << cfg.k << " must be between 1 and the number of rows (" << n
                                                       << ")");
  DDM_CHECK(cfg.max_iter >= 1, "k-means: max_iter must be >= 1, got " << cfg.max_iter);
  const auto x = x_in.to(torch::kFloat32).contiguous();
  DDM_CHECK(torch::isfinite(x).all().item<bool>(), "k-means: the rows contain NaN or infinity");
  const auto w = weights.defined() ? weights.to(torch::kFloat64).contiguous() : torch::ones({n}, torch::kFloat64);
  DDM_CHECK(w.dim() == 1 && w.size(0) == n && w.ge(0).all().item<bool>() && w.sum().item<double>() > 0,
            "k-means: weights must be [N] non-negative with a positive sum");
  if (cfg.capacity.defined()) {
    DDM_CHECK(cfg.capacity.dim() == 1 && cfg.capacity.size(0) == cfg.k, "k-means: capacity must have k entries");
    DDM_CHECK(w.eq(w.round()).all().item<bool>(), "k-means: balanced mode needs integer weights (counts)");
  }

  auto c = kmeanspp(x, w, cfg);
  if (cfg.cosine) c = normalize_rows(c);
  Assignment a = assign(x, w, c, cfg);
  KMeansResult r;
  int64_t it = 0;
  for (it = 1; it <= cfg.max_iter; ++it) {
    c = update(x, w, a, c, cfg);
    Assignment next = assign(x, w, c, cfg);
    const int64_t changed = a.allocation.defined() ? a.allocation.ne(next.allocation).any(1).sum().item<int64_t>()
                                                   : a.labels.ne(next.labels).sum().item<int64_t>();
    const double improvement = a.inertia - next.inertia;
    a = std::move(next);
    if (cfg.on_iter) cfg.on_iter(it, a.inertia, changed);
    if (changed == 0 || improvement <= cfg.tol * std::max(a.inertia, 1e-300)) break;
  }
  r.centroids = c;
  r.labels = a.labels;
  r.allocation = a.allocation;
  r.sizes = a.allocation.defined() ? a.allocation.sum(0).to(torch::kFloat64)
                                   : torch::zeros({cfg.k}, torch::kFloat64).index_add_(0, a.labels, w);
  r.inertia = a.inertia;
  r.iterations = std::min(it, cfg.max_iter);
  return r;
}

}  // namespace ddm
