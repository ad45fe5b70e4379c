// Tolerances derived from float32 rounding, for comparing results that compute the same math in a
// different order. ddm promises bit-identical results only for the same config, seed, thread count
// and shapes (docs/determinism.md). A different batch size, batch split, thread count
// or CPU may change the order in which a matrix product adds its terms: OpenBLAS and oneDNN choose
// their blocking, vector kernels and thread partitioning by shape, thread count and CPU (on an AVX-512
// CPU even one row of a plain x @ w.t() changes with the batch size). Such results are compared with
// the bounds below, and every test that uses one also checks that a real bug would exceed it.
#pragma once
#include <torch/torch.h>

namespace ddm::test {

// Unit roundoff of float32: each +, -, *, / (and each FMA) is exact up to a factor (1 + d), |d| <= u.
inline constexpr double kFloat32Roundoff = 0x1p-24;  // 5.96e-8

// gamma_K = K u / (1 - K u): a float32 dot product of length K, summed in any order, with or without
// FMA, is within gamma_K * sum_k |a_k b_k| of the exact value (Higham, "Accuracy and Stability of
// Numerical Algorithms", 2nd ed., eq. 3.5).
inline double gamma32(int64_t k) {
  const double ku = static_cast<double>(k) * kFloat32Roundoff;
  return ku / (1.0 - ku);
}

// Elementwise bound on |fl(x w^T) - x w^T| for x [..., M, K] and w [N, K], in float64:
//   gamma_K * (|x| @ |w|^T).
// Two float32 evaluations in different orders are each within it of the exact product, so they
// differ by at most twice it.
inline torch::Tensor matmul_error_bound(const torch::Tensor& x, const torch::Tensor& w) {
  return gamma32(x.size(-1)) *
         torch::matmul(x.to(torch::kFloat64).abs(), w.to(torch::kFloat64).abs().transpose(-1, -2));
}

// max |a - b| / tol over all elements: <= 1 means within tolerance. An element with tol == 0 must be
// equal (any difference there gives a huge ratio).
inline double tolerance_ratio(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& tol) {
  const auto diff = (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs();
  return (diff / tol.to(torch::kFloat64).clamp_min(1e-300)).max().item<double>();
}

}  // namespace ddm::test
