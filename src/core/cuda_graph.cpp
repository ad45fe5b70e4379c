// CUDA graph capture and replay (see cuda_graph.h): LibTorch's CUDAGraph is used in libddm_cuda.so
// (src/cuda/graphs.cpp; core/cuda_module.h says why); this side holds what it gives.
#include "core/cuda_graph.h"

#include <sstream>

#include "core/cuda_module.h"
#include "core/error.h"

namespace ddm {

struct GraphStream::Impl {
  std::unique_ptr<CudaStreamRunner> runner;
};

GraphStream::GraphStream(torch::Device device) {
  DDM_CHECK(device.is_cuda(), "CUDA graphs need a CUDA device, not " << device);
  impl_ = std::make_unique<Impl>();
  impl_->runner = cuda_module().graph_stream(device.index());
}

GraphStream::~GraphStream() = default;

void GraphStream::run(const std::function<void()>& f) { impl_->runner->run(f); }

void GraphStream::fork(const std::function<void()>& f) { impl_->runner->fork(f); }

void GraphStream::join(const std::vector<torch::Tensor>& read) { impl_->runner->join(read); }

struct CapturedGraph::Impl {
  std::unique_ptr<CudaGraph> graph;
};

CapturedGraph::CapturedGraph() : impl_(std::make_unique<Impl>()) {}
CapturedGraph::~CapturedGraph() = default;

std::string CapturedGraph::capture(const std::function<void()>& f, const CapturedGraph* share_pool_of) {
  if (!impl_->graph) {
    try {
      impl_->graph = cuda_module().graph();
    } catch (const Error& e) {
      return e.what();  // as a capture that failed: the caller goes on eagerly
    }
  }
  const CudaGraph* other =
      share_pool_of != nullptr && share_pool_of->captured() ? share_pool_of->impl_->graph.get() : nullptr;
  return impl_->graph->capture(f, other);
}

bool CapturedGraph::captured() const { return impl_->graph && impl_->graph->captured(); }

void CapturedGraph::reset() {
  if (impl_->graph) impl_->graph->reset();
}

void CapturedGraph::replay() {
  DDM_CHECK(captured(), "CapturedGraph::replay: nothing was captured");
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
