// A pipeline-parallel training step (see runtime.h).
#include "pipeline/runtime.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "core/device.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "pipeline/partition.h"

namespace ddm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kMeasuredStep = 2;  // the fill plan is made from the run's second step

}  // namespace

std::vector<int> pipe_stage_bounds(NetImpl& net, const Prepared& sample, int stages,
                                   const std::vector<int64_t>& cuts, bool v_shaped) {
  const std::vector<NetUnit> units = net.units();
  const int L = static_cast<int>(units.size());
  DDM_CHECK(v_shaped || (stages >= 1 && stages <= L), "parallel.pp = " << stages << " stages, but the model has only " << L
                                                         << " units to split (`ddm plan` lists them): use at most " << L);
  DDM_CHECK(!v_shaped || stages <= L, "parallel.pp = " << stages / 2 << " V-shaped ranks run " << stages
                                                       << " stages, but the model has only " << L
                                                       << " units to split (`ddm plan` lists them): use at most " << L / 2);
  if (!cuts.empty()) {
    DDM_CHECK(static_cast<int>(cuts.size()) == stages - 1,
              "parallel.cuts has " << cuts.size() << " entries for " << stages << " stages; it needs " << stages - 1);
    std::vector<int> b{0};
    for (int64_t c : cuts) {
      DDM_CHECK(c > b.back() && c < L, "parallel.cuts = " << c << " is not a unit index in " << b.back() + 1 << ".."
                                                          << L - 1 << " (the model has " << L
                                                          << " units, each stage at least one)");
      b.push_back(static_cast<int>(c));
    }
    b.push_back(L);
    return b;
  }
  // Each unit's multiply-adds, estimated on one sample row as the larger of its parameters x the
  // positions of its output (pixels or tokens: a convolution's or linear layer's work) and its
  // output's size x its input's channels (the same for layers without trainable parameters, such as
  // a ControlNet's locked decoder); attention's quadratic term aside.
  torch::NoGradGuard no_grad;
  std::vector<PipeUnit> costs;
  NetCarry k{sample.xt.narrow(0, 0, 1), {}, {}};
  const torch::Tensor t = sample.t.narrow(0, 0, 1);
  Cond c = sample.cond;
  auto channels = [](const torch::Tensor& h) { return static_cast<double>(h.dim() == 4 ? h.size(1) : h.size(-1)); };
  for (const NetUnit& u : units) {
    const double in_channels = channels(k.h);
    u.run(k, t, c);
    double params = 0;
    for (const torch::Tensor& p : u.params) params += static_cast<double>(p.numel());
    const torch::Tensor& h = k.h;
    const double positions = h.dim() == 4 ? static_cast<double>(h.size(2) * h.size(3))
                                          : h.dim() == 3 ? static_cast<double>(h.size(1)) : 1.0;
    PipeUnit pu;
    pu.name = u.name;
    pu.forward = 1.0 + std::max(params * positions, static_cast<double>(h.numel()) * in_channels);
    costs.push_back(pu);
  }
  const std::vector<int> ones(static_cast<size_t>(stages), 1);
  const PipePartition p = v_shaped ? partition_units_v(costs, stages / 2, ones, std::numeric_limits<double>::infinity(), PipeLink{})
                                   : partition_units(costs, stages, ones, std::numeric_limits<double>::infinity(), PipeLink{});
  return p.first;
}

