// Model operations with more than one implementation: multi-head self-attention on packed q, k, v,
// and DiT's adaLN modulation and gated residual. Each call picks the
// implementation that runs here:
//   - attention: the fused kernel of fused_cpu.h for float32 CPU tensors on AVX2 + FMA CPUs (measured
//     1.04x-1.31x faster than LibTorch 2.11's SDPA on this project's DiT presets, docs/results.md),
//     else LibTorch's fused at::scaled_dot_product_attention (CUDA, other dtypes);
//   - adaln_modulate, gated_residual: the fused_cpu.h kernels for float32 CPU tensors on AVX2 + FMA
//     CPUs, the fused_gpu.h kernels for CUDA tensors, else the same expression in ATen ops.
//   - group_norm_silu, group_norm_act: the fused_gpu.h kernel for CUDA tensors where it is enabled
//     (DDM_FUSED_GROUPNORM=1 until a GPU has checked it), else the same expression in ATen ops.
// Also apply_linear: an nn::Linear's map through at::linear, for autocast's cache of weight casts.
#pragma once
#include <torch/torch.h>

namespace ddm {

// m's map of x [.., in] (x W^T + b), through at::linear: under autocast the weight is cast as itself (a
// leaf tensor), a cast that an AutocastWeightCache (core/device.h) keeps for all of a sampler's steps;
// nn::Linear's own forward casts the view W^T instead, afresh at every call. The same arithmetic (for
// 2-D x both are addmm(b, x, W^T)).
torch::Tensor apply_linear(const torch::nn::Linear& m, const torch::Tensor& x);
torch::Tensor apply_linear(const torch::nn::LinearImpl& m, const torch::Tensor& x);  // a ModuleList's entry

// qkv: [B, 3, heads, N, d] (any strides, e.g. a permuted view of a linear's output).
// Returns softmax(q k^T / sqrt(d)) v as [B, heads, N, d]; on the fused CPU path it is a view of a
// [B, N, heads, d] buffer, so a.transpose(1, 2).reshape(B N, heads d) costs no copy.
torch::Tensor attention_qkv(const torch::Tensor& qkv);
// The same from a linear's output viewed as tokens, qkv [B, N, 3, heads, d] (a DiT block's): on the
// fused CPU path attention_qkv of its [B, 3, heads, N, d] permutation; elsewhere (CUDA, bfloat16) q,
// k and v are unbound along dim 2 first, so that backward stacks their gradients straight into the
// linear's layout. (Unbinding the permutation instead costs a strided concatenation and a copy per
// block in backward: 9.5 ms of a 156 ms dit-b step on an H100, docs/results.md.)
torch::Tensor attention_tokens_qkv(const torch::Tensor& qkv);

// The reference three-op form on separate q, k, v [B, heads, N, d]; used by tests and as fallback.
torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// LayerNorm(x) (no affine, epsilon eps) * (1 + scale) + shift; x [B, N, W], shift/scale [B, W]. On
// the CUDA kernel's path under bfloat16 autocast the result is bfloat16 (it feeds a linear, which
// would cast it); elsewhere float32 for float32 x.
torch::Tensor adaln_modulate(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                             double eps);

// x + gate * a; x, a [B, N, W], gate [B, W].
torch::Tensor gated_residual(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a);

// x + gate * (a + bias); x, a [B, N, W], gate [B, W], bias [W] (the bias of the linear that made a).
torch::Tensor gated_residual(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a,
                             const torch::Tensor& bias);

// Whether ddm's U-Nets run their activations on `device` in channels-last order (NHWC):
// DDM_CHANNELS_LAST=1 in the environment (read at each call), and on a GPU the GroupNorm kernel on
// (fused_gpu.h), which reads that order as it is; LibTorch's CUDA GroupNorm would copy it to NCHW
// and back at every norm. On a GPU it is cuDNN's own order for bf16 convolutions, which otherwise
// transposes each convolution's input and output; on a CPU oneDNN's convolutions are slower in it
// (docs/results.md), so there it serves tests. Opt-in until a GPU has measured it.
bool channels_last_enabled(const torch::Device& device);
// DDM_CHANNELS_LAST=1 is set.
bool channels_last_requested();

// silu(norm(x)) for a convolution to take; x [B, C, H, W]. On the CUDA kernel's path under bf16
// autocast the result is bfloat16 (the convolution would cast it); elsewhere norm's and silu's types.
torch::Tensor group_norm_silu(const torch::nn::GroupNorm& norm, const torch::Tensor& x);

// act(norm(x) * (1 + scale) + shift) for a convolution or linear to take, act SiLU (silu) or none;
// x [B, C, H, W], scale and shift [B, C] or both undefined (then act(norm(x))). Types as above.
torch::Tensor group_norm_act(const torch::nn::GroupNorm& norm, const torch::Tensor& x, bool silu,
                             const torch::Tensor& scale = {}, const torch::Tensor& shift = {});

}  // namespace ddm
