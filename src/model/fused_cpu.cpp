// Hand-written CPU kernels for x86-64 with AVX2 + FMA (see fused_cpu.h): fused multi-head
// attention, adaLN modulation and gated residual. Written by hand for LibTorch 1.13, which had none
// of these fused ops on the CPU, and kept on 2.11 because they still beat what 2.11 provides on the
// presets' shapes, measured side by side (`ddm_bench ops`, docs/results.md "LibTorch 2.11"): the
// attention kernel 1.04x-1.31x scaled_dot_product_attention, adaLN and the gated residual
// 1.39x-1.56x ATen's ops. (A fused linear + GELU lived here too; on 2.11 ATen's was as fast or
// faster, and it went.)
//
// Attention. Each (batch, head) is computed entirely in per-thread scratch buffers that stay in
// cache, with a small register-blocked GEMM kernel of its own (no BLAS call from inside the
// parallel loop), and the N x N scores are never written to memory:
//   forward:  S = Q K^T, P = softmax(S / sqrt(d)) (row log-sum-exp kept), O = P V;
//   backward: P recomputed from the log-sum-exp, dV = P^T dO, dP = dO V^T,
//             dS = P * (dP - rowsum(dO * O)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
// Each (batch, head) is computed the same way whatever the thread count, so results do not
// depend on it.
//
// adaLN modulation and gated residual (DiT blocks). In ATen, LayerNorm, the modulation
// LN(x) * (1 + scale) + shift and the gated residual x + gate * (a + bias) are five or six
// memory-bound passes forward and about twice as many backward (plus the broadcast-bias copy in
// addmm); on DiT-sized rows they cost a tenth of a training step. Here each is one pass forward
// and one backward over rows that stay in L1.
#include "model/fused_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "core/error.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DDM_HAVE_X86_KERNEL 1
#define DDM_AVX2 __attribute__((target("avx2,fma")))
#else
#define DDM_HAVE_X86_KERNEL 0
#endif

namespace ddm {

#if DDM_HAVE_X86_KERNEL
namespace {

bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

bool f32_cpu(const torch::Tensor& t, int64_t dim) {
  return t.defined() && t.dim() == dim && t.device().is_cpu() && t.scalar_type() == torch::kFloat32;
}

constexpr int64_t kNR = 16;  // output columns per kernel tile (two 8-float registers)
constexpr int64_t kMR = 6;   // output rows per kernel tile (12 accumulators)

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A read-only strided matrix operand: element (r, k) is p[r * rs + k * cs]. The kernel broadcasts
// single elements of A, so A can be read in place from a tensor, or transposed, at no cost.
struct Strided {
  const float* p;
  int64_t rs, cs;
};

// C[MR x 16] = A[MR x K] B[K x 16]; B and C row-major with leading dimensions ldb, ldc.
// Named accumulators (not an array) so that GCC keeps all 12 in registers.
template <int MR>
DDM_AVX2 inline void tile(int64_t K, Strided A, const float* B, int64_t ldb, float* C, int64_t ldc) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* a = A.p;
  for (int64_t k = 0; k < K; ++k, a += A.cs) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
#define DDM_TILE_ROW(r)                                            \
  if constexpr (MR > r) {                                          \
    const __m256 ar = _mm256_broadcast_ss(a + r * A.rs);           \
    c##r##0 = _mm256_fmadd_ps(ar, b0, c##r##0);                    \
    c##r##1 = _mm256_fmadd_ps(ar, b1, c##r##1);                    \
  }
    DDM_TILE_ROW(0) DDM_TILE_ROW(1) DDM_TILE_ROW(2) DDM_TILE_ROW(3) DDM_TILE_ROW(4) DDM_TILE_ROW(5)
#undef DDM_TILE_ROW
  }
#define DDM_STORE_ROW(r)                                           \
  if constexpr (MR > r) {                                          \
    _mm256_storeu_ps(C + r * ldc, c##r##0);                        \
    _mm256_storeu_ps(C + r * ldc + 8, c##r##1);                    \
  }
  DDM_STORE_ROW(0) DDM_STORE_ROW(1) DDM_STORE_ROW(2) DDM_STORE_ROW(3) DDM_STORE_ROW(4) DDM_STORE_ROW(5)
#undef DDM_STORE_ROW
}

// C[M x N] = A[M x K] B[K x N]; N must be a multiple of 16 (callers pad B and C with zero columns).
// Column panels outermost so a 16-column panel of B stays in L1 while all rows of A pass over it.
DDM_AVX2 void gemm(int64_t M, int64_t N, int64_t K, Strided A, const float* B, int64_t ldb, float* C,
                   int64_t ldc) {
  for (int64_t j = 0; j < N; j += kNR) {
    for (int64_t i = 0; i < M; i += kMR) {
      const Strided a{A.p + i * A.rs, A.rs, A.cs};
      const float* b = B + j;
      float* c = C + i * ldc + j;
      switch (std::min(kMR, M - i)) {
        case 6: tile<6>(K, a, b, ldb, c, ldc); break;
        case 5: tile<5>(K, a, b, ldb, c, ldc); break;
        case 4: tile<4>(K, a, b, ldb, c, ldc); break;
        case 3: tile<3>(K, a, b, ldb, c, ldc); break;
        case 2: tile<2>(K, a, b, ldb, c, ldc); break;
        default: tile<1>(K, a, b, ldb, c, ldc); break;
      }
    }
  }
}

// exp(x) for x <= 0 in 8 lanes: Cody-Waite range reduction and a degree-6 polynomial (Cephes'
// expf coefficients), relative error about 2e-7. Inputs below -80 are clamped (exp(-80) = 2e-35,
// far below a float probability's resolution next to the row maximum, which is exp(0) = 1).
DDM_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-80.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// row[j] = exp(row[j] * scale - shift) for j < n, in place.
DDM_AVX2 void exp_row(float* row, int64_t n, float scale, float shift) {
  const __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(shift);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(row + j, exp_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(row + j), vs, vb)));
  for (; j < n; ++j) row[j] = std::exp(std::max(row[j] * scale - shift, -80.0f));
}

