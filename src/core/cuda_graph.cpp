// CUDA graph capture and replay around LibTorch's CUDAGraph (see cuda_graph.h).
#include "core/cuda_graph.h"

#include <sstream>

#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
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

std::string CapturedGraph::capture(const std::function<void()>& f) {
  impl_->graph.reset();
  const bool cache = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_cache_enabled(false);
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  std::string why;
  try {
    // Thread-local: a data loader's threads may use CUDA (pinned memory) while this one captures.
    graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      f();
    } catch (...) {
      try {
        graph->capture_end();  // ends the stream's capture; throws for the invalidated graph
      } catch (...) {
      }
      throw;
    }
    graph->capture_end();
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
