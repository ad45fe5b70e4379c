// Counter-based random numbers keyed per sample: each row of a tensor, and each scalar, comes from its
// own stream named by a 64-bit key (derive_seed of run seed, purpose, step, sample index...). What a
// sample draws therefore does not depend on which batch, micro-batch or rank it is in: N ranks x b
// samples draw exactly what 1 rank x N*b samples draws. Hand-written (SplitMix64 + Box-Muller): a
// LibTorch generator per row costs microseconds of set-up, which dominates small images.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/types.h>

namespace ddm {

// Standard normal float [N, shape...]: row j from the stream keyed by keys[j] (N = keys.size()).
torch::Tensor normal_rows(const std::vector<uint64_t>& keys, at::IntArrayRef row_shape,
                          const torch::TensorOptions& options = torch::kFloat);
// One standard normal value from a key (the first value of normal_rows' stream for that key).
double normal_from_key(uint64_t key);

}  // namespace ddm
