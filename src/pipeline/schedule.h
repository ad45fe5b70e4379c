// Pipeline schedules as data: per-rank lists of actions (forward, backward, input-gradient,
// weight-gradient of one micro-batch on one stage, or a piece of non-trainable work placed by the
// bubble filler), produced by a generator here and consumed by one simulator (simulate.h) and,
// later, by the runtime. An empty stretch of time between two actions is a bubble.
//
// Generators (M micro-batches; linear ones: S stages, stage s on rank s):
//   gpipe   all forwards, then all backwards (in micro-batch order); M activations in flight
//   1f1b    PipeDream-flush: S-s-1 warm-up forwards, then forward/backward pairs, then the
//           remaining backwards; min(S-s, M) activations in flight on stage s
//   zb-h1   Qi et al.'s ZB-H1: 1F1B with the backward split into I (input gradient, on the critical
//           path) and W (weight gradient, needed only by the optimizer); stage s runs each W s
//           micro-batches after its I, so W's fill the cooldown. Every stage holds at most S
//           micro-batches between F and W (1F1B's peak, now on every stage); with per-stage costs
//           F, I, W and M >= S the idle time per stage is (S-1)(F+I-W) instead of 1F1B's (S-1)(F+I+W).
// V-shaped placement (R ranks, 2R stages: rank r holds stage r and stage 2R-1-r, so a U-Net's down
// block and its up block, and the skips between them, share a rank; the loss is on rank 0):
//   1f1b-v  warm-up forwards of the first chunk, then the second chunk's forward/backward pairs,
//           then steady F0 B0 F1 B1 rounds and the cooldown backwards (schedule.cpp lists the
//           phases); at most 2R chunk activations per rank, i.e. 1F1B's first-rank peak when a
//           chunk is half a stage; idle per rank about 2/3 of 1F1B's at equal work (unit costs)
//   zb-v    Qi et al.'s ZB-V: the same phases with the backward split into I and W, W's deferred
//           into the cooldown; near zero bubble once M >= 2R-1
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
  kTask,        // a piece of non-trainable work (fill.h): `task`, `micro`, `rows`
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
  std::vector<int> stage_rank;                  // the rank of each stage; empty: stage s on rank s
  int rank_of(int stage) const { return stage_rank.empty() ? stage : stage_rank[stage]; }
  bool several_per_rank() const { return !stage_rank.empty() && stages > static_cast<int>(ranks.size()); }
};

// The schedule names accepted by make_schedule, for messages and --help: the linear ones, then the
// V-shaped ones.
const std::vector<std::string>& schedule_names();
bool is_v_schedule(const std::string& name);

// Builds a schedule by name over `ranks` ranks (stages = ranks, or 2 x ranks for a V-shaped one);
// throws ddm::Error naming the accepted names for any other, and for ranks < 1 or micro < 1.
PipeSchedule make_schedule(const std::string& name, int ranks, int micro);

// Throws ddm::Error unless every (stage, micro) has exactly one F and one B (or one I and one W),
// each on the rank of its stage, with F before B/I before W on that rank. Order across ranks
// (deadlocks) is the simulator's to find.
void validate_schedule(const PipeSchedule& s);

// Per stage, the peak number of micro-batches whose activations it holds at once: counted from F
// to the end of B (or of W for a split backward: W needs the stage's saved inputs).
std::vector<int> peak_in_flight(const PipeSchedule& s);

// "F3", "I0", "W2", "T1.0x16" (task 1, micro 0, 16 rows): compact text for messages and tests;
// with `stage`, a backbone action also names its stage ("F3@5": micro 3 on stage 5), for ranks
// that hold several stages.
std::string action_text(const PipeAction& a, bool stage = false);
std::string rank_text(const std::vector<PipeAction>& actions, bool stage = false);

}  // namespace ddm
