// One training step in phases (see step.h).
#include "train/step.h"

#include <cmath>
#include <sstream>

#include <torch/autograd.h>

#include "core/device.h"
#include "core/error.h"
#include "model/recompute.h"
#include "train/shard.h"

namespace ddm {

void settle_loss_scale(LossScale& scale, bool finite, StepResult& r) {
  if (!scale.on()) return;
  r.loss_scale = scale.scale();
  scale.update(finite);
  r.overflow = !finite;
  r.overflows_in_a_row = scale.skips_in_a_row();
}

double lr_at(const TrainConfig& t, int64_t step) {
  double lr = t.lr;
  if (t.warmup > 0 && step < t.warmup) return lr * static_cast<double>(step + 1) / t.warmup;
  if (t.lr_schedule == "cosine") {
    const double p = static_cast<double>(step - t.warmup) / std::max<int64_t>(1, t.steps - t.warmup);
    lr *= 0.5 * (1.0 + std::cos(3.14159265358979323846 * std::min(1.0, p)));
  }
  return lr;
}

TrainStep::TrainStep(const RunConfig& cfg, Net net, std::shared_ptr<Objective> objective, ShardOf shard)
    : cfg_(cfg),
      net_(std::move(net)),
      optim_(*net_, {cfg.train.beta1, cfg.train.beta2, cfg.train.adam_eps, cfg.train.weight_decay}, false, shard),
      objective_(std::move(objective)) {
  DDM_CHECK(objective_, "TrainStep needs an objective");
  forward_net_ = net_;
  if (cfg.train.precision == Precision::kFp16) optim_.loss_scale() = LossScale(cfg.train.loss_scale);
  if (cfg.train.checkpoint_activations) {
    try {
      (void)net_->units();
    } catch (const Error& e) {
      DDM_FAIL("train.checkpoint_activations: " << e.what() << "; turn it off for this model");
    }
    forward_net_ = std::make_shared<RecomputedNetImpl>(net_);
  }
  if (cfg.train.cuda_graphs) {
    const torch::Device device = optim_.flat_params().device();
    DDM_CHECK(device.is_cuda(), "train.cuda_graphs needs a CUDA GPU, but this run's model is on "
                                    << device << ": turn train.cuda_graphs off, or set train.device = cuda");
    DDM_CHECK(!cfg.train.checkpoint_activations,
              "train.cuda_graphs with train.checkpoint_activations is not supported: turn one of them off");
    graph_ = make_step_graph(device);
  }
}

void TrainStep::set_data_parallel(std::shared_ptr<Comm> comm, std::shared_ptr<GradSync> sync) {
  comm_ = std::move(comm);
  sync_ = std::move(sync);
}

Prepared TrainStep::prepare(const Batch& micro, int64_t step) {
  torch::NoGradGuard no_grad;  // prepare: draws, x_t, target (a distillation teacher runs here)
  Prepared p = objective_->prepare(micro, step);
  Autocast autocast(optim_.flat_params().device(), cfg_.train.precision);
  objective_->self_condition(*net_, p, micro.first, step);  // train.self_cond: a first pass of the model
  p.cond = net_->precompute(p.xt, p.t, p.cond);  // the network's frozen part (a ControlNet's locked encoder)
  times_.prepared = std::chrono::steady_clock::now();
  return p;
}

torch::Tensor TrainStep::forward_backward(const Prepared& p, double scale, const torch::Tensor& scale_t) {
  torch::Tensor loss;
  {
    Autocast autocast(optim_.flat_params().device(), cfg_.train.precision);  // bf16: the forward in bfloat16, the loss in float32
    loss = objective_->forward_loss(*forward_net_, p);  // forward + loss, [] (checkpointed: unit by unit)
  }
  // Backward even when the loss is not finite: with data parallelism every rank must take part in
  // the gradient all-reduce; the non-finite gradient then stops the step on every rank alike.
  times_.backward_start = std::chrono::steady_clock::now();
  (scale_t.defined() ? loss * scale_t : scale == 1.0 ? loss : loss * scale).backward();
  times_.backward_end = std::chrono::steady_clock::now();
  return loss.detach().to(torch::kDouble);  // [], on the device: read once per step, not per micro-batch
}

namespace {

// A micro-batch's identity for prepare ahead: the memory its images start at, their shape and their
// position in the global batch (the stash keeps that memory alive, so no other batch can take it).
std::string identity(const Batch& b) {
  std::ostringstream s;
  s << b.x.data_ptr() << " " << b.x.sizes() << " " << b.first;
  return s.str();
}

}  // namespace

std::vector<Prepared> TrainStep::prepared_for(const std::vector<Batch>& micro, int64_t step, bool lazy) {
  Ahead ahead = std::move(ahead_);
  ahead_ = Ahead();
  bool same = ahead.step == step && ahead.of.size() == micro.size();
  for (size_t i = 0; same && i < micro.size(); ++i) same = ahead.of[i] == identity(micro[i]);
  if (same) {
    ++ahead_used_;
    times_.prepared = times_.start;
    return std::move(ahead.prepared);
  }
  std::vector<Prepared> out;
  if (!lazy)
    for (const Batch& b : micro) out.push_back(prepare(b, step));
  return out;
}

void TrainStep::prepare_ahead(const std::vector<Batch>& next, int64_t step) {
  if (next.empty()) return;
  const auto prepared = times_.prepared;  // this step's, for benchmarks and timelines
  Ahead a;
  a.step = step;
  for (const Batch& b : next) {
    a.of.push_back(identity(b));
    a.keep.push_back(b.x);  // the identity's memory stays this batch's
    a.prepared.push_back(prepare(b, step));
  }
  ahead_ = std::move(a);
  times_.prepared = prepared;
}

StepResult TrainStep::run(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) {
  DDM_CHECK(!micro.empty(), "TrainStep::run: no micro-batches");
  if (graph_) return run_graphed(micro, step, next);
  times_.start = std::chrono::steady_clock::now();
  std::vector<Prepared> ahead = prepared_for(micro, step, /*lazy=*/true);
  optim_.zero_grad();
  // Equal micro-batches: the mean of their mean losses is the mean over all their samples. fp16: the
  // loss scale on top (finish() divides the gradient by it again).
  const double scale = 1.0 / static_cast<double>(micro.size());
  const double backward_scale = scale * optim_.loss_scale().scale();
  torch::Tensor loss_sum;  // [] double, where the model is
  for (size_t i = 0; i < micro.size(); ++i) {
    // Gradient sync: only the last micro-batch's backward all-reduces (its buckets launch from the
    // gradient hooks while backward still runs); the others accumulate locally.
    if (sync_) sync_->set_enabled(i + 1 == micro.size());
    const torch::Tensor l = forward_backward(ahead.empty() ? prepare(micro[i], step) : std::move(ahead[i]), backward_scale);
    loss_sum = i == 0 ? l : loss_sum + l;
  }
  const StepResult r = finish(loss_sum, scale, step);
  // After the update it reads (self-conditioning's first pass); a skipped fp16 step changed nothing.
  if (r.finite || r.overflow) prepare_ahead(next, step + 1);
  return r;
}

StepResult TrainStep::finish(const torch::Tensor& loss_sum, double scale, int64_t step) {
  const TrainConfig& tc = cfg_.train;
  StepResult r;
  r.lr = lr_at(tc, step);
  r.loss = loss_sum.item<double>() * scale;
  if (sync_) sync_->finish();  // gradients are now the average over every rank's samples
  if (comm_ && comm_->distributed()) {
    // The loss over the global batch; every rank then decides alike whether the step is finite.
    auto l = torch::tensor({r.loss}, torch::kDouble);
    comm_->allreduce_sum(l);
    r.loss = l.item<double>() / comm_->world_size();
  }
  optim_.unscale_grad();  // fp16: the gradient of the loss itself
  times_.synced = std::chrono::steady_clock::now();
  // Clip by the global norm: after the all-reduce every rank holds the same (global) gradient, so
  // every rank decides alike whether the step is finite (and, in fp16, how the scale changes).
  r.grad_norm = optim_.clip_grad_norm(tc.grad_clip);
  times_.clipped = times_.end = std::chrono::steady_clock::now();
  const bool finite = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  settle_loss_scale(optim_.loss_scale(), finite, r);
  if (!finite) {
    r.finite = false;
    return r;
  }
  // EMA with the usual warm-up so short runs are not dominated by the initial weights.
  optim_.step(r.lr, ema_ ? ema_decay_at(tc.ema_decay, optim_.step_count() + 1) : -1.0);
  if (optim_.sharded()) gather_parameters(*comm_, optim_);  // each rank updated its range alone
  times_.end = std::chrono::steady_clock::now();
  return r;
}

}  // namespace ddm
