// The hand-written CUDA kernels of a DiT block and of a U-Net's GroupNorm chain (fused_cuda.h says
// what each computes and why they are hand-written; the GroupNorm kernels' layout is described where
// they start). A block of threads takes a chunk of kRows rows of one batch element. In the adaLN
// kernels each warp takes whole rows (rows n0 + w, n0 + w + kWarps, ...), each lane the columns
// lane + 32 j (j < K, K = the columns per lane the row's width needs), so a row's reductions are warp
// shuffles alone and a warp has up to K loads in flight per row: bandwidth-bound, not bound by the
// block-wide barriers of one block per row (4x slower on an H200; docs/results.md, forty-first session).
// The backward's per-column sums over the chunk's rows add each warp's sums in a fixed order through
// shared memory, without atomics. The gated residual's backward gives each thread a column and walks
// the chunk's rows.
#include "model/fused_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace ddm::cuda_kernels {
namespace {

constexpr int kWarps = 4;              // warps per block of the adaLN kernels
constexpr int kMaxThreads = 256;       // threads per block of the gated residual's backward
constexpr int kRows = 16;              // rows of N per block
constexpr int kMaxPerLane = kMaxWidth / 32;  // columns per lane of the widest row
static_assert(kRows % kWarps == 0, "each warp takes the same number of a chunk's rows");

template <typename T>
__device__ __forceinline__ float load(const T* p);
template <>
__device__ __forceinline__ float load<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
__device__ __forceinline__ void store(T* p, float v);
template <>
__device__ __forceinline__ void store<float>(float* p, float v) { *p = v; }
template <>
__device__ __forceinline__ void store<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// The sum of v over the warp, in every lane: a fixed butterfly, so the same bits on every run and in
// every lane (each level adds the same two values, in either order).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// out = LayerNorm(x) * (1 + scale) + shift for the block's rows, one warp a row; K columns per lane.
template <typename TM, typename TO, int K>
__global__ void __launch_bounds__(kWarps * 32) adaln_forward_kernel(
    const float* __restrict__ x, const TM* __restrict__ shift, const TM* __restrict__ scale, int64_t mod_stride,
    TO* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t N, int64_t W,
    float eps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t n1 = min(N, n0 + kRows);
  const float inv_w = 1.f / static_cast<float>(W);
  const TM* sh = shift + b * mod_stride;
  const TM* sc = scale + b * mod_stride;
  for (int64_t n = n0 + warp; n < n1; n += kWarps) {
    const int64_t row = b * N + n;
    const float* xr = x + row * W;
    float v[K];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t c = lane + 32 * j;
      v[j] = c < W ? xr[c] : 0.f;
      s += v[j];
    }
    const float mean = warp_sum(s) * inv_w;
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t c = lane + 32 * j;
      const float d = v[j] - mean;
      q += c < W ? d * d : 0.f;
    }
    const float rstd = rsqrtf(warp_sum(q) * inv_w + eps);
    TO* o = out + row * W;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t c = lane + 32 * j;
      if (c < W) store(o + c, (v[j] - mean) * rstd * (1.f + load(sc + c)) + load(sh + c));
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// Writes the block's per-column sums of acc (each warp's K columns per lane) to part[0, W): the warps'
// values through shared memory (red: [kWarps, W]), added in warp order. Every thread calls it.
template <int K>
__device__ __forceinline__ void block_column_sums(const float (&acc)[K], float* red, float* __restrict__ part,
                                                  int64_t W) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int64_t c = lane + 32 * j;
    if (c < W) red[warp * W + c] = acc[j];
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < W; c += blockDim.x) {
    float t = red[c];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) t += red[w * W + c];
    part[c] = t;
  }
  __syncthreads();
}

