// NCCL for the data plane: the process group that carries CUDA tensors (the gradient buckets, a
// pipeline's activations, DiLoCo's pseudo-gradients) when parallel.backend resolves to nccl. Gloo
// stays the control plane (the store, config agreement, stop decisions, faults) and carries every
// CPU tensor. The group is made in libddm_cuda.so (src/cuda/nccl.cpp; core/cuda_module.h): both
// functions throw ddm::Error where LibTorch's CUDA libraries are not loaded.
#pragma once
#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddm {

// A ProcessGroupNCCL of `world` ranks on CUDA GPU `device` (this rank's), connected at once (every
// rank calls this together), its communication on high-priority streams that wait for the caller's
// current stream through events: a collective never blocks the host, and Comm::wait orders the
// caller's stream after it. A collective that runs past `timeout` is caught by PyTorch's NCCL
// watchdog, which aborts the communicator (docs/gpu.md, "Backends").
c10::intrusive_ptr<c10d::Backend> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                  int device, std::chrono::milliseconds timeout);

// The NCCL version LibTorch runs ("2.28.9"), for messages and the run's header.
std::string nccl_version();

}  // namespace ddm
