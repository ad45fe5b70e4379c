// ProcessGroupNCCL for comm/nccl.h, in the module (core/cuda_module.h). Its header is guarded by
// USE_C10D_NCCL, which the PyPI wheel was built with: defined here, the one file that includes it.
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "cuda/parts.h"

namespace ddm::cuda {

c10::intrusive_ptr<c10d::Backend> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  int device, std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/true);
  opts->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, opts);
  // Eager: the communicator forms now, so a rank that cannot form it fails at start-up, not inside
  // the first step's backward.
  pg->eagerConnectSingleDevice(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  return pg;
}

std::string nccl_version() { return c10d::getNcclVersion(); }

}  // namespace ddm::cuda
