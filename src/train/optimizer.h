// FlatAdamW: all parameters of a model live as views into one flat buffer, and so do their
// gradients. AdamW, gradient clipping and the EMA then run as a handful of large tensor ops instead
// of several small ops per parameter tensor, which matters on CPU for models with many small layers.
// The update is torch.optim.AdamW's (decoupled weight decay, bias correction), through its fused kernel.
// Frozen parameters (requires_grad false) are not in the buffers: no gradient, no optimizer state, no
// EMA and no gradient sync; they are saved with the model and loaded like every other weight.
// Sharded (parallel.shard_optimizer, ZeRO stage 1): the EMA and both moments are held for one range
// of the flat buffer only, and step() updates only that range of the parameters; train/shard.h
// gathers the rest from the other data-parallel ranks, and assembles checkpoints from the ranges.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "train/checkpoint.h"
#include "train/loss_scale.h"

namespace ddm {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

// This rank's share of a sharded optimizer's state (parallel.shard_optimizer): rank `rank` of `world`
// keeps the EMA and moments of the flat range train/shard.h's shard_range gives; world 1: all of it.
struct ShardOf {
  int world = 1, rank = 0;
};

// The EMA decay of optimizer step n (n = 1 for a run's first step): `decay` (train.ema_decay) with the
// usual warm-up, min(decay, (1 + n) / (10 + n)), so that a short run's EMA is not dominated by the
// initial weights (0.18 at step 1, 0.5 at step 8, 0.9 at step 80). The one formula of every trainer:
// TrainStep, the pipeline runtime, and DiLoCo's EMA of the global weights.
double ema_decay_at(double decay, int64_t n);

class FlatAdamW {
 public:
  // Re-points every parameter of `module` (and its .grad) into flat buffers. A module without
  // trainable parameters is an error unless allow_empty (a pipeline stage of frozen layers only).
  // `shard`: the EMA and the moments are allocated for this rank's range alone (sharded()).
  FlatAdamW(torch::nn::Module& module, AdamWOptions opt, bool allow_empty = false, ShardOf shard = {});

  void zero_grad() { grad_.zero_(); }
  // Global L2 norm of the gradient, before clipping.
  double grad_norm() const;
  // Scales gradients so their global norm is at most max_norm; returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  // The same with a norm computed elsewhere (a pipeline stage: the norm over every stage's gradients).
  void clip_grad_norm(double max_norm, double norm);
  // One AdamW step at learning rate lr (LibTorch's fused AdamW kernel on the flat buffers); with
  // ema_decay >= 0 then also the EMA (ema = d * ema + (1 - d) * params).
  void step(double lr, double ema_decay = -1.0);

  // EMA of the parameters: ema = d * ema + (1 - d) * params.
  void ema_update(double decay);

  // Sharded (constructed with a ShardOf of world > 1): the EMA and both moments cover the flat range
  // [shard_begin(), shard_end()) only, and step() and ema_update() change only that range of the
  // parameters.
  bool sharded() const { return sharded_; }
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_; }

  // The clip and the update of a step with nothing read back to the host, for a step captured as a
  // CUDA graph (train/step_graph.cpp): the gradient's global norm, the clip to max_norm (<= 0: none),
  // then AdamW and the EMA, both skipped on the device when `loss` (a double []) or the norm is not
  // finite. lr (double [] on the CPU, float [] on a GPU: the fused kernel reads it so), step (float
  // [], the 1-based count this update makes) and ema_weight (float [], 1 - decay; undefined: no EMA)
  // are 0-dim tensors on the buffers' device that the caller fills before each run. Returns double
  // [2]: the norm before clipping, and 1 if the step was finite (else 0); the caller then counts a
  // finite step with count_step(). On the CPU the result equals clip_grad_norm + step bit for bit.
  torch::Tensor clip_and_step_on_device(const torch::Tensor& loss, double max_norm, const torch::Tensor& lr,
                                        const torch::Tensor& step, const torch::Tensor& ema_weight);
  void count_step() { ++step_; }