// gx, and the chunk's sums of g * xhat and of g per column, one warp a row; K columns per lane. Each
// row is read twice (the second time from cache), so that a lane holds only its column sums.
template <typename TG, typename TM, int K>
__global__ void __launch_bounds__(kWarps * 32) adaln_backward_kernel(
    const TG* __restrict__ g, const float* __restrict__ x, const float* __restrict__ mean,
    const float* __restrict__ rstd, const TM* __restrict__ scale, int64_t mod_stride, float* __restrict__ gx,
    float* __restrict__ part_scale, float* __restrict__ part_shift, int64_t N, int64_t W) {
  extern __shared__ float red[];  // [kWarps, W]: the launch gives kWarps * W floats
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t n1 = min(N, n0 + kRows);
  const float inv_w = 1.f / static_cast<float>(W);
  const TM* sc = scale + b * mod_stride;
  float dscale[K], dshift[K];
#pragma unroll
  for (int j = 0; j < K; ++j) dscale[j] = dshift[j] = 0.f;
  for (int64_t n = n0 + warp; n < n1; n += kWarps) {
    const int64_t row = b * N + n;
    const TG* gr = g + row * W;
    const float* xr = x + row * W;
    const float m = mean[row], r = rstd[row];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t c = lane + 32 * j;
      if (c < W) {
        const float gv = load(gr + c), xh = (xr[c] - m) * r;
        const float gh = gv * (1.f + load(sc + c));  // dL/dxhat
        s1 += gh;
        s2 += gh * xh;
        dscale[j] += gv * xh;
        dshift[j] += gv;
      }
    }
    const float mean_gh = warp_sum(s1) * inv_w, mean_ghx = warp_sum(s2) * inv_w;
    float* gxr = gx + row * W;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t c = lane + 32 * j;
      if (c < W) {
        const float xh = (xr[c] - m) * r, gh = load(gr + c) * (1.f + load(sc + c));
        gxr[c] = r * (gh - mean_gh - xh * mean_ghx);
      }
    }
  }
  const int64_t part = (b * gridDim.x + blockIdx.x) * W;
  block_column_sums<K>(dscale, red, part_scale + part, W);
  block_column_sums<K>(dshift, red, part_shift + part, W);
}

template <typename TA, typename TM>
__global__ void gated_backward_kernel(const float* __restrict__ g, const TA* __restrict__ a,
                                      const TM* __restrict__ gate, int64_t mod_stride, TA* __restrict__ ga,
                                      float* __restrict__ part_gate, int64_t N, int64_t W) {
  const int64_t b = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t n1 = min(N, n0 + kRows);
  const int64_t part = (b * gridDim.x + blockIdx.x) * W;
  for (int64_t c = threadIdx.x; c < W; c += blockDim.x) {
    const float gt = load(gate + b * mod_stride + c);
    float acc = 0.f;
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t i = (b * N + n) * W + c;
      const float gv = g[i];
      store(ga + i, gv * gt);
      acc += gv * load(a + i);
    }
    part_gate[part + c] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// GroupNorm, modulation and SiLU: a block of kGnThreads threads per group (b, g). In NCHW order the
// group's C/G channels of batch row b are one contiguous span of L = C/G * HW elements; in NHWC
// (channels-last) order it is HW runs of C/G channels, C apart, and the block walks them position by
// position (i = p C/G + ci). The forward reads the group three times (the mean, the variance about it,
// the output; the second and third from cache), the backward twice (each channel's sums, then gx).
// Block sums add the warps' sums in warp order: fixed.
constexpr int kGnThreads = 256;
constexpr int kGnWarps = kGnThreads / 32;

// The sum of v over the block, the same bits in every thread; red: kGnWarps floats of shared memory.
// Every thread calls it.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = red[0];
#pragma unroll
  for (int w = 1; w < kGnWarps; ++w) t += red[w];
  __syncthreads();  // red may be written again
  return t;
}

template <typename T>
__device__ __forceinline__ float load_or(const T* p, int64_t i, float none) {
  return p == nullptr ? none : load(p + i);
}

// SiLU and its derivative at z (finite for every finite z: expf(-z) may be inf, 1 / inf is 0).
__device__ __forceinline__ float silu_of(float z) { return z / (1.f + expf(-z)); }
__device__ __forceinline__ float silu_grad(float z) {
  const float s = 1.f / (1.f + expf(-z));
  return s * (1.f + z * (1.f - s));
}

// Element i (0 <= i < L) of group (b, g): its offset from the tensor's start and its channel ci in the
// group. NCHW: the group starts at (b G + g) L and i = ci HW + p; NHWC: i = p Cg + ci, at
// (b HW + p) C + g Cg + ci.
template <bool NHWC>
struct GroupLayout {
  int64_t start;  // NCHW: (b G + g) L; NHWC: b HW C + g Cg
  int Cg, HW, C;
  __device__ __forceinline__ GroupLayout(int64_t b, int g, int G, int cg, int hw)
      : start(NHWC ? b * hw * static_cast<int64_t>(G) * cg + static_cast<int64_t>(g) * cg
                   : (b * G + g) * static_cast<int64_t>(cg) * hw),
        Cg(cg), HW(hw), C(G * cg) {}
  __device__ __forceinline__ int64_t at(int i, int& ci) const {
    if (NHWC) {
      const int p = i / Cg;
      ci = i - p * Cg;
      return start + static_cast<int64_t>(p) * C + ci;
    }
    ci = i / HW;
    return start + i;
  }
};

