// The loop of every training run, over any engine (parallel/engine.h) and any batch source: draw
// this process's rows of the global batch, split them into micro-batches, step, stop at a non-finite
// loss (the last good checkpoint named), agree on a stop with the other ranks after every step,
// log, and checkpoint every train.ckpt_every steps, at the last step and on a signal (deferred while
// the engine cannot take one). A sample that cannot be used (data.skip_bad = false) stops the run
// with a checkpoint of the last step done, at the data position before the batch that holds it: one
// process writes it alone; several whose engine agrees every step read their next batch before they
// agree, and stop together (a DiLoCo replica, which agrees only at synchronizations, stops alone and
// writes none). run/trainer.cpp sets up what it runs over; tests drive it with an
// engine of their own (tests/unit/run/test_loop.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "data/batch_source.h"
#include "parallel/engine.h"
#include "run/run_log.h"

namespace ddm {

struct LoopSpec {
  int64_t steps = 0;         // train.steps: the run ends after this many
  int64_t ckpt_every = 1;    // train.ckpt_every
  int64_t grad_accum = 1;    // micro-batches per step (train.grad_accum)
  int64_t shard_offset = 0;  // this process's rows [shard_offset, shard_offset + local_batch) of each batch
  int64_t local_batch = 0;
  torch::Device device = torch::kCPU;
  std::string who;           // "rank N: " in a job of several processes (errors), else empty
  double lr = 0;             // train.lr, named in the error for a non-finite loss
  double grad_clip = 0;      // train.grad_clip, the same
  double loss_scale = 0;     // fp16: train.loss_scale, named in the error for too many overflows
  bool alone = false;        // one process: it can write a checkpoint without the others (a bad sample)
  int rank = 0;              // this process's (rank 0 writes the checkpoints)
};

// Where the loop is. Shared with the engine's transfer hook: a DiLoCo replica joining mid-run takes
// whether a checkpoint is due from the group.
struct LoopState {
  int64_t step = 0;                    // steps done
  bool ckpt_due = false;               // a checkpoint waits until the engine can take one
  std::string last_ckpt = "none yet";  // the last checkpoint written (or resumed from)
};

struct LoopHooks {
  // Writes a checkpoint after `step` (a collective: every rank calls it at the same step); returns
  // its directory (rank 0's; others return what they like).
  std::function<std::string(int64_t step)> save;
  // The signal this process received (SIGINT, SIGTERM), 0 if none.
  std::function<int()> signal;
  // After each step that no signal stops, before its checkpoint (rank 0's grids); unset: nothing.
  std::function<void(int64_t step)> after_step;
};

// Runs from state.step to spec.steps, or to the step every rank agreed to stop after. `begun`: a
// replica that joined a running group first finishes the step the group was at. Returns the signal
// that stopped it (0: it ran to the end).
int run_loop(Engine& engine, BatchSource& source, const LoopSpec& spec, const EngineBegun& begun, LoopState& state,
             RunLog& log, const LoopHooks& hooks);

}  // namespace ddm
