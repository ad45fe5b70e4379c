// Deterministic seed derivation: every random draw in ddm comes from a generator seeded with a
// mix of (run seed, purpose, step, ...), so any step can be replayed without saved RNG state.
#pragma once
#include <cstdint>
#include <initializer_list>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

namespace ddm {

// SplitMix64 finalizer.
inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline uint64_t derive_seed(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x6a09e667f3bcc909ULL;
  for (uint64_t p : parts) h = mix64(h ^ mix64(p));
  return h;
}

// A uniform double in [0, 1) from a key: the top 53 bits of its mix.
inline double uniform_from_key(uint64_t key) { return static_cast<double>(mix64(key) >> 11) * 0x1p-53; }

inline at::Generator make_generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// Purposes, so that different uses of the same step never share a stream.
enum class RngPurpose : uint64_t { kDataOrder = 1, kFlip = 2, kNoise = 3, kTime = 4, kLabelDrop = 5, kSample = 6, kInit = 7,
                                 kHoldout = 8, kPosterior = 9, kSelfCond = 10, kShuffleBuffer = 11,
                                 kCrop = 12, kCaptionDrop = 13 };

}  // namespace ddm