// Each channel's coefficients in shared memory, written by the block: z = xhat * ca[c] + ck[c], where
// xhat = (x - mean) * rstd, ca = gamma * (1 + scale), ck = beta * (1 + scale) + shift.
template <typename TM>
__device__ __forceinline__ void group_coefficients(const float* __restrict__ gamma, const float* __restrict__ beta,
                                                   const TM* __restrict__ scale, const TM* __restrict__ shift,
                                                   int64_t mod_row, int64_t c0, int Cg, float* ca, float* ck) {
  for (int ci = threadIdx.x; ci < Cg; ci += kGnThreads) {
    const int64_t c = c0 + ci;
    const float m = 1.f + load_or(scale, mod_row + c, 0.f);
    ca[ci] = (gamma == nullptr ? 1.f : gamma[c]) * m;
    ck[ci] = (beta == nullptr ? 0.f : beta[c]) * m + load_or(shift, mod_row + c, 0.f);
  }
  __syncthreads();
}

template <typename TX, typename TO, bool NHWC>
__global__ void __launch_bounds__(kGnThreads) group_norm_forward_kernel(
    const TX* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ beta,
    const TO* __restrict__ scale, const TO* __restrict__ shift, int64_t mod_stride, TO* __restrict__ out,
    float* __restrict__ mean_out, float* __restrict__ rstd_out, int G, int Cg, int HW, bool silu, float eps) {
  extern __shared__ float coef[];  // ca [Cg], then ck [Cg]: the launch gives 2 Cg floats
  __shared__ float red[kGnWarps];
  const int64_t bg = blockIdx.x, b = bg / G;
  const int g = static_cast<int>(bg % G);
  const GroupLayout<NHWC> at(b, g, G, Cg, HW);
  const int L = Cg * HW;
  int ci;
  float s = 0.f;
  for (int i = threadIdx.x; i < L; i += kGnThreads) s += load(x + at.at(i, ci));
  const float mean = block_sum(s, red) / static_cast<float>(L);
  float q = 0.f;
  for (int i = threadIdx.x; i < L; i += kGnThreads) {
    const float d = load(x + at.at(i, ci)) - mean;
    q += d * d;
  }
  const float rstd = rsqrtf(block_sum(q, red) / static_cast<float>(L) + eps);
  if (threadIdx.x == 0) {
    mean_out[bg] = mean;
    rstd_out[bg] = rstd;
  }
  float *ca = coef, *ck = coef + Cg;
  group_coefficients(gamma, beta, scale, shift, b * mod_stride, static_cast<int64_t>(g) * Cg, Cg, ca, ck);
  for (int i = threadIdx.x; i < L; i += kGnThreads) {
    const int64_t o = at.at(i, ci);
    const float z = (load(x + o) - mean) * rstd * ca[ci] + ck[ci];
    store(out + o, silu ? silu_of(z) : z);
  }
}

// dz = gy * act'(z) at element o of channel ci (a, k: the channel's coefficients).
template <typename TX, typename TO>
__device__ __forceinline__ float group_dz(const TO* gy, const TX* x, int64_t o, float mu, float r, float a, float k,
                                          bool silu, float& xh) {
  xh = (load(x + o) - mu) * r;
  return silu ? load(gy + o) * silu_grad(xh * a + k) : load(gy + o);
}

