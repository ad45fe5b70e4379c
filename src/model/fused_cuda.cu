// The hand-written CUDA kernels of a DiT block (fused_cuda.h says what each computes and why they are
// hand-written). One design for all three: a block of threads takes a chunk of kRows rows of one batch
// element, each thread a fixed set of columns (c = threadIdx.x + j * blockDim.x, j < kPerThread), so
// a row's values stay in registers between its reductions and each thread adds up its columns' sums
// over the chunk's rows (the partial sums of the [B, W] gradients) without atomics.
#include "model/fused_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace ddm::cuda_kernels {
namespace {

constexpr int kPerThread = 8;    // columns per thread
constexpr int kMaxThreads = 256;  // threads per block: kMaxThreads * kPerThread = kMaxWidth
constexpr int kRows = 16;        // rows of N per block
static_assert(kMaxThreads * kPerThread == kMaxWidth, "fused_cuda.h's kMaxWidth");

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

// The sums of a and b over the block, in every thread (blockDim.x a multiple of 32). A fixed tree:
// the same bits on every run. shared: 64 floats, free again when it returns.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    shared[warp] = a;
    shared[32 + warp] = b;
  }
  __syncthreads();
  a = lane < warps ? shared[lane] : 0.f;
  b = lane < warps ? shared[32 + lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  __syncthreads();
  return make_float2(a, b);
}

template <typename TM, typename TO>
__global__ void adaln_forward_kernel(const float* __restrict__ x, const TM* __restrict__ shift,
                                     const TM* __restrict__ scale, int64_t mod_stride, TO* __restrict__ out,
                                     float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t N,
                                     int64_t W, float eps) {
  __shared__ float shared[64];
  const int64_t b = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t n1 = min(N, n0 + kRows);
  const float inv_w = 1.f / static_cast<float>(W);
  float sc[kPerThread], sh[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    sc[j] = c < W ? 1.f + load(scale + b * mod_stride + c) : 0.f;
    sh[j] = c < W ? load(shift + b * mod_stride + c) : 0.f;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t row = b * N + n;
    const float* xr = x + row * W;
    float v[kPerThread];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      v[j] = c < W ? xr[c] : 0.f;
      s += v[j];
    }
    const float mean = block_sum2(s, 0.f, shared).x * inv_w;
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      const float d = v[j] - mean;
      q += c < W ? d * d : 0.f;
    }
    const float rstd = rsqrtf(block_sum2(q, 0.f, shared).x * inv_w + eps);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (c < W) store(out + row * W + c, (v[j] - mean) * rstd * sc[j] + sh[j]);
    }
    if (threadIdx.x == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

template <typename TG, typename TM>
__global__ void adaln_backward_kernel(const TG* __restrict__ g, const float* __restrict__ x,
                                      const float* __restrict__ mean, const float* __restrict__ rstd,
                                      const TM* __restrict__ scale, int64_t mod_stride, float* __restrict__ gx,
                                      float* __restrict__ part_scale, float* __restrict__ part_shift, int64_t N,
                                      int64_t W) {
  __shared__ float shared[64];
  const int64_t b = blockIdx.y;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t n1 = min(N, n0 + kRows);
  const float inv_w = 1.f / static_cast<float>(W);
  float sc[kPerThread], dscale[kPerThread], dshift[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    sc[j] = c < W ? 1.f + load(scale + b * mod_stride + c) : 0.f;
    dscale[j] = 0.f;
    dshift[j] = 0.f;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t row = b * N + n;
    const float m = mean[row], r = rstd[row];
    float gh[kPerThread], xh[kPerThread];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      const float gv = c < W ? load(g + row * W + c) : 0.f;
      xh[j] = c < W ? (x[row * W + c] - m) * r : 0.f;
      gh[j] = gv * sc[j];  // dL/dxhat
      s1 += gh[j];
      s2 += gh[j] * xh[j];
      dscale[j] += gv * xh[j];
      dshift[j] += gv;
    }
    const float2 s = block_sum2(s1, s2, shared);
    const float mean_gh = s.x * inv_w, mean_ghx = s.y * inv_w;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (c < W) gx[row * W + c] = r * (gh[j] - mean_gh - xh[j] * mean_ghx);
    }
  }
  const int64_t part = (b * gridDim.x + blockIdx.x) * W;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (c < W) {
      part_scale[part + c] = dscale[j];
      part_shift[part + c] = dshift[j];
    }
  }
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
  with_types(mod, out_type, [&](auto* tm, auto* to) {
    using TM = std::remove_pointer_t<decltype(tm)>;
    using TO = std::remove_pointer_t<decltype(to)>;
    adaln_forward_kernel<TM, TO><<<grid_for(B, N), threads_for(W), 0, static_cast<cudaStream_t>(stream)>>>(
        x, static_cast<const TM*>(shift), static_cast<const TM*>(scale), mod_stride, static_cast<TO*>(out), mean,
        rstd, N, W, eps);
  });
  return launched();
}

const char* adaln_backward(const void* g, DType g_type, const float* x, const float* mean, const float* rstd,
                           const void* scale, DType mod, int64_t mod_stride, float* gx, float* part_scale,
                           float* part_shift, int64_t B, int64_t N, int64_t W, void* stream) {
  if (W > kMaxWidth) return "adaln_backward: a row wider than kMaxWidth";
  with_types(g_type, mod, [&](auto* tg, auto* tm) {
    using TG = std::remove_pointer_t<decltype(tg)>;
    using TM = std::remove_pointer_t<decltype(tm)>;
    adaln_backward_kernel<TG, TM><<<grid_for(B, N), threads_for(W), 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const TG*>(g), x, mean, rstd, static_cast<const TM*>(scale), mod_stride, gx, part_scale,
        part_shift, N, W);
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