DDM_AVX2 inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

DDM_AVX2 inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Softmax of row[0..n) * scale in place; returns the log-sum-exp of the scaled row.
DDM_AVX2 float softmax_row(float* row, int64_t n, float scale) {
  float mx = row[0];
  int64_t j = 0;
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(row);
    for (j = 8; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(row + j));
    mx = hmax(vm);
  }
  for (; j < n; ++j) mx = std::max(mx, row[j]);
  const float shift = mx * scale;
  exp_row(row, n, scale, shift);
  __m256 vs = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) vs = _mm256_add_ps(vs, _mm256_loadu_ps(row + j));
  float sum = hsum(vs);
  for (; j < n; ++j) sum += row[j];
  const float inv = 1.0f / sum;
  for (j = 0; j < n; ++j) row[j] *= inv;
  return shift + std::log(sum);
}

// ---------------------------------------------------------------------------------------------
// adaLN modulation and gated residual. Each sample's rows are processed by one thread in a fixed
// order (parallel over samples), so results do not depend on the thread count. The row pointers
// are __restrict: without it GCC cannot prove them distinct and leaves these loops scalar (3x
// slower, measured).

// Sum of v[0..n): eight lanes, then the tail.
DDM_AVX2 float row_sum(const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(v + j));
  float s = hsum(acc);
  for (; j < n; ++j) s += v[j];
  return s;
}

// Sum of u[j] * v[j] over [0, n).
DDM_AVX2 float row_dot(const float* u, const float* v, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(u + j), _mm256_loadu_ps(v + j), acc);
  float s = hsum(acc);
  for (; j < n; ++j) s += u[j] * v[j];
  return s;
}

