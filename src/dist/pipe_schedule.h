// Pipeline schedules as data: per-rank lists of actions (forward, backward, input-gradient,
// weight-gradient of one micro-batch on one stage, or a piece of non-trainable work placed by the
// bubble filler), produced by a generator here and consumed by one simulator (pipe_simulate.h) and,
// later, by the runtime. An empty stretch of time between two actions is a bubble.
//
// Generators (S stages, M micro-batches, stage s on rank s):
//   gpipe   all forwards, then all backwards (in micro-batch order); M activations in flight
//   1f1b    PipeDream-flush: S-s-1 warm-up forwards, then forward/backward pairs, then the
//           remaining backwards; min(S-s, M) activations in flight on stage s
//   zb-h1   Qi et al.'s ZB-H1: 1F1B with the backward split into I (input gradient, on the critical
//           path) and W (weight gradient, needed only by the optimizer); stage s runs each W s
//           micro-batches after its I, so W's fill the cooldown. Every stage holds at most S
//           micro-batches between F and W (1F1B's peak, now on every stage); with per-stage costs
//           F, I, W and M >= S the idle time per stage is (S-1)(F+I-W) instead of 1F1B's (S-1)(F+I+W).
// Written from the papers' descriptions (GPipe, PipeDream-2BW's 1F1B flush, Zero Bubble Pipeline
// Parallelism, ICLR 2024); no packaged library builds schedules.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ddm {

enum class PipeOp : uint8_t {
  kForward,     // F: stage forward (the last stage also computes the loss)
  kBackward,    // B: full backward = input gradient + weight gradient
  kInputGrad,   // I: gradient of the stage's inputs only
  kWeightGrad,  // W: gradient of the stage's parameters (after its I)
  kTask,        // a piece of non-trainable work (pipe_fill.h): `task`, `micro`, `rows`
};

struct PipeAction {
  PipeOp op = PipeOp::kForward;
  int stage = 0;      // backbone actions: the stage; tasks: unused (-1)
  int micro = 0;      // micro-batch index
  int task = -1;      // kTask: index into the task list
  int64_t rows = 0;   // kTask: rows of the micro-batch this piece covers
  bool serial = false;  // kTask: run serially at the iteration's start (not placed in a bubble)
};

struct PipeSchedule {
  std::string name;
  int stages = 0, micro = 0;
  bool split_backward = false;                  // I + W instead of B
  std::vector<std::vector<PipeAction>> ranks;   // per rank, in execution order
};

// The schedule names accepted by make_schedule, for messages and --help.
const std::vector<std::string>& schedule_names();

// Builds a schedule by name ("gpipe", "1f1b", "zb-h1"); throws ddm::Error naming the accepted
// names for any other, and for stages < 1 or micro < 1.
PipeSchedule make_schedule(const std::string& name, int stages, int micro);

// Throws ddm::Error unless every (stage, micro) has exactly one F and one B (or one I and one W),
// each on the rank of its stage, with F before B/I before W on that rank. Order across ranks
// (deadlocks) is the simulator's to find.
void validate_schedule(const PipeSchedule& s);

// Peak number of micro-batches whose activations a stage holds at once: counted from F to the end
// of B (or of W for a split backward: W needs the stage's saved inputs).
std::vector<int> peak_in_flight(const PipeSchedule& s);

// "F3", "I0", "W2", "T1.0x16" (task 1, micro 0, 16 rows): compact text for messages and tests.
std::string action_text(const PipeAction& a);
std::string rank_text(const std::vector<PipeAction>& actions);

}  // namespace ddm
