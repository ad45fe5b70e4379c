// The network interface every backbone implements. A Net maps (x, noise-level conditioning t,
// conditioning c) to a tensor shaped like x. It knows nothing about the noise process: what t means
// and what the output is trained to predict is decided in src/diffusion. The conditioning is a small
// struct: the class label, a ControlNet's control map, what a ControlNet hands its locked U-Net, an
// image embedding, and a text encoder's token states and pooled embedding.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "core/config.h"

namespace ddm {

// What a network is conditioned on besides x and t. Per-sample tensors have the batch first.
struct Cond {
  Cond() = default;
  Cond(torch::Tensor y) : y(std::move(y)) {}  // NOLINT(google-explicit-constructor): a label alone is a Cond
  // int64 [B]; y == num_classes is the null class (unconditional; classifier-free guidance).
  torch::Tensor y;
  // A ControlNet's control map, float [B, Cc, H, W] in [-1, 1] (data/control.h); undefined: none.
  torch::Tensor control;
  // Added to a U-Net's skip features, in the order it pushes them, then to its middle's output: a
  // ControlNet's contribution to its locked U-Net (model/controlnet.h). Empty: none.
  std::vector<torch::Tensor> residuals;
  // A network's own no-grad precomputation on (x, t, c), from NetImpl::precompute (a ControlNet: its
  // locked encoder's features). Only the network that made it reads it; empty: none.
  std::vector<torch::Tensor> frozen;
  // Self-conditioning (model.self_cond): the previous x0 estimate [B, C, H, W]; undefined: none (zeros).
  torch::Tensor self_cond;
  // Image-embedding conditioning (model.embed): a frozen network's embedding of each sample's reference
  // image, float [B, D]; undefined: every row takes the learned null embedding. embed_null, bool [B]
  // (optional): the rows that take it anyway (dropped in training, guidance's unconditional branch).
  torch::Tensor embed;
  torch::Tensor embed_null;
  // Text conditioning (model.text_dim > 0): a frozen text encoder's token states float [B, T, D] and
  // which of them to attend to, int64 [B, T] (nonzero: attend; undefined: all); its pooled embedding
  // float [B, P] (model.text_pooled_dim > 0). The null condition is the empty prompt's encoding.
  torch::Tensor context;
  torch::Tensor context_mask;
  torch::Tensor pooled;