PipeStep::PipeStep(const RunConfig& cfg, Net net, std::shared_ptr<Objective> objective, std::shared_ptr<Comm> comm,
                   std::vector<int> bounds, PipeSchedule schedule, int64_t rows, std::shared_ptr<Comm> replicas,
                   std::shared_ptr<Comm> world, PipeSkipRoutes routes)
    : cfg_(cfg),
      net_(std::move(net)),
      objective_(std::move(objective)),
      comm_(std::move(comm)),
      replicas_(replicas && replicas->world_size() > 1 ? std::move(replicas) : nullptr),
      world_(world ? std::move(world) : comm_),
      bounds_(std::move(bounds)),
      schedule_(std::move(schedule)),
      routes_(std::move(routes)),
      rank_(comm_->rank()),
      rows_(rows) {
  DDM_CHECK(objective_, "PipeStep needs an objective");
  DDM_CHECK(rows_ >= 1, "pipeline: micro-batches of " << rows_ << " rows; a micro-batch needs at least one");
  const int S = stages(), R = static_cast<int>(schedule_.ranks.size());
  DDM_CHECK(R == comm_->world_size() && S == schedule_.stages,
            "a pipeline of " << S << " stages under schedule '" << schedule_.name << "' needs " << R
                             << " processes and a schedule of " << S << " stages (got " << comm_->world_size()
                             << " processes, a schedule of " << schedule_.stages << ")");
  validate_schedule(schedule_);
  if (routes_.in.empty()) routes_.in.assign(static_cast<size_t>(S), {});  // no routes: every skip carried
  DDM_CHECK(static_cast<int>(routes_.in.size()) == S && (routes_.out.empty() || static_cast<int>(routes_.out.size()) == S - 1),
            "pipeline: skip routes for " << routes_.in.size() << " stages, not " << S);
  for (const torch::Tensor& p : net_->parameters()) {
    device_ = p.device();  // the model's (every stage builds the whole model there)
    break;
  }
  wire_ = std::make_unique<PipeWire>(comm_, schedule_, routes_.slots, cfg_.parallel.pipe_wire == WireFormat::kBfloat16, device_);
  // Every trainable parameter of the whole model, by name, before the other stages' are frozen.
  std::map<const void*, std::string> name_of;
  std::vector<const void*> all_impls;
  for (const auto& p : net_->named_parameters()) {
    if (!p.value().requires_grad()) continue;
    name_of[p.value().unsafeGetTensorImpl()] = p.key();
    index_of_[p.key()] = all_names_.size();
    all_names_.push_back(p.key());
    all_shapes_.push_back(p.value().sizes().vec());
    all_impls.push_back(p.value().unsafeGetTensorImpl());
  }
  std::vector<NetUnit> all = net_->units();
  DDM_CHECK(bounds_.front() == 0 && bounds_.back() == static_cast<int>(all.size()),
            "pipeline stage bounds must cover units 0.." << all.size() - 1);
  std::map<const void*, bool> mine;
  std::map<const void*, int> owner_rank;  // each parameter's rank in this pipeline
  std::map<int, std::pair<std::vector<NetUnit>, std::vector<torch::Tensor>>> here_units;  // per stage here: units, params
  needs_.assign(static_cast<size_t>(R), PrepNeeds{});  // per rank: what its stages read
  needs_[static_cast<size_t>(rank_of(0))].xt = needs_[static_cast<size_t>(rank_of(S - 1))].target = true;
  for (int u = 0; u < static_cast<int>(all.size()); ++u) {
    unit_names_.push_back(all[static_cast<size_t>(u)].name);
    const int owner = static_cast<int>(std::upper_bound(bounds_.begin(), bounds_.end(), u) - bounds_.begin()) - 1;
    if (all[static_cast<size_t>(u)].reads_frozen) needs_[static_cast<size_t>(rank_of(owner))].frozen = true;
    const bool here = rank_of(owner) == rank_;
    for (const torch::Tensor& p : all[static_cast<size_t>(u)].params) {
      mine[p.unsafeGetTensorImpl()] = here;
      owner_rank[p.unsafeGetTensorImpl()] = rank_of(owner);
    }
    if (here) {
      auto& [units, params] = here_units[owner];
      for (const torch::Tensor& p : all[static_cast<size_t>(u)].params)
        if (p.requires_grad()) params.push_back(p);
      units.push_back(std::move(all[static_cast<size_t>(u)]));
    }
  }
  for (auto& p : net_->parameters()) {
    if (!p.requires_grad()) continue;
    auto it = mine.find(p.unsafeGetTensorImpl());
    DDM_CHECK(it != mine.end(), "parameter " << name_of[p.unsafeGetTensorImpl()] << " belongs to no unit of the model");
    if (!it->second) {
      // Another stage's: no gradient, no optimizer state, and no weights here (they come and go by
      // name through gather_view / send_own / share), so a stage holds its share of the model, not the whole.
      p.set_requires_grad(false);
      p.set_data(torch::empty({0}, p.options()));
    }
  }
  for (const void* impl : all_impls) all_owners_.push_back(owner_rank.at(impl));  // each checked above: in a unit
  const TrainConfig& tc = cfg_.train;
  // A stage may hold no trainable parameter at all (a ControlNet's locked decoder): it still runs
  // its units' forward and input gradients.
  optim_ = std::make_unique<FlatAdamW>(*net_, AdamWOptions{tc.beta1, tc.beta2, tc.adam_eps, tc.weight_decay},
                                       /*allow_empty=*/true);
  // fp16: every stage keeps the same loss scale, changed by the same agreed decisions.
  if (tc.precision == Precision::kFp16) optim_->loss_scale() = LossScale(tc.loss_scale);
  for (auto& [stage, up] : here_units)  // ascending
    locals_.emplace_back(stage, S, std::move(up.first), std::move(up.second), *wire_, routes_, rows_);
  quantum_ = prepare_quantum(rows_);
  if (tc.self_cond > 0) first_pass_ = std::make_unique<PipeFirstPass>(*objective_, *wire_, S, rows_, quantum_);
  if (replicas_) {
    // Averaged during the stage's last backward (hooks enabled for it alone), as data parallelism
    // with gradient accumulation does.
    sync_ = std::make_shared<GradSync>(replicas_, optim_->params(), optim_->flat_grad(),
                                       grad_sync_options(cfg_.parallel));
    sync_->set_enabled(false);
  }
}

