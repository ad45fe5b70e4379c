// The DiT block's adaLN modulation and gated residual, and a U-Net's GroupNorm + modulation + SiLU, on
// CUDA tensors, as autograd functions over the hand-written kernels of fused_cuda.cu; model/ops.h
// decides when they run. Each replaces a chain of LibTorch ops that makes a pass over the activations
// per op, forward and backward (fused_cuda.h).
// On by default since an H200 checked them (2026-12-04: within float32 rounding of their float64
// expressions, bit-identical repeats, dit-b's step 1.21x faster); DDM_FUSED_CUDA=0 in the environment
// turns them off, and LibTorch's ops run instead.
#pragma once
#include <torch/torch.h>

namespace ddm {

// An on/off switch in the environment: `unset` when unset or empty, else 1 (true) or 0 (false); any
// other value is refused with a ddm::Error naming the variable. Read at each call.
bool env_switch(const char* name, bool unset);

// False when DDM_FUSED_CUDA=0 is set; then neither function below runs (its _supported is false).
bool fused_cuda_enabled();
// The compute capabilities the kernels were built for ("7.5 8.0 ... 12.0"; each with its PTX, which
// newer GPUs compile when they load it).
std::string fused_cuda_archs();
// Whether the kernels run on GPU `device` (asked once per device). Where none of the built
// architectures does, LibTorch's ops run instead, and one line on stderr says so.
bool fused_cuda_runs_on(int device);

// True when adaln_modulate_cuda() runs on these tensors: float32 CUDA x [B, N, W] (contiguous, W at
// most 2048), shift and scale [B, W] of one type, float32 or bfloat16, with unit column stride.
bool adaln_modulate_cuda_supported(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale);

// LayerNorm(x) (no affine, epsilon eps) * (1 + scale) + shift, [B, N, W], in one pass each way. Under
// CUDA autocast the result has autocast's type (bfloat16): the linear that takes it would cast it
// anyway, so the cast is fused too. Precondition: adaln_modulate_cuda_supported(x, shift, scale).
torch::Tensor adaln_modulate_cuda(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                  double eps);

// True when gated_residual_cuda() runs on these tensors: float32 CUDA x [B, N, W] (contiguous), a of
// x's shape, float32 or bfloat16, gate [B, W] float32 or bfloat16 with unit column stride.
bool gated_residual_cuda_supported(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a);

// x + gate * a, float32 [B, N, W]: LibTorch's addcmul forward, and a backward in one pass (the
// gradient of a in a's type, the gate's summed over N without atomics).
// Precondition: gated_residual_cuda_supported(x, gate, a).
torch::Tensor gated_residual_cuda(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a);

// The GroupNorm kernel is opt-in until a GPU has checked it: it runs where DDM_FUSED_GROUPNORM=1 is set
// (and DDM_FUSED_CUDA is not 0). Written 2026-12-04 without a GPU; tests/gpu/test_cuda.cpp checks it
// against its float64 expression.
bool fused_group_norm_enabled();

// True when group_norm_act_cuda() runs on these: x a CUDA [B, C, H, W] (or [B, C, L]), contiguous or
// channels-last, float32 or bfloat16, a GroupNorm's float32 weight and bias (or none), at most
// kMaxGroupChannels channels a group (kMaxGroupChannelsNHWC channels-last); scale and shift [B, C] of
// the output's type with unit column stride and one row stride, or both undefined. The output's
// type: bfloat16 under bf16 CUDA autocast, else x's.
bool group_norm_act_cuda_supported(const torch::Tensor& x, const torch::nn::GroupNorm& norm,
                                   const torch::Tensor& scale, const torch::Tensor& shift);

// act(GroupNorm(x) * (1 + scale) + shift), act SiLU (silu) or none, in one pass each way. Under bf16
// autocast the result is bfloat16: the convolution or linear that takes it would cast it there (so
// call it only where one does). The result, and the gradient of x, are in x's memory order.
// Precondition: group_norm_act_cuda_supported(x, norm, scale, shift).
torch::Tensor group_norm_act_cuda(const torch::Tensor& x, const torch::nn::GroupNorm& norm, bool silu,
                                  const torch::Tensor& scale, const torch::Tensor& shift);

}  // namespace ddm
