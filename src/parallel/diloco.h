// DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al. 2025): the outer loop around
// a replica's ordinary training steps. Every process is a replica with its own inner AdamW state
// (train/optimizer.h); all replicas hold the same global weights. After a fragment's inner_steps
// inner steps its pseudo-gradient (global - local weights) is averaged over the replicas, an outer
// Nesterov-momentum SGD step updates the global weights of that fragment, and the replica continues
// from them (with overlap, from a mix of them and its own weights, since it went on training while
// the all-reduce ran). The EMA follows the global weights. Nothing else is communicated: no gradient
// sync, no loss all-reduce; stop requests (signals) travel with each synchronization.
//
// Schedule (steps counted from 1): fragment f of F has offset o_f = f * H / F and launches after
// every step s with (s + o_f) % H == 0; its result is applied after step s + overlap. After the last
// step of the run every fragment synchronizes, without overlap and without mixing, so the run ends on
// global weights.
//
// Faults (comm/elastic.h): a synchronization whose all-reduce fails (a replica died or hangs) is
// redone by the survivors in a new group, after waiting up to diloco.peer_wait for the missing;
// the dead replica's pseudo-gradient is dropped for that round (the mean is over the replicas that
// contributed). A restarted replica asks to join; it is admitted at the next synchronization, where
// the lowest surviving replica sends it the global weights, the outer momentum, its own inner state
// and the step, and it contributes nothing to that round.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "comm/comm.h"
#include "comm/elastic.h"
#include "core/config.h"
#include <functional>
#include "train/checkpoint.h"
#include "train/optimizer.h"

namespace ddm {

struct DilocoReplicas {  // every replica's inner state, on rank 0 (empty on the others)
  std::vector<torch::Tensor> params, exp_avg, exp_avg_sq;
  // fp16 (train/loss_scale.h): each replica's loss scale and optimizer step count, double [4] (scale,
  // good steps, skips in a row, optimizer step); empty without loss scaling.
  std::vector<torch::Tensor> loss_scales;
  std::vector<int> ranks;  // their job ranks
  std::vector<std::string> records;  // each replica's `mine` (gather_replicas), on every replica
};

class Diloco {
 public:
  // The global weights start as optim's current parameters (identical on every replica).
  // ema_decay: train.ema_decay (the EMA takes every inner step's decay, applied at each sync).
  // group: the replicas (a job of one process needs none: pass the one-process Comm's group).
  Diloco(const DilocoConfig& cfg, std::shared_ptr<ElasticGroup> group, FlatAdamW& optim, double ema_decay,
         int64_t start_step);
  // Convenience for a fixed group: every replica of `comm`.
  Diloco(const DilocoConfig& cfg, std::shared_ptr<Comm> comm, FlatAdamW& optim, double ema_decay,
         int64_t start_step);

  // What the trainer adds to the state a joining replica receives (its data cursor): called on
  // every member of the new group with the group and the sending group rank; a broadcast inside.
  void set_transfer_hook(std::function<void(Comm&, int source)> hook) { transfer_hook_ = std::move(hook); }
  ElasticGroup& group() { return *group_; }

  // [begin, end) ranges of the flat parameter buffer, on parameter-tensor boundaries, of about equal
  // size; every parameter lies in exactly one. Errors if there are more fragments than tensors.
  static std::vector<std::pair<int64_t, int64_t>> split_fragments(const std::vector<torch::Tensor>& params,
                                                                  int64_t fragments);
  const std::vector<std::pair<int64_t, int64_t>>& fragments() const { return frags_; }
  // Whether fragment f launches its synchronization after step s (1-based count of done steps).
  bool launches_after(int64_t f, int64_t s) const;

  // What the replicas agreed on at a synchronization that completed after this step.
  struct Report {
    bool synced = false;  // a fragment's outer step was applied after this step
    int stop = 0;         // a signal some replica received (SIGINT wins over SIGTERM); 0: none
  };
  // Call after every inner step: `done` steps are complete, `last` is the run's final step, and
  // `signal` the signal this process received (0: none). Finishes the fragment whose overlap ends
  // now, launches the fragments due now and applies outer steps; after `last`, every fragment not
  // synchronized at `last` synchronizes. A stop is reported only when nothing is left in flight.
  Report after_step(int64_t done, int64_t last, int signal);
  // A restarted replica (DistEnv::rejoin): waits up to `wait` to be admitted, takes the state the
  // group sends and its part in that synchronization; returns the step the group is at (the
  // trainer continues after it) and what was agreed there.
  std::pair<int64_t, Report> rejoin(std::chrono::milliseconds wait, int64_t last);
  bool in_flight() const { return pending_ >= 0; }

