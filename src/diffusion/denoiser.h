// Denoiser: the one interface between a trained network and every sampler (and, later, the expert
// ensemble). Whatever the network was trained to predict (flow velocity, eps or v), the Denoiser
// returns the data estimate x0_hat and noise estimate eps_hat, both affine in the raw output F:
//   x0_hat  = c_skip * x + c_out * F,     eps_hat = e_skip * x + e_out * F
//   velocity dx/dt = dalpha(t) * x0_hat + dsigma(t) * eps_hat
// Classifier-free guidance is applied to F (equivalently to x0_hat / eps_hat, which are affine in F).
#pragma once
#include <functional>
#include <string>

#include <torch/types.h>

#include "core/config.h"
#include "diffusion/path.h"
#include "model/net.h"

namespace ddm {

enum class Prediction { kVelocity, kEps, kV };
Prediction prediction_for(const DiffusionConfig& cfg);  // flow -> velocity, eps -> eps, v -> v
std::string prediction_name(Prediction p);

struct Scalings {
  torch::Tensor c_skip, c_out, e_skip, e_out;  // each [B, 1, 1, 1]
};
// Scalings for a prediction type on a path at times t [B].
Scalings scalings(const NoisePath& path, Prediction pred, const torch::Tensor& t);

// The training target for the raw network output, given x0, eps and t [B]:
// velocity: dalpha x0 + dsigma eps (= eps - x0 for flow); eps: eps; v: alpha eps - sigma x0.
torch::Tensor training_target(const NoisePath& path, Prediction pred, const torch::Tensor& x0,
                              const torch::Tensor& eps, const torch::Tensor& t);

class Denoiser {
 public:
  struct Estimate {
    torch::Tensor x0;   // [B, C, H, W]
    torch::Tensor eps;  // [B, C, H, W]
  };
  // Any estimator of (x0_hat, eps_hat) at (x, t, y, guidance w) on `path`, e.g. a routed ensemble.
  // keys: int64 [B], one random key per sample for this evaluation (sampler.h), for an estimator that
  // draws at random per sample; undefined when the caller has none.
  using EstimateFn = std::function<Estimate(const torch::Tensor& x, const torch::Tensor& t, const Cond& y,
                                            double w, const torch::Tensor& keys)>;

  // num_classes: the null class index used for the unconditional branch (0 = unconditional model).
  Denoiser(Net net, NoisePath path, Prediction pred, int64_t num_classes);
  // A denoiser defined by an estimator on `path` (the samplers then integrate on that path) that
  // computes on `device` (where samplers put their noise).
  Denoiser(EstimateFn fn, NoisePath path, int64_t num_classes, torch::Device device = torch::kCPU);
  // x [B,C,H,W] at times t [B]; y the conditioning (labels int64 [B]; the unconditional branch of
  // guidance takes the null class and the null embedding, and keeps a control map); guidance scale w
  // (1 = conditional only, 0 = unconditional only). Counts one network evaluation (NFE) per call, whatever the batch. keys: as
  // for EstimateFn (a network ignores them).
  Estimate estimate(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w,
                    const torch::Tensor& keys = {}) const;
  // The probability-flow velocity dx/dt of an estimate at times t [B].
  torch::Tensor velocity(const Estimate& e, const torch::Tensor& t) const;
  // The probability-flow velocity dx/dt at (x, t).
  torch::Tensor velocity(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w,
                         const torch::Tensor& keys = {}) const;

  const NoisePath& path() const { return path_; }
  int64_t num_classes() const { return num_classes_; }
  // A self-conditioned network (model.self_cond): samplers pass each estimate's x0 to the next call.
  bool self_conditioned() const { return net_ && net_->self_conditioned(); }
  int64_t nfe() const { return nfe_; }
  // The network (null for an estimator): who shares one with whom.
  const NetImpl* network() const { return net_.get(); }
  void reset_nfe() { nfe_ = 0; }
  // Where the network computes (its parameters' device; an estimator's given device): samplers put their
  // noise there. bf16: its forward passes under bfloat16 autocast, the estimates in float32.
  torch::Device device() const;
  void set_precision(Precision p) { precision_ = p; }
  // Text models: the unconditional branch of guidance takes this text condition (context [1, T, D],
  // context_mask [1, T], pooled [1, P]: the empty prompt's encoding, or a negative prompt's) for every
  // row. Without it, guidance of a text-conditioned y is refused.
  void set_null_text(Cond null_text) { null_text_ = std::move(null_text); }

 private:
  torch::Tensor raw(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w) const;
  Net net_;
  EstimateFn fn_;
  NoisePath path_;
  Prediction pred_;
  int64_t num_classes_;
  Precision precision_ = Precision::kFp32;
  torch::Device fn_device_ = torch::kCPU;  // an estimator's
  Cond null_text_;
  mutable int64_t nfe_ = 0;
};

}  // namespace ddm
