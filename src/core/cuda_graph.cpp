// CUDA graph capture and replay around LibTorch's CUDAGraph (see cuda_graph.h).
#include "core/cuda_graph.h"

#include <sstream>

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/error.h"

namespace ddm {

struct GraphStream::Impl {
  explicit Impl(torch::Device device) : stream(c10::cuda::getStreamFromPool(false, device.index())) {}
  c10::cuda::CUDAStream stream;
};

GraphStream::GraphStream(torch::Device device) {
  DDM_CHECK(device.is_cuda(), "CUDA graphs need a CUDA device, not " << device);
  impl_ = std::make_unique<Impl>(device);
}

GraphStream::~GraphStream() = default;

void GraphStream::run(const std::function<void()>& f) {
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(impl_->stream.device_index());
  at::cuda::CUDAEvent ready;
  ready.record(caller);
  ready.block(impl_->stream);
  {
    const c10::cuda::CUDAStreamGuard guard(impl_->stream);
    f();
  }
  at::cuda::CUDAEvent done;
  done.record(impl_->stream);
  done.block(caller);
}

struct CapturedGraph::Impl {
  std::unique_ptr<at::cuda::CUDAGraph> graph;
};

CapturedGraph::CapturedGraph() : impl_(std::make_unique<Impl>()) {}
CapturedGraph::~CapturedGraph() = default;

namespace {

// LibTorch 2.11's CUDAGraph::capture_end throws at cudaStreamEndCapture for a capture that was
// invalidated (a host synchronization inside it, say) before it tells the caching allocators that the
// capture is over, and a graph whose capture did not end never gives its memory pool back. Left so,
// the device allocator believes a capture is still under way: its emptyCache() then fails an internal
// assertion, and it no longer frees cached blocks to retry an allocation that ran out of memory. So
// the pool is ended here, where capture_end did not end it, and released. (Where capture_end failed
// after ending it, the ending here throws and nothing is released twice.)
void end_failed_capture(c10::DeviceIndex device, c10::MempoolId_t pool) {
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
    c10::cuda::CUDACachingAllocator::releasePool(device, pool);
  } catch (const std::exception&) {
  }
  try {
    at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
    at::getHostAllocator(at::kCUDA)->release_pool(pool);
  } catch (const std::exception&) {
  }
}

}  // namespace

std::string CapturedGraph::capture(const std::function<void()>& f) {
  impl_->graph.reset();
  const bool cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  const c10::DeviceIndex device = c10::cuda::current_device();
  const c10::MempoolId_t pool = at::cuda::graph_pool_handle();  // the graph's own, named so it can be ended
  std::string why;
  try {
    // Thread-local: a data loader's threads may use CUDA (pinned memory) while this one captures.
    graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    try {
      f();
    } catch (...) {
      try {
        graph->capture_end();  // ends the stream's capture; throws for the invalidated graph
      } catch (...) {
        end_failed_capture(device, pool);
      }
      throw;
    }
    try {
      graph->capture_end();
    } catch (...) {
      end_failed_capture(device, pool);
      throw;
    }
    impl_->graph = std::move(graph);
  } catch (const std::exception& e) {
    why = e.what();
    if (const auto nl = why.find('\n'); nl != std::string::npos) why.resize(nl);
    if (why.empty()) why = "an error without a message";
  }
  at::autocast::set_autocast_cache_enabled(cache);
  return why;
}

bool CapturedGraph::captured() const { return impl_->graph != nullptr; }

void CapturedGraph::reset() { impl_->graph.reset(); }

void CapturedGraph::replay() {
  DDM_CHECK(impl_->graph, "CapturedGraph::replay: nothing was captured");
  impl_->graph->replay();
}

std::string slots_signature(const std::vector<const torch::Tensor*>& slots) {
  std::ostringstream s;
  for (const torch::Tensor* t : slots) {
    if (!t->defined()) {
      s << "-;";
      continue;
    }
    s << t->scalar_type() << t->sizes() << t->device() << ";";
  }
  return s.str();
}

}  // namespace ddm