template <typename TX, typename TO, bool NHWC>
__global__ void __launch_bounds__(kGnThreads) group_norm_backward_kernel(
    const TO* __restrict__ gy, const TX* __restrict__ x, const float* __restrict__ mean,
    const float* __restrict__ rstd, const float* __restrict__ gamma, const float* __restrict__ beta,
    const TO* __restrict__ scale, const TO* __restrict__ shift, int64_t mod_stride, TX* __restrict__ gx,
    float* __restrict__ p_out, float* __restrict__ q_out, int G, int Cg, int HW, bool silu) {
  extern __shared__ float coef[];  // ca [Cg], ck [Cg], and in NHWC order each thread's p and q [2 kGnThreads]
  __shared__ float red[kGnWarps];
  const int64_t bg = blockIdx.x, b = bg / G;
  const int g = static_cast<int>(bg % G);
  const GroupLayout<NHWC> at(b, g, G, Cg, HW);
  const int L = Cg * HW;
  const float mu = mean[bg], r = rstd[bg];
  float *ca = coef, *ck = coef + Cg;
  group_coefficients(gamma, beta, scale, shift, b * mod_stride, static_cast<int64_t>(g) * Cg, Cg, ca, ck);
  // Per channel p = sum dz * xhat and q = sum dz, into ca's neighbours pc [Cg] and qc [Cg] (shared).
  // dL/dxhat = dz * ca, so the group's sums of dL/dxhat and of dL/dxhat * xhat are sum_c ca q and
  // sum_c ca p.
  float *pc = coef + 2 * Cg, *qc = coef + 3 * Cg;
  int ci;
  float xh;
  if (!NHWC && HW >= kGnThreads) {
    // A channel is a contiguous run of HW: the block sums one channel at a time.
    for (int c = 0; c < Cg; ++c) {
      float p = 0.f, q = 0.f;
      for (int i = c * HW + threadIdx.x; i < (c + 1) * HW; i += kGnThreads) {
        const int64_t o = at.at(i, ci);
        const float dz = group_dz(gy, x, o, mu, r, ca[c], ck[c], silu, xh);
        p += dz * xh;
        q += dz;
      }
      p = block_sum(p, red);
      q = block_sum(q, red);
      if (threadIdx.x == 0) {
        pc[c] = p;
        qc[c] = q;
      }
    }
  } else if (!NHWC) {
    // Runs shorter than the block: a warp sums a channel (channels warp, warp + kGnWarps, ...).
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c = warp; c < Cg; c += kGnWarps) {
      float p = 0.f, q = 0.f;
      for (int i = c * HW + lane; i < (c + 1) * HW; i += 32) {
        const int64_t o = at.at(i, ci);
        const float dz = group_dz(gy, x, o, mu, r, ca[c], ck[c], silu, xh);
        p += dz * xh;
        q += dz;
      }
      p = warp_sum(p);
      q = warp_sum(q);
      if (lane == 0) {
        pc[c] = p;
        qc[c] = q;
      }
    }
  } else {
    // Channels alternate: the first `used` threads (a multiple of Cg) walk the group `used` elements at
    // a time, so thread t always meets channel t mod Cg; its sums go to shared memory and each
    // channel's are added in thread order.
    const int used = kGnThreads / Cg * Cg;
    float* tp = coef + 4 * Cg;  // [kGnThreads]
    float* tq = tp + kGnThreads;
    float p = 0.f, q = 0.f;
    if (threadIdx.x < used) {
      for (int i = threadIdx.x; i < L; i += used) {
        const int64_t o = at.at(i, ci);
        const float dz = group_dz(gy, x, o, mu, r, ca[ci], ck[ci], silu, xh);
        p += dz * xh;
        q += dz;
      }
    }
    tp[threadIdx.x] = p;
    tq[threadIdx.x] = q;
    __syncthreads();
    for (int c = threadIdx.x; c < Cg; c += kGnThreads) {
      float sp = 0.f, sq = 0.f;
      for (int t = c; t < used; t += Cg) {
        sp += tp[t];
        sq += tq[t];
      }
      pc[c] = sp;
      qc[c] = sq;
    }
  }
  __syncthreads();
  float s1 = 0.f, s2 = 0.f;  // the same in every thread: channel order
  for (int c = 0; c < Cg; ++c) {
    s1 += ca[c] * qc[c];
    s2 += ca[c] * pc[c];
  }
  for (int c = threadIdx.x; c < Cg; c += kGnThreads) {
    p_out[b * G * Cg + static_cast<int64_t>(g) * Cg + c] = pc[c];
    q_out[b * G * Cg + static_cast<int64_t>(g) * Cg + c] = qc[c];
  }
  const float m1 = s1 / static_cast<float>(L), m2 = s2 / static_cast<float>(L);
  for (int i = threadIdx.x; i < L; i += kGnThreads) {
    const int64_t o = at.at(i, ci);
    const float a = ca[ci];
    const float dz = group_dz(gy, x, o, mu, r, a, ck[ci], silu, xh);
    store(gx + o, r * (dz * a - m1 - xh * m2));
  }
}

int threads_for(int64_t W) {
  const int64_t t = (W + 31) / 32 * 32;
  return static_cast<int>(t < kMaxThreads ? t : kMaxThreads);
}

