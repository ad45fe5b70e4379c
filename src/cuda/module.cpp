// libddm_cuda.so's CudaModule (core/cuda_module.h): LibTorch's CUDA streams, events, caching
// allocator and device properties, and the pieces of graphs.cpp and nccl.cpp. Exported: the one
// function the binaries look up; everything else stays inside (-fvisibility=hidden).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/parts.h"

namespace ddm::cuda {
namespace {

class Module final : public CudaModule {
 public:
  std::unique_ptr<CudaStreamRunner> graph_stream(int device) const override { return make_stream(device); }
  std::unique_ptr<CudaGraph> graph() const override { return make_graph(); }
  void empty_cache() const override { c10::cuda::CUDACachingAllocator::emptyCache(); }

  std::function<void()> mark(int device) const override {
    auto event = std::make_shared<at::cuda::CUDAEvent>();
    event->record(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
    return [event] { event->synchronize(); };
  }

  std::string device_name(int device) const override {
    return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->name;
  }

  void* current_stream(int device) const override {
    return static_cast<void*>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }

  c10::intrusive_ptr<c10d::Backend> nccl_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               int device, std::chrono::milliseconds timeout) const override {
    return make_nccl_group(store, rank, world, device, timeout);
  }

  std::string nccl_version() const override { return cuda::nccl_version(); }
};

}  // namespace
}  // namespace ddm::cuda

extern "C" __attribute__((visibility("default"))) const ddm::CudaModule* ddm_cuda_module(int interface) {
  if (interface != ddm::kCudaModuleInterface) return nullptr;
  static const ddm::cuda::Module module;
  return &module;
}
