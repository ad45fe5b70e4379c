// The hand-written CUDA kernels of a DiT block (fused_cuda.h says what each computes and why they are
// hand-written). A block of threads takes a chunk of kRows rows of one batch element. In the adaLN
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

}  // namespace ddm::cuda_kernels
