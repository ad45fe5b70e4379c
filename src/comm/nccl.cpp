// make_nccl_group and nccl_version (see nccl.h): ProcessGroupNCCL is LibTorch's CUDA half, used in
// libddm_cuda.so (src/cuda/nccl.cpp; core/cuda_module.h says why).
#include "comm/nccl.h"

#include "core/cuda_module.h"

namespace ddm {

c10::intrusive_ptr<c10d::Backend> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  int device, std::chrono::milliseconds timeout) {
  return cuda_module().nccl_group(store, rank, world, device, timeout);
}

std::string nccl_version() { return cuda_module().nccl_version(); }

}  // namespace ddm