PipeStage& PipeStep::local(int stage) {
  for (PipeStage& l : locals_)
    if (l.stage() == stage) return l;
  DDM_FAIL("pipeline: stage " << stage << " does not run on rank " << rank_);
}

void PipeStep::forward(PipeStage& l, int micro) {
  Prepared& p = prep_[static_cast<size_t>(micro)];
  if (l.stage() == 0 && first_pass_) first_pass_->estimate(micro, p);
  Autocast autocast(device_, cfg_.train.precision);  // bf16: the units in bfloat16, the loss in float32
  const torch::Tensor out = l.forward(micro, p);
  if (!l.last()) return;
  const torch::Tensor loss = objective_->loss(out, p);  // []
  loss_sum_ += loss.item<double>();
  const double backward_scale = scale_ * optim_->loss_scale().scale();  // fp16: the loss scale on top
  l.set_loss(micro, backward_scale == 1.0 ? loss : loss * backward_scale);
}

void PipeStep::first_pass(PipeStage& l, int m, int64_t first, int64_t rows, bool filling, bool serial) {
  wire_->note_arrival(Clock::now());
  if (filling) complete(m);
  {
    Autocast autocast(device_, cfg_.train.precision);
    first_pass_->run(l, m, prep_[static_cast<size_t>(m)], first, rows);
  }
  PipeAction a;
  a.op = PipeOp::kTask, a.stage = -1, a.micro = m, a.task = 1 + l.stage(), a.rows = rows, a.serial = serial;
  events_.push_back({a, ms_since_start(wire_->arrived()), ms_since_start(Clock::now())});
}

