// One optimization step, in explicit phases, shared by the trainer and the training benchmark so
// that the benchmark measures exactly what training runs:
//   prepare       (no grad)  the objective draws t / noise / label dropout and builds x_t and the
//                            target (a distillation teacher, a latent encoder, control maps run here):
//                            diffusion/objective.h; self-conditioning's first pass of the model;
//                            then the network's precompute (a ControlNet's locked encoder)
//   forward+loss             the trainable model on x_t, the objective's loss
//   backward                 gradients accumulate into FlatAdamW's flat buffer, micro-batch by micro-batch
//   gradient sync            all-reduce across data-parallel ranks (a no-op with one process)
//   clip                     by the global gradient norm
//   update                   AdamW + EMA, one pass over the flat buffers (parallel.shard_optimizer:
//                            over this rank's range, then every rank's range broadcast: train/shard.h)
// All randomness is keyed by (seed, step, global sample position): see objective.h.
// Prepare ahead: given the next step's micro-batches, run() prepares them once its own update is
// queued, so that on a GPU the host draws and launches the next step's prepare phase while the
// device still computes this one (docs/gpu.md). The prepare phase is a pure function of the batch,
// the step and the weights, so the results are bit-identical to preparing at the start of the step.
// train.cuda_graphs: the phases from forward to update are captured once as a CUDA graph and
// replayed (train/step_graph.cpp); prepare stays outside.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/grad_sync.h"
#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "train/optimizer.h"

namespace ddm {

struct StepResult {
  double loss = 0;       // mean over the global batch
  double grad_norm = 0;  // global norm, before clipping
  double lr = 0;
  bool finite = true;    // false: loss or gradient not finite; no weight was changed
  // train.precision = fp16 (train/loss_scale.h): the scale this step's loss was multiplied by (0: no
  // loss scaling), and whether the step was not finite at it and so skipped, the scale halved. A
  // skipped step is part of training (the run goes on) until too many come in a row.
  double loss_scale = 0;
  bool overflow = false;
  int64_t overflows_in_a_row = 0;
};

// fp16 (train/loss_scale.h), once a step knows whether it was finite: the scale it ran at goes into
// `r`, the scale is updated, and a non-finite step is reported as an overflow (skipped). Nothing
// without loss scaling. Every trainer's step ends so: TrainStep's eager and graphed, a pipeline's.
void settle_loss_scale(LossScale& scale, bool finite, StepResult& r);

// Learning rate at a 0-based step: linear warm-up, then constant or cosine decay to 0.
double lr_at(const TrainConfig& t, int64_t step);

// When the phases of the last TrainStep::run() began and ended (steady clock), for benchmarks and
// timelines; reading the clock six times a step costs nothing measurable. With several micro-batches
// backward_start / backward_end are those of the last one (the one whose backward synchronizes).
// With train.cuda_graphs (a step replayed from its graph) backward_start is `prepared` and synced,
// clipped and end are when the replay's results were read back: the phases in between are one launch.
struct StepTimes {
  using TimePoint = std::chrono::steady_clock::time_point;
  TimePoint start;           // run() entered
  TimePoint prepared;        // the prepare phase done: its frozen work (an encoder, a teacher) included
  TimePoint backward_start;  // prepare + forward + loss done: backward() called
  TimePoint backward_end;    // backward() returned: with data parallelism it has waited for every bucket
  TimePoint synced;          // the global loss is known (one small all-reduce)
  TimePoint clipped;         // the global gradient norm is computed and applied
  TimePoint end;             // AdamW + EMA done (== clipped when the step was not finite)
};

struct StepGraph;  // train/step_graph.cpp: a step's CUDA graph, its inputs and its stream
std::shared_ptr<StepGraph> make_step_graph(torch::Device device);

class TrainStep {
 public:
  // cfg.model must be resolved (in_channels, image_size, num_classes); net built from it.
  // shard: this rank's share of the optimizer state (parallel.shard_optimizer; train/shard.h).
  TrainStep(const RunConfig& cfg, Net net, std::shared_ptr<Objective> objective, ShardOf shard = {});
  // One step over this process's micro-batches (equal sizes; their `first` positions disjoint).
  // `next`: the micro-batches of step + 1, when the caller knows them and nothing but this step
  // changes the weights before it (not DiLoCo's outer steps): their prepare phase runs at the end of
  // this step, and run(next, step + 1) uses it (the same tensors: a batch is recognised by its memory,
  // shape and position; any other batch is prepared as usual).
  StepResult run(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next = {});
  StepResult run(const Batch& batch, int64_t step) { return run(std::vector<Batch>{batch}, step); }
  // Data parallelism: gradients are averaged over comm's ranks by `sync` (built on this step's
  // optim().params() and flat_grad()), and the reported loss over the ranks. Without: one process.
  void set_data_parallel(std::shared_ptr<Comm> comm, std::shared_ptr<GradSync> sync);
  // DiLoCo's inner steps leave the EMA alone: it follows the global weights (parallel/diloco.h).
  void set_ema(bool on) { ema_ = on; }
  FlatAdamW& optim() { return optim_; }
  const FlatAdamW& optim() const { return optim_; }
  const Net& net() const { return net_; }
  const Objective& objective() const { return *objective_; }
  const StepTimes& last_times() const { return times_; }
  // train.cuda_graphs: the steps that replayed the captured graph so far (0 without graphs).
  int64_t graph_replays() const;
  // The steps whose prepare phase ran at the end of the step before (given as `next`).
  int64_t prepared_ahead() const { return ahead_used_; }