  int64_t step_count() const { return step_; }
  // train.precision = fp16: the dynamic loss scale of the steps this optimizer takes (off otherwise:
  // 1); saved and restored with the step count.
  LossScale& loss_scale() { return loss_scale_; }
  const LossScale& loss_scale() const { return loss_scale_; }
  // fp16: divides the gradient by the loss scale, leaving the gradient of the loss itself (exact
  // where the scale is a power of two); nothing without loss scaling.
  void unscale_grad() {
    if (loss_scale_.on()) grad_.mul_(1.0 / loss_scale_.scale());
  }
  // The trainable parameters in flat-buffer order, and the flat gradient their .grad views point into
  // (what gradient synchronization reduces).
  const std::vector<torch::Tensor>& params() const { return params_; }
  const torch::Tensor& flat_grad() const { return grad_; }
  const torch::Tensor& flat_params() const { return data_; }
  // Every flat buffer that makes up the optimizer's state (parameters, EMA, both moments), for
  // broadcasting it from one rank to the others; and the step counter that goes with them. Sharded:
  // the EMA and the moments are the shard's range [shard_begin(), shard_end()) only.
  std::vector<torch::Tensor> state_buffers() const { return {data_, ema_, exp_avg_, exp_avg_sq_}; }
  const torch::Tensor& flat_ema() const { return ema_; }
  const torch::Tensor& flat_exp_avg() const { return exp_avg_; }
  const torch::Tensor& flat_exp_avg_sq() const { return exp_avg_sq_; }
  void set_step_count(int64_t step) { step_ = step; }
  int64_t numel() const { return data_.numel(); }

  // Named views of the parameters / EMA, for checkpoints; and restoring from them (named_ema and
  // optimizer_state only unsharded: train/shard.h assembles a sharded optimizer's).
  TensorMap named_params() const { return views(data_); }
  TensorMap named_ema() const;
  TensorMap optimizer_state() const;
  // The trainable parameters' names, their offsets in the flat buffers and their shapes, in order.
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<std::vector<int64_t>>& shapes() const { return shapes_; }
  // Any flat buffer laid out like the parameters (e.g. DiLoCo's global weights), viewed by parameter
  // name; and the reverse: fills `flat` from src["<prefix><name>"], checking that every name is there
  // with the right shape (errors name `what`, the file, and `origin`, the checkpoint).
  TensorMap views(const torch::Tensor& flat) const;
  void fill_flat(const torch::Tensor& flat, const TensorMap& src, const std::string& prefix, const std::string& what,
                 const std::string& origin) const;
  // The same for the range [begin, end) of such a buffer: `range` (numel end - begin) takes the parts
  // of the named tensors that fall into it; every name is still checked.
  void fill_range(const torch::Tensor& range, int64_t begin, int64_t end, const TensorMap& src, const std::string& prefix,
                  const std::string& what, const std::string& origin) const;
  // The EMA and both moments of the range [begin, end) from a checkpoint's named tensors (or its flat
  // moments, as checkpoints of older versions hold them), into ema, exp_avg and exp_avg_sq (each
  // end - begin elements).
  void state_range(const TensorMap& ema_src, const TensorMap& optim_state, int64_t begin, int64_t end,
                   const torch::Tensor& ema, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq,
                   const std::string& origin) const;
  // Restores the state from named tensors (a checkpoint's); sharded: the EMA and moments of its range.
  void load(const TensorMap& params, const TensorMap& ema, const TensorMap& optim_state, int64_t step,
            const std::string& origin);

 private:
  AdamWOptions opt_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_;
  torch::Tensor data_, grad_, ema_, exp_avg_, exp_avg_sq_;  // float [P] (sharded: ema_ and the moments [end_ - begin_])
  int64_t step_ = 0;
  LossScale loss_scale_;
  bool sharded_ = false;
  int64_t begin_ = 0, end_ = 0;  // the range the EMA and the moments cover
};

// What load_module_state fills: every parameter and buffer (model.safetensors), or only the
// trainable parameters (ema.safetensors: frozen parameters have no EMA and keep their weights).
enum class LoadScope { kAll, kTrainable, kHeld };
// Loads named tensors into a module's parameters and buffers, checking names and shapes; errors
// name `origin` (the checkpoint) and the first mismatching tensor. kHeld: all but the frozen
// parameters with no elements (another pipeline stage's, whose weights this process let go).
void load_module_state(torch::nn::Module& module, const TensorMap& tensors, const std::string& origin,
                       LoadScope scope = LoadScope::kAll);
// Parameters and buffers of a module by name (contiguous copies).
TensorMap module_state(const torch::nn::Module& module);

}  // namespace ddm
