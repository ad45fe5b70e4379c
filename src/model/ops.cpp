// Dispatch between the implementations of the model operations in ops.h.
#include "model/ops.h"

#include <cmath>

#include <torch/torch.h>

#include "core/error.h"
#include "model/fused_cpu.h"
#include "model/fused_gpu.h"

namespace ddm {

torch::Tensor attention_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto w = torch::matmul(q, k.transpose(-2, -1)).mul(scale).softmax(-1);  // [B, h, N, N]
  return torch::matmul(w, v);                                              // [B, h, N, d]
}

torch::Tensor attention_qkv(const torch::Tensor& qkv) {
  DDM_CHECK(qkv.dim() == 5 && qkv.size(1) == 3, "attention: expected qkv [B, 3, heads, N, d], got " << qkv.sizes());
  // The hand-written kernel where it runs (float32 CPU tensors, AVX2 + FMA): 1.04x-1.31x faster than
  // LibTorch 2.11's SDPA on the DiT presets (docs/results.md); SDPA everywhere else (CUDA, bfloat16).
  if (fused_attention_cpu_supported(qkv)) return fused_attention_cpu(qkv);  // [B, h, N, d]
  auto u = qkv.unbind(1);                                                  // 3 x [B, h, N, d]
  return at::scaled_dot_product_attention(u[0], u[1], u[2]);              // [B, h, N, d]
}

torch::Tensor attention_tokens_qkv(const torch::Tensor& qkv) {
  DDM_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, "attention: expected qkv [B, N, 3, heads, d], got " << qkv.sizes());
  const auto permuted = qkv.permute({0, 2, 3, 1, 4});                     // [B, 3, h, N, d]
  if (fused_attention_cpu_supported(permuted)) return fused_attention_cpu(permuted);  // [B, h, N, d]
  const auto u = qkv.unbind(2);                                           // 3 x [B, N, h, d]
  return at::scaled_dot_product_attention(u[0].transpose(1, 2), u[1].transpose(1, 2),
                                          u[2].transpose(1, 2));          // [B, h, N, d]
}

torch::Tensor apply_linear(const torch::nn::Linear& m, const torch::Tensor& x) {
  return at::linear(x, m->weight, m->bias);  // [.., out]
}

torch::Tensor apply_linear(const torch::nn::LinearImpl& m, const torch::Tensor& x) {
  return at::linear(x, m.weight, m.bias);  // [.., out]
}

torch::Tensor adaln_modulate(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                             double eps) {
  if (adaln_modulate_cpu_supported(x, shift, scale)) return adaln_modulate_cpu(x, shift, scale, eps);  // [B, N, W]
  if (adaln_modulate_cuda_supported(x, shift, scale)) return adaln_modulate_cuda(x, shift, scale, eps);  // [B, N, W]
  auto h = torch::layer_norm(x, {x.size(-1)}, {}, {}, eps);                                            // [B, N, W]
  return torch::addcmul(shift.unsqueeze(1), h, scale.unsqueeze(1) + 1.0);                              // [B, N, W]
}

torch::Tensor gated_residual(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a) {
  if (gated_residual_cuda_supported(x, gate, a)) return gated_residual_cuda(x, gate, a);  // [B, N, W]
  return torch::addcmul(x, gate.unsqueeze(1), a);                                       // [B, N, W]
}

torch::Tensor gated_residual(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a,
                             const torch::Tensor& bias) {
  if (gated_residual_cpu_supported(x, gate, a, bias)) return gated_residual_cpu(x, gate, a, bias);  // [B, N, W]
  return torch::addcmul(x, gate.unsqueeze(1), a + bias);                                           // [B, N, W]
}

bool channels_last_requested() { return env_switch("DDM_CHANNELS_LAST", false); }

bool channels_last_enabled(const torch::Device& device) {
  return channels_last_requested() && (!device.is_cuda() || fused_group_norm_enabled());
}

torch::Tensor group_norm_silu(const torch::nn::GroupNorm& norm, const torch::Tensor& x) {
  return group_norm_act(norm, x, /*silu=*/true);  // [B, C, H, W]
}

torch::Tensor group_norm_act(const torch::nn::GroupNorm& norm, const torch::Tensor& x, bool silu,
                             const torch::Tensor& scale, const torch::Tensor& shift) {
  DDM_CHECK(scale.defined() == shift.defined(), "group_norm_act: scale and shift come together");
  if (group_norm_act_cuda_supported(x, norm, scale, shift)) return group_norm_act_cuda(x, norm, silu, scale, shift);
  // GroupNormImpl::forward's own call (through a const holder, whose operator() is not const).
  auto h = torch::group_norm(x, norm->options.num_groups(), norm->weight, norm->bias, norm->options.eps(),
                             at::globalContext().userEnabledCuDNN());     // [B, C, H, W]
  if (scale.defined()) {
    std::vector<int64_t> per_channel(static_cast<size_t>(x.dim()), 1);           // [B, C, 1, 1]
    per_channel[0] = x.size(0);
    per_channel[1] = x.size(1);
    h = torch::addcmul(shift.view(per_channel), h, scale.view(per_channel) + 1.0);  // [B, C, H, W]
  }
  return silu ? torch::silu(h) : h;                                               // [B, C, H, W]
}

}  // namespace ddm
