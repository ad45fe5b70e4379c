// CUDA graph capture and replay around LibTorch's CUDAGraph, and the stream they run on: the
// module's side of core/cuda_graph.h (core/cuda_module.h says why it is a module).
#include <sstream>
#include <stdexcept>

#include <ATen/autocast_mode.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/parts.h"

namespace ddm::cuda {
namespace {

class Stream final : public CudaStreamRunner {
 public:
  explicit Stream(int device) : stream_(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device))) {}

  void run(const std::function<void()>& f) override {
    try {
      fork(f);
    } catch (...) {
      join({});
      throw;
    }
    join({});
  }

  void fork(const std::function<void()>& f) override {
    ready_.record(c10::cuda::getCurrentCUDAStream(stream_.device_index()));
    ready_.block(stream_);
    try {
      const c10::cuda::CUDAStreamGuard guard(stream_);
      f();
    } catch (...) {
      done_.record(stream_);  // what f queued before it threw can still be joined
      throw;
    }
    done_.record(stream_);
  }

  void join(const std::vector<at::Tensor>& read) override {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(stream_.device_index());
    done_.block(current);
    for (const at::Tensor& t : read)
      if (t.defined() && t.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), current);
  }

 private:
  c10::cuda::CUDAStream stream_;
  at::cuda::CUDAEvent ready_;  // recorded on the caller's stream before fork's work
  at::cuda::CUDAEvent done_;   // recorded after it
};

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

class Graph final : public CudaGraph {
 public:
  std::string capture(const std::function<void()>& f, const CudaGraph* share_pool_of) override {
    graph_.reset();
    // The pool: another graph's (LibTorch counts its users; each graph releases its use), or the
    // graph's own, named so that a failed capture can end it.
    const auto* other = dynamic_cast<const Graph*>(share_pool_of);
    const c10::MempoolId_t pool =
        other != nullptr && other->graph_ ? other->graph_->pool() : at::cuda::graph_pool_handle();
    struct CacheOff {  // autocast's cache off while capturing, and as it was after, however this ends
      bool was = at::autocast::is_autocast_cache_enabled();
      CacheOff() { at::autocast::set_autocast_cache_enabled(false); }
      ~CacheOff() { at::autocast::set_autocast_cache_enabled(was); }
    } cache_off;
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    const c10::DeviceIndex device = c10::cuda::current_device();
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
      graph_ = std::move(graph);
    } catch (const c10::OutOfMemoryError&) {
      throw;  // not a network that cannot be captured: with memory to spare it can
    } catch (const std::exception& e) {
      why = e.what();
      if (const auto nl = why.find('\n'); nl != std::string::npos) why.resize(nl);
      if (why.empty()) why = "an error without a message";
    }
    return why;
  }

  bool captured() const override { return graph_ != nullptr; }

  void replay() override {
    if (!graph_) throw std::runtime_error("CapturedGraph::replay: nothing was captured");
    graph_->replay();
  }

  void reset() override { graph_.reset(); }

 private:
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
};

}  // namespace

std::unique_ptr<CudaStreamRunner> make_stream(int device) { return std::make_unique<Stream>(device); }

std::unique_ptr<CudaGraph> make_graph() { return std::make_unique<Graph>(); }

}  // namespace ddm::cuda