// Calls f with std::integral_constant<int, K>, K the columns per lane the kernels are built for that
// cover a row of W <= kMaxWidth: 8 (W <= 256), 24 (W <= 768, DiT-B's width exactly) or 64. Three, so
// that the kernels' 12 instances build in 24 s for the seven architectures (a lane's unused columns
// cost registers, not passes).
template <typename F>
void with_per_lane(int64_t W, F&& f) {
  if (W <= 8 * 32) {
    f(std::integral_constant<int, 8>{});
  } else if (W <= 24 * 32) {
    f(std::integral_constant<int, 24>{});
  } else {
    f(std::integral_constant<int, kMaxPerLane>{});
  }
}

dim3 grid_for(int64_t B, int64_t N) { return dim3(static_cast<unsigned>(row_chunks(N)), static_cast<unsigned>(B)); }

const char* launched() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Calls f with a null pointer of the C++ type of t (float or __nv_bfloat16), to pick a template.
template <typename F>
void with_type(DType t, F&& f) {
  if (t == DType::bf16) {
    f(static_cast<__nv_bfloat16*>(nullptr));
  } else {
    f(static_cast<float*>(nullptr));
  }
}

// Calls f with null pointers of the C++ types of t1 and t2, to pick a kernel's two types.
template <typename F>
void with_types(DType t1, DType t2, F&& f) {
  with_type(t1, [&](auto* a) { with_type(t2, [&](auto* b) { f(a, b); }); });
}

}  // namespace

int row_chunks(int64_t N) { return static_cast<int>((N + kRows - 1) / kRows); }

const char* kernels_load(int device, int* major, int* minor) {
  cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device);
  // Fails with "no kernel image is available" where neither the code nor the PTX of any built
  // architecture runs on this device.
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, gated_backward_kernel<float, float>);
  cudaGetLastError();  // the query's error is answered here, not left for the next launch
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

const char* adaln_forward(const float* x, const void* shift, const void* scale, DType mod, int64_t mod_stride,
                          void* out, DType out_type, float* mean, float* rstd, int64_t B, int64_t N, int64_t W,
                          float eps, void* stream) {
  if (W > kMaxWidth) return "adaln_forward: a row wider than kMaxWidth";
  if (mod != out_type) return "adaln_forward: shift, scale and out of different types";
  with_type(mod, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    with_per_lane(W, [&](auto k) {
      adaln_forward_kernel<T, T, decltype(k)::value>
          <<<grid_for(B, N), kWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
              x, static_cast<const T*>(shift), static_cast<const T*>(scale), mod_stride, static_cast<T*>(out), mean,
              rstd, N, W, eps);
    });
  });
  return launched();
}

const char* adaln_backward(const void* g, DType g_type, const float* x, const float* mean, const float* rstd,
                           const void* scale, DType mod, int64_t mod_stride, float* gx, float* part_scale,
                           float* part_shift, int64_t B, int64_t N, int64_t W, void* stream) {
  if (W > kMaxWidth) return "adaln_backward: a row wider than kMaxWidth";
  if (g_type != mod) return "adaln_backward: g and scale of different types";
  with_type(mod, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    with_per_lane(W, [&](auto k) {
      const size_t shared = sizeof(float) * kWarps * static_cast<size_t>(W);  // 32 KiB at kMaxWidth
      adaln_backward_kernel<T, T, decltype(k)::value>
          <<<grid_for(B, N), kWarps * 32, shared, static_cast<cudaStream_t>(stream)>>>(
              static_cast<const T*>(g), x, mean, rstd, static_cast<const T*>(scale), mod_stride, gx, part_scale,
              part_shift, N, W);
    });
  });
  return launched();
}

const char* gated_backward(const float* g, const void* a, DType a_type, const void* gate, DType mod,
                           int64_t mod_stride, void* ga, float* part_gate, int64_t B, int64_t N, int64_t W,
                           void* stream) {
  with_types(a_type, mod, [&](auto* ta, auto* tm) {
    using TA = std::remove_pointer_t<decltype(ta)>;
    using TM = std::remove_pointer_t<decltype(tm)>;
    gated_backward_kernel<TA, TM><<<grid_for(B, N), threads_for(W), 0, static_cast<cudaStream_t>(stream)>>>(
        g, static_cast<const TA*>(a), static_cast<const TM*>(gate), mod_stride, static_cast<TA*>(ga), part_gate, N, W);
  });
  return launched();
}