StepResult PipeStep::run(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) {
  const int M = static_cast<int>(micro.size());
  DDM_CHECK(M == schedule_.micro, "pipeline: " << M << " micro-batches for a schedule of " << schedule_.micro);
  DDM_CHECK(next.empty() || static_cast<int>(next.size()) == M,
            "pipeline: the next step has " << next.size() << " micro-batches, not " << M);
  for (const Batch& b : micro) DDM_CHECK(b.x.size(0) == rows_, "pipeline: a micro-batch of " << b.x.size(0) << " rows, not " << rows_);
  times_.start = Clock::now();
  const TrainConfig& tc = cfg_.train;
  StepResult r;
  r.lr = lr_at(tc, step);
  optim_->zero_grad();
  scale_ = 1.0 / M;
  loss_sum_ = 0;
  fill_news_ = false;
  prep_.assign(static_cast<size_t>(M), Prepared{});
  wire_->begin_step();
  const bool filling = plan_ && plan_->used;
  // Before the prepare phase: the carries may arrive while it runs. A window of S micro-batches:
  // enough to keep the transfers ahead of the forwards, and at most S carry buffers held at once.
  for (PipeStage& l : locals_) l.begin_step(M, stages());
  prepare(micro, step, filling, !next.empty());
  times_.prepared = times_.backward_start = Clock::now();
  events_.clear();
  auto ms = [&](Clock::time_point t) { return ms_since_start(t); };
  const std::vector<PipeAction>& actions = (filling ? plan_->fill.schedule : schedule_).ranks[static_cast<size_t>(rank_)];
  // The last action that accumulates weight gradients (B, or W for a split backward): the replicas'
  // all-reduce starts from its hooks, bucket by bucket.
  size_t last_weights = actions.size();
  for (size_t i = 0; i < actions.size(); ++i)
    if (actions[i].op == PipeOp::kBackward || actions[i].op == PipeOp::kWeightGrad) last_weights = i;
  if (sync_) sync_->set_enabled(false);
  // Self-conditioning's first passes: actions of the fill plan when it placed them (tasks 1 + s),
  // else a sweep of every micro-batch through this process's stages after this step's serial
  // prepare pieces (each stage's passes in micro-batch order, a V's earlier stage first).
  if (first_pass_) first_pass_->begin_step(micro, step);
  bool sweep_done = !first_pass_ || filling;  // a fill plan holds every first pass, serial or not
  for (size_t i = 0; i < actions.size(); ++i) {
    const PipeAction& a = actions[i];
    if (!sweep_done && !(a.op == PipeOp::kTask && a.task == 0 && a.serial)) {
      for (PipeStage& l : locals_)
        for (int m = 0; m < M; ++m) first_pass(l, m, 0, rows_, filling, /*serial=*/true);
      sweep_done = true;
    }
    // (Two stages here: the last action accumulates one stage's gradients alone; the replicas' sync
    // then runs after every action, not overlapped.)
    if (sync_ && i == last_weights && locals_.size() == 1) sync_->set_enabled(true);
    const Clock::time_point t0 = Clock::now();
    wire_->note_arrival(t0);  // a receive moves it on: the action's work starts once its input has arrived
    if (a.op == PipeOp::kTask && a.task > 0) {
      first_pass(local(a.task - 1), a.micro, pass_first_.at(i), a.rows, filling, a.serial);
      continue;  // (it records its own event)
    } else if (a.op == PipeOp::kTask) {
      const size_t piece = static_cast<size_t>(piece_at_.at(i));
      if (pieces_[piece].ahead && next.empty()) continue;  // the run's last step: no next step to prepare
      run_piece(piece, micro, next, step);
    } else if (a.op == PipeOp::kForward) {
      if (filling) complete(a.micro);
      forward(local(a.stage), a.micro);
    } else {
      local(a.stage).backward(a.micro, a.op);
    }
    // On a GPU an action ends when its kernels do: the timeline and the fill plan's measurements
    // are the device's time, not the time to launch it.
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    events_.push_back({a, ms(wire_->arrived()), ms(Clock::now())});
  }
  if (filling) {
    for (Incoming& in : incoming_)
      if (!in.done) receive(in);  // the next step's rows the other stages prepared
    incoming_.clear();
    if (!next.empty()) ahead_step_ = step + 1;
  }
  wire_->wait_sends();
  if (sync_ && locals_.size() == 1) sync_->finish();  // the replicas' gradients averaged
  if (sync_ && locals_.size() > 1) sync_->sync_now();
  times_.backward_end = Clock::now();
  // The loss (the mean of the replicas' last stages) and the squared gradient norm (a sum over the
  // stages' disjoint parts, once: replica 0's; after the average every replica holds the same).
  optim_->unscale_grad();  // fp16: this stage's gradient of the loss itself
  const double norm_here = optim_->grad_norm();
  const double replicas = replicas_ ? replicas_->world_size() : 1;
  auto sums = torch::tensor({rank_of(stages() - 1) == rank_ ? loss_sum_ * scale_ / replicas : 0.0,
                             replica() == 0 ? norm_here * norm_here : 0.0},
                            torch::kDouble);
  world_->allreduce_sum(sums);
  r.loss = sums[0].item<double>();
  r.grad_norm = std::sqrt(sums[1].item<double>());
  times_.synced = Clock::now();
  optim_->clip_grad_norm(tc.grad_clip, r.grad_norm);
  times_.clipped = times_.end = Clock::now();
  const bool finite = std::isfinite(r.loss) && std::isfinite(r.grad_norm);  // the same on every rank
  settle_loss_scale(optim_->loss_scale(), finite, r);
  if (!finite) {
    r.finite = false;
    return r;
  }
  optim_->step(r.lr, ema_decay_at(tc.ema_decay, optim_->step_count() + 1));
  times_.end = Clock::now();
  if (!filling || !next.empty())
    shown_times_ = times_, shown_events_ = events_, shown_step_ = step + 1, shown_filled_ = filling;
  // The plan is made from the second step (the first warms up), by every stage at once.
  if (++steps_run_ == kMeasuredStep && cfg_.parallel.fill && !plan_) measure_and_plan();
  return r;
}

