// Float64 finite-difference gradient checks shared by the model tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace ddm {

// Compares the autograd gradient of the scalar f() with respect to every element of every leaf
// against central differences; all leaves must be contiguous float64 tensors requiring grad.
inline void expect_gradients_match(const std::function<torch::Tensor()>& f, const std::vector<torch::Tensor>& leaves,
                                   const std::string& what) {
  auto grads = torch::autograd::grad({f()}, leaves);
  const double eps = 1e-6;
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto numeric = torch::zeros_like(leaves[i]);
    {
      torch::NoGradGuard ng;
      double* p = leaves[i].data_ptr<double>();
      double* g = numeric.data_ptr<double>();
      for (int64_t j = 0; j < leaves[i].numel(); ++j) {
        const double saved = p[j];
        p[j] = saved + eps;
        const double fp = f().item<double>();
        p[j] = saved - eps;
        const double fm = f().item<double>();
        p[j] = saved;
        g[j] = (fp - fm) / (2 * eps);
      }
    }
    const double scale = std::max(grads[i].norm().item<double>(), numeric.norm().item<double>());
    ASSERT_GT(scale, 0.0) << what << " leaf " << i << ": gradient is identically zero";
    // Relative 1e-5, with a floor at the differences' own rounding: each quotient carries about
    // u |f| / eps = 1e-16 |f| / 1e-6 of float64 rounding, amplified by cancellation in f's sums;
    // 1e-8 |f| per element leaves 100x for that. (A leaf whose gradient is tiny, a GroupNorm bias
    // of 1e-4, meets that floor first, and on some CPUs' BLAS kernels passes 1e-5 relative only
    // just, or not.)
    const double f0 = std::abs(f().item<double>());
    const double floor = 1e-8 * std::max(1.0, f0) * std::sqrt(static_cast<double>(leaves[i].numel()));
    const double err = (grads[i] - numeric).norm().item<double>();
    EXPECT_LT(err, 1e-5 * scale + floor) << what << " leaf " << i << " (shape " << leaves[i].sizes() << "): error " << err
                                         << ", gradient norm " << scale << ", |f| " << f0;
  }
}

}  // namespace ddm