// One sample's N rows of width W: y = LayerNorm(x) * (1 + scale) + shift; the row mean and
// 1 / std are stored for the backward pass. xc is scratch of W floats.
DDM_AVX2 void adaln_sample(const float* __restrict x, const float* __restrict shift, const float* __restrict scale,
                           float* __restrict y, float* __restrict mean, float* __restrict rstd, float* __restrict xc,
                           int64_t N, int64_t W, float eps) {
  const float inv_w = 1.0f / static_cast<float>(W);
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * W;
    float* yr = y + n * W;
    const float mu = row_sum(xr, W) * inv_w;
    for (int64_t j = 0; j < W; ++j) xc[j] = xr[j] - mu;
    const float rs = 1.0f / std::sqrt(row_dot(xc, xc, W) * inv_w + eps);
    for (int64_t j = 0; j < W; ++j) yr[j] = xc[j] * rs * (1.0f + scale[j]) + shift[j];
    mean[n] = mu;
    rstd[n] = rs;
  }
}

// Backward of adaln_sample for one sample: dx, and dshift / dscale (sums over the sample's rows,
// written to dshift[0..W), dscale[0..W)). xhat and g are scratch of W floats each.
DDM_AVX2 void adaln_sample_backward(const float* __restrict x, const float* __restrict scale,
                                    const float* __restrict mean, const float* __restrict rstd,
                                    const float* __restrict dy, float* __restrict dx, float* __restrict dshift,
                                    float* __restrict dscale, float* __restrict xhat, float* __restrict g, int64_t N,
                                    int64_t W) {
  const float inv_w = 1.0f / static_cast<float>(W);
  for (int64_t j = 0; j < W; ++j) dshift[j] = dscale[j] = 0.0f;
  for (int64_t n = 0; n < N; ++n) {
    const float *xr = x + n * W, *dyr = dy + n * W;
    float* dxr = dx + n * W;
    const float mu = mean[n], rs = rstd[n];
    for (int64_t j = 0; j < W; ++j) {
      xhat[j] = (xr[j] - mu) * rs;
      g[j] = dyr[j] * (1.0f + scale[j]);
      dshift[j] += dyr[j];
      dscale[j] += dyr[j] * xhat[j];
    }
    const float c1 = row_sum(g, W) * inv_w, c2 = row_dot(g, xhat, W) * inv_w;
    for (int64_t j = 0; j < W; ++j) dxr[j] = rs * (g[j] - c1 - xhat[j] * c2);
  }
}

// LayerNorm (no affine) followed by the adaLN modulation, x [B, N, W], shift and scale [B, W].
struct AdaLN : public torch::autograd::Function<AdaLN> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& shift, const torch::Tensor& scale, double eps) {
    const auto xc = x.contiguous(), sh = shift.contiguous(), sc = scale.contiguous();
    const int64_t B = xc.size(0), N = xc.size(1), W = xc.size(2);
    auto y = torch::empty_like(xc);
    auto stats = torch::empty({2, B, N}, xc.options());  // row mean, row 1 / std
    const float *xp = xc.data_ptr<float>(), *shp = sh.data_ptr<float>(), *scp = sc.data_ptr<float>();
    float *yp = y.data_ptr<float>(), *mp = stats[0].data_ptr<float>(), *rp = stats[1].data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> scratch(W);
      for (int64_t b = b0; b < b1; ++b)
        adaln_sample(xp + b * N * W, shp + b * W, scp + b * W, yp + b * N * W, mp + b * N, rp + b * N,
                     scratch.data(), N, W, static_cast<float>(eps));
    });
    ctx->save_for_backward({xc, sc, stats});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &scale = saved[1], &stats = saved[2];
    const auto dy = grads[0].contiguous();
    const int64_t B = x.size(0), N = x.size(1), W = x.size(2);
    auto dx = torch::empty_like(x);
    auto dshift = torch::empty({B, W}, x.options()), dscale = torch::empty({B, W}, x.options());
    const float *xp = x.data_ptr<float>(), *scp = scale.data_ptr<float>(), *dyp = dy.data_ptr<float>();
    const float *mp = stats[0].data_ptr<float>(), *rp = stats[1].data_ptr<float>();
    float *dxp = dx.data_ptr<float>(), *dshp = dshift.data_ptr<float>(), *dscp = dscale.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> scratch(2 * W);
      for (int64_t b = b0; b < b1; ++b)
        adaln_sample_backward(xp + b * N * W, scp + b * W, mp + b * N, rp + b * N, dyp + b * N * W, dxp + b * N * W,
                              dshp + b * W, dscp + b * W, scratch.data(), scratch.data() + W, N, W);
    });
    return {dx, dshift, dscale, torch::Tensor()};
  }
};

