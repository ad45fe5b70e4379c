// A network whose forward, under no-grad on a GPU, is captured as a CUDA graph per input shape and
// replayed (`ddm sample --cuda-graphs`): a sampler's network evaluation then costs the host one
// launch instead of one per kernel, which is what holds small models back on a GPU. The first call
// of a shape runs eagerly on the graph's stream (cuBLAS sets itself up there), the second captures
// it; from then on the inputs are copied into the graph's and its output is copied out (a caller may
// keep it while the next call replays). The graphs share one memory pool, so that many shapes cost
// the memory of the largest one's forward (and each one's output), not the sum. Shapes beyond
// max_graphs, calls that record gradients, CPU tensors, and a network that cannot be captured (said
// once on stderr) run eagerly: the same results either way, bit for bit, since a replay runs the
// eager call's kernels.
#pragma once
#include <map>
#include <memory>
#include <string>

#include "core/cuda_graph.h"
#include "model/net.h"

namespace ddm {

class GraphedNetImpl : public NetImpl {
 public:
  explicit GraphedNetImpl(std::shared_ptr<NetImpl> inner, int64_t max_graphs = 4);
  // x: [B, C, H, W]; t: [B]; returns inner's forward, [B, C, H, W].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  Cond precompute(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override {
    return inner_->precompute(x, t, c);
  }
  bool self_conditioned() const override { return inner_->self_conditioned(); }
  std::vector<NetUnit> units() override { return inner_->units(); }
  int64_t replays() const { return replays_; }
  int64_t graphs() const { return static_cast<int64_t>(graphs_.size()); }

 private:
  struct Graph {
    CapturedGraph graph;
    torch::Tensor x, t, out;  // the graph's input and output tensors
    Cond c;
  };
  std::shared_ptr<NetImpl> inner_;
  int64_t max_graphs_;
  std::unique_ptr<GraphStream> stream_;
  std::map<std::string, std::unique_ptr<Graph>> graphs_;  // by the inputs' signature
  std::map<std::string, int64_t> eager_calls_;            // shapes seen, not yet captured
  bool failed_ = false;
  int64_t replays_ = 0;
};

}  // namespace ddm
