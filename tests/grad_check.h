// Float64 finite-difference gradient checks shared by the model tests.
#pragma once
#include <algorithm>
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
    const double rel = (grads[i] - numeric).norm().item<double>() / scale;
    EXPECT_LT(rel, 1e-5) << what << " leaf " << i << " (shape " << leaves[i].sizes() << ")";
  }
}

}  // namespace ddm