 private:
  // The prepare phase of one micro-batch (no gradients): draws, x_t, target, frozen work.
  Prepared prepare(const Batch& micro, int64_t step);
  // The prepared micro-batches of this step: those made ahead by the step before when they are of
  // these batches, else prepared now (empty when `lazy`: the caller prepares each one as it goes).
  std::vector<Prepared> prepared_for(const std::vector<Batch>& micro, int64_t step, bool lazy);
  // At the end of a step: the next step's prepare phase, kept for prepared_for.
  void prepare_ahead(const std::vector<Batch>& next, int64_t step);
  // forward + loss -> backward for one prepared micro-batch, on the model's device; returns its loss
  // (before scaling: a double [] on that device). The loss is multiplied by `scale` before backward,
  // or by `scale_t` (a float [] on the device, that a CUDA graph reads) where it is defined.
  torch::Tensor forward_backward(const Prepared& p, double scale, const torch::Tensor& scale_t = {});
  // After the micro-batches' backward: the loss over the job, the clip and the update (the eager tail).
  StepResult finish(const torch::Tensor& loss_sum, double scale, int64_t step);
  // train.cuda_graphs (train/step_graph.cpp): the graph's stream, warm-up, capture and replay.
  StepResult run_graphed(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next);
  StepResult graph_step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next);
  void capture(const std::vector<Prepared>& prepared, double scale);
  RunConfig cfg_;
  Net net_;
  Net forward_net_;  // what the loss's forward runs: net_, or net_ unit by unit (train.checkpoint_activations)
  FlatAdamW optim_;
  std::shared_ptr<Objective> objective_;
  std::shared_ptr<Comm> comm_;
  std::shared_ptr<GradSync> sync_;
  StepTimes times_;
  bool ema_ = true;
  std::shared_ptr<StepGraph> graph_;  // train.cuda_graphs
  struct Ahead {
    int64_t step = -1;                 // the step they were prepared for (-1: none)
    std::vector<std::string> of;       // each micro-batch's identity: memory, shape, position
    std::vector<torch::Tensor> keep;   // their images: that memory is not reused while stashed
    std::vector<Prepared> prepared;
  };
  Ahead ahead_;
  int64_t ahead_used_ = 0;
};

}  // namespace ddm
