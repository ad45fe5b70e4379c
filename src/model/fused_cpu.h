// Hand-written CPU kernels for x86-64 with AVX2 + FMA (fused_cpu.cpp); model/ops.h decides when
// they run. Each is differentiable (a custom autograd function with its own backward).
#pragma once
#include <torch/torch.h>

namespace ddm {

// True when fused_attention_cpu() can run on this tensor and this CPU.
bool fused_attention_cpu_supported(const torch::Tensor& qkv);

// Multi-head attention on qkv [B, 3, heads, N, d] (any strides) -> [B, heads, N, d] (a view of a
// [B, N, heads, d] buffer). Forward and backward never write the N x N attention matrix to memory:
// each (batch, head) is computed in cache and the backward recomputes the probabilities from the
// saved row log-sum-exp, as in FlashAttention. Precondition: fused_attention_cpu_supported(qkv).
torch::Tensor fused_attention_cpu(const torch::Tensor& qkv);

// True when adaln_modulate_cpu() can run on these tensors and this CPU.
bool adaln_modulate_cpu_supported(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale);

// LayerNorm over the last dim (no affine) then adaLN modulation, in one pass each way:
// x [B, N, W], shift and scale [B, W] -> LN(x) * (1 + scale) + shift, [B, N, W].
// Precondition: adaln_modulate_cpu_supported(x, shift, scale).
torch::Tensor adaln_modulate_cpu(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                 double eps);

// True when gated_residual_cpu() can run on these tensors and this CPU.
bool gated_residual_cpu_supported(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a,
                                  const torch::Tensor& bias);

// x + gate * (a + bias): x, a [B, N, W], gate [B, W], bias [W] -> [B, N, W]. The bias of the linear
// that produced `a` is folded in, so that linear can run without one.
// Precondition: gated_residual_cpu_supported(x, gate, a, bias).
torch::Tensor gated_residual_cpu(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a,
                                 const torch::Tensor& bias);

}  // namespace ddm
