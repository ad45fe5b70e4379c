// DiLoCo's outer loop (see diloco.h).
#include "parallel/diloco.h"

#include <algorithm>
#include <csignal>
#include <iostream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/run_dir.h"

namespace ddm {
namespace {

// A Comm error as the cause inside a DiLoCo message: without its "rank R: " prefix and without the
// conclusion a data-parallel job draws from it ("the job stops").
std::string cause(std::string m) {
  if (m.rfind("rank ", 0) == 0 && m.find(": ") != std::string::npos) m = m.substr(m.find(": ") + 2);
  const std::string stops = "; the job stops";
  if (const size_t at = m.find(stops); at != std::string::npos) m.erase(at, stops.size());
  return m;
}

// fp16: a replica's loss scale (train/loss_scale.h) and its optimizer's step count, which differ
// between replicas (each skips its own steps, and a skipped step takes no AdamW step), as double [4]
// (scale, good steps, skips in a row, optimizer step), to send; and back.
torch::Tensor scale_state(const FlatAdamW& o) {
  const LossScale& s = o.loss_scale();
  return torch::tensor({s.scale(), static_cast<double>(s.good_steps()), static_cast<double>(s.skips_in_a_row()),
                        static_cast<double>(o.step_count())},
                       torch::kDouble);
}
void set_scale(FlatAdamW& o, const torch::Tensor& t) {
  o.loss_scale().set(t[0].item<double>(), static_cast<int64_t>(t[1].item<double>()),
                     static_cast<int64_t>(t[2].item<double>()));
  o.set_step_count(static_cast<int64_t>(t[3].item<double>()));
}
// The same as a replica's entry of state.json's diloco.loss_scales, and back (`step`: the
// checkpoint's optimizer_step, for an entry without its own).
nlohmann::json scale_json(const torch::Tensor& t) {
  LossScale one;
  one.set(t[0].item<double>(), static_cast<int64_t>(t[1].item<double>()), static_cast<int64_t>(t[2].item<double>()));
  nlohmann::json j = one.to_json();
  j["optimizer_step"] = static_cast<int64_t>(t[3].item<double>());
  return j;
}
torch::Tensor scale_from_json(const nlohmann::json& j, int64_t step, const std::string& origin) {
  LossScale one;
  one.from_json(j, origin);
  if (j.contains("optimizer_step")) {
    DDM_CHECK(j["optimizer_step"].is_number_integer() && j["optimizer_step"].get<int64_t>() >= 0,
              origin << ": diloco.loss_scales: \"optimizer_step\" must be an integer >= 0, got " << j.dump());
    step = j["optimizer_step"].get<int64_t>();
  }
  return torch::tensor({one.scale(), static_cast<double>(one.good_steps()), static_cast<double>(one.skips_in_a_row()),
                        static_cast<double>(step)},
                       torch::kDouble);
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> Diloco::split_fragments(const std::vector<torch::Tensor>& params,
                                                                 int64_t fragments) {
  const int64_t n = static_cast<int64_t>(params.size());
  DDM_CHECK(fragments >= 1 && fragments <= n,
            "diloco.fragments = " << fragments << " but the model has only " << n
                                  << " parameter tensors to split among them; lower diloco.fragments");
  int64_t total = 0;
  for (const auto& p : params) total += p.numel();
  // Greedy on tensor boundaries: close fragment f once it reaches (f + 1) / F of the total, keeping
  // at least one tensor for each fragment still to come.
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t begin = 0, offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    offset += params[i].numel();
    const int64_t f = static_cast<int64_t>(out.size());
    const bool last_tensor = i + 1 == n;
    const bool must_close = n - (i + 1) == fragments - f - 1;  // one tensor left for each later fragment
    const bool reached = offset * fragments >= (f + 1) * total;
    if (last_tensor || (f + 1 < fragments && (must_close || reached))) {
      out.emplace_back(begin, offset);
      begin = offset;
    }
  }
  return out;
}

Diloco::Diloco(const DilocoConfig& cfg, std::shared_ptr<ElasticGroup> group, FlatAdamW& optim, double ema_decay,
               int64_t start_step)
    : cfg_(cfg), group_(std::move(group)), optim_(optim), ema_decay_(ema_decay) {
  DDM_CHECK(group_, "DiLoCo needs its group of replicas (one process is fine)");
  frags_ = split_fragments(optim_.params(), cfg_.fragments);
  global_ = optim_.flat_params().clone();
  momentum_ = torch::zeros_like(global_);
  last_sync_.assign(frags_.size(), start_step);
}

Diloco::Diloco(const DilocoConfig& cfg, std::shared_ptr<Comm> comm, FlatAdamW& optim, double ema_decay,
               int64_t start_step)
    : Diloco(cfg,
             std::make_shared<ElasticGroup>(comm, comm->world_size(),
                                            std::chrono::milliseconds(static_cast<int64_t>(cfg.peer_wait * 1000))),
             optim, ema_decay, start_step) {}

bool Diloco::launches_after(int64_t f, int64_t s) const {
  const int64_t offset = f * cfg_.inner_steps / static_cast<int64_t>(frags_.size());
  return s > 0 && (s + offset) % cfg_.inner_steps == 0;
}

void Diloco::restore(const torch::Tensor& global, const torch::Tensor& momentum, std::vector<int64_t> last_sync,
                     int64_t step) {
  DDM_CHECK(global.numel() == global_.numel() && momentum.numel() == momentum_.numel(),
            "DiLoCo state of " << global.numel() << " parameters for a model of " << global_.numel());
  global_.copy_(global.view({-1}));
  momentum_.copy_(momentum.view({-1}));
  if (last_sync.size() != frags_.size()) last_sync.assign(frags_.size(), step);
  last_sync_ = std::move(last_sync);
}

void Diloco::launch(int64_t f, int64_t done, int signal) {
  torch::NoGradGuard no_grad;
  ++round_;
  pending_ = f;
  pending_step_ = done;
  signal_ = signal;
  const auto [b, e] = frags_[f];
  // Pseudo-gradient of this replica: global - local.
  delta_ = global_.slice(0, b, e) - optim_.flat_params().slice(0, b, e);  // [e - b]
  try {
    // A group missing a replica takes in whoever asked to join, and sends them the state.
    if (!group_->complete() && !group_->admit(round_name()).empty()) transfer(kLaunching, done);
    issue();
  } catch (const Error& e) {
    // The group is broken (or a joiner vanished): finish() redoes the all-reduce in a new one.
    launch_error_ = e.what();
    work_.reset();
    flag_work_.reset();
  }
}

void Diloco::issue() {
  // On the host, for Gloo (on a GPU too: docs/gpu.md, "Backends", says why not NCCL).
  send_ = delta_.to(torch::kCPU, cfg_.wire == WireFormat::kFloat16 ? torch::kHalf : torch::kFloat, /*non_blocking=*/false,
                    /*copy=*/true);
  const double contributes = fresh_ ? 0.0 : 1.0;  // a joiner has no pseudo-gradient this round
  flags_ = torch::tensor({signal_ == SIGINT ? 1.0 : 0.0, signal_ != 0 && signal_ != SIGINT ? 1.0 : 0.0, contributes},
                         torch::kDouble);
  std::vector<at::Tensor> a{send_}, c{flags_};
  work_ = group_->comm().allreduce_async(a);
  flag_work_ = group_->comm().allreduce_async(c);
}

void Diloco::transfer(Phase phase, int64_t done) {
  torch::NoGradGuard no_grad;
  Comm& c = group_->comm();
  const int src = group_->source();
  const bool sender = c.rank() == src;
  // Everyone but the source receives into scratch: only the joiners (fresh_) adopt what arrives.
  const int64_t scaled = optim_.loss_scale().on() ? 1 : 0;  // fp16
  auto ints = torch::tensor({static_cast<int64_t>(phase), pending_, pending_step_, done, round_, optim_.step_count(),
                             static_cast<int64_t>(frags_.size()), scaled},
                            torch::kLong);
  c.broadcast(ints, src);
  DDM_CHECK(ints[6].item<int64_t>() == static_cast<int64_t>(frags_.size()),
            "rank " << c.job_rank() << ": the group synchronizes " << ints[6].item<int64_t>()
                    << " fragments and this replica " << frags_.size() << ": every replica must run the same config");
  DDM_CHECK(ints[7].item<int64_t>() == scaled,
            "rank " << c.job_rank() << ": the group trains " << (scaled ? "without" : "in fp16 with")
                    << " loss scaling and this replica " << (scaled ? "with it" : "without")
                    << ": every replica must run the same train.precision");
  auto last = torch::tensor(last_sync_, torch::kLong);
  c.broadcast(last, src);
  std::vector<torch::Tensor> state{global_, momentum_, optim_.flat_ema(), optim_.flat_exp_avg(), optim_.flat_exp_avg_sq()};
  std::vector<torch::Tensor> got;
  for (const auto& t : state) {
    torch::Tensor x = sender ? t : torch::empty_like(t);
    c.broadcast(x, src);
    got.push_back(x);
  }
  // fp16: a joiner goes on with the source's loss scale, as with its optimizer moments.
  torch::Tensor scale = scale_state(optim_);
  if (optim_.loss_scale().on()) c.broadcast(scale, src);
  if (transfer_hook_) transfer_hook_(c, src);
  if (!fresh_) return;
  joined_phase_ = static_cast<Phase>(ints[0].item<int64_t>());
  joined_done_ = ints[3].item<int64_t>();
  pending_ = ints[1].item<int64_t>();
  pending_step_ = ints[2].item<int64_t>();
  round_ = ints[4].item<int64_t>();
  optim_.set_step_count(ints[5].item<int64_t>());
  last_sync_.assign(last.data_ptr<int64_t>(), last.data_ptr<int64_t>() + last.numel());
  for (size_t i = 0; i < state.size(); ++i) state[i].copy_(got[i]);
  if (optim_.loss_scale().on()) set_scale(optim_, scale);
  optim_.flat_params().copy_(global_);  // the joiner starts from the global weights
  const auto [b, e] = frags_[pending_];
  delta_ = torch::zeros({e - b}, global_.options());
}

std::pair<int64_t, Diloco::Report> Diloco::rejoin(std::chrono::milliseconds wait, int64_t last) {
  fresh_ = true;
  const std::string round = group_->join(wait);
  if (round.empty()) return {-1, Report{}};  // the job finished before this replica was taken back
  DDM_CHECK(round.size() > 1 && round[0] == 's', "rank " << group_->job_rank() << ": admitted at '" << round
                                                         << "', which is not a synchronization");
  transfer(kLaunching, 0);  // a joiner's arguments are ignored: it takes the source's phase and step
  const int64_t done = joined_done_;
  Report report;
  issue();
  // The members finish this fragment now (no overlap, or they were redoing it after a failure), or
  // after their overlap: the joiner's loop then finishes it at the same step.
  if (joined_phase_ == kFinishing || cfg_.overlap == 0 || done == last) finish(done, done == last, report);
  report.stop = pending_ >= 0 ? 0 : agreed_stop_;
  return {done, report};
}

void Diloco::finish(int64_t done, bool final_sync, Report& report) {
  torch::NoGradGuard no_grad;
  const int64_t f = pending_;
  const std::string what = "DiLoCo outer all-reduce (fragment " + std::to_string(f) + ")";
  // Until it succeeds: a failed all-reduce (a replica died, hangs, or joined a broken group) is
  // redone in a new group of the survivors and of whoever asked to join meanwhile.
  std::string failure = launch_error_;
  launch_error_.clear();
  for (int tries = 0;; ++tries) {
    try {
      if (!failure.empty()) {
        DDM_CHECK(tries < 20, failure);
        std::cerr << "rank " << group_->job_rank() << ": step " << done << ": the synchronization failed ("
                  << cause(failure) << "); regrouping with the replicas that answer within diloco.peer_wait = "
                  << cfg_.peer_wait << " s" << std::endl;
        const auto joiners = group_->recover(round_name(), failure, true);
        std::cerr << "rank " << group_->job_rank() << ": step " << done << ": synchronizing with "
                  << group_->members().size() << " of " << group_->job_size() << " replicas" << std::endl;
        failure.clear();
        if (!joiners.empty()) transfer(kFinishing, done);
        issue();
      }
      group_->comm().wait(work_, what);
      group_->comm().wait(flag_work_, "DiLoCo outer all-reduce (stop flags)");
      // A replica lost mid-way can fail the all-reduce on some survivors and not on others: the
      // sums are applied only where every member has them, else every member redoes them.
      if (group_->completed_everywhere(round_name())) break;
      throw Error("another replica did not complete the " + what);
    } catch (const ElasticGroup::Fatal&) {
      throw;  // rank 0 is gone, or this replica was left out: no new group mends that
    } catch (const Error& e) {
      // A lost or hung replica, or one that vanished while the new group formed: regroup again.
      work_.reset();
      flag_work_.reset();
      failure = e.what();
    }
  }
  const auto [b, e] = frags_[f];
  const double contributors = std::max(1.0, flags_[2].item<double>());
  const torch::Tensor delta = send_.to(global_.device(), torch::kFloat).div_(contributors);  // the mean over the contributors
  // Outer Nesterov SGD, as torch.optim.SGD(nesterov=True, dampening=0): m = mu m + d; theta -= lr (d + mu m).
  torch::Tensor m = momentum_.slice(0, b, e), g = global_.slice(0, b, e);
  const double mu = cfg_.outer_momentum;
  m.mul_(mu).add_(delta);
  g.sub_(delta.add(m, mu), cfg_.outer_lr);
  // The EMA follows the global weights: every inner step since the last sync contributes its decay
  // (with the trainer's warm-up, ema_decay_at: train/optimizer.h, at optimizer step n).
  double keep = 1.0;
  for (int64_t n = last_sync_[f] + 1; n <= pending_step_; ++n) keep *= ema_decay_at(ema_decay_, n);
  optim_.flat_ema().slice(0, b, e).mul_(keep).add_(g, 1.0 - keep);
  torch::Tensor local = optim_.flat_params().slice(0, b, e);
  if (done == pending_step_ || final_sync || fresh_)
    local.copy_(g);
  else  // the replica trained on during the all-reduce: keep part of that progress
    local.mul_(cfg_.mix).add_(g, 1.0 - cfg_.mix);
  fresh_ = false;
  last_sync_[f] = pending_step_;
  ++syncs_;
  report.synced = true;
  // Every replica sees the same sums, so every replica agrees on the stop and on the step it stops at.
  const double sigint = flags_[0].item<double>(), sigterm = flags_[1].item<double>();
  if (sigint > 0) agreed_stop_ = SIGINT;
  else if (sigterm > 0 && agreed_stop_ == 0) agreed_stop_ = SIGTERM;
  pending_ = -1;
  work_.reset();
  flag_work_.reset();
}

Diloco::Report Diloco::after_step(int64_t done, int64_t last, int signal) {
  Report report;
  if (pending_ >= 0 && done >= pending_step_ + cfg_.overlap) finish(done, false, report);
  if (done == last) {
    // The run ends on global weights: every fragment not already synchronized after this very step.
    for (int64_t f = 0; f < static_cast<int64_t>(frags_.size()); ++f) {
      if (last_sync_[f] == done) continue;
      launch(f, done, signal);
      finish(done, true, report);
    }
    report.stop = agreed_stop_;
    return report;
  }
  for (int64_t f = 0; f < static_cast<int64_t>(frags_.size()); ++f) {
    if (!launches_after(f, done)) continue;
    DDM_CHECK(pending_ < 0, "DiLoCo: fragment " << f << " is due while fragment " << pending_
                                                 << " is still in flight (diloco.overlap too large)");
    launch(f, done, signal);
    if (cfg_.overlap == 0) finish(done, false, report);
  }
  // A stop is acted on only when nothing is in flight (the trainer then checkpoints): a stop that
  // arrived while this fragment's all-reduce ran waits for its result.
  report.stop = pending_ >= 0 ? 0 : agreed_stop_;
  return report;
}

DilocoReplicas Diloco::gather_replicas(int64_t step, const std::string& mine) {
  std::string failure;
  for (int tries = 0;; ++tries) {
    try {
      if (!failure.empty()) {
        DDM_CHECK(tries < 20, failure);
        std::cerr << "rank " << group_->job_rank() << ": step " << step << ": gathering the replicas for a checkpoint failed ("
                  << cause(failure) << "); saving the replicas that answer within diloco.peer_wait" << std::endl;
        group_->recover("c" + std::to_string(step), failure, false);  // joiners wait for the next sync
      }
      Comm& comm = group_->comm();
      DilocoReplicas r;
      r.params = comm.gather(optim_.flat_params(), 0);
      r.exp_avg = comm.gather(optim_.flat_exp_avg(), 0);
      r.exp_avg_sq = comm.gather(optim_.flat_exp_avg_sq(), 0);
      if (optim_.loss_scale().on()) r.loss_scales = comm.gather(scale_state(optim_), 0);
      if (comm.rank() == 0)
        for (int i = 0; i < comm.world_size(); ++i) r.ranks.push_back(comm.job_rank_of(i));
      r.records = comm.world_size() > 1 ? comm.all_gather_strings(mine) : std::vector<std::string>{mine};
      if (group_->completed_everywhere("c" + std::to_string(step))) return r;
      throw Error("another replica did not complete gathering the replicas for the checkpoint");
    } catch (const ElasticGroup::Fatal&) {
      throw;
    } catch (const Error& e) {
      failure = e.what();
    }
  }
}

void add_diloco_state(Checkpoint& ck, Diloco& diloco, const FlatAdamW& optim, const DilocoReplicas& replicas) {
  for (const auto& [name, t] : optim.views(diloco.global())) ck.model[name] = t;
  for (const auto& [name, t] : optim.views(diloco.momentum())) ck.optim["outer_momentum." + name] = t;
  for (size_t r = 0; r < replicas.params.size(); ++r) {
    const std::string prefix = "replica" + std::to_string(replicas.ranks[r]) + ".";
    for (const auto& [name, t] : optim.views(replicas.params[r])) ck.optim[prefix + "params." + name] = t;
    for (const auto& [name, t] : optim.views(replicas.exp_avg[r])) ck.optim[prefix + "exp_avg." + name] = t;
    for (const auto& [name, t] : optim.views(replicas.exp_avg_sq[r])) ck.optim[prefix + "exp_avg_sq." + name] = t;
  }
  ck.state["diloco"] = {{"world_size", diloco.group().job_size()},
                        {"replicas", replicas.ranks},
                        {"fragments", diloco.fragments().size()},
                        {"last_sync", diloco.last_sync()}};
  if (!replicas.loss_scales.empty()) {  // fp16: each replica's loss scale, in the order of "replicas"
    nlohmann::json scales = nlohmann::json::array();
    for (const torch::Tensor& t : replicas.loss_scales) scales.push_back(scale_json(t));
    ck.state["diloco"]["loss_scales"] = scales;
  }
}

void restore_diloco(Diloco& diloco, FlatAdamW& optim, Comm& comm, const Checkpoint* ck, int64_t step, bool quiet) {
  torch::NoGradGuard no_grad;
  const int world = comm.world_size();
  // Rank 0 says whether there is DiLoCo state to restore, and from how many replicas.
  const bool has = ck && ck->state.contains("diloco");
  // fp16: the checkpoint holds each replica's loss scale (one of another precision holds none: the
  // scales start at train.loss_scale, or rank 0's, which start_run gave every rank).
  const bool scales = has && optim.loss_scale().on() && ck->state["diloco"].contains("loss_scales");
  auto head = torch::tensor({has ? int64_t{1} : int64_t{0},
                             has ? ck->field<int64_t>("/diloco/world_size") : int64_t{0}, scales ? int64_t{1} : int64_t{0}},
                            torch::kLong);
  comm.broadcast(head, 0);
  if (head[0].item<int64_t>() == 0) {
    if (ck && !quiet)
      std::cout << "note: " << ck->state_path << " holds no DiLoCo state (a data-parallel run): every replica starts "
                   "from its weights, with zero outer momentum" << std::endl;
    return;
  }
  const int64_t old_world = head[1].item<int64_t>();
  const int64_t nfrag = static_cast<int64_t>(diloco.fragments().size());
  torch::Tensor momentum = torch::zeros_like(diloco.global());
  auto last = torch::full({nfrag}, step, torch::kLong);
  std::vector<std::vector<torch::Tensor>> parts(3);  // params, exp_avg, exp_avg_sq: one per replica
  std::vector<torch::Tensor> scale_parts;            // fp16: each replica's loss scale, double [3]
  if (ck) {
    const std::string origin = ck->state_path;
    DDM_CHECK(old_world >= 1, origin << ": diloco.world_size is " << old_world);
    optim.fill_flat(momentum, ck->optim, "outer_momentum.", RunDir::kOptim, origin);
    const auto stored = ck->field<std::vector<int64_t>>("/diloco/last_sync");
    if (static_cast<int64_t>(stored.size()) == nfrag)
      for (int64_t f = 0; f < nfrag; ++f) last[f] = stored[f];
    // The replicas the checkpoint holds (all, unless some were gone when it was written).
    std::vector<int64_t> held;
    if (ck->state.contains(nlohmann::json::json_pointer("/diloco/replicas")))
      held = ck->field<std::vector<int64_t>>("/diloco/replicas");
    else
      for (int64_t r = 0; r < old_world; ++r) held.push_back(r);
    DDM_CHECK(!held.empty(), origin << ": diloco.replicas is empty");
    const char* kinds[3] = {"params.", "exp_avg.", "exp_avg_sq."};
    const nlohmann::json* stored_scales = scales ? &ck->state["diloco"]["loss_scales"] : nullptr;
    DDM_CHECK(!stored_scales || (stored_scales->is_array() && stored_scales->size() == held.size()),
              origin << ": diloco.loss_scales must hold one entry per replica in diloco.replicas (" << held.size()
                     << ")");
    for (int r = 0; r < world; ++r) {
      const bool own = std::find(held.begin(), held.end(), r) != held.end();
      const int64_t from = own ? r : held[r % held.size()];
      const std::string prefix = "replica" + std::to_string(from) + ".";
      for (int k = 0; k < 3; ++k) {
        parts[k].push_back(torch::empty_like(diloco.global()));
        optim.fill_flat(parts[k].back(), ck->optim, prefix + kinds[k], RunDir::kOptim, origin);
      }
      if (stored_scales) {
        const size_t at = static_cast<size_t>(std::find(held.begin(), held.end(), from) - held.begin());
        scale_parts.push_back(scale_from_json((*stored_scales)[at], ck->field<int64_t>("/optimizer_step"), origin));
      }
    }
    if ((old_world != world || static_cast<int64_t>(held.size()) != old_world) && !quiet)
      std::cout << "note: the checkpoint holds " << held.size() << " of " << old_world
                << " DiLoCo replicas and this run has " << world
                << ": a replica it does not hold continues from one it does (docs/distributed.md)" << std::endl;
  }
  comm.broadcast(momentum, 0);
  comm.broadcast(last, 0);
  std::vector<int64_t> last_sync(last.data_ptr<int64_t>(), last.data_ptr<int64_t>() + nfrag);
  diloco.restore(diloco.global().clone(), momentum, last_sync, step);
  torch::Tensor outs[3] = {optim.flat_params(), optim.flat_exp_avg(), optim.flat_exp_avg_sq()};
  for (int k = 0; k < 3; ++k) comm.scatter(parts[k], outs[k], 0);
  if (head[2].item<int64_t>() != 0) {
    torch::Tensor mine = torch::empty({4}, torch::kDouble);
    comm.scatter(scale_parts, mine, 0);
    set_scale(optim, mine);
  }
}

}  // namespace ddm
