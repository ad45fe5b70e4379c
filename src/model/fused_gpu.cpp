// Autograd functions over the CUDA kernels of fused_cuda.cu (fused_gpu.h). The kernels take raw
// pointers; this file checks what they may be given, picks the types, allocates the outputs and the
// partial sums, and runs them on the current CUDA stream of the tensors' device.
#include "model/fused_gpu.h"

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <string>

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>

#include "core/cuda_module.h"
#include "core/error.h"
#include "model/fused_cuda.h"

namespace ddm {
namespace {

namespace k = cuda_kernels;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

bool kernel_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

k::DType dtype(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16 ? k::DType::bf16 : k::DType::f32; }

// A [B, W] modulation tensor the kernels read with a row stride: a view of the adaLN linear's output.
bool modulation(const torch::Tensor& m, const torch::Tensor& x) {
  return m.device() == x.device() && kernel_type(m) && m.dim() == 2 && m.size(0) == x.size(0) &&
         m.size(1) == x.size(2) && m.stride(1) == 1;
}

bool block_input(const torch::Tensor& x) {
  return fused_cuda_enabled() && x.is_cuda() && x.scalar_type() == torch::kFloat && x.dim() == 3 &&
         x.is_contiguous() && x.numel() > 0 && x.size(0) <= 65535 && x.size(2) <= k::kMaxWidth &&
         fused_cuda_runs_on(x.device().index());
}

void check(const char* error, const char* what) {
  DDM_CHECK(error == nullptr, what << ": the CUDA kernel failed to launch: " << error);
}

void* stream_of(const torch::Tensor& t) {
  return cuda_module().current_stream(t.device().index());
}

// The [B, W] gradient from its partial sums [B, chunks, W], in the type of the input it is for.
torch::Tensor summed(const torch::Tensor& parts, const torch::Tensor& like) {
  return parts.sum(1).to(like.scalar_type());
}

// The type of adaln_modulate's output: bfloat16 under bf16 autocast (the next op, a linear, would cast
// it there), else float32.
torch::ScalarType adaln_out_type() {
  return at::autocast::is_autocast_enabled(at::kCUDA) && at::autocast::get_autocast_dtype(at::kCUDA) == torch::kBFloat16
             ? torch::kBFloat16
             : torch::kFloat;
}

struct AdaLNModulate : torch::autograd::Function<AdaLNModulate> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& shift,
                               const torch::Tensor& scale, double eps) {
    const c10::DeviceGuard guard(x.device());
    const int64_t B = x.size(0), N = x.size(1), W = x.size(2);
    const auto out_type = adaln_out_type();
    auto out = torch::empty({B, N, W}, x.options().dtype(out_type));   // [B, N, W]
    auto mean = torch::empty({B * N}, x.options());                    // [B N]
    auto rstd = torch::empty({B * N}, x.options());                    // [B N]
    check(k::adaln_forward(x.data_ptr<float>(), shift.data_ptr(), scale.data_ptr(), dtype(scale), scale.stride(0),
                           out.data_ptr(), dtype(out), mean.data_ptr<float>(), rstd.data_ptr<float>(), B, N, W,
                           static_cast<float>(eps), stream_of(x)),
          "adaln_modulate");
    ctx->save_for_backward({x, shift, scale, mean, rstd});
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &shift = saved[1], &scale = saved[2], &mean = saved[3], &rstd = saved[4];
    const c10::DeviceGuard guard(x.device());
    const int64_t B = x.size(0), N = x.size(1), W = x.size(2);
    const auto g = grads[0].to(scale.scalar_type()).contiguous();      // [B, N, W], the output's type
    auto gx = torch::empty_like(x);                                    // [B, N, W]
    const int64_t chunks = k::row_chunks(N);
    auto part_scale = torch::empty({B, chunks, W}, x.options());       // [B, chunks, W]
    auto part_shift = torch::empty({B, chunks, W}, x.options());       // [B, chunks, W]
    check(k::adaln_backward(g.data_ptr(), dtype(g), x.data_ptr<float>(), mean.data_ptr<float>(),
                            rstd.data_ptr<float>(), scale.data_ptr(), dtype(scale), scale.stride(0),
                            gx.data_ptr<float>(), part_scale.data_ptr<float>(), part_shift.data_ptr<float>(), B, N,
                            W, stream_of(x)),
          "adaln_modulate backward");
    return {gx, summed(part_shift, shift), summed(part_scale, scale), torch::Tensor()};
  }
};