double PipeStep::ms_since_start(Clock::time_point t) const {
  return std::chrono::duration<double, std::milli>(t - times_.start).count();
}

std::string PipeStep::last_step_json() const {
  auto ms = [&](Clock::time_point t) { return std::chrono::duration<double, std::milli>(t - shown_times_.start).count(); };
  PipeTimelineRank r;
  r.stage = rank_;
  r.step = shown_step_;
  r.filled = shown_filled_;
  r.start_ms = std::chrono::duration<double, std::milli>(shown_times_.start.time_since_epoch()).count();
  r.prepared_ms = ms(shown_times_.prepared);
  r.actions_ms = ms(shown_times_.backward_end);
  r.synced_ms = ms(shown_times_.synced);
  r.end_ms = ms(shown_times_.end);
  r.events = shown_events_;
  r.with_stage = schedule_.several_per_rank();
  return timeline_rank_json(r);
}

TensorMap PipeStep::gather_view(const TensorMap& mine, const std::string& prefix) const {
  // Point to point, one message per parameter, received only as the writer reaches it: an
  // all-reduce of zero-padded copies held the whole model's state on every stage at once (a
  // 2-stage ControlNet ran out of memory), and receiving a whole part held it on rank 0 (SD 2.1's).
  TensorMap out;
  for (size_t i = 0; i < all_names_.size(); ++i) {
    const std::string name = prefix + all_names_[i];
    if (all_owners_[i] == comm_->rank()) {
      auto it = mine.find(name);
      DDM_CHECK(it != mine.end(), "pipeline: stage tensor '" << name << "' is missing from this stage's state");
      out[name] = it->second;
    } else {
      out[name] = torch::empty(all_shapes_[i], torch::TensorOptions().dtype(torch::kFloat).device(torch::kMeta));
    }
  }
  return out;
}