// Calls f with null pointers of the GroupNorm kernels' input and output types: float32 or bfloat16 x
// to an output of its own type, or float32 x to bfloat16 (under bf16 autocast); bfloat16 x to a float32
// output does not occur (fused_gpu.cpp), so it is not built. False if asked for it.
template <typename F>
bool with_group_types(DType x, DType out, F&& f) {
  if (x == DType::bf16 && out == DType::f32) return false;
  with_types(x, out, [&](auto* tx, auto* to) {
    using TX = std::remove_pointer_t<decltype(tx)>;
    using TO = std::remove_pointer_t<decltype(to)>;
    if constexpr (!(std::is_same_v<TX, __nv_bfloat16> && std::is_same_v<TO, float>)) f(tx, to);
  });
  return true;
}

// Calls f with std::bool_constant<NHWC>, to pick the kernels' layout.
template <typename F>
void with_layout(bool nhwc, F&& f) {
  if (nhwc) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

const char* group_sizes(int64_t B, int64_t C, int64_t G, int64_t HW, bool nhwc) {
  if (G <= 0 || C % G != 0 || C / G > (nhwc ? kMaxGroupChannelsNHWC : kMaxGroupChannels))
    return "C/G is not a channel count the kernels take";
  // Element indices are int and step by kGnThreads.
  if (C * HW > INT32_MAX - kGnThreads || B * G > INT32_MAX) return "a group or a batch too large";
  return nullptr;
}

const char* group_norm_forward(const void* x, DType x_type, const float* gamma, const float* beta,
                               const void* scale, const void* shift, int64_t mod_stride, void* out, DType out_type,
                               float* mean, float* rstd, int64_t B, int64_t C, int64_t G, int64_t HW, bool nhwc,
                               bool silu, float eps, void* stream) {
  if (const char* e = group_sizes(B, C, G, HW, nhwc)) return e;
  const int Cg = static_cast<int>(C / G);
  const bool built = with_group_types(x_type, out_type, [&](auto* tx, auto* to) {
    using TX = std::remove_pointer_t<decltype(tx)>;
    using TO = std::remove_pointer_t<decltype(to)>;
    with_layout(nhwc, [&](auto layout) {
      group_norm_forward_kernel<TX, TO, decltype(layout)::value>
          <<<static_cast<unsigned>(B * G), kGnThreads, 2 * Cg * sizeof(float), static_cast<cudaStream_t>(stream)>>>(
              static_cast<const TX*>(x), gamma, beta, static_cast<const TO*>(scale), static_cast<const TO*>(shift),
              mod_stride, static_cast<TO*>(out), mean, rstd, static_cast<int>(G), Cg, static_cast<int>(HW), silu, eps);
    });
  });
  if (!built) return "bfloat16 x to a float32 output: not built";
  return launched();
}

const char* group_norm_backward(const void* gy, DType out_type, const void* x, DType x_type, const float* mean,
                                const float* rstd, const float* gamma, const float* beta, const void* scale,
                                const void* shift, int64_t mod_stride, void* gx, float* p, float* q, int64_t B,
                                int64_t C, int64_t G, int64_t HW, bool nhwc, bool silu, void* stream) {
  if (const char* e = group_sizes(B, C, G, HW, nhwc)) return e;
  const int Cg = static_cast<int>(C / G);
  // ca, ck, pc, qc [Cg] each, and in NHWC order each thread's two sums: at most 32 KiB, under the 48 KiB
  // a launch may ask for without opting in.
  const size_t shared = sizeof(float) * (4 * static_cast<size_t>(Cg) + (nhwc ? 2 * kGnThreads : 0));
  const bool built = with_group_types(x_type, out_type, [&](auto* tx, auto* to) {
    using TX = std::remove_pointer_t<decltype(tx)>;
    using TO = std::remove_pointer_t<decltype(to)>;
    with_layout(nhwc, [&](auto layout) {
      group_norm_backward_kernel<TX, TO, decltype(layout)::value>
          <<<static_cast<unsigned>(B * G), kGnThreads, shared, static_cast<cudaStream_t>(stream)>>>(
              static_cast<const TO*>(gy), static_cast<const TX*>(x), mean, rstd, gamma, beta,
              static_cast<const TO*>(scale), static_cast<const TO*>(shift), mod_stride, static_cast<TX*>(gx), p, q,
              static_cast<int>(G), Cg, static_cast<int>(HW), silu);
    });
  });
  if (!built) return "bfloat16 x to a float32 output: not built";
  return launched();
}

}  // namespace ddm::cuda_kernels
