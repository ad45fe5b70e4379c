// DiLoCo's outer loop (see diloco.h).
#include "train/diloco.h"

#include <algorithm>
#include <csignal>
#include <iostream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/run_dir.h"

namespace ddm {

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

Diloco::Diloco(const DilocoConfig& cfg, std::shared_ptr<Comm> comm, FlatAdamW& optim, double ema_decay,
               int64_t start_step)
    : cfg_(cfg), comm_(std::move(comm)), optim_(optim), ema_decay_(ema_decay) {
  DDM_CHECK(comm_, "DiLoCo needs a process group (one process is fine)");
  frags_ = split_fragments(optim_.params(), cfg_.fragments);
  global_ = optim_.flat_params().clone();
  momentum_ = torch::zeros_like(global_);
  last_sync_.assign(frags_.size(), start_step);
}

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
  const auto [b, e] = frags_[f];
  // Pseudo-gradient of this replica: global - local.
  torch::Tensor delta = global_.slice(0, b, e) - optim_.flat_params().slice(0, b, e);  // [e - b]
  send_ = cfg_.wire == "float16" ? delta.to(torch::kHalf) : delta;
  flags_ = torch::tensor({signal == SIGINT ? 1.0 : 0.0, signal != 0 && signal != SIGINT ? 1.0 : 0.0}, torch::kDouble);
  std::vector<at::Tensor> a{send_}, c{flags_};
  work_ = comm_->allreduce_async(a);
  flag_work_ = comm_->allreduce_async(c);
  pending_ = f;
  pending_step_ = done;
}

void Diloco::finish(int64_t done, bool final_sync, Report& report) {
  torch::NoGradGuard no_grad;
  comm_->wait(work_, "DiLoCo outer all-reduce (fragment " + std::to_string(pending_) + ")");
  comm_->wait(flag_work_, "DiLoCo outer all-reduce (stop flags)");
  const int64_t f = pending_;
  const auto [b, e] = frags_[f];
  const torch::Tensor delta = send_.to(torch::kFloat).div_(static_cast<double>(comm_->world_size()));  // mean
  // Outer Nesterov SGD, as torch.optim.SGD(nesterov=True, dampening=0): m = mu m + d; theta -= lr (d + mu m).
  torch::Tensor m = momentum_.slice(0, b, e), g = global_.slice(0, b, e);
  const double mu = cfg_.outer_momentum;
  m.mul_(mu).add_(delta);
  g.sub_(delta.add(m, mu), cfg_.outer_lr);
  // The EMA follows the global weights: every inner step since the last sync contributes its decay
  // (with the trainer's warm-up, min(d, (1 + n) / (10 + n)) at optimizer step n).
  double keep = 1.0;
  for (int64_t n = last_sync_[f] + 1; n <= pending_step_; ++n)
    keep *= std::min(ema_decay_, (1.0 + n) / (10.0 + n));
  optim_.flat_ema().slice(0, b, e).mul_(keep).add_(g, 1.0 - keep);
  torch::Tensor local = optim_.flat_params().slice(0, b, e);
  if (done == pending_step_ || final_sync)
    local.copy_(g);
  else  // the replica trained on during the all-reduce: keep part of that progress
    local.mul_(cfg_.mix).add_(g, 1.0 - cfg_.mix);
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

DilocoReplicas gather_replicas(const FlatAdamW& optim, Comm& comm) {
  DilocoReplicas r;
  r.params = comm.gather(optim.flat_params(), 0);
  r.exp_avg = comm.gather(optim.flat_exp_avg(), 0);
  r.exp_avg_sq = comm.gather(optim.flat_exp_avg_sq(), 0);
  return r;
}

void add_diloco_state(Checkpoint& ck, const Diloco& diloco, const FlatAdamW& optim, const DilocoReplicas& replicas) {
  for (const auto& [name, t] : optim.views(diloco.global())) ck.model[name] = t;
  for (const auto& [name, t] : optim.views(diloco.momentum())) ck.optim["outer_momentum." + name] = t;
  for (size_t r = 0; r < replicas.params.size(); ++r) {
    const std::string prefix = "replica" + std::to_string(r) + ".";
    for (const auto& [name, t] : optim.views(replicas.params[r])) ck.optim[prefix + "params." + name] = t;
    for (const auto& [name, t] : optim.views(replicas.exp_avg[r])) ck.optim[prefix + "exp_avg." + name] = t;
    for (const auto& [name, t] : optim.views(replicas.exp_avg_sq[r])) ck.optim[prefix + "exp_avg_sq." + name] = t;
  }
  ck.state["diloco"] = {{"world_size", replicas.params.size()},
                        {"fragments", diloco.fragments().size()},
                        {"last_sync", diloco.last_sync()}};
}

void restore_diloco(Diloco& diloco, FlatAdamW& optim, Comm& comm, const Checkpoint* ck, int64_t step, bool quiet) {
  torch::NoGradGuard no_grad;
  const int world = comm.world_size();
  // Rank 0 says whether there is DiLoCo state to restore, and from how many replicas.
  const bool has = ck && ck->state.contains("diloco");
  auto head = torch::tensor({has ? int64_t{1} : int64_t{0},
                             has ? ck->field<int64_t>("/diloco/world_size") : int64_t{0}}, torch::kLong);
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
  if (ck) {
    const std::string origin = ck->state_path;
    DDM_CHECK(old_world >= 1, origin << ": diloco.world_size is " << old_world);
    optim.fill_flat(momentum, ck->optim, "outer_momentum.", RunDir::kOptim, origin);
    const auto stored = ck->field<std::vector<int64_t>>("/diloco/last_sync");
    if (static_cast<int64_t>(stored.size()) == nfrag)
      for (int64_t f = 0; f < nfrag; ++f) last[f] = stored[f];
    const char* kinds[3] = {"params.", "exp_avg.", "exp_avg_sq."};
    for (int r = 0; r < world; ++r) {
      const std::string prefix = "replica" + std::to_string(r % old_world) + ".";
      for (int k = 0; k < 3; ++k) {
        parts[k].push_back(torch::empty_like(diloco.global()));
        optim.fill_flat(parts[k].back(), ck->optim, prefix + kinds[k], RunDir::kOptim, origin);
      }
    }
    if (old_world != world && !quiet)
      std::cout << "note: the checkpoint holds " << old_world << " DiLoCo replicas and this run has " << world
                << ": replica r continues from replica r mod " << old_world << "'s inner state" << std::endl;
  }
  comm.broadcast(momentum, 0);
  comm.broadcast(last, 0);
  std::vector<int64_t> last_sync(last.data_ptr<int64_t>(), last.data_ptr<int64_t>() + nfrag);
  diloco.restore(diloco.global().clone(), momentum, last_sync, step);
  torch::Tensor outs[3] = {optim.flat_params(), optim.flat_exp_avg(), optim.flat_exp_avg_sq()};
  for (int k = 0; k < 3; ++k) comm.scatter(parts[k], outs[k], 0);
}

}  // namespace ddm