torch::Tensor PipeStep::fetch(const std::string& name, const std::string& prefix, int slot) {
  torch::NoGradGuard no_grad;
  auto it = name.rfind(prefix, 0) == 0 ? index_of_.find(name.substr(prefix.size())) : index_of_.end();
  DDM_CHECK(it != index_of_.end(), "pipeline: no parameter '" << name << "' to gather");
  const size_t i = it->second;
  torch::Tensor t = torch::empty(all_shapes_[i], torch::kFloat);
  comm_->wait(comm_->recv_async(t, all_owners_[i], slot * static_cast<int>(all_names_.size()) + static_cast<int>(i)),
              "assembling the stages' state for a checkpoint");
  return t;
}

void PipeStep::send_own(const TensorMap& mine, const std::vector<std::string>& prefixes, int first_slot) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> held;  // host copies being sent (a Gloo send needs its tensor alive)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t k = 0; k < prefixes.size(); ++k) {
    const int slot = first_slot + static_cast<int>(k);
    DDM_CHECK(slot >= 0 && slot < kSlots, "pipeline: gathering slot " << slot << " out of range");
    for (size_t i = 0; i < all_names_.size(); ++i) {
      if (all_owners_[i] != comm_->rank()) continue;
      const std::string name = prefixes[k] + all_names_[i];
      auto it = mine.find(name);
      DDM_CHECK(it != mine.end(), "pipeline: stage tensor '" << name << "' is missing from this stage's state");
      held.push_back(it->second.detach().to(torch::kCPU, torch::kFloat).contiguous());
      works.push_back(comm_->send_async(held.back(), 0, slot * static_cast<int>(all_names_.size()) + static_cast<int>(i)));
    }
  }
  for (const auto& w : works) comm_->wait(w, "assembling the stages' state for a checkpoint");
}

TensorMap PipeStep::share(const TensorMap& whole, const std::string& prefix, const std::string& origin) {
  // The reverse: stage 0 checks the whole, then sends each stage only its own parameters.
  torch::NoGradGuard no_grad;
  std::string error;  // stage 0's: every stage learns of it first, so none is left waiting
  if (comm_->rank() == 0) {
    for (size_t i = 0; i < all_names_.size() && error.empty(); ++i) {
      auto it = whole.find(prefix + all_names_[i]);
      if (it == whole.end() || it->second.sizes().vec() != all_shapes_[i]) {
        std::ostringstream os;
        os << origin << " has no tensor '" << prefix << all_names_[i] << "' of shape "
           << at::IntArrayRef(all_shapes_[i]) << ": it belongs to a different model";
        error = os.str();
      }
    }
  }
  if (comm_->max_int(error.empty() ? 0 : 1) != 0) {
    DDM_CHECK(error.empty(), error);
    DDM_FAIL("stage 0 could not load " << origin << " (its message says why)");
  }
  TensorMap out;
  std::vector<torch::Tensor> held;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < all_names_.size(); ++i) {
    const std::string name = prefix + all_names_[i];
    const int owner = all_owners_[i], tag = static_cast<int>(i);
    if (comm_->rank() == 0) {
      const torch::Tensor& t = whole.at(name);
      if (owner == 0) {
        out[name] = t;
      } else {
        held.push_back(t.detach().to(torch::kCPU, torch::kFloat).contiguous());
        works.push_back(comm_->send_async(held.back(), owner, tag));
      }
    } else if (owner == comm_->rank()) {
      torch::Tensor t = torch::empty(all_shapes_[i], torch::kFloat);
      works.push_back(comm_->recv_async(t, 0, tag));
      out[name] = t;
    }
  }
  for (const auto& w : works) comm_->wait(w, "sending each stage its state from " + origin);
  return out;
}

void PipeStep::share_with_replicas() {
  if (!replicas_) return;
  torch::NoGradGuard no_grad;
  for (torch::Tensor t : optim_->state_buffers()) replicas_->broadcast(t, 0);
}

}  // namespace ddm
