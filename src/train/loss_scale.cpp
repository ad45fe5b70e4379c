// Dynamic loss scaling (see loss_scale.h).
#include "train/loss_scale.h"

#include <cmath>
#include <string>

#include "core/error.h"

namespace ddm {

LossScale::LossScale(double init) : on_(true), scale_(init) {
  DDM_CHECK(std::isfinite(init) && init > 0, "train.loss_scale must be a finite number > 0, got " << init);
}

void LossScale::update(bool finite) {
  if (!on_) return;
  if (!finite) {
    scale_ *= kBackoff;
    good_ = 0;
    ++skips_;
    ++skips_total_;
    return;
  }
  skips_ = 0;
  if (++good_ == kGrowthInterval) {
    // As GradScaler: grow only where the grown scale is still finite.
    if (std::isfinite(scale_ * kGrowth)) scale_ *= kGrowth;
    good_ = 0;
  }
}

nlohmann::json LossScale::to_json() const {
  return {{"scale", scale_}, {"good_steps", good_}, {"skips_in_a_row", skips_}};
}

void LossScale::from_json(const nlohmann::json& j, const std::string& origin) {
  auto number = [&](const char* key) -> const nlohmann::json& {
    DDM_CHECK(j.is_object() && j.contains(key) && j[key].is_number(),
              origin << ": \"loss_scale\" needs a number \"" << key << "\" (an fp16 run's loss scale state), got "
                     << j.dump());
    return j[key];
  };
  const double s = number("scale").get<double>();
  const auto good = number("good_steps").get<int64_t>();
  const auto skips = number("skips_in_a_row").get<int64_t>();
  DDM_CHECK(std::isfinite(s) && s > 0 && good >= 0 && good < kGrowthInterval && skips >= 0,
            origin << ": \"loss_scale\" is out of range (scale > 0, 0 <= good_steps < " << kGrowthInterval
                   << ", skips_in_a_row >= 0): " << j.dump());
  set(s, good, skips);
}

void LossScale::set(double scale, int64_t good_steps, int64_t skips_in_a_row) {
  on_ = true;
  scale_ = scale;
  good_ = good_steps;
  skips_ = skips_in_a_row;
}

}  // namespace ddm
