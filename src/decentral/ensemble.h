// The routed expert ensemble of decentralized diffusion (docs/decentralized.md, "Routed sampling").
// At every solver step and for every sample, router probabilities p(k | x_t, t, y) become mixture
// weights by a routing strategy; the samples are grouped by expert and each expert runs once on its
// group; the experts' data and noise estimates (x0_hat, eps_hat), which do not depend on the path or
// the parameterization an expert was trained with, are combined with those weights. So flow, eps
// and v experts mix, and the ensemble is a Denoiser that every sampler accepts.
//
// Classifier-free guidance: each chosen expert applies the guidance itself, conditional and
// unconditional branch in one batch, and the router is queried once with the class label (the null
// label when the whole sample is unconditional, w = 0). So both branches of a sample use the same
// expert, the guidance direction cond - uncond is taken within one expert's model, and routing costs
// one router pass per step whatever the guidance.
//
// On a GPU the experts run side by side: each expert's group on a CUDA stream of its own, so that
// the kernels of small experts (or, from CUDA graphs, their graphs) overlap instead of queueing one
// after another; their weighted estimates are then added into the mixture on the caller's stream in
// the experts' order, which gives the same bits as running them one after another.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/types.h>

#include "data/dataset.h"
#include "diffusion/denoiser.h"

namespace ddm {

class GraphStream;
struct Partition;

struct Routing {
  enum class Kind { kTop1, kTopK, kFull, kThreshold, kSample };
  Kind kind = Kind::kTop1;
  int64_t k = 1;          // topk: experts per sample
  double threshold = 0;   // threshold: keep experts with p > threshold (top-1 if none)
  bool oracle = false;    // probabilities from the exact posterior over the training data (top-1)
  std::string spec = "top1";
};
// top1 | topk:K | full | threshold:P | sample | oracle. Throws ddm::Error listing the forms.
Routing parse_routing(const std::string& spec);

// Mixture weights [B, K] (each row sums to 1) from probabilities [B, K]: top-1 one-hot, top-k
// renormalized, the full distribution, the experts above a threshold renormalized, or one expert
// drawn from p (kSample only) by inverting its CDF at uniforms [B] (in [0, 1)): row b takes the first
// expert whose cumulative probability exceeds uniforms[b] times the row's total.
torch::Tensor routing_weights(const torch::Tensor& probs, const Routing& r, const torch::Tensor& uniforms = {});

// Router probabilities [B, K] at (x, t) on the sampling path with labels y.y [B] (null = num_classes)
// and, for text, the prompts' encodings (the router reads y.pooled).
using RouterFn = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& t, const Cond& y)>;

// A trained router net (logits) as a RouterFn: converts x_t from the sampling path to the path the
// router was trained on, then softmax.
RouterFn net_router(Net router, NoisePath router_path, NoisePath sampling_path);

// The Bayes-optimal router of the training data itself: the exact posterior p(k | x_t, t, y) when
// x0 is drawn uniformly from the images of class y (all images for the null label) and x_t =
// alpha x0 + sigma eps: softmax over images of -|x_t - alpha x0_i|^2 / (2 sigma^2), summed per
// cluster. Costs one [B, N] x [N, D] product per call (N images of D pixels). x0 (float [N, ...]):
// what the experts learn, when not the images themselves: a latent ensemble's encoded images. The
// data is held, and the product computed, on `device`.
RouterFn oracle_router(const Dataset& data, const torch::Tensor& clusters, int64_t k, NoisePath sampling_path,
                       torch::Tensor x0 = {}, torch::Device device = torch::kCPU);

struct EnsembleUsage {
  int64_t calls = 0;                  // estimate() calls (solver evaluations, summed over batches)
  int64_t sample_evals = 0;           // samples x calls
  std::vector<int64_t> expert_evals;  // per expert: samples it was evaluated on, summed over calls
  int64_t padding_evals = 0;          // rows evaluated only to pad a group (set_group_quantum)
  std::vector<std::set<int64_t>> group_sizes;  // per expert: the batch sizes it was called with
  double router_flops = 0, expert_flops = 0;  // forward FLOPs spent, in total
};

// CUDA graphs of an ensemble of K experts sampling batches of `batch` (`ddm sample --ensemble
// --cuda-graphs`): each expert's group is padded to a multiple of batch / 4K rows. With the batch
// shared evenly each group is about 4 quanta, so the padding adds about an eighth of the rows,
// whatever K (a quarter of the batch, as before, doubled the rows of 4 even groups). An expert may
// see any of 4K sizes, each also with guidance's doubled batch and self-conditioning's first call:
// graphed_expert_graphs() bounds its graphs (model/graphed_net.h; they share one memory pool).
inline int64_t graphed_group_quantum(int64_t batch, int64_t k) {
  return std::max<int64_t>(1, (batch + 4 * k - 1) / (4 * k));
}
inline int64_t graphed_expert_graphs(int64_t k) { return 16 * k; }