// out = x + gate * (a + bias) for x, a [B, N, W], gate [B, W], bias [W]: the residual branch of a
// DiT block with the bias of the linear that produced `a` folded in (so that linear runs as a
// plain mm and ATen never copies the broadcast bias into its output).
DDM_AVX2 void gated_residual_sample(const float* __restrict x, const float* __restrict gate, const float* __restrict a,
                                    const float* __restrict bias, float* __restrict out, int64_t N, int64_t W) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < W; ++j) out[n * W + j] = x[n * W + j] + gate[j] * (a[n * W + j] + bias[j]);
}

// Backward for one sample: da = dout * gate; dgate and this sample's share of dbias summed over
// its rows.
DDM_AVX2 void gated_residual_sample_backward(const float* __restrict gate, const float* __restrict a,
                                             const float* __restrict bias, const float* __restrict dout,
                                             float* __restrict da, float* __restrict dgate,
                                             float* __restrict dbias_part, int64_t N, int64_t W) {
  for (int64_t j = 0; j < W; ++j) dgate[j] = dbias_part[j] = 0.0f;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < W; ++j) {
      const float d = dout[n * W + j];
      da[n * W + j] = d * gate[j];
      dbias_part[j] += d * gate[j];
      dgate[j] += d * (a[n * W + j] + bias[j]);
    }
}

struct GatedResidual : public torch::autograd::Function<GatedResidual> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& gate, const torch::Tensor& a, const torch::Tensor& bias) {
    const auto xc = x.contiguous(), gc = gate.contiguous(), ac = a.contiguous(), bc = bias.contiguous();
    const int64_t B = xc.size(0), N = xc.size(1), W = xc.size(2);
    auto out = torch::empty_like(xc);
    const float *xp = xc.data_ptr<float>(), *gp = gc.data_ptr<float>(), *ap = ac.data_ptr<float>();
    const float* bp = bc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        gated_residual_sample(xp + b * N * W, gp + b * W, ap + b * N * W, bp, op + b * N * W, N, W);
    });
    ctx->save_for_backward({gc, ac, bc});
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &gate = saved[0], &a = saved[1], &bias = saved[2];
    const auto dout = grads[0].contiguous();
    const int64_t B = a.size(0), N = a.size(1), W = a.size(2);
    auto da = torch::empty_like(a);
    auto dgate = torch::empty({B, W}, a.options()), part = torch::empty({B, W}, a.options());
    const float *gp = gate.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = bias.data_ptr<float>();
    const float* dp = dout.data_ptr<float>();
    float *dap = da.data_ptr<float>(), *dgp = dgate.data_ptr<float>(), *pp = part.data_ptr<float>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        gated_residual_sample_backward(gp + b * W, ap + b * N * W, bp, dp + b * N * W, dap + b * N * W, dgp + b * W,
                                       pp + b * W, N, W);
    });
    auto dbias = torch::zeros({W}, a.options());
    float* dbp = dbias.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)  // fixed order, whatever the thread count
      for (int64_t j = 0; j < W; ++j) dbp[j] += pp[b * W + j];
    return {dout, dgate, da, dbias};
  }
};

// ---------------------------------------------------------------------------------------------
// Attention

// A strided [rows x cols] matrix view into a tensor's storage.
struct View {
  float* p;
  int64_t row_stride, col_stride;
  float& at(int64_t r, int64_t c) const { return p[r * row_stride + c * col_stride]; }
  Strided operand() const { return Strided{p, row_stride, col_stride}; }
};

// Row-major buffer views used as kernel operands: as stored, or read transposed.
Strided rows(const float* p, int64_t ld) { return Strided{p, ld, 1}; }
Strided transposed(const float* p, int64_t ld) { return Strided{p, 1, ld}; }

