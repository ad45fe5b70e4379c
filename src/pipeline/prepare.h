// The prepare phase of a pipeline stage in pieces, for DiffusionPipe's bubble filling
// (docs/pipeline.md, "Filling the bubbles"): a micro-batch's prepared inputs (Prepared: x_t, t, the
// conditioning with a ControlNet's locked features, the target) are made a few rows at a time by
// whichever stage has a bubble, sent to the stages that read them, and put back together in row order.
//   prepare_rows   rows [first, first + n) of a micro-batch, `quantum` rows per call of the
//                  objective's prepare and the network's precompute. Every quantum is prepared alone,
//                  so whatever pieces a plan cuts a micro-batch into, the result is the same bit for
//                  bit (and within float32 rounding of one call on all its rows).
//   PrepNeeds      what a stage reads: t and the small conditioning tensors (labels, control maps,
//                  embeddings, a caption's text encoding) always; x_t on stage 0, the target on the last stage, Cond::frozen on a
//                  stage whose units read it (NetUnit::reads_frozen).
//   prep_pieces    a filled schedule's task pieces and the rows each covers.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "pipeline/schedule.h"
#include "train/checkpoint.h"

namespace ddm {

// The rows prepared per call for micro-batches of `rows` rows: the smallest divisor of `rows` that
// cuts it into at most 8 quanta (1 for a prime above 8). The quantum is the finest piece bubble filling can place; at least
// 4 rows (the rule until the seed's own workloads were measured) left ControlNet v1.0's micro-batches
// of 2 rows, whose prepare phase outlasts every bubble, nothing to fill with (docs/results.md).
int64_t prepare_quantum(int64_t rows);

// Rows [first, first + n) of `micro` (n a multiple of quantum), prepared for `step` a quantum at a
// time: objective.prepare then net.precompute on each (under `precision`'s autocast on the batch's
// device, as a single process's step runs it), concatenated. Call without gradients.
Prepared prepare_rows(const Objective& objective, NetImpl& net, const Batch& micro, int64_t first, int64_t n,
                      int64_t quantum, int64_t step, Precision precision = Precision::kFp32);

struct PrepNeeds {
  bool xt = false;      // the backbone's input (stage 0)
  bool target = false;  // the loss's target (the last stage)
  bool frozen = false;  // Cond::frozen: a unit of the stage reads it
};

// The tensors of `p` a stage with `needs` reads, by name ("xt", "t", "target", "y", "control",
// "embed", "embed_null", "self_cond", "posterior_eps", "context", "context_mask", "pooled",
// "frozen.<i>"), each with the rows first.
TensorMap prepared_tensors(const Prepared& p, const PrepNeeds& needs);

// Pieces (first row, prepared_tensors of those rows) back into one Prepared of `rows` rows,
// concatenated in row order. Throws ddm::Error (naming `what`) unless they cover [0, rows) exactly,
// each once, with the same tensors.
Prepared prepared_from(std::vector<std::pair<int64_t, TensorMap>> pieces, int64_t rows, const std::string& what);

// One task piece of a filled schedule (fill.h): who runs it, where in its list, and which rows.
struct PrepPiece {
  int rank = 0, position = 0;  // rank and index in its action list
  int micro = 0;
  int64_t first = 0, rows = 0;
  bool ahead = false;  // placed in a bubble: prepares the next step's micro-batch; else (serial) this step's
};

// Every piece of the prepare task (task 0) of `filled`, ranks in order, each rank's in list order. Per micro-batch the
// ahead pieces take rows from 0 in that order and the serial ones the rest after them; throws
// ddm::Error unless each micro-batch's pieces add up to `rows`.
std::vector<PrepPiece> prep_pieces(const PipeSchedule& filled, int64_t rows);

}  // namespace ddm
