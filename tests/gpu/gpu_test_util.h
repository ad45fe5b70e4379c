// What the GPU test files share (label gpu): the skip without a GPU, and the bounds of "the same
// result in another float32 order" for a tensor and for a whole training run, GPU against CPU.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "unit/run/train_test_util.h"

namespace ddm::test {

inline bool no_gpu() { return !torch::cuda::is_available(); }
inline constexpr const char* kNoGpu = "no CUDA GPU on this machine";

// Float32 arithmetic in another order: relative differences of a few ulps per accumulation, so the
// bound grows with the reduction length (here up to a few thousand terms through several layers).
inline void expect_close(const torch::Tensor& gpu, const torch::Tensor& cpu, double rtol, const std::string& what) {
  const auto g = gpu.cpu().to(torch::kDouble), c = cpu.to(torch::kDouble);
  const double scale = c.abs().max().item<double>() + 1e-30;
  const double diff = (g - c).abs().max().item<double>();
  EXPECT_LE(diff / scale, rtol) << what << ": max |gpu - cpu| = " << diff << " of max |cpu| = " << scale;
  std::printf("%s: max |gpu - cpu| / max |cpu| = %.2e (bound %.0e)\n", what.c_str(), diff / scale, rtol);
}

// The trainer's tests (tests/unit/parallel/test_data_parallel.cpp) bound two runs that compute the
// same thing in another float32 order: losses within 1e-4 relative per step, and weights within
// 1e-3 after 20 steps (AdamW divides each gradient element by its running RMS, so an element whose
// gradient is within rounding of zero may take a different step of up to ~3 lr; 1e-3 is half a step
// at tiny()'s lr). A GPU against the CPU is such a pair: cuBLAS and cuDNN against MKL and oneDNN.
// `a` and `b` are run directories (metrics.jsonl's losses, the last checkpoint's weights).
inline void expect_same_training(const std::string& a, const std::string& b, const std::string& what,
                                 double loss_bound = 1e-4) {
  const auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), lb.size()) << what;
  ASSERT_FALSE(la.empty()) << what;
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) worst = std::max(worst, std::abs(la[i] - lb[i]) / std::abs(lb[i]));
  const double w = max_weight_difference(final_weights(a), final_weights(b));
  EXPECT_LE(worst, loss_bound) << what;
  EXPECT_LE(w, 1e-3) << what;
  std::printf("%s: losses within %.2e (relative) over %zu steps, weights within %.2e\n", what.c_str(), worst, la.size(), w);
}

}  // namespace ddm::test