  // The rows [first, first + n) of every per-sample tensor (y, control, self_cond, embed, text);
  // residuals and frozen must be empty.
  Cond rows(int64_t first, int64_t n) const;
  // The rows idx (int64 [b]) of every per-sample tensor, in that order; residuals and frozen must be empty.
  Cond select(const torch::Tensor& idx) const;
  // a's rows then b's (classifier-free guidance's two branches in one batch).
  static Cond cat(const Cond& a, const Cond& b);
  // Every tensor on `device`.
  Cond to(torch::Device device) const;
  // Every tensor slot in a fixed order (the per-sample ones, then residuals and frozen), defined or
  // not: what a CUDA graph copies its inputs into (core/cuda_graph.h).
  std::vector<torch::Tensor*> slots();
};

// What is live between two units of a backbone (NetImpl::units): what a pipeline stage hands to the next.
struct NetCarry {
  torch::Tensor h;                   // the running activation; the first unit reads the input x here
  torch::Tensor emb;                 // the conditioning every later unit reads (SiLU of the t/label embedding)
  std::vector<torch::Tensor> skips;  // U-Net skips still open, in push order
  // h, emb and the skips, in that order (the defined ones).
  std::vector<torch::Tensor> tensors() const;
  // Bytes of those tensors.
  int64_t bytes() const;
};

// One unit of a backbone: a contiguous piece of its forward (a ResBlock and its attention, a
// transformer block, the input embedding, the output head).
struct NetUnit {
  std::string name;
  std::function<void(NetCarry& k, const torch::Tensor& t, const Cond& c)> run;
  std::vector<torch::Tensor> params;  // the parameters it reads (frozen ones too: a ControlNet's locked decoder)
  bool reads_frozen = false;          // it reads Cond::frozen (NetImpl::precompute's features)
};

// One U-Net skip's life over a backbone's units: unit `made` put it in skip slot `slot`, and unit
// `read` is the next to touch that slot, by popping it or putting another tensor there (the unit
// count when none does). While made <= u < read it is live after unit u: a cut there holds it.
struct NetSkipLife {
  int slot = 0, made = 0, read = 0;
  std::vector<int64_t> row_shape;  // one row's shape, e.g. [c, h, w]
  int64_t row_bytes = 0;
};

// Every skip's life, ordered by (made, slot), from one pass of `units` in order starting from k
// (run under no-grad; one row is enough: the lives do not depend on the batch).
std::vector<NetSkipLife> skip_lives(const std::vector<NetUnit>& units, NetCarry k, const torch::Tensor& t, const Cond& c);

class NetImpl : public torch::nn::Module {
 public:
  // x: float [B, C, H, W]; t: float [B] in [0, 1]; c: conditioning of the B samples. Returns float
  // [B, C, H, W] (routers, model/router.h: logits [B, num_experts]).
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) = 0;
  // The part of forward that depends on no trainable parameter, run by the training step's prepare
  // phase under no-grad (a ControlNet's locked encoder): returns c with Cond::frozen filled, which
  // forward then uses instead of recomputing. By default nothing: returns c.
  virtual Cond precompute(const torch::Tensor& /*x*/, const torch::Tensor& /*t*/, const Cond& c) { return c; }
  // Whether forward takes Cond::self_cond (model.self_cond): samplers then feed it each step's estimate.
  virtual bool self_conditioned() const { return false; }
  // The backbone as an ordered list of units, for pipeline stages and their profiler: starting from
  // NetCarry{h = x}, running every unit in order leaves forward(x, t, c) in h, bit for bit. Every
  // trainable parameter belongs to exactly one unit. By default: a ddm::Error (not splittable).
  virtual std::vector<NetUnit> units();
};
using Net = std::shared_ptr<NetImpl>;

// Builds the network described by cfg (arch unet | dit | router-dit | router-conv | autoencoder; a
// ControlNet when cfg.controlnet is set, whose locked base train/controlnet.h loads). cfg.in_channels,
// image_size and num_classes must already be resolved (> 0, > 0, >= 0). Throws ddm::Error on invalid shapes
// (e.g. image_size not divisible by the DiT patch or by the U-Net's downsampling).
Net make_net(const ModelConfig& cfg);

// The network's input for x [B, C, H, W] under model.self_cond: x itself, or x with the estimate
// c.self_cond (zeros when undefined) as C more channels, [B, 2C, H, W].
torch::Tensor with_self_cond(const torch::Tensor& x, const Cond& c, bool self_cond);

// Image-embedding conditioning in a backbone: Linear(D, E) of Cond::embed, and a learned null
// embedding [E] for the rows without one (zero-initialized: a null row adds nothing at first).
class EmbedProjectorImpl : public torch::nn::Module {
 public:
  EmbedProjectorImpl(int64_t embed_dim, int64_t out_dim);
  // The projected embeddings [B, E] of c (B = batch); null rows are the null embedding.
  torch::Tensor forward(const Cond& c, int64_t batch);

 private:
  int64_t embed_dim_;
  torch::nn::Linear proj_{nullptr};
  torch::Tensor null_;
};
TORCH_MODULE(EmbedProjector);

// Number of trainable parameters.
int64_t count_params(const torch::nn::Module& m);
// Analytic forward FLOPs per image (2 x multiply-accumulates of convolutions, linear layers and
// attention matmuls; elementwise ops ignored), for the configuration.
double forward_flops_per_image(const ModelConfig& cfg);

}  // namespace ddm
