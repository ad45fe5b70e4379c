// A network whose forward, under no-grad on a GPU, is captured as a CUDA graph per input shape and
// replayed (`ddm sample --cuda-graphs`): a sampler's network evaluation then costs the host one
// launch instead of one per kernel, which is what holds small models back on a GPU. The first call
// of a shape runs eagerly on the graph's stream (cuBLAS sets itself up there), the second captures
// it; from then on the inputs are copied into the graph's and its output is copied out (a caller may
// keep it while the next call replays). The graphs share one memory pool, so that many shapes cost
// the memory of the largest one's forward (and each one's output), not the sum. Shapes beyond
// max_graphs, calls that record gradients, CPU tensors, a shape whose capture ran out of GPU memory
// and a network that cannot be captured (each said once on stderr) run eagerly: the same results
// either way, bit for bit, since a replay runs the eager call's kernels. Under autocast a graph does
// not cast the linear and convolution weights at every replay: it reads casts made once
// (HeldWeightCasts below), made again where a weight changed.
#pragma once
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/cuda_graph.h"
#include "model/net.h"

namespace ddm {

// A network's linear and convolution weights (float32 parameters named "weight" in those layers)
// cast to `dtype` and held: what autocast casts them to at each use. While a Swap lives, those
// parameters are the casts, so that autocast, finding them in its lower precision already, casts
// nothing; a CUDA graph captured then reads the held casts instead of casting at every replay. The
// forward's bits do not change: autocast runs linear and convolution in `dtype`, and the cast is the
// same rounding, done once (Nets.HeldWeightCastsChangeNoBitOfAForward checks every preset on the CPU).
// Biases are left as they are (the DiT's fused residual adds a linear's bias itself, in float32), and
// so are weights that share their memory with more (a flat buffer's). Only the network's registered
// modules are seen (a ControlNet's locked UNet is not one: its weights are cast at each use).
class HeldWeightCasts {
 public:
  HeldWeightCasts(torch::nn::Module& net, at::ScalarType dtype);
  // Casts again, in place (on the current stream), every weight whose version changed since its cast.
  // Returns how many. Not while a Swap lives. A weight given other memory since (Module::to, a load
  // into it anew) is refused, naming the fix: the graphs read the memory they were captured with.
  int64_t refresh();
  int64_t size() const { return static_cast<int64_t>(params_.size()); }

  class Swap {
   public:
    explicit Swap(HeldWeightCasts& h);
    ~Swap();
    Swap(const Swap&) = delete;
    Swap& operator=(const Swap&) = delete;

   private:
    HeldWeightCasts& h_;
    std::vector<torch::Tensor> saved_;  // the parameters' data before the swap
  };

 private:
  std::vector<torch::Tensor> params_;    // the parameters themselves
  std::vector<torch::Tensor> weights_;   // their float32 data (detached: the same storage and version counter)
  std::vector<torch::Tensor> casts_;     // [i]: weights_[i] in dtype
  std::vector<uint32_t> versions_;       // weights_[i]'s version when cast
};

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
    HeldWeightCasts* casts = nullptr;  // under autocast: the weights' casts it reads (in casts_)
  };
  std::shared_ptr<NetImpl> inner_;
  int64_t max_graphs_;
  std::unique_ptr<GraphStream> stream_;
  // Per autocast type: the weights' casts that the graphs captured under it read (kept while they live).
  std::map<at::ScalarType, std::unique_ptr<HeldWeightCasts>> casts_;
  std::map<std::string, std::unique_ptr<Graph>> graphs_;  // by the inputs' signature
  std::map<std::string, int64_t> eager_calls_;            // shapes seen, not yet captured
  std::set<std::string> eager_only_;                      // shapes whose capture ran out of GPU memory
  bool failed_ = false;
  int64_t replays_ = 0;
};

}  // namespace ddm
