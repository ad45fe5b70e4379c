// FlatAdamW and module state helpers (see optimizer.h).
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include <ATen/ops/_fused_adamw.h>

#include "core/error.h"
#include "core/run_dir.h"
#include "train/shard.h"

namespace ddm {
namespace {
std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}
}  // namespace

double ema_decay_at(double decay, int64_t n) {
  const double x = static_cast<double>(n);
  return std::min(decay, (1.0 + x) / (10.0 + x));
}

FlatAdamW::FlatAdamW(torch::nn::Module& module, AdamWOptions opt, bool allow_empty, ShardOf shard) : opt_(opt) {
  auto params = module.named_parameters(/*recurse=*/true);
  int64_t total = 0;
  for (const auto& p : params) {
    if (!p.value().requires_grad()) continue;
    names_.push_back(p.key());
    shapes_.push_back(p.value().sizes().vec());
    offsets_.push_back(total);
    total += p.value().numel();
  }
  DDM_CHECK(total > 0 || allow_empty, "the model has no trainable parameters");
  // The buffers live where the parameters do (the model is moved to its device before this).
  torch::Device device(torch::kCPU);
  for (const auto& p : params)
    if (p.value().requires_grad()) {
      device = p.value().device();
      break;
    }
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  data_ = torch::empty({total}, f32);
  grad_ = torch::zeros({total}, f32);
  torch::NoGradGuard no_grad;
  size_t i = 0;
  for (const auto& p : params) {
    if (!p.value().requires_grad()) continue;
    torch::Tensor param = p.value();
    DDM_CHECK(param.device() == device && param.scalar_type() == torch::kFloat,
              "FlatAdamW: parameter '" << p.key() << "' is " << param.scalar_type() << " on " << param.device()
                                       << ", the others float on " << device << " (move the whole model first)");
    auto slot = data_.narrow(0, offsets_[i], param.numel()).view(param.sizes());
    slot.copy_(param);
    param.set_data(slot);
    // Autograd accumulates into an existing .grad in place, so gradients land in grad_.
    param.mutable_grad() = grad_.narrow(0, offsets_[i], param.numel()).view(param.sizes());
    params_.push_back(param);
    ++i;
  }
  // Sharded: only this rank's range is ever allocated (a whole copy first would be the peak the
  // sharding is there to avoid).
  const ShardRange range = shard_range(total, shard.world, shard.rank);
  sharded_ = shard.world > 1;
  begin_ = range.begin, end_ = range.end;
  ema_ = data_.narrow(0, begin_, end_ - begin_).clone();
  exp_avg_ = torch::zeros({end_ - begin_}, f32);
  exp_avg_sq_ = torch::zeros({end_ - begin_}, f32);
}

double FlatAdamW::grad_norm() const { return grad_.norm().item<double>(); }

double FlatAdamW::clip_grad_norm(double max_norm) {
  const double norm = grad_norm();
  clip_grad_norm(max_norm, norm);
  return norm;
}

void FlatAdamW::clip_grad_norm(double max_norm, double norm) {
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) grad_.mul_(max_norm / (norm + 1e-6));
}

void FlatAdamW::step(double lr, double ema_decay) {
  torch::NoGradGuard no_grad;
  ++step_;
  // LibTorch's fused AdamW kernel (what torch.optim.AdamW(fused=True) runs: the same update as
  // torch.optim.AdamW, decoupled weight decay and bias correction from the step count) over the
  // flat buffers at once: one vectorized pass, 2.7x-4.0x faster than a scalar loop of ours on the
  // presets (docs/results.md, "What LibTorch 2.11 does that ddm wrote by hand"). Elementwise, so
  // the result does not depend on the thread count.
  // (On a GPU the kernel reads the step count from device memory.)
  // Sharded: the shard's range of the parameters and gradients (the whole buffers otherwise).
  const torch::Tensor step = torch::full({}, static_cast<double>(step_), data_.options());
  const torch::Tensor data = data_.narrow(0, begin_, end_ - begin_), grad = grad_.narrow(0, begin_, end_ - begin_);
  at::_fused_adamw_({data}, {grad}, {exp_avg_}, {exp_avg_sq_}, {}, {step}, lr, opt_.beta1, opt_.beta2,
                    opt_.weight_decay, opt_.eps, /*amsgrad=*/false, /*maximize=*/false);
  if (ema_decay >= 0) ema_.lerp_(data, 1.0 - ema_decay);  // ema = d * ema + (1 - d) * params
}