// dst[r * ld + c] = src(r, c)
void pack(const View& src, int64_t nrows, int64_t ncols, float* dst, int64_t ld) {
  for (int64_t r = 0; r < nrows; ++r) {
    if (src.col_stride == 1) {
      std::memcpy(dst + r * ld, src.p + r * src.row_stride, sizeof(float) * ncols);
    } else {
      for (int64_t c = 0; c < ncols; ++c) dst[r * ld + c] = src.at(r, c);
    }
  }
}

// dst[c * ld + r] = src(r, c)
void pack_transposed(const View& src, int64_t nrows, int64_t ncols, float* dst, int64_t ld) {
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t c = 0; c < ncols; ++c) dst[c * ld + r] = src.at(r, c);
}

// dst(r, c) = src[r * ld + c] * scale
void unpack(const float* src, int64_t ld, int64_t nrows, int64_t ncols, float scale, const View& dst) {
  for (int64_t r = 0; r < nrows; ++r) {
    if (dst.col_stride == 1) {
      float* d = dst.p + r * dst.row_stride;
      for (int64_t c = 0; c < ncols; ++c) d[c] = src[r * ld + c] * scale;
    } else {
      for (int64_t c = 0; c < ncols; ++c) dst.at(r, c) = src[r * ld + c] * scale;
    }
  }
}

// Geometry of one call: qkv [B, 3, H, N, d] with arbitrary strides.
struct Geometry {
  int64_t B, H, N, d, Np, dp;
  float scale;
  explicit Geometry(const torch::Tensor& qkv)
      : B(qkv.size(0)), H(qkv.size(2)), N(qkv.size(3)), d(qkv.size(4)), Np(round_up(N, kNR)),
        dp(round_up(d, kNR)), scale(static_cast<float>(1.0 / std::sqrt(static_cast<double>(qkv.size(4))))) {}
};

// The (batch b, head h) slice of part `which` (0 = q, 1 = k, 2 = v) of a [B, 3, H, N, d] tensor.
View qkv_view(const torch::Tensor& t, int64_t which, int64_t b, int64_t h) {
  float* p = t.data_ptr<float>() + b * t.stride(0) + which * t.stride(1) + h * t.stride(2);
  return View{p, t.stride(3), t.stride(4)};
}

// The (b, h) slice of a [B, N, H, d] tensor.
View bnhd_view(const torch::Tensor& t, int64_t b, int64_t h) {
  float* p = t.data_ptr<float>() + b * t.stride(0) + h * t.stride(2);
  return View{p, t.stride(1), t.stride(3)};
}

// out [B, N, H, d] and lse [B, H, N] for qkv [B, 3, H, N, d].
void forward_kernel(const torch::Tensor& qkv, const torch::Tensor& out, const torch::Tensor& lse) {
  const Geometry g(qkv);
  float* lse_p = lse.data_ptr<float>();
  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    // Zero-filled once, so padding columns stay zero (they only ever meet ignored outputs).
    std::vector<float> kt(g.d * g.Np, 0.0f), v(g.N * g.dp, 0.0f), s(g.N * g.Np, 0.0f), o(g.N * g.dp, 0.0f);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H, h = bh % g.H;
      pack_transposed(qkv_view(qkv, 1, b, h), g.N, g.d, kt.data(), g.Np);
      pack(qkv_view(qkv, 2, b, h), g.N, g.d, v.data(), g.dp);
      gemm(g.N, g.Np, g.d, qkv_view(qkv, 0, b, h).operand(), kt.data(), g.Np, s.data(), g.Np);  // S = Q K^T
      for (int64_t i = 0; i < g.N; ++i) lse_p[bh * g.N + i] = softmax_row(&s[i * g.Np], g.N, g.scale);
      gemm(g.N, g.dp, g.N, rows(s.data(), g.Np), v.data(), g.dp, o.data(), g.dp);                 // O = P V
      unpack(o.data(), g.dp, g.N, g.d, 1.0f, bnhd_view(out, b, h));
    }
  });
}

