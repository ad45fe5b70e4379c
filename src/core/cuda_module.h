// LibTorch's CUDA half, loaded only where a GPU can be used: the interface of libddm_cuda.so (its
// loading: core/cuda_load.h). ddm's binaries link LibTorch's CPU
// libraries alone. What ddm's code needs of the CUDA ones (libtorch_cuda, c10_cuda, NCCL: graphs,
// streams, events, the caching allocator, device properties, ProcessGroupNCCL) sits behind the
// interface below, in libddm_cuda.so (src/cuda/), built beside the binaries. load_cuda() opens it at a
// process's start where an NVIDIA driver is present. Opening it loads libtorch_cuda, whose kernels
// and hooks register with LibTorch as they would in a binary linked with it, so CUDA tensors work.
// Where no driver is present (a CPU machine) nothing of CUDA is loaded: each process starts about
// 0.2 s of CPU sooner and maps about 350 MB less (docs/testing.md), and LibTorch answers as a build
// without CUDA does (torch::cuda::device_count() is 0; asking for cuda names the reason).
//
// LibTorch decides once per process, at its first CUDA question, whether CUDA exists: load_cuda()
// must run before anything asks, first thing in main (the ddm binary, the helpers and benches; for
// the tests, test_util.cpp).
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/cuda_load.h"
#include "core/error.h"

namespace ddm {

// A stream of a GPU's own (core/cuda_graph.h's GraphStream).
class CudaStreamRunner {
 public:
  virtual ~CudaStreamRunner() = default;
  // Runs f with this stream current: after the caller's stream's queued work; the caller's stream
  // then waits for f's.
  virtual void run(const std::function<void()>& f) = 0;
  // Runs f with this stream current, after the caller's stream's queued work, and returns with the
  // caller's stream not waiting for f's work: join() makes the then current stream wait for it, and
  // keeps `read` (tensors f's work made on this stream, which the current stream goes on to read) from
  // the caching allocator until that stream's work queued so far is done. Where f throws, what it
  // queued can still be joined.
  virtual void fork(const std::function<void()>& f) = 0;
  virtual void join(const std::vector<at::Tensor>& read) = 0;
};

// One CUDA graph (core/cuda_graph.h's CapturedGraph).
class CudaGraph {
 public:
  virtual ~CudaGraph() = default;
  // Captures f's work on the current stream; "" or, when the capture failed, why (its first line).
  // Running out of GPU memory is thrown (c10::OutOfMemoryError), not returned: with memory to spare
  // the same capture may succeed.
  // With share_pool_of (a graph of this module, captured), the capture allocates from that graph's
  // memory pool instead of a pool of its own (CapturedGraph::capture says when that is safe).
  virtual std::string capture(const std::function<void()>& f, const CudaGraph* share_pool_of) = 0;
  virtual bool captured() const = 0;
  virtual void replay() = 0;  // only when captured()
  virtual void reset() = 0;
};

// What libddm_cuda.so gives (`device` -1: the current device). Its functions throw c10::Error or std::runtime_error, never ddm::Error
// (whose type the module does not share with the binary): callers name the failure.
class CudaModule {
 public:
  virtual ~CudaModule() = default;
  virtual std::unique_ptr<CudaStreamRunner> graph_stream(int device) const = 0;
  virtual std::unique_ptr<CudaGraph> graph() const = 0;
  // Gives the caching allocator's unused cached blocks back to the driver (LibTorch's emptyCache).
  virtual void empty_cache() const = 0;
  // Records an event on `device`'s current stream now; the function returned blocks the host until
  // the work queued before it is done.
  virtual std::function<void()> mark(int device) const = 0;
  virtual std::string device_name(int device) const = 0;
  // `device`'s current stream, a cudaStream_t.
  virtual void* current_stream(int device) const = 0;
  // A ProcessGroupNCCL of `world` ranks on GPU `device` (comm/nccl.h says how), and NCCL's version.
  virtual c10::intrusive_ptr<c10d::Backend> nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int world, int device,
                                                       std::chrono::milliseconds timeout) const = 0;
  virtual std::string nccl_version() const = 0;
};

// The module; throws ddm::Error naming why it is not loaded (core/cuda_load.h).
inline const CudaModule& cuda_module() {
  const CudaModule* m = loaded_cuda_module();
  DDM_CHECK(m != nullptr, "CUDA is needed here, but LibTorch's CUDA libraries are " << cuda_status());
  return *m;
}

}  // namespace ddm