class Ensemble {
 public:
  // experts[k]: expert k's denoiser, or nullopt when missing (its probability is set to 0 and the
  // rest renormalized); expert_flops[k]: its forward FLOPs per image; router_flops: per image.
  // device: where the experts and the router compute (samples arrive there); the routing decisions
  // are the same on every device up to the router's float32 rounding, `sample` routing's draws exactly.
  Ensemble(std::vector<std::optional<Denoiser>> experts, std::vector<double> expert_flops, RouterFn router,
           double router_flops, NoisePath sampling_path, int64_t num_classes, Routing routing, uint64_t seed,
           torch::Device device = torch::kCPU);

  // The routed, grouped estimate (see the file comment). x [B,C,H,W], t [B], guidance w; y: the labels
  // [B] (the router's condition) and, for text experts, the prompts' encodings (each expert's guidance
  // takes its own null text, Denoiser::set_null_text).
  // `sample` routing draws each sample's expert from its key (keys int64 [B], from the sampler; see
  // sampler.h) and the ensemble's seed, so the draw does not depend on the batch; without keys (a
  // direct call) from the seed, the number of this call and the row.
  Denoiser::Estimate estimate(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w,
                              const torch::Tensor& keys = {}) const;
  // Each sample evaluated by one given expert, experts [B] int64 (no router), with the labels as
  // given (the null label for unconditional) and no guidance: the teacher of distillation.
  Denoiser::Estimate estimate_assigned(const torch::Tensor& x, const torch::Tensor& t, const Cond& y,
                                       const torch::Tensor& experts) const;
  // Text experts: the unconditional branch of every expert's guidance takes this text condition
  // (context [1, T, D], context_mask [1, T], pooled [1, P]: the empty prompt's, make_ensemble sets it;
  // or a negative prompt's), and so does the router when the whole sample is unconditional (w = 0).
  void set_null_text(const Cond& null_text);
  // Pads each expert's group to a multiple of `rows` (0: exact groups, the default), so that an
  // expert is called with a few batch sizes only: what CUDA graphs of the experts' forward need
  // (`ddm sample --ensemble --cuda-graphs`: graphed_group_quantum above). The padding rows repeat
  // row 0 and their outputs are dropped; the real rows' estimates change only by the float rounding
  // of another batch size.
  void set_group_quantum(int64_t rows);
  // Side by side (the default): on a GPU, outside gradient recording, each expert's group runs on a
  // stream of its own (see the file comment), holding the working memory of all the experts' forward
  // passes at once rather than one's (`ddm sample --one-expert-at-a-time` turns it off). Off: one after
  // another on the caller's stream. The same bits either way, given the same convolution algorithms
  // (cuDNN's benchmark mode times them afresh in each process). Experts that share one network run one
  // after another, and so does every step after one that ran out of GPU memory side by side (said once
  // on stderr; that step's experts run again, one at a time).
  void set_side_by_side(bool on) { side_by_side_ = on; }
  // A Denoiser over this ensemble (which must outlive it).
  Denoiser denoiser() const;

  int64_t k() const { return static_cast<int64_t>(experts_.size()); }
  const EnsembleUsage& usage() const { return usage_; }
  void reset_usage();
  // "expert usage: 0 24.9% | 1 25.3% ..." and FLOPs per image (router share) for n images.
  std::string usage_report(int64_t n_images) const;

 private:
  // Mixes the experts with weights [B, K], grouped: each expert runs once on the samples it weighs.
  Denoiser::Estimate combine(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w,
                             const torch::Tensor& weights) const;
  std::vector<std::optional<Denoiser>> experts_;
  Cond null_text_;
  std::vector<double> expert_flops_;
  RouterFn router_;
  double router_flops_;
  NoisePath path_;
  int64_t num_classes_;
  Routing routing_;
  uint64_t seed_;
  torch::Device device_;
  torch::Tensor present_;  // float [K]: 1 where the expert exists
  int64_t quantum_ = 0;    // set_group_quantum
  bool side_by_side_ = true;
  bool shared_network_ = false;               // two experts with one network: never side by side
  mutable bool side_by_side_failed_ = false;  // out of memory side by side once: one at a time since
  mutable std::vector<std::shared_ptr<GraphStream>> streams_;  // per expert, made at its first side-by-side run
  mutable torch::Device streams_device_ = torch::kCPU;          // where they are
  mutable EnsembleUsage usage_;
};

}  // namespace ddm
