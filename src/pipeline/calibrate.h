// Planning bubble filling inside a pipelined run (docs/pipeline.md, "Filling the bubbles"): every
// stage measures a step run with the prepare phase serial (its actions' compute times, its prepare
// time per quantum of rows, its optimizer, the bytes it sends) and ranks 0 and 1 time the link
// between them; all stages exchange these measurements, and each turns the same numbers into the
// same costs (simulate.h), fills the schedule's bubbles with the prepare work (fill.h), and
// so runs the same plan, with no plan ever sent. Measured under the run's own load, on its own link,
// the costs need no profile file and describe this machine as it is during training.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "pipeline/fill.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"

namespace ddm {

// One stage's measurements of one step (milliseconds, bytes).
struct PipeStageMeasure {
  double forward = 0, input_grad = 0, weight_grad = 0;  // mean per micro-batch; B alone is input_grad
  double optimizer = 0;                                 // clip, AdamW, EMA
  double prepare_quantum = 0;                           // prepare time per `quantum` rows
  int64_t carry_bytes = 0;                              // what it sends the next stage per micro-batch
  std::vector<int64_t> prepared_bytes;                  // per rank: a micro-batch's prepared tensors it reads
  double link_latency = 0, link_bytes_per_ms = 0;       // measured by rank 0 (0 elsewhere)
  std::vector<int64_t> skip_bytes;                      // per stage: skips it sends there directly, per micro-batch
  double first_pass = -1;                               // self-conditioning's first pass per micro-batch; < 0: none
  int64_t first_pass_bytes = 0;                         // ... and what it sends on per micro-batch
};

std::string measure_json(const PipeStageMeasure& m);
// Throws ddm::Error naming the key that is missing or wrong.
PipeStageMeasure measure_from_json(const std::string& text);

// The simulator's costs from every stage's measurements (stage s on rank stage_rank[s]; empty: on
// rank s; a rank's optimizer is on its first stage's measurement): per-stage compute, the
// link's time for each cut's carry and its gradient and for each direct skip route, each rank's optimizer, and one task "prepare"
// per micro-batch of `rows` rows in quanta of `quantum` (any rank, consumed by stage 0, weight-
// independent so it may prepare the next step in this step's bubbles, its output sent to the stage
// that reads the most of it). With self-conditioning (first_pass >= 0 on every stage), also task
// 1 + s, stage s's first pass of a micro-batch: in whole quanta (a partial batch where a bubble
// holds only part; its rows travel on as one message once all pieces ran), on stage s's rank,
// after stage s-1's (stage 0's after this step's prepared rows), consumed by stage 0's forward,
// and not movable into the previous step (it uses this step's weights).
PipeCosts costs_from_measures(const std::vector<PipeStageMeasure>& stages, int64_t rows, int64_t quantum,
                              const std::vector<int>& stage_rank = {});

struct PipeFillPlan {
  PipeCosts costs;
  PipeFill fill;             // the schedule with the prepare pieces, and its simulated timeline
  PipeTimeline serial;       // the same schedule with the prepare work serial on stage 0's rank
  bool used = false;         // some rows or first passes fit into bubbles (else the run stays serial)
  int64_t first_pass_rows = 0;  // rows of self-conditioning's first passes placed in bubbles (of stages x micro-batches x rows)
  std::string summary;       // one line for the run's output
};

PipeFillPlan plan_fill(const PipeSchedule& schedule, const std::vector<PipeStageMeasure>& stages, int64_t rows,
                       int64_t quantum);

}  // namespace ddm
