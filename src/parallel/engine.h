// The one seam between the training loop (run/trainer.h) and the ways a job's processes train
// together. An Engine is this process's part of one mode: data parallel (world 1 is its trivial
// case), DiLoCo, or a pipeline (with data-parallel replicas of it). The loop asks it to step, to
// take the state rank 0 resumed, to contribute to a checkpoint, to agree on a stop, to describe
// itself, how many bytes it sent, and to finish; it never asks which mode it is. Every call marked
// "collective" is made by every rank of the job at the same point of the run.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/config.h"
#include "core/run_dir.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "parallel/layout.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace ddm {

// What every engine is built from. cfg.model resolved; net built from it and initialized alike on
// every rank; comm the whole job's group.
struct EngineParts {
  const RunConfig& cfg;
  const ParallelLayout& layout;
  Net net;
  std::shared_ptr<Objective> objective;
  std::shared_ptr<Comm> comm;
  const Dataset& data;  // a pipeline balances its stages on one prepared row of it
  // The run resumes from a checkpoint (JobProcess::from_checkpoint): no rank compares the seeded
  // initialization, so a pipeline stage does not hash the whole model's weights.
  bool from_checkpoint = false;
};

// How the run begins, once every rank holds rank 0's state (Engine::begin).
struct EngineStart {
  int64_t step = 0;                      // the step every rank resumes after (0: a fresh run)
  const Checkpoint* resumed = nullptr;   // rank 0: the checkpoint it resumed from (null elsewhere)
  bool rejoining = false;                // restarted alone into a running job (DistEnv::rejoin)
  bool quiet = false;
  // What else a replica joining mid-run takes from the group (the loop's data cursor and a pending
  // checkpoint): called on every member with the group and the sending rank; a broadcast inside.
  std::function<void(Comm&, int source)> transfer;
};

// Where the run is after Engine::begin.
struct EngineBegun {
  int64_t step = 0;  // the step to continue after (a rejoining replica: the group's)
  bool over = false; // a rejoining replica found the job finished: nothing to do
  // Joined a running group: the rest of the step it was at comes first (at the run's last step, the
  // other final synchronizations: agree_stop(step, last, 0); else `stop`, the stop the group agreed
  // on when it was admitted).
  bool joined = false;
  int stop = 0;
};

// agree_stop's stop for a rank that cannot read its next batch: a value no signal has, which carries
// whether its error was bad input (a sample it cannot use: InputError, exit 2) or another failure
// (an I/O error: exit 1, which a launcher may restart), and, once agreed, the rank.
constexpr int kStopCannotRead = 1 << 20;
inline int cannot_read_stop(bool bad_input) { return kStopCannotRead + (bad_input ? 1 : 0); }
inline bool is_cannot_read_stop(int stop) { return stop >= kStopCannotRead; }
// Of an agreed stop (is_cannot_read_stop): the rank that could not read, and whether it was bad input.
inline int cannot_read_rank(int stop) { return (stop - kStopCannotRead) / 2; }
inline bool cannot_read_bad_input(int stop) { return (stop - kStopCannotRead) % 2 == 1; }

class Engine {
 public:
  virtual ~Engine() = default;
  // This process's optimizer (a pipeline stage's: its own parameters only).
  virtual FlatAdamW& optim() = 0;

  // Collective, once rank 0 has loaded a checkpoint into the model and its optimizer: every rank
  // takes rank 0's state (`resumed`: rank 0's checkpoint, null elsewhere; `origin` names it in errors).
  virtual void take_resumed(const Checkpoint* resumed, const std::string& origin, int64_t optimizer_step) = 0;
  // A fresh start: the weights every rank must hold identically (hashed and compared by the loop).
  virtual std::vector<torch::Tensor> initial_weights() = 0;
  // Collective, after the state is agreed and before the first step (DiLoCo builds its outer state,
  // or a restarted replica rejoins its group here).
  virtual EngineBegun begin(const EngineStart& start) { return {start.step}; }

  // One step over this process's micro-batches. `next`: the next step's, when wants_next() (a filled
  // pipeline prepares them in this step's bubbles, data parallelism at this step's end); empty on the
  // run's last step. The loop then passes these same tensors as the next step's micro-batches.
  virtual StepResult step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) = 0;
  virtual bool wants_next() const { return false; }
  // A line worth printing after the last step, `done` steps in all (a pipeline's fill plan, once
  // made); empty: none.
  virtual std::string news(int64_t /*done*/) { return {}; }
  // Collective after each step: the stop every rank makes after `done` steps (of `last`), given the
  // signal this process received (0: none). SIGINT wins over SIGTERM. Engines that agree every step
  // (agrees_every_step()) also take cannot_read_stop(): this process cannot read its next batch; it
  // wins over any signal, and comes back naming the rank (the highest) that said it.
  virtual int agree_stop(int64_t done, int64_t last, int signal) = 0;
  // Whether agree_stop is a collective of every rank after every step (data parallelism, pipelines):
  // then a rank that cannot read its next batch stops them all after the same step (run/loop.h).
  // DiLoCo's replicas agree only at their synchronizations.
  virtual bool agrees_every_step() const { return false; }

  // Collective: the EMA of the trainable parameters by name on rank 0, for its training grids (a
  // sharded optimizer's assembled from every rank's range; elsewhere this process's own, no
  // communication); empty or unused on the other ranks.
  virtual TensorMap lead_ema() { return optim().named_ema(); }

  // Whether a checkpoint may be written now (false while a DiLoCo all-reduce is in flight).
  virtual bool can_checkpoint() const { return true; }
  // Collective: on rank 0 fills ck's model, EMA and optimizer tensors and this mode's state. Returns
  // every rank's `mine` (the trainer's record of its data), on every rank: DiLoCo's are the replicas
  // in the group, gathered with their state in one round, so that a replica lost during it is left
  // out of both alike.
  virtual std::vector<std::string> contribute(Checkpoint& ck, int64_t step, const std::string& mine) = 0;

  // The "parallel: ..." line of the run header (no newline); empty for one process.
  virtual std::string describe() const = 0;
  // Bytes this process sent in this run, over every group it used.
  virtual int64_t bytes_sent() const = 0;
  // The group that still holds every rank at the end (for the final totals).
  virtual Comm& group() = 0;
  // Collective, after the last step: `dir` the run's (rank 0 writes), `first_step` and `step` where
  // this run began and ended, `threads` each process's.
  virtual void finish(const RunDir& /*dir*/, int64_t /*first_step*/, int64_t /*step*/, int /*threads*/) {}
};

// The engine of layout's mode. Errors (before any file is touched) for what the mode cannot take.
std::unique_ptr<Engine> make_engine(const EngineParts& parts);

// The three, for make_engine (parallel/data_parallel.cpp, diloco_engine.cpp, pipeline_engine.cpp).
std::unique_ptr<Engine> make_data_parallel_engine(const EngineParts& parts);
std::unique_ptr<Engine> make_diloco_engine(const EngineParts& parts);
std::unique_ptr<Engine> make_pipeline_engine(const EngineParts& parts);

}  // namespace ddm
