// k-means for data partitioning: seeded k-means++ initialization, Lloyd iterations with row
// chunking (memory O(chunk x k), never O(N^2)), optional per-row weights, Euclidean or cosine
// (spherical k-means: rows and centroids on the unit sphere), and balanced assignment under
// per-cluster capacities. Deterministic for a given seed and thread count.
#pragma once

#include <cstdint>
#include <functional>

#include <torch/torch.h>

namespace ddm {

struct KMeansConfig {
  int64_t k = 8;
  int64_t max_iter = 30;
  double tol = 1e-4;           // stop when the inertia improves by less than this fraction
  bool cosine = false;         // spherical k-means (the caller passes unit rows; centroids are renormalized)
  uint64_t seed = 0;
  int64_t init_sample = 0;     // k-means++ runs on at most this many rows (0 = max(4096, 32 k))
  // Balanced mode: capacities [k] (int64, sum = total weight) that the assignment must respect.
  // Weights must then be integers (counts). Undefined = unconstrained nearest-centroid assignment.
  torch::Tensor capacity;
  std::function<void(int64_t iter, double inertia, int64_t changed)> on_iter;  // progress (optional)
};

struct KMeansResult {
  torch::Tensor centroids;   // float32 [k, D]
  torch::Tensor labels;      // int64 [N]: the cluster of each row (balanced: the cluster holding most of it)
  torch::Tensor allocation;  // balanced only: int64 [N, k], how much of each row's weight went where
  torch::Tensor sizes;       // float64 [k]: total weight per cluster
  double inertia = 0;        // weighted sum of squared distances to the assigned centroid
  int64_t iterations = 0;
};

// x: float32 [N, D]; weights: optional [N] (undefined = all 1). k <= N.
KMeansResult kmeans(const torch::Tensor& x, const torch::Tensor& weights, const KMeansConfig& cfg);

// Nearest centroid of each row, in chunks: labels int64 [N] and squared distances float32 [N].
std::pair<torch::Tensor, torch::Tensor> nearest_centroid(const torch::Tensor& x, const torch::Tensor& centroids);

// Squared distances float64 [N, k] (for small N, e.g. centroids of centroids).
torch::Tensor squared_distances(const torch::Tensor& x, const torch::Tensor& centroids);

// Capacity-constrained assignment of weighted rows to clusters, greedy by regret: rows whose best
// cluster is most clearly better than their second best choose first, each taking its cheapest
// clusters that still have room, split across clusters when one fills up. cost: float64 [M, k];
// weight, capacity: int64 [M], [k] with sum(capacity) >= sum(weight). Returns int64 [M, k].
// Ties break by row index, so the result is deterministic.
torch::Tensor greedy_capacity_assign(const torch::Tensor& cost, const torch::Tensor& weight,
                                     const torch::Tensor& capacity);

// Equal capacities for `total` items in k clusters: floor(total / k), the first total % k get one more.
torch::Tensor equal_capacities(int64_t total, int64_t k);

}  // namespace ddm