// dqkv [B, 3, H, N, d] from the saved qkv, out, lse and the incoming gradient dout [B, N, H, d].
void backward_kernel(const torch::Tensor& qkv, const torch::Tensor& out, const torch::Tensor& lse,
                     const torch::Tensor& dout, const torch::Tensor& dqkv) {
  const Geometry g(qkv);
  const float* lse_p = lse.data_ptr<float>();
  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(g.N * g.dp, 0.0f), k(g.N * g.dp, 0.0f), kt(g.d * g.Np, 0.0f), vt(g.d * g.Np, 0.0f),
        dov(g.N * g.dp, 0.0f), p(g.N * g.Np, 0.0f), ds(g.N * g.Np, 0.0f), dv(g.N * g.dp, 0.0f),
        dq(g.N * g.dp, 0.0f), dk(g.N * g.dp, 0.0f), delta(g.N);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H, h = bh % g.H;
      const View qv = qkv_view(qkv, 0, b, h), kv = qkv_view(qkv, 1, b, h), vv = qkv_view(qkv, 2, b, h);
      const View ov = bnhd_view(out, b, h), gv = bnhd_view(dout, b, h);
      pack(qv, g.N, g.d, q.data(), g.dp);
      pack(kv, g.N, g.d, k.data(), g.dp);
      pack_transposed(kv, g.N, g.d, kt.data(), g.Np);
      pack_transposed(vv, g.N, g.d, vt.data(), g.Np);
      pack(gv, g.N, g.d, dov.data(), g.dp);
      for (int64_t i = 0; i < g.N; ++i) {
        float acc = 0;
        for (int64_t c = 0; c < g.d; ++c) acc += dov[i * g.dp + c] * ov.at(i, c);
        delta[i] = acc;                                                                      // rowsum(dO * O)
      }
      gemm(g.N, g.Np, g.d, qv.operand(), kt.data(), g.Np, p.data(), g.Np);                 // S = Q K^T
      for (int64_t i = 0; i < g.N; ++i) exp_row(&p[i * g.Np], g.N, g.scale, lse_p[bh * g.N + i]);  // P
      gemm(g.N, g.Np, g.d, rows(dov.data(), g.dp), vt.data(), g.Np, ds.data(), g.Np);      // dP = dO V^T
      for (int64_t i = 0; i < g.N; ++i) {
        float* dsi = &ds[i * g.Np];
        const float* pi = &p[i * g.Np];
        for (int64_t j = 0; j < g.N; ++j) dsi[j] = pi[j] * (dsi[j] - delta[i]);             // dS (unscaled)
      }
      gemm(g.N, g.dp, g.N, transposed(p.data(), g.Np), dov.data(), g.dp, dv.data(), g.dp);  // dV = P^T dO
      gemm(g.N, g.dp, g.N, rows(ds.data(), g.Np), k.data(), g.dp, dq.data(), g.dp);         // dQ = dS K
      gemm(g.N, g.dp, g.N, transposed(ds.data(), g.Np), q.data(), g.dp, dk.data(), g.dp);   // dK = dS^T Q
      unpack(dq.data(), g.dp, g.N, g.d, g.scale, qkv_view(dqkv, 0, b, h));
      unpack(dk.data(), g.dp, g.N, g.d, g.scale, qkv_view(dqkv, 1, b, h));
      unpack(dv.data(), g.dp, g.N, g.d, 1.0f, qkv_view(dqkv, 2, b, h));
    }
  });
}

struct FusedAttention : public torch::autograd::Function<FusedAttention> {
  // qkv [B, 3, H, N, d] -> out [B, N, H, d]
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& qkv) {
    const int64_t B = qkv.size(0), H = qkv.size(2), N = qkv.size(3), d = qkv.size(4);
    auto out = torch::empty({B, N, H, d}, qkv.options());
    auto lse = torch::empty({B, H, N}, qkv.options());
    forward_kernel(qkv, out, lse);
    ctx->save_for_backward({qkv, out});
    ctx->saved_data["lse"] = lse;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& qkv = saved[0];
    // Same strides as qkv (when it is dense), so the gradient flows back through the caller's
    // permute/reshape views without a copy.
    auto dqkv = torch::empty_like(qkv);
    backward_kernel(qkv, saved[1], ctx->saved_data["lse"].toTensor(), grads[0], dqkv);
    return {dqkv};
  }
};

}  // namespace

