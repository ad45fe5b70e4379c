// A network's no-grad forward captured as CUDA graphs, one per input shape (see graphed_net.h).
#include "model/graphed_net.h"

#include <iostream>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include "core/device.h"

namespace ddm {

GraphedNetImpl::GraphedNetImpl(std::shared_ptr<NetImpl> inner, int64_t max_graphs)
    : inner_(std::move(inner)), max_graphs_(max_graphs) {
  // A submodule: its parameters are this network's, so that whoever asks where the network computes
  // (Denoiser::device, the ensemble built on it) finds the GPU, and eval() and to() reach it.
  register_module("inner", inner_);
}

torch::Tensor GraphedNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  if (failed_ || torch::GradMode::is_enabled() || !x.is_cuda()) return inner_->forward(x, t, c);
  // A graph casts its weights itself: autocast's cached casts (a sampler keeps them across its steps)
  // would be freed when the sampler returns, under the graph's feet.
  const AutocastCacheOff own_casts;
  Cond cc = c;
  std::vector<const torch::Tensor*> in{&x, &t};
  for (torch::Tensor* s : cc.slots()) in.push_back(s);
  // The shapes, and the autocast the call runs under (a graph keeps the precision it was captured in).
  const at::DeviceType cuda = at::kCUDA;
  const std::string key = std::to_string(cc.residuals.size()) + "," + std::to_string(cc.frozen.size()) + ":" +
                          slots_signature(in) + (at::autocast::is_autocast_enabled(cuda) ? "autocast " : "") +
                          c10::toString(at::autocast::get_autocast_dtype(cuda));
  if (!stream_) stream_ = std::make_unique<GraphStream>(x.device());
  torch::Tensor out;
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (static_cast<int64_t>(graphs_.size()) >= max_graphs_ || eager_calls_[key]++ == 0) {
      stream_->run([&] { out = inner_->forward(x, t, c); });  // first of its shape: warm up eagerly
      return out;
    }
    auto g = std::make_unique<Graph>();  // the graph's own inputs: a replay reads them where capture saw them
    g->x = x.clone();
    g->t = t.clone();
    g->c = c;
    for (torch::Tensor* s : g->c.slots())
      if (s->defined()) *s = s->clone();
    std::string why;
    // Every graph of this network allocates from the first one's memory pool: they replay one at a time
    // on stream_, and each one's output is copied out right after its replay (below).
    const CapturedGraph* pool = graphs_.empty() ? nullptr : &graphs_.begin()->second->graph;
    stream_->run([&] { why = g->graph.capture([&] { g->out = inner_->forward(g->x, g->t, g->c); }, pool); });
    if (!why.empty()) {
      failed_ = true;
      std::cerr << "--cuda-graphs: the network could not be captured as a CUDA graph (" << why
                << "); it runs without graphs\n";
      stream_->run([&] { out = inner_->forward(x, t, c); });
      return out;
    }
    it = graphs_.emplace(key, std::move(g)).first;
  }
  Graph& g = *it->second;
  stream_->run([&] {
    g.x.copy_(x);
    g.t.copy_(t);
    const std::vector<torch::Tensor*> to = g.c.slots(), from = cc.slots();
    for (size_t k = 0; k < to.size(); ++k)
      if (to[k]->defined()) to[k]->copy_(*from[k]);
    g.graph.replay();
    out = g.out.clone();  // the next replay overwrites g.out
  });
  ++replays_;
  return out;
}

}  // namespace ddm
