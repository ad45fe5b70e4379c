// Launchers of the hand-written CUDA kernels of a DiT block and of a U-Net's GroupNorm chain
// (fused_cuda.cu), on raw pointers, so that
// the .cu file compiles with nvcc alone, without LibTorch's headers. The autograd functions that call
// them (and decide where they run) are in fused_gpu.h. Hand-written because LibTorch's eager ops run
// each step of these chains as its own pass over [B N, W]: the adaLN chain (layer norm, modulate, the
// autocast cast) and the gated residual's backward (two products, a cast, a reduction) are most of a
// DiT step's elementwise time on a GPU (docs/results.md, "Where eager's time goes").
//
// Layouts: x, out, g, gx, a, ga are [B, N, W] row-major (contiguous); shift, scale, gate are [B, W]
// with row stride mod_stride (views of the adaLN linear's [B, k W] output) and unit column stride.
// Every reduction has a fixed order (block sums in a fixed tree, then partial sums per chunk of rows
// that the caller adds up): the same inputs give the same bits on every run.
#pragma once
#include <cstdint>

namespace ddm::cuda_kernels {

enum class DType { f32, bf16 };

// The widest row the kernels take (the adaLN kernels: 64 columns a lane, a warp a row).
constexpr int kMaxWidth = 2048;
// How many partial sums per batch row the backward kernels write: one per chunk of rows of N.
int row_chunks(int64_t N);

// Whether the kernels can run on GPU `device`: nullptr if so, else CUDA's reason (no code or PTX of
// the architectures they were built for runs there). Fills in its compute capability. Call it with
// `device` current (a device guard).
const char* kernels_load(int device, int* major, int* minor);

// Each returns nullptr on success, else CUDA's error message for the launch. stream: a cudaStream_t.

// out = LayerNorm(x) * (1 + scale) + shift (no affine, biased variance, epsilon eps); mean and rstd
// [B N] get each row's mean and 1 / sqrt(var + eps) for the backward. shift, scale and out of one type.
const char* adaln_forward(const float* x, const void* shift, const void* scale, DType mod, int64_t mod_stride,
                          void* out, DType out_type, float* mean, float* rstd, int64_t B, int64_t N, int64_t W,
                          float eps, void* stream);

// From g = dL/dout (of scale's type): gx = dL/dx (float32, [B, N, W]), and per chunk of rows the partial
// sums of dL/dscale = sum_n g * xhat and dL/dshift = sum_n g, part_scale and part_shift
// [B, row_chunks(N), W] (float32).
const char* adaln_backward(const void* g, DType g_type, const float* x, const float* mean, const float* rstd,
                           const void* scale, DType mod, int64_t mod_stride, float* gx, float* part_scale,
                           float* part_shift, int64_t B, int64_t N, int64_t W, void* stream);

// The backward of out = x + gate * a (x, g float32; a and ga of a_type): ga = g * gate, and the partial
// sums of dL/dgate = sum_n g * a in part_gate [B, row_chunks(N), W] (float32).
const char* gated_backward(const float* g, const void* a, DType a_type, const void* gate, DType mod,
                           int64_t mod_stride, void* ga, float* part_gate, int64_t B, int64_t N, int64_t W,
                           void* stream);

// GroupNorm, modulation and SiLU in one pass each way (a U-Net's res block: GroupNorm, then
// h * (1 + scale) + shift, then SiLU, then the cast for the next convolution: five passes over
// [B, C, H, W] in LibTorch's ops, three of them in float32 under bf16 autocast). x, out, gy, gx are
// [B, C, HW] in NCHW order (contiguous) or, with nhwc, [B, HW, C] (channels-last), all four alike;
// gamma, beta [C] float32 or null (1 and 0); scale, shift [B, C] of out's type with row stride
// mod_stride, or null (no modulation). A block takes one group (b, g).
// The widest group (channels per group) the kernels take: their per-channel values live in shared
// memory. In NHWC order at most 256 (a block's threads each keep to one channel of the group).
constexpr int kMaxGroupChannels = 2048;
constexpr int kMaxGroupChannelsNHWC = 256;

// out = act(((x - mean) * rstd * gamma + beta) * (1 + scale) + shift), act SiLU or none, per group
// (biased variance, epsilon eps); mean and rstd [B G] for the backward.
const char* group_norm_forward(const void* x, DType x_type, const float* gamma, const float* beta,
                               const void* scale, const void* shift, int64_t mod_stride, void* out, DType out_type,
                               float* mean, float* rstd, int64_t B, int64_t C, int64_t G, int64_t HW, bool nhwc,
                               bool silu, float eps, void* stream);

// From gy = dL/dout (of out's type): gx = dL/dx (x's type), and per (b, c) the sums over HW of
// dz * xhat (p) and of dz (q), [B, C] float32, where dz = dL/d(the value before act) and xhat the
// normalized x. The gradients of gamma, beta, scale and shift follow from p and q (fused_gpu.cpp).
const char* group_norm_backward(const void* gy, DType out_type, const void* x, DType x_type, const float* mean,
                                const float* rstd, const float* gamma, const float* beta, const void* scale,
                                const void* shift, int64_t mod_stride, void* gx, float* p, float* q, int64_t B,
                                int64_t C, int64_t G, int64_t HW, bool nhwc, bool silu, void* stream);

}  // namespace ddm::cuda_kernels