torch::Tensor FlatAdamW::clip_and_step_on_device(const torch::Tensor& loss, double max_norm, const torch::Tensor& lr,
                                                  const torch::Tensor& step, const torch::Tensor& ema_weight) {
  torch::NoGradGuard no_grad;
  DDM_CHECK(!sharded_, "a step captured as a CUDA graph cannot update a sharded optimizer (parallel.shard_optimizer)");
  // As clip_grad_norm: the float norm, compared and divided in double, the factor rounded to float.
  const torch::Tensor norm = grad_.norm().to(torch::kDouble);  // []
  const torch::Tensor norm_finite = torch::isfinite(norm);
  const torch::Tensor finite = norm_finite.logical_and(torch::isfinite(loss));  // bool []
  if (max_norm > 0) {
    // (max_norm / x written as a division: LibTorch's scalar / tensor is a reciprocal and a product.)
    const torch::Tensor factor = torch::full_like(norm, max_norm).div(norm + 1e-6);
    const torch::Tensor clip = norm_finite.logical_and(norm.gt(max_norm));
    grad_.mul_(torch::where(clip, factor, torch::ones_like(norm)).to(torch::kFloat));  // x 1 leaves a gradient as it is
  }
  // The fused kernel does nothing where found_inf is 1: no AdamW step, no moment changes.
  const torch::Tensor found_inf = finite.logical_not().to(torch::kFloat);
  at::_fused_adamw_({data_}, {grad_}, {exp_avg_}, {exp_avg_sq_}, {}, {step}, lr, opt_.beta1, opt_.beta2,
                    opt_.weight_decay, opt_.eps, /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/{}, found_inf);
  if (ema_weight.defined()) ema_.lerp_(data_, ema_weight * finite.to(torch::kFloat));  // weight 0: ema unchanged
  return torch::stack({norm, finite.to(torch::kDouble)});  // [2]
}

void FlatAdamW::ema_update(double decay) {
  torch::NoGradGuard no_grad;
  ema_.mul_(decay).add_(data_.narrow(0, begin_, end_ - begin_), 1.0 - decay);
}

TensorMap FlatAdamW::named_ema() const {
  DDM_CHECK(!sharded_, "FlatAdamW::named_ema: the EMA is sharded (train/shard.h assembles it)");
  return views(ema_);
}

TensorMap FlatAdamW::views(const torch::Tensor& flat) const {
  TensorMap out;
  for (size_t i = 0; i < names_.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : shapes_[i]) n *= d;
    out[names_[i]] = flat.narrow(0, offsets_[i], n).view(shapes_[i]);
  }
  return out;
}

// Moments by parameter name ("exp_avg.<param>", "exp_avg_sq.<param>"), so that a checkpoint does not
// depend on the order of the flat buffer (another stage split, frozen parts added).
TensorMap FlatAdamW::optimizer_state() const {
  DDM_CHECK(!sharded_, "FlatAdamW::optimizer_state: the moments are sharded (train/shard.h assembles them)");
  TensorMap out;
  for (const auto& [name, t] : views(exp_avg_)) out["exp_avg." + name] = t;
  for (const auto& [name, t] : views(exp_avg_sq_)) out["exp_avg_sq." + name] = t;
  return out;
}

void FlatAdamW::fill_flat(const torch::Tensor& flat, const TensorMap& src, const std::string& prefix,
                          const std::string& what, const std::string& origin) const {
  torch::NoGradGuard no_grad;
  auto dst = views(flat);
  for (const auto& [name, t] : dst) {
    auto it = src.find(prefix + name);
    DDM_CHECK(it != src.end(), origin << ": " << what << " has no tensor '" << prefix + name
                                      << "': the checkpoint belongs to a different model (check model.preset)");
    DDM_CHECK(it->second.sizes() == t.sizes(),
              origin << ": " << what << " tensor '" << prefix + name << "' has shape "
                     << shape_str(it->second.sizes()) << " but the model expects " << shape_str(t.sizes())
                     << ": the checkpoint belongs to a different model shape");
    t.copy_(it->second);
  }
}

