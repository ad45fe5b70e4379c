// A network's no-grad forward captured as CUDA graphs, one per input shape (see graphed_net.h).
#include "model/graphed_net.h"

#include <iostream>
#include <optional>

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include "core/device.h"
#include "core/error.h"

namespace ddm {

namespace {
// The layers whose weights autocast casts to its lower precision at every use (linear, convolution).
bool casts_weights(torch::nn::Module& m) {
  namespace nn = torch::nn;
  return m.as<nn::Linear>() || m.as<nn::Conv1d>() || m.as<nn::Conv2d>() || m.as<nn::Conv3d>() ||
         m.as<nn::ConvTranspose1d>() || m.as<nn::ConvTranspose2d>() || m.as<nn::ConvTranspose3d>();
}
}  // namespace

HeldWeightCasts::HeldWeightCasts(torch::nn::Module& net, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  for (const auto& m : net.modules(/*include_self=*/true)) {
    if (!casts_weights(*m)) continue;
    for (auto& item : m->named_parameters(/*recurse=*/false)) {
      torch::Tensor& p = item.value();
      // Only a weight that is all of its memory: one in a flat buffer (FlatAdamW's) changes through that
      // buffer, whose version counter is not the weight's.
      if (item.key() != "weight" || p.scalar_type() != torch::kFloat || p.storage_offset() != 0 ||
          p.storage().nbytes() != p.nbytes())
        continue;
      params_.push_back(p);
      weights_.push_back(p.detach());
      casts_.push_back(p.detach().to(dtype));
      versions_.push_back(p._version());
    }
  }
}

int64_t HeldWeightCasts::refresh() {
  torch::NoGradGuard no_grad;
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    DDM_CHECK(params_[i].data_ptr() == weights_[i].data_ptr() && params_[i].scalar_type() == torch::kFloat &&
                  params_[i].sizes() == weights_[i].sizes(),
              "--cuda-graphs: a weight of the network was given other memory after its casts for CUDA graphs were "
              "made (moved, converted or loaded into anew): wrap the network for graphs after it is loaded and placed");
    if (weights_[i]._version() == versions_[i]) continue;
    casts_[i].copy_(weights_[i]);
    versions_[i] = weights_[i]._version();
    ++n;
  }
  return n;
}

HeldWeightCasts::Swap::Swap(HeldWeightCasts& h) : h_(h) {
  saved_.reserve(h_.params_.size());
  for (size_t i = 0; i < h_.params_.size(); ++i) {
    saved_.push_back(h_.params_[i].detach());  // the parameter's data as it is, put back at the end
    h_.params_[i].set_data(h_.casts_[i]);
  }
}

HeldWeightCasts::Swap::~Swap() {
  for (size_t i = 0; i < saved_.size(); ++i) h_.params_[i].set_data(saved_[i]);
}

GraphedNetImpl::GraphedNetImpl(std::shared_ptr<NetImpl> inner, int64_t max_graphs)
    : inner_(std::move(inner)), max_graphs_(max_graphs) {
  // A submodule: its parameters are this network's, so that whoever asks where the network computes
  // (Denoiser::device, the ensemble built on it) finds the GPU, and eval() and to() reach it.
  register_module("inner", inner_);
}

torch::Tensor GraphedNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  if (failed_ || torch::GradMode::is_enabled() || !x.is_cuda()) return inner_->forward(x, t, c);
  // A graph's casts are its own (the linear and convolution weights' in HeldWeightCasts, the rest cast
  // at every replay): autocast's cached casts (a sampler keeps them across its steps) would be freed
  // when the sampler returns, under the graph's feet.
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
    if (static_cast<int64_t>(graphs_.size()) >= max_graphs_ || eager_calls_[key]++ == 0 || eager_only_.count(key)) {
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
    try {
      stream_->run([&] {
        // Under autocast the graph reads the weights' held casts, swapped in while it is captured.
        std::optional<HeldWeightCasts::Swap> swap;
        if (at::autocast::is_autocast_enabled(cuda)) {
          const at::ScalarType dtype = at::autocast::get_autocast_dtype(cuda);
          auto& held = casts_[dtype];
          if (!held) held = std::make_unique<HeldWeightCasts>(*inner_, dtype);
          held->refresh();
          g->casts = held.get();
          swap.emplace(*held);
        }
        why = g->graph.capture([&] { g->out = inner_->forward(g->x, g->t, g->c); }, pool);
      });
    } catch (const c10::OutOfMemoryError& e) {
      // Out of GPU memory while capturing: this shape runs without a graph from now on (its eager call
      // needs no pool of its own), the others keep theirs.
      std::string first = e.what();
      first.resize(std::min(first.find('\n'), first.size()));
      if (eager_only_.empty())
        std::cerr << "--cuda-graphs: out of GPU memory capturing a graph (" << first
                  << "); that batch shape runs without one\n";
      eager_only_.insert(key);
      stream_->run([&] { out = inner_->forward(x, t, c); });
      return out;
    }
    if (!why.empty()) {
      failed_ = true;
      std::cerr << "--cuda-graphs: the network could not be captured as a CUDA graph (" << why
                << "); it runs without graphs\n";
      graphs_.clear();  // nothing replays from here on; the graphs first, then the casts they read
      casts_.clear();
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
    if (g.casts) g.casts->refresh();  // a weight changed since: its cast made again, where the graph reads it
    g.graph.replay();
    out = g.out.clone();  // the next replay overwrites g.out
  });
  ++replays_;
  return out;
}

}  // namespace ddm
