// Analytic FLOP counting rule shared by the backbones' forward_flops functions.
//
// Rule: one multiply-accumulate (MAC) = 2 FLOPs. Counted: convolutions, linear layers (including
// the time-embedding MLP and the adaLN modulation linears) and the two attention matmuls
// (Q K^T and softmax(.) V). Not counted: biases, normalization, activations, softmax, scaling,
// residual adds, upsampling, patch reshapes and embedding-table lookups (all O(elements), small
// next to the matmuls).
#pragma once
#include <cstdint>

namespace ddm::flops {

// Conv2d with `in` -> `out` channels, k x k kernel, producing an h_out x w_out map.
inline double conv2d(int64_t in, int64_t out, int64_t k, int64_t h_out, int64_t w_out) {
  return 2.0 * static_cast<double>(in) * out * k * k * h_out * w_out;
}
// Linear in -> out applied to `tokens` vectors.
inline double linear(int64_t in, int64_t out, int64_t tokens = 1) {
  return 2.0 * static_cast<double>(in) * out * tokens;
}
// Q K^T ([N, d] x [d, N]) and A V ([N, N] x [N, d]) over all heads, width = heads * d.
inline double attention(int64_t tokens, int64_t width) {
  return 2.0 * 2.0 * static_cast<double>(tokens) * tokens * width;
}

// Q K^T ([N, d] x [d, T]) and A V ([N, T] x [T, d]) of N queries on T keys, width = heads * d.
inline double cross_attention(int64_t queries, int64_t keys, int64_t width) {
  return 2.0 * 2.0 * static_cast<double>(queries) * keys * width;
}

}  // namespace ddm::flops
