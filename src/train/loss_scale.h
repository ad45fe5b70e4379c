// Dynamic loss scaling for training in float16 (train.precision = fp16), the scheme of PyTorch's
// torch.amp.GradScaler with its defaults: the loss is multiplied by a scale S before backward, so that
// the small gradients of float16 activations do not flush to zero, and the float32 gradients are
// divided by S before the clip and the update. A step whose gradient is not finite (float16
// overflowed somewhere in backward, or in the forward) changes no weight and S halves; after
// kGrowthInterval finite steps in a row S doubles. With S a power of two both scalings are exact.
// The update rule is GradScaler's kernel's (at::_amp_update_scale_, which the tests compare against);
// it runs here on the host because the step reads its gradient norm back anyway.
// S and its counters are part of a run's state: saved in state.json and restored on resume, so that a
// resumed fp16 run repeats the uninterrupted one bit for bit.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace ddm {

class LossScale {
 public:
  static constexpr double kGrowth = 2.0, kBackoff = 0.5;  // GradScaler's growth_factor, backoff_factor
  static constexpr int64_t kGrowthInterval = 2000;        // GradScaler's growth_interval
  // A run stops after this many skipped steps in a row (S fell by 2^32): float16 cannot hold what
  // the model computes, whatever the scale (core/config.cpp's message says what to do).
  static constexpr int64_t kMaxSkipsInARow = 32;

  LossScale() = default;           // off: scale() is 1 and nothing changes it
  explicit LossScale(double init);  // on, starting at S = init (train.loss_scale)
  bool on() const { return on_; }
  double scale() const { return scale_; }
  // After a step's gradients are unscaled: `finite` whether the loss and the gradient were. Not
  // finite: S halves (the step is skipped). Otherwise kGrowthInterval finite steps in a row double S.
  void update(bool finite);
  int64_t good_steps() const { return good_; }        // finite steps since S last changed
  int64_t skips_in_a_row() const { return skips_; }   // steps skipped since the last finite one
  int64_t skips() const { return skips_total_; }      // steps skipped in this process's run so far

  // state.json's "loss_scale": {"scale", "good_steps", "skips_in_a_row"}; from_json names `origin`
  // (the checkpoint) when a field is missing or out of range.
  nlohmann::json to_json() const;
  void from_json(const nlohmann::json& j, const std::string& origin);
  // The same state as numbers, for broadcasting it from rank 0 on resume.
  void set(double scale, int64_t good_steps, int64_t skips_in_a_row);

 private:
  bool on_ = false;
  double scale_ = 1.0;
  int64_t good_ = 0, skips_ = 0, skips_total_ = 0;
};

}  // namespace ddm
