// The pieces of libddm_cuda.so (core/cuda_module.h says what it is and why), one file each, put
// together as its CudaModule in module.cpp. Only this folder's files include LibTorch's CUDA headers,
// and only the module links LibTorch's CUDA libraries.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "core/cuda_module.h"

namespace ddm::cuda {

// graphs.cpp
std::unique_ptr<CudaStreamRunner> make_stream(int device);
std::unique_ptr<CudaGraph> make_graph();

// nccl.cpp
c10::intrusive_ptr<c10d::Backend> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  int device, std::chrono::milliseconds timeout);
std::string nccl_version();

}  // namespace ddm::cuda
