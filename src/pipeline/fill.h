// DiffusionPipe's bubble filling: places the non-trainable work of an iteration (PipeCosts::tasks,
// one instance per task and micro-batch) into the idle stretches of a simulated pipeline schedule,
// greedily and earliest-deadline-first, never delaying a backbone action:
//   1. simulate the schedule with the work not yet placed run serially at the front;
//   2. walk every rank's idle stretches in time order; in each, repeatedly take the ready instance
//      allowed on that rank with the earliest deadline (the start of its consumer's F, less the
//      send time from another rank; for cross-iteration work, the end of the iteration, since it
//      prepares the next iteration's micro-batch) and place as many of its rows as fit before the
//      stretch or the deadline ends, in whole quanta (a partial batch leaves the rest ready);
//   3. rows left unplaced join the serial work of step 1, and the two steps repeat until everything
//      is placed or serial (each round moves at least one instance to the front, so it ends).
// The serial work runs on the consumer's rank, or spread in whole quanta over every rank the task
// may run on (each does its share before its first backbone action, the shares sent to the
// consumer): both are filled, and the faster kept. Spreading is data parallelism's way with the work
// that does not fit, and it leaves no rank idle while another prepares.
// "Ready" means released (every task is released at the iteration's start: after the previous
// optimizer step, which self-conditioning's use of the current weights needs) and its `after`
// instance finished and sent (of a cross-iteration `after`, this iteration's rows: its serial
// pieces). Serial rows of a task make its predecessors' instances serial too, up to a
// cross-iteration one. The result is simulated once more; the backbone keeps the times it
// had in step 1's schedule (tested). Written from the DiffusionPipe paper's description of its
// greedy filler; no public implementation exists.
#pragma once
#include <cstdint>
#include <vector>

#include "pipeline/schedule.h"
#include "pipeline/simulate.h"

namespace ddm {

// `s` with every task instance run whole, serially, at the front of a rank (the consumer's rank
// when allowed there, else the task's first allowed rank), ordered by micro-batch, then task: how
// data parallelism and an unfilled pipeline do the non-trainable work (the step's prepare phase).
PipeSchedule with_serial_tasks(const PipeSchedule& s, const PipeCosts& c);

struct PipeFill {
  PipeSchedule schedule;  // the backbone, the serial work at the front, the pieces in the bubbles
  PipeTimeline timeline;
  std::vector<int64_t> filled_rows, serial_rows;  // per task, over all micro-batches
  int pieces = 0;                                 // pieces placed in bubbles
  int rounds = 0;                                 // serial/fill rounds (step 3)
  bool spread = false;                            // the serial work is spread over the ranks
};

PipeFill fill_bubbles(const PipeSchedule& s, const PipeCosts& c);

}  // namespace ddm
