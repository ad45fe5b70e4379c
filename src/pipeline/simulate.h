// The pipeline simulator: runs a schedule (schedule.h) on modelled costs and returns when each
// action starts and ends on each rank. Each rank executes its list in order; an action starts when
// its rank is free and its inputs have arrived:
//   F(s, m)   after F(s-1, m) + send_forward[s-1], after F(from, m) + the route's time for each
//             skip route into s, and after every piece of each task instance (t, m) that s consumes
//             in this iteration (+ the task's send time when the piece ran on another rank): all of
//             them, or for a cross-iteration task its serial pieces alone (the others in the bubbles
//             prepare the next iteration)
//   B/I(s, m) after F(s, m), after B/I(s+1, m) + send_backward[s], and after B/I(to, m) + the
//             route's time for each skip route out of s
//   W(s, m)   after I(s, m)
//   task piece (t, m)  after every piece of (t.after, m) (+ send time across ranks); of a
//             cross-iteration t.after only the serial pieces, as for F (a self-conditioning pass
//             after this iteration's rows of the prepare phase)
// Sends overlap compute, but the backbone's messages between two ranks share their link: each
// direction of a pair of ranks carries one message at a time, in the order the sender makes them
// (as one TCP connection per pair does), so a message waits for the ones before it. A message's
// time is the link's latency plus its bytes over the bandwidth; only the bytes hold the link
// (PipeCosts::latency says how much of each time is latency). Messages between two stages of one
// rank take their time without a link. Task outputs are not queued on the links: they arrive their
// `send` time after the piece ends (they are small next to the carries: a latent encoder's output
// is 1/17 of the latent U-Net's carry per row). After the last action of every rank, the
// iteration ends with the slowest rank's optimizer step (clipping by the global norm needs every
// stage's gradients). A schedule whose ranks wait on each other in a cycle is reported as a
// deadlock naming each rank's blocked action.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/schedule.h"

namespace ddm {

// Per micro-batch compute times of one stage (milliseconds, or any one unit used throughout). B is
// input_grad + weight_grad. I and W of a split backward are input_grad and weight_grad unless
// split_input / split_weight say otherwise (>= 0): in ddm's runtime stage 0 has no input gradient to
// compute, so its I is nothing and its W the whole backward (costs_of_partition models it).
struct PipeStageCost {
  double forward = 0, input_grad = 0, weight_grad = 0;
  double split_input = -1, split_weight = -1;
  double i_time() const { return split_input >= 0 ? split_input : input_grad; }
  double w_time() const { return split_weight >= 0 ? split_weight : weight_grad; }
};

// A tensor sent straight from the stage that makes it to a later stage that consumes it (an open
// U-Net skip), and its gradient back; each way's transfer time.
struct PipeSkipRoute {
  int from = 0, to = 0;
  double forward = 0, backward = 0;
};

// One kind of non-trainable work, done once per micro-batch (an "instance" (task, micro)): a frozen
// encoder, a ControlNet's locked encoder, a self-conditioning pass over one stage, a teacher.
struct PipeTask {
  std::string name;
  std::vector<std::pair<int64_t, double>> cost;  // profiled (rows, time) points, rows ascending
  int64_t rows = 1;           // rows of one micro-batch
  int consumer = 0;           // the stage whose F(m) needs the output
  std::vector<int> ranks;     // ranks it may run on; empty: any rank
  double send = 0;            // moving its output to another rank (its consumer's or its successor's)
  int after = -1;             // an earlier task whose same micro-batch instance must finish first
                              // (a cross-iteration one: its serial pieces, this iteration's rows)
  bool cross_iteration = false;  // weight-independent: may run in the previous iteration's bubbles
  int64_t quantum = 1;        // pieces are whole multiples of this many rows (it divides `rows`)
  // Time of `rows` rows: linear between profiled points, proportional to the first point below it
  // and to the last point above it.
  double time(int64_t rows) const;
  bool allowed_on(int rank) const;
};

struct PipeCosts {
  std::vector<PipeStageCost> stage;   // one per stage
  std::vector<double> send_forward;   // [s]: stage s's output to stage s+1 (S-1 entries, or empty: 0)
  std::vector<double> send_backward;  // [s]: the gradient of that output back to stage s
  std::vector<PipeSkipRoute> skips;
  std::vector<double> optimizer;      // per rank (or empty: 0)
  std::vector<PipeTask> tasks;
  double latency = 0;                 // the link's latency in every send time above: it does not hold the link
};

// Throws ddm::Error naming the field when sizes disagree with the schedule (`stages` stages on
// `ranks` ranks; < 0: as many as stages), a time is negative or not finite, a task's profile is
// empty or unsorted, or a task's `after`/`consumer`/ranks is out of range.
void validate_costs(const PipeCosts& c, int stages, int ranks = -1);

struct PipeSlot {
  PipeAction action;
  double start = 0, end = 0;
};

struct PipeInterval {
  int rank = 0;
  double start = 0, end = 0;
};

struct PipeTimeline {
  std::vector<std::vector<PipeSlot>> ranks;  // per rank, in execution order
  double makespan = 0;   // end of the last action
  double iteration = 0;  // makespan + the slowest optimizer step
  // Busy time of backbone actions (`tasks` false) or of task pieces (true) on a rank.
  double busy(int rank, bool tasks) const;
  // Idle stretches of each rank inside [0, makespan], in time order (rank, then start).
  std::vector<PipeInterval> idle() const;
  // Idle time / (ranks x makespan).
  double bubble_fraction() const;
  // Start time of backbone action (op, stage, micro); -1 when absent.
  double start_of(PipeOp op, int stage, int micro) const;
};

PipeTimeline simulate(const PipeSchedule& s, const PipeCosts& c);

}  // namespace ddm
