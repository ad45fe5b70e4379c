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

// True when linear_gelu_cpu() can run on these tensors and this CPU.
bool linear_gelu_cpu_supported(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

// gelu(x w^T + b), x [M, K], w [H, K], b [H] -> [M, H], with GELU = x Phi(x) and the bias add and
// bias gradient folded into the GELU passes. Phi comes from Abramowitz and Stegun's erf
// approximation 7.1.26 (absolute error below 1.5e-7, float32 resolution near 1).
// Precondition: linear_gelu_cpu_supported(x, w, b).
torch::Tensor linear_gelu_cpu(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

}  // namespace ddm