struct GatedResidualCuda : torch::autograd::Function<GatedResidualCuda> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& gate,
                               const torch::Tensor& a) {
    ctx->save_for_backward({gate, a});
    return torch::addcmul(x, gate.unsqueeze(1), a);                    // [B, N, W] float32
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &a = saved[1];
    const c10::DeviceGuard guard(a.device());
    const int64_t B = a.size(0), N = a.size(1), W = a.size(2);
    const auto g = grads[0].to(torch::kFloat).contiguous();            // [B, N, W]
    const auto ac = a.contiguous();                                    // [B, N, W]
    auto ga = torch::empty_like(ac);                                   // [B, N, W]
    auto part_gate = torch::empty({B, k::row_chunks(N), W}, g.options());  // [B, chunks, W]
    check(k::gated_backward(g.data_ptr<float>(), ac.data_ptr(), dtype(ac), gate.data_ptr(), dtype(gate),
                            gate.stride(0), ga.data_ptr(), part_gate.data_ptr<float>(), B, N, W, stream_of(g)),
          "gated_residual backward");
    return {grads[0], summed(part_gate, gate), ga};
  }
};

// The type of group_norm_act's output: bfloat16 under bf16 CUDA autocast (a convolution or a linear
// takes it and would cast it there), else x's.
torch::ScalarType group_norm_out_type(const torch::Tensor& x) {
  if (!at::autocast::is_autocast_enabled(at::kCUDA)) return x.scalar_type();
  return at::autocast::get_autocast_dtype(at::kCUDA) == torch::kBFloat16 ? torch::kBFloat16 : torch::kHalf;
}

