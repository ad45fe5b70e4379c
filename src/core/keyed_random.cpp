// Keyed per-sample random numbers (see keyed_random.h).
#include "core/keyed_random.h"

#include <cmath>

#include <ATen/Parallel.h>

#include "core/device.h"
#include "core/rng.h"

namespace ddm {
namespace {
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

// Fills out[0..d) with standard normals from the SplitMix64 stream starting at `state`.
void fill_normal(uint64_t state, double* out, int64_t d) {
  for (int64_t i = 0; i < d; i += 2) {
    const uint64_t a = mix64(state), b = mix64(state + kGolden);
    state += 2 * kGolden;
    const double u1 = static_cast<double>((a >> 11) + 1) * 0x1p-53;  // (0, 1]
    const double u2 = static_cast<double>(b >> 11) * 0x1p-53;        // [0, 1)
    const double r = std::sqrt(-2.0 * std::log(u1)), angle = 2.0 * M_PI * u2;
    out[i] = r * std::cos(angle);
    if (i + 1 < d) out[i + 1] = r * std::sin(angle);
  }
}
}  // namespace

torch::Tensor normal_rows(const std::vector<uint64_t>& keys, at::IntArrayRef row_shape,
                          const torch::TensorOptions& options) {
  const int64_t n = static_cast<int64_t>(keys.size());
  int64_t d = 1;
  for (int64_t s : row_shape) d *= s;
  auto z = torch::empty({n, d}, torch::kDouble);  // [N, D]
  double* p = z.data_ptr<double>();
  // Rows are independent streams, so the split over threads cannot change any value.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) fill_normal(keys[static_cast<size_t>(j)], p + j * d, d);
  });
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  // Converted on the host, then moved without waiting for the device's queue (core/device.h).
  return to_device_async(z.to(options.dtype().toScalarType()), options.device()).view(shape);  // [N, shape...]
}

double normal_from_key(uint64_t key) {
  double v[1];
  fill_normal(key, v, 1);
  return v[0];
}

}  // namespace ddm
