// One optimization step of diffusion training — noise, times, label dropout, forward, loss,
// backward, clipping, AdamW, EMA — shared by the trainer and the training benchmark so that the
// benchmark measures exactly what training runs. All randomness comes from (seed, step).
// A router (model/router.h) trains through the same step: the same noisy x_t, times and label
// dropout as the experts, but the loss is the cross-entropy of its logits against the batch's
// clusters (Batch::k). A distilled student (train.teacher) trains through it too: its target is the
// teacher's estimate at the same x_t instead of the one made from the data.
#pragma once
#include <cstdint>
#include <functional>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/denoiser.h"
#include "model/net.h"
#include "train/optimizer.h"

namespace ddm {

struct StepResult {
  double loss = 0;
  double grad_norm = 0;  // before clipping
  double lr = 0;
  bool finite = true;    // false: loss or gradient not finite; no weight was changed
};

// Learning rate at a 0-based step: linear warm-up, then constant or cosine decay to 0.
double lr_at(const TrainConfig& t, int64_t step);

// The teacher of distillation: (x0_hat, eps_hat) at x_t [B,C,H,W] on the student's path, times t [B],
// labels y [B] (null = num_classes) and the examples' clusters k [B].
using TeacherFn = std::function<Denoiser::Estimate(const torch::Tensor& xt, const torch::Tensor& t,
                                                   const torch::Tensor& y, const torch::Tensor& k)>;

class DiffusionStep {
 public:
  // cfg.model must be resolved (in_channels, image_size, num_classes); net built from it.
  DiffusionStep(const RunConfig& cfg, Net net);
  StepResult run(const Batch& batch, int64_t step);
  // Distillation: regress the teacher's prediction (run without gradients) instead of the data's.
  void set_teacher(TeacherFn teacher) { teacher_ = std::move(teacher); }
  FlatAdamW& optim() { return optim_; }
  const Net& net() const { return net_; }

 private:
  RunConfig cfg_;
  Net net_;
  FlatAdamW optim_;
  NoisePath path_;
  Prediction pred_;
  bool router_;
  TeacherFn teacher_;
};

}  // namespace ddm
