// The few API differences between Debian's LibTorch 1.13 (CPU) and PyTorch 2.x's bundled LibTorch
// (CUDA), guarded in one place.
#pragma once
#include <torch/torch.h>
#include <torch/version.h>

#define DDM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10d backends, declared only (src/dist/ includes their headers where it builds them). In 1.13
// ProcessGroupGloo derives from c10d::ProcessGroup, in 2.x from c10d::Backend; its constructor
// (store, rank, size, options) and its collectives are the same, so code holds it as GlooBackend.
namespace c10d {
class ProcessGroupGloo;
#ifdef USE_C10D_NCCL
class ProcessGroupNCCL;
#endif
}  // namespace c10d

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

// The concrete c10d backends ddm drives directly (not through a 2.x ProcessGroup wrapper).
using GlooBackend = c10d::ProcessGroupGloo;
// NCCL: only in a CUDA build of PyTorch 2.x, whose CMake config defines USE_C10D_NCCL. Not compiled
// (and not tested) with Debian's CPU LibTorch; src/dist selects it only under the same #ifdef.
#ifdef USE_C10D_NCCL
using NcclBackend = c10d::ProcessGroupNCCL;
constexpr bool kHaveNccl = true;
#else
constexpr bool kHaveNccl = false;
#endif

}  // namespace ddm