bool fused_attention_cpu_supported(const torch::Tensor& qkv) {
  return cpu_has_avx2_fma() && qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat32 && qkv.dim() == 5 &&
         qkv.size(1) == 3 && qkv.numel() > 0;
}

bool adaln_modulate_cpu_supported(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale) {
  return cpu_has_avx2_fma() && f32_cpu(x, 3) && f32_cpu(shift, 2) && f32_cpu(scale, 2) && x.numel() > 0 &&
         shift.sizes() == scale.sizes() && shift.size(0) == x.size(0) && shift.size(1) == x.size(2);
}

torch::Tensor adaln_modulate_cpu(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale,
                                 double eps) {
  DDM_CHECK(adaln_modulate_cpu_supported(x, shift, scale),
            "adaln_modulate_cpu: needs float32 CPU tensors x [B, N, W], shift and scale [B, W] and a CPU with AVX2 + "
            "FMA, got x " << x.sizes() << ", shift " << shift.sizes() << ", scale " << scale.sizes());
  RECORD_FUNCTION("ddm::adaln_modulate", std::vector<c10::IValue>{x});  // named in profiles
  return AdaLN::apply(x, shift, scale, eps);
}

bool gated_residual_cpu_supported(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a,
                                  const torch::Tensor& bias) {
  return cpu_has_avx2_fma() && f32_cpu(x, 3) && f32_cpu(gate, 2) && f32_cpu(a, 3) && f32_cpu(bias, 1) &&
         x.numel() > 0 && a.sizes() == x.sizes() && gate.size(0) == x.size(0) && gate.size(1) == x.size(2) &&
         bias.size(0) == x.size(2);
}

torch::Tensor gated_residual_cpu(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& a,
                                 const torch::Tensor& bias) {
  DDM_CHECK(gated_residual_cpu_supported(x, gate, a, bias),
            "gated_residual_cpu: needs float32 CPU tensors x and a [B, N, W], gate [B, W], bias [W] and a CPU with "
            "AVX2 + FMA, got x " << x.sizes() << ", gate " << gate.sizes() << ", a " << a.sizes() << ", bias "
                                 << bias.sizes());
  RECORD_FUNCTION("ddm::gated_residual", std::vector<c10::IValue>{x});  // named in profiles
  return GatedResidual::apply(x, gate, a, bias);
}

torch::Tensor fused_attention_cpu(const torch::Tensor& qkv) {
  DDM_CHECK(fused_attention_cpu_supported(qkv),
            "fused_attention_cpu: needs a float32 CPU tensor [B, 3, heads, N, d] and a CPU with AVX2 + FMA, got "
                << qkv.scalar_type() << " " << qkv.sizes() << " on " << qkv.device());
  RECORD_FUNCTION("ddm::fused_attention", std::vector<c10::IValue>{qkv});  // named in profiles
  return FusedAttention::apply(qkv).permute({0, 2, 1, 3});  // [B, N, H, d] -> [B, H, N, d]
}

#else  // no x86-64 kernel on this platform

bool fused_attention_cpu_supported(const torch::Tensor&) { return false; }

bool adaln_modulate_cpu_supported(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) { return false; }
bool gated_residual_cpu_supported(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                  const torch::Tensor&) {
  return false;
}

torch::Tensor adaln_modulate_cpu(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, double) {
  DDM_FAIL("adaln_modulate_cpu: not available on this platform (needs x86-64 with AVX2 + FMA)");
}

torch::Tensor gated_residual_cpu(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&) {
  DDM_FAIL("gated_residual_cpu: not available on this platform (needs x86-64 with AVX2 + FMA)");
}

torch::Tensor fused_attention_cpu(const torch::Tensor&) {
  DDM_FAIL("fused_attention_cpu: not available on this platform (needs x86-64 with AVX2 + FMA)");
}

#endif

}  // namespace ddm