  // Checkpoint state: global weights, outer momentum (flat, laid out like the parameters) and the
  // step of each fragment's last synchronization (for the EMA's decay since then).
  const torch::Tensor& global() const { return global_; }
  const torch::Tensor& momentum() const { return momentum_; }
  const std::vector<int64_t>& last_sync() const { return last_sync_; }
  // Restores them (identical on every replica); last_sync of another length (the fragment count
  // changed) is replaced by `step` for every fragment.
  void restore(const torch::Tensor& global, const torch::Tensor& momentum, std::vector<int64_t> last_sync,
               int64_t step);
  int64_t syncs() const { return syncs_; }  // outer steps applied (all fragments) in this process
  // Collective over the replicas that are there (a dead one is left out after diloco.peer_wait):
  // every replica sends its local weights and moments to rank 0, for the checkpoint of `step`, and
  // `mine` to every replica.
  DilocoReplicas gather_replicas(int64_t step, const std::string& mine = "");

 private:
  enum Phase : int64_t { kLaunching = 0, kFinishing = 1 };
  void launch(int64_t f, int64_t done, int signal);
  void issue();  // starts the all-reduces of the pending fragment in the current group
  // Waits for the pending fragment and applies its outer step; `final_sync`: replace, do not mix.
  // A failed all-reduce is redone by the survivors (and joiners) in a new group.
  void finish(int64_t done, bool final_sync, Report& report);
  // Every member of a group with joiners: the source sends its state, joiners take it.
  void transfer(Phase phase, int64_t done);
  std::string round_name() const { return "s" + std::to_string(round_); }

  DilocoConfig cfg_;
  std::shared_ptr<ElasticGroup> group_;
  FlatAdamW& optim_;
  double ema_decay_;
  std::vector<std::pair<int64_t, int64_t>> frags_;
  torch::Tensor global_, momentum_;  // float [P]
  std::vector<int64_t> last_sync_;
  // The one fragment in flight (config validation keeps overlap < H / F): its index, launch step,
  // the pseudo-gradient being summed (float, or half on a float16 wire) and the stop flags with it.
  int64_t pending_ = -1, pending_step_ = 0;
  torch::Tensor delta_, send_, flags_;  // delta_ is kept to redo a failed all-reduce
  int signal_ = 0;                      // the stop flag this replica sends with the pending fragment
  std::string launch_error_;            // launch() found the group broken: finish() regroups
  bool fresh_ = false;                  // a joiner: it replaces its weights at its first sync
  Phase joined_phase_ = kLaunching;     // a joiner: what the group was doing when it was admitted
  int64_t joined_done_ = 0;
  int64_t round_ = 0;                   // synchronizations launched so far (every fragment)
  std::function<void(Comm&, int)> transfer_hook_;
  c10::intrusive_ptr<c10d::Work> work_, flag_work_;
  int64_t syncs_ = 0;
  int agreed_stop_ = 0;  // a stop every replica learned from a synchronization
};

// Checkpoints. model.safetensors holds the global weights, ema.safetensors the EMA (of the global
// weights), optim.safetensors replica 0's moments under the usual names (a data-parallel run can
// resume from it) plus "outer_momentum.<p>" and every replica's inner state,
// "replica<r>.params.<p>", "replica<r>.exp_avg.<p>", "replica<r>.exp_avg_sq.<p>"; state.json
// "diloco" holds the world size and each fragment's last synchronization step.
// Rank 0: puts the global weights, the outer state and the replicas' states into ck.
void add_diloco_state(Checkpoint& ck, Diloco& diloco, const FlatAdamW& optim, const DilocoReplicas& replicas);
// Collective, after the model and optimizer were loaded from ck on rank 0 and broadcast (so every
// replica holds the global weights): restores the outer momentum and each replica's inner state
// from ck (rank 0's; null elsewhere or on a fresh start). Replica r takes the state of replica r if
// the checkpoint holds it, else of held[r mod |held|] (another world size, or a replica that was
// gone when it was written); a checkpoint without DiLoCo state (a data-parallel run) starts every
// replica from the global weights with zero outer momentum.
void restore_diloco(Diloco& diloco, FlatAdamW& optim, Comm& comm, const Checkpoint* ck, int64_t step, bool quiet);

}  // namespace ddm
