// The few API differences between Debian's LibTorch 1.13 (CPU) and PyTorch 2.x's bundled LibTorch
// (CUDA), guarded in one place.
#pragma once
#include <torch/torch.h>
#include <torch/version.h>

#define DDM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddm {

// LibTorch >= 2.0 has a fused scaled-dot-product attention (CPU and CUDA); 1.13 does not.
constexpr bool kTorchHasSdpa = DDM_TORCH_AT_LEAST(2, 0);

// softmax(q k^T / sqrt(d)) v over the last two dims; q, k, v: [B, heads, N, d].
// 2.x: the fused kernel; 1.13: the plain three-op form (model/ops.h picks a faster path where it can).
inline torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if DDM_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto w = torch::matmul(q, k.transpose(-2, -1)).mul_(scale).softmax(-1);  // [B, h, N, N]
  return torch::matmul(w, v);                                               // [B, h, N, d]
#endif
}

}  // namespace ddm
