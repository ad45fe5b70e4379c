// Sample-quality metrics on feature vectors (rows of [N, D] tensors, computed in float64):
//   - FD: the Frechet distance between Gaussian fits of two feature sets (FID's formula; on ddm's
//     own feature network it is called FD-fmnist, never FID);
//   - KID: the unbiased MMD^2 estimate with the cubic polynomial kernel k(x, y) = (x.y / D + 1)^3,
//     averaged over random subsets (Binkowski et al. 2018);
//   - improved precision and recall with k-nearest-neighbour radii (Kynkaanniemi et al. 2019).
#pragma once
#include <cstdint>

#include <torch/types.h>

namespace ddm {

// Gaussian fit of a feature set: mean [D] and covariance [D, D] (unbiased, divisor n - 1), float64.
struct GaussianStats {
  torch::Tensor mu;
  torch::Tensor sigma;
  int64_t n = 0;
};

// Requires n > D rows (otherwise the covariance is singular and FD undefined: a clear error says so).
GaussianStats gaussian_stats(const torch::Tensor& features);

// ||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr((S1^1/2 S2 S1^1/2)^1/2), the matrix square roots
// through symmetric eigendecompositions (eigenvalues clamped at 0).
double frechet_distance(const GaussianStats& a, const GaussianStats& b);

struct KidResult {
  double mean = 0, std = 0;  // over subsets
  int64_t subsets = 0, subset_size = 0;
};

// Draws `subsets` pairs of subsets of `subset_size` rows (without replacement within a subset) from
// x and y with a generator seeded by `seed`. subset_size is reduced to min(n_x, n_y) if larger.
KidResult kernel_inception_distance(const torch::Tensor& x, const torch::Tensor& y, int64_t subsets = 100,
                                    int64_t subset_size = 1000, uint64_t seed = 0);

struct PrecisionRecall {
  double precision = 0, recall = 0;
  int64_t k = 0;
};

// Precision: the fraction of `fake` rows inside the k-NN ball of at least one `real` row; recall:
// the fraction of `real` rows inside the k-NN ball of at least one `fake` row. Each ball's radius is
// the distance from its centre to its k-th nearest neighbour within its own set. Memory is
// O(chunk x N), never N x N.
PrecisionRecall precision_recall(const torch::Tensor& real, const torch::Tensor& fake, int64_t k = 3);

}  // namespace ddm