// Whether the kernels read x in channels-last (NHWC) order: a 4-D x that is channels-last and not
// also contiguous (a tensor that is both, with one channel or one position, has the same offsets in
// both orders).
bool channels_last(const torch::Tensor& x) {
  return x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

at::MemoryFormat memory_format(bool nhwc) {
  return nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

const float* optional_f32(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
const void* optional_ptr(const torch::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// act(GroupNorm(x) * (1 + scale) + shift); the modulation optional. Saves x (not the normalized
// activations): the backward recomputes them, reading x twice.
struct GroupNormAct : torch::autograd::Function<GroupNormAct> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& gamma,
                               const torch::Tensor& beta, const torch::Tensor& scale, const torch::Tensor& shift,
                               int64_t groups, double eps, bool silu) {
    const c10::DeviceGuard guard(x.device());
    const int64_t B = x.size(0), C = x.size(1), HW = x.numel() / (B * C);
    const bool nhwc = channels_last(x);
    auto out = torch::empty(x.sizes(), x.options().dtype(group_norm_out_type(x)),
                            memory_format(nhwc));                           // [B, C, H, W], x's order
    auto mean = torch::empty({B * groups}, x.options().dtype(torch::kFloat));       // [B G]
    auto rstd = torch::empty({B * groups}, x.options().dtype(torch::kFloat));       // [B G]
    const int64_t mod_stride = scale.defined() ? scale.stride(0) : 0;
    check(k::group_norm_forward(x.data_ptr(), dtype(x), optional_f32(gamma), optional_f32(beta), optional_ptr(scale),
                                optional_ptr(shift), mod_stride, out.data_ptr(), dtype(out), mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), B, C, groups, HW, nhwc, silu, static_cast<float>(eps),
                                stream_of(x)),
          "group_norm_act");
    ctx->save_for_backward({x, gamma, beta, scale, shift, mean, rstd});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["silu"] = silu;
    ctx->saved_data["nhwc"] = nhwc;
    ctx->saved_data["out_type"] = static_cast<int64_t>(out.scalar_type());
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &gamma = saved[1], &beta = saved[2], &scale = saved[3], &shift = saved[4];
    const auto &mean = saved[5], &rstd = saved[6];
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const bool silu = ctx->saved_data["silu"].toBool();
    const bool nhwc = ctx->saved_data["nhwc"].toBool();
    const auto out_type = static_cast<torch::ScalarType>(ctx->saved_data["out_type"].toInt());
    const c10::DeviceGuard guard(x.device());
    const int64_t B = x.size(0), C = x.size(1), HW = x.numel() / (B * C);
    const auto gy = grads[0].to(out_type).contiguous(memory_format(nhwc));  // [B, C, H, W], the output's type
    auto gx = torch::empty(x.sizes(), x.options(), memory_format(nhwc));    // [B, C, H, W], x's type and order
    auto p = torch::empty({B, C}, x.options().dtype(torch::kFloat));  // [B, C]: sum over HW of dz * xhat
    auto q = torch::empty({B, C}, x.options().dtype(torch::kFloat));  // [B, C]: sum over HW of dz
    const int64_t mod_stride = scale.defined() ? scale.stride(0) : 0;
    check(k::group_norm_backward(gy.data_ptr(), dtype(gy), x.data_ptr(), dtype(x), mean.data_ptr<float>(),
                                 rstd.data_ptr<float>(), optional_f32(gamma), optional_f32(beta), optional_ptr(scale),
                                 optional_ptr(shift), mod_stride, gx.data_ptr(), p.data_ptr<float>(),
                                 q.data_ptr<float>(), B, C, groups, HW, nhwc, silu, stream_of(x)),
          "group_norm_act backward");
    // With z = u (1 + scale) + shift and u = xhat gamma + beta: dL/dshift = q, dL/dscale = gamma p + beta q,
    // dL/dgamma = sum_b (1 + scale) p, dL/dbeta = sum_b (1 + scale) q. Fixed-order reductions over B.
    const auto m = scale.defined() ? scale.to(torch::kFloat) + 1.0 : torch::Tensor();  // [B, C]
    const auto pm = m.defined() ? p * m : p, qm = m.defined() ? q * m : q;            // [B, C]
    torch::Tensor g_gamma, g_beta, g_scale, g_shift;
    if (gamma.defined()) g_gamma = pm.sum(0);                                           // [C]
    if (beta.defined()) g_beta = qm.sum(0);                                             // [C]
    if (scale.defined()) {
      auto u = gamma.defined() ? p * gamma : p;                                         // [B, C]
      if (beta.defined()) u = u + q * beta;
      g_scale = u.to(scale.scalar_type());
      g_shift = q.to(shift.scalar_type());
    }
    return {gx, g_gamma, g_beta, g_scale, g_shift, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool env_switch(const char* name, bool unset) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  DDM_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0,
            name << "=" << v << ": expected 1 (on) or 0 (off); unset it for the default (docs/gpu.md)");
  return v[0] == '1';
}

bool fused_cuda_enabled() {
  // Read at every call (a few per block), so a test can turn the kernels on and off.
  return env_switch("DDM_FUSED_CUDA", true);
}

bool fused_group_norm_enabled() { return fused_cuda_enabled() && env_switch("DDM_FUSED_GROUPNORM", false); }

std::string fused_cuda_archs() { return DDM_CUDA_ARCHS; }

bool fused_cuda_runs_on(int device) {
  // Asked once per device; a GPU none of the built architectures runs on gets LibTorch's ops and one
  // line saying so.
  static std::mutex mu;
  static std::map<int, bool> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find(device);
  if (it != known.end()) return it->second;
  int major = 0, minor = 0;
  // The query runs on `device` (LibTorch's guard: rank r of a data-parallel run on cuda:r makes no
  // context on cuda:0).
  const c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
  const char* error = k::kernels_load(device, &major, &minor);
  if (error != nullptr)
    std::cerr << "note: ddm's fused DiT kernels have no code for cuda:" << device << " (compute capability " << major
              << "." << minor << "; built for " << fused_cuda_archs() << "): LibTorch's ops run instead (" << error
              << ")" << std::endl;
  return known[device] = error == nullptr;
}

bool adaln_modulate_cuda_supported(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale) {
  // The kernels read shift and scale in the output's type (a DiT's adaLN linear runs under the same
  // autocast); float32 modulation under bf16 autocast takes LibTorch's ops.
  const auto out = adaln_out_type();
  return block_input(x) && modulation(shift, x) && modulation(scale, x) && shift.scalar_type() == out &&
         scale.scalar_type() == out && shift.stride(0) == scale.stride(0);
}

torch::Tensor adaln_modulate_cuda(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                  double eps) {
  DDM_CHECK(adaln_modulate_cuda_supported(x, shift, scale),
            "adaln_modulate_cuda: needs float32 CUDA x [B, N, W] (contiguous, W <= "
                << k::kMaxWidth << ") and shift, scale [B, W] of the output's type (bfloat16 under bf16 autocast, "
                   "else float32); got " << x.sizes() << " " << x.dtype()
                << ", " << shift.sizes() << " " << shift.dtype() << ", " << scale.sizes() << " " << scale.dtype());
  return AdaLNModulate::apply(x, shift, scale, eps);
}

bool gated_residual_cuda_supported(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a) {
  return block_input(x) && modulation(gate, x) && a.device() == x.device() && kernel_type(a) &&
         a.sizes() == x.sizes();
}

torch::Tensor gated_residual_cuda(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a) {
  DDM_CHECK(gated_residual_cuda_supported(x, gate, a),
            "gated_residual_cuda: needs float32 CUDA x [B, N, W] (contiguous), a of its shape and gate [B, W]; got "
                << x.sizes() << " " << x.dtype() << ", " << a.sizes() << " " << a.dtype() << ", " << gate.sizes());
  return GatedResidualCuda::apply(x, gate, a);
}

bool group_norm_act_cuda_supported(const torch::Tensor& x, const torch::nn::GroupNorm& norm,
                                   const torch::Tensor& scale, const torch::Tensor& shift) {
  if (!fused_group_norm_enabled() || !x.is_cuda() || !kernel_type(x) || x.dim() < 3 || x.numel() == 0 ||
      !(x.is_contiguous() || channels_last(x)))
    return false;
  const int64_t B = x.size(0), C = x.size(1), G = norm->options.num_groups();
  const int64_t widest = channels_last(x) ? k::kMaxGroupChannelsNHWC : k::kMaxGroupChannels;
  if (G <= 0 || C != norm->options.num_channels() || C % G != 0 || C / G > widest ||
      x.numel() / B > INT32_MAX - 256 || B * G > INT32_MAX)  // fused_cuda.cu's int indices
    return false;
  const auto out = group_norm_out_type(x);
  if (!(out == torch::kFloat || out == torch::kBFloat16)) return false;
  for (const auto& p : {norm->weight, norm->bias})
    if (p.defined() && !(p.device() == x.device() && p.scalar_type() == torch::kFloat && p.is_contiguous()))
      return false;
  if (scale.defined() != shift.defined()) return false;
  if (scale.defined()) {
    for (const auto& m : {scale, shift})
      if (!(m.device() == x.device() && m.scalar_type() == out && m.dim() == 2 && m.size(0) == B && m.size(1) == C &&
            m.stride(1) == 1))
        return false;
    if (scale.stride(0) != shift.stride(0)) return false;
  }
  return fused_cuda_runs_on(x.device().index());
}

torch::Tensor group_norm_act_cuda(const torch::Tensor& x, const torch::nn::GroupNorm& norm, bool silu,
                                  const torch::Tensor& scale, const torch::Tensor& shift) {
  DDM_CHECK(group_norm_act_cuda_supported(x, norm, scale, shift),
            "group_norm_act_cuda: needs a contiguous or channels-last float32 or bfloat16 CUDA x [B, C, ...] of "
            "the GroupNorm's channels (at most " << k::kMaxGroupChannels << " a group, " << k::kMaxGroupChannelsNHWC
                << " channels-last), its float32 weight and bias, and scale, shift [B, C] of the output's type or "
                   "neither; got " << x.sizes() << " " << x.dtype() << ", "
            << scale.sizes() << ", " << shift.sizes());
  return GroupNormAct::apply(x, norm->weight, norm->bias, scale, shift, norm->options.num_groups(),
                             norm->options.eps(), silu);
}

}  // namespace ddm
