// Self-conditioning's first pass through a pipeline (train.self_cond; docs/pipeline.md): which rows
// of each micro-batch take one (keyed by sample position, alike on every stage); each stage's pass
// over them without gradients, with this step's weights, a quantum of positions at a time, so that
// however a fill plan cuts the pass into pieces the result is the same bit for bit; once a stage ran
// all of a micro-batch's pieces, their carry goes on as one message (the last stage's output back to
// stage 0); and stage 0 turning that output into the x0 estimate its forward feeds in. PipeStep
// (runtime.h) says when each piece runs: a sweep before the first forward, or the fill plan's pieces.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "pipeline/stage.h"
#include "pipeline/wire.h"

namespace ddm {

class PipeFirstPass {
 public:
  // rows: a micro-batch's; quantum: the rows of one prepare call (pipeline/prepare.h), the unit of
  // a piece.
  PipeFirstPass(const Objective& objective, PipeWire& wire, int stages, int64_t rows, int64_t quantum);
  // A step over these micro-batches: the rows of each that take a first pass.
  void begin_step(const std::vector<Batch>& micro, int64_t step);
  // Stage l's pass over positions [first, first + rows) of micro-batch m, prepared as p (whole
  // quanta, continuing where its last piece of m ended).
  void run(PipeStage& l, int m, const Prepared& p, int64_t first, int64_t rows);
  // Stage 0, before micro-batch m's forward: p.cond.self_cond = the x0 estimates of the rows that
  // took a first pass (waiting for the last stage's output), zeros elsewhere.
  void estimate(int m, Prepared& p);
  // Micro-batch m's chosen rows, ascending [b'].
  const torch::Tensor& rows_of(int m) const { return micro_.at(static_cast<size_t>(m)).idx; }

 private:
  struct StagePass {            // one stage's first pass of one micro-batch, piece by piece
    NetCarry in;                // stage > 0: the previous stage's carry of all b' rows
    bool received = false;
    std::vector<NetCarry> out;  // each quantum's carry after this stage's units, in row order
    int64_t done = 0;           // positions covered by the pieces run so far
  };
  struct Micro {
    torch::Tensor idx;             // the micro-batch's rows that take a first pass [b'], ascending
    std::vector<int64_t> bound;    // per quantum q of positions: idx[bound[q], bound[q + 1]) lie in it
    torch::Tensor x, t;            // stage 0: their x_t and t
    PipeWire::Recv out;            // ... and the last stage's output
    std::vector<StagePass> stage;  // per stage
  };
  const Objective& objective_;
  PipeWire& wire_;
  int stages_ = 0;
  int64_t rows_ = 0, quantum_ = 1;
  std::vector<Micro> micro_;
};

}  // namespace ddm
