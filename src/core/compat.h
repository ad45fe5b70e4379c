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

// softmax(q k^T / sqrt(d)) v over the last two dims with LibTorch's fused kernel; q, k, v:
// [B, heads, N, d]. Only when kTorchHasSdpa; on 1.13 it returns an undefined tensor and callers use
// model/ops.h's other implementations.
inline torch::Tensor sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if DDM_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v);
#else
  (void)q, (void)k, (void)v;
  return torch::Tensor();
#endif
}

}  // namespace ddm
