// A tensor's bytes into a running sha256 (core/fileio.h), as it holds them on the CPU in row-major
// order: digests of weights and data compared across ranks (the seeded initialization, the data a
// run reads) without joining the tensors into one buffer first.
#pragma once
#include <torch/types.h>

#include "core/fileio.h"

namespace ddm {

inline void hash_tensor(Sha256& hash, const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  hash.update(c.data_ptr(), c.nbytes());
}

}  // namespace ddm