void FlatAdamW::fill_range(const torch::Tensor& range, int64_t begin, int64_t end, const TensorMap& src,
                           const std::string& prefix, const std::string& what, const std::string& origin) const {
  torch::NoGradGuard no_grad;
  DDM_CHECK(range.numel() == end - begin, "FlatAdamW::fill_range: " << range.numel() << " elements for [" << begin
                                                                     << ", " << end << ")");
  for (size_t i = 0; i < names_.size(); ++i) {
    const std::string& name = names_[i];
    auto it = src.find(prefix + name);
    DDM_CHECK(it != src.end(), origin << ": " << what << " has no tensor '" << prefix + name
                                      << "': the checkpoint belongs to a different model (check model.preset)");
    DDM_CHECK(it->second.sizes() == at::IntArrayRef(shapes_[i]),
              origin << ": " << what << " tensor '" << prefix + name << "' has shape "
                     << shape_str(it->second.sizes()) << " but the model expects " << shape_str(shapes_[i])
                     << ": the checkpoint belongs to a different model shape");
    const int64_t a = std::max(begin, offsets_[i]), b = std::min(end, offsets_[i] + it->second.numel());
    if (a < b) range.narrow(0, a - begin, b - a).copy_(it->second.reshape({-1}).narrow(0, a - offsets_[i], b - a));
  }
}

void FlatAdamW::state_range(const TensorMap& ema_src, const TensorMap& optim_state, int64_t begin, int64_t end,
                            const torch::Tensor& ema, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq,
                            const std::string& origin) const {
  torch::NoGradGuard no_grad;
  fill_range(ema, begin, end, ema_src, "", RunDir::kEma, origin);
  const bool legacy = optim_state.count("exp_avg") != 0;  // before moments were saved by name: two flat tensors
  if (legacy) {
    for (const char* k : {"exp_avg", "exp_avg_sq"}) {
      auto it = optim_state.find(k);
      DDM_CHECK(it != optim_state.end() && it->second.numel() == data_.numel(),
                origin << ": " << RunDir::kOptim << " '" << k << "' is missing or has the wrong size");
    }
    exp_avg.copy_(optim_state.at("exp_avg").view({-1}).narrow(0, begin, end - begin));
    exp_avg_sq.copy_(optim_state.at("exp_avg_sq").view({-1}).narrow(0, begin, end - begin));
  } else {
    fill_range(exp_avg, begin, end, optim_state, "exp_avg.", RunDir::kOptim, origin);
    fill_range(exp_avg_sq, begin, end, optim_state, "exp_avg_sq.", RunDir::kOptim, origin);
  }
}

void FlatAdamW::load(const TensorMap& params, const TensorMap& ema, const TensorMap& optim_state, int64_t step,
                     const std::string& origin) {
  torch::NoGradGuard no_grad;
  fill_flat(data_, params, "", RunDir::kModel, origin);
  state_range(ema, optim_state, begin_, end_, ema_, exp_avg_, exp_avg_sq_, origin);
  step_ = step;
}

void load_module_state(torch::nn::Module& module, const TensorMap& tensors, const std::string& origin,
                       LoadScope scope) {
  torch::NoGradGuard no_grad;
  auto load_one = [&](const std::string& name, torch::Tensor& dst) {
    auto it = tensors.find(name);
    DDM_CHECK(it != tensors.end(), origin << " has no tensor '" << name
                                          << "': it belongs to a different model (check model.preset)");
    DDM_CHECK(it->second.sizes() == dst.sizes(),
              origin << ": tensor '" << name << "' has shape " << shape_str(it->second.sizes())
                     << " but the model expects " << shape_str(dst.sizes())
                     << ": the checkpoint belongs to a different model shape");
    // A checksum only proves the file is what was written; weights that were already NaN or inf
    // (written by a diverged run, or edited) would sample black images without complaint.
    if (it->second.is_floating_point()) {
      const int64_t bad = it->second.numel() - torch::isfinite(it->second).sum().item<int64_t>();
      DDM_CHECK(bad == 0, origin << ": tensor '" << name << "' holds " << bad << " non-finite value"
                                 << (bad == 1 ? "" : "s") << " (NaN or inf) of " << it->second.numel()
                                 << "; these weights are unusable: use an earlier checkpoint");
    }
    dst.copy_(it->second);
  };
  for (auto& p : module.named_parameters(true)) {
    const bool let_go = !p.value().requires_grad() && p.value().numel() == 0;
    if (scope == LoadScope::kAll || (scope == LoadScope::kHeld && !let_go) || p.value().requires_grad())
      load_one(p.key(), p.value());
  }
  if (scope == LoadScope::kTrainable) return;
  for (auto& b : module.named_buffers(true)) {
    if (tensors.count(b.key())) load_one(b.key(), b.value());
  }
}

TensorMap module_state(const torch::nn::Module& module) {
  TensorMap out;
  for (const auto& p : module.named_parameters(true)) out[p.key()] = p.value().detach().contiguous();
  for (const auto& b : module.named_buffers(true)) out[b.key()] = b.value().detach().contiguous();
  return out;
}

}  // namespace ddm
