// Stage partitioning by dynamic programming (DiffusionPipe section 4; PipeDream's planner): a model
// is an ordered list of units (blocks) with profiled per-micro-batch times and byte counts, and a
// pipeline of S stages takes S contiguous, non-empty runs of units. The partition minimizes the
// slowest stage's time (compute plus sending what crosses its cut), subject to a per-stage memory
// limit that counts the schedule's in-flight micro-batches on that stage:
//   time(i, j)      = sum over units i..j-1 of (forward + input_grad + weight_grad)
//                     + latency + stage_send_bytes(i, j) / bandwidth   (no send after the last stage)
//   memory(i, j, s) = sum of state_bytes + in_flight[s] * sum of activation_bytes
//   T[0][0] = 0,  T[s][j] = min over i < j with memory(i, j, s-1) <= limit of max(T[s-1][i], time(i, j))
// O(S L^2) with prefix sums (the send bytes tabled once). When no partition fits, the error names
// the smallest limit that does
// (a second DP minimizing the largest stage memory).
//
// V-shaped placement (schedule.h: rank r holds stage r and stage 2R-1-r) partitions the units
// into 2R stages and minimizes the slowest *rank*: rank r holds units [a_r, a_{r+1}) and
// [b_{r+1}, b_r) (a_0 = 0, b_0 = L), the last rank the middle run [a_{R-1}, b_{R-1}), split in
// two stages where the larger half is smallest. Skips made and read on one rank cost no send.
//   V[r][a][b] = min over a < a' < b' < b of max(time_r(a, a', b', b), V[r+1][a'][b'])
// under each rank's memory limit (both stages' state and in-flight activations). O(R L^4); the
// models here have tens of units.
#pragma once
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "pipeline/simulate.h"

namespace ddm {

// A U-Net skip a unit makes: the unit that reads it (pops or replaces it; the unit count when none
// does, and then the last stage holds it) and its bytes.
struct PipeSkip {
  int read = 0;
  double bytes = 0;
};

struct PipeUnit {
  std::string name;
  double forward = 0, input_grad = 0, weight_grad = 0;  // per micro-batch
  double activation_bytes = 0;  // saved for the backward, per micro-batch
  double state_bytes = 0;       // parameters, gradients and optimizer state
  double cut_bytes = 0;         // every tensor live after this unit (open U-Net skips too), per micro-batch
  std::vector<PipeSkip> skips;  // the skips it makes, per micro-batch (part of cut_bytes while open)
  double weight_pass = -1;      // autograd of its parameters alone (the runtime's W); < 0: not profiled
};

// What a stage of units [i, j) sends on (j < the unit count), per micro-batch: the carry after unit
// j-1 without the open skips (cut_bytes less their bytes), plus every skip made in [i, j) that a
// unit from j on reads. Each skip thus leaves its stage once, straight to its reader (the
// runtime's direct routes, pipeline/routes.h), and a skip made before i costs this stage nothing.
// Units without skip lists send their whole cut_bytes.
// With `local` = [lo, hi): skips read there stay on the stage's rank and are not sent.
double stage_send_bytes(const std::vector<PipeUnit>& units, int i, int j, std::pair<int, int> local = {0, 0});

struct PipeLink {
  double bandwidth = std::numeric_limits<double>::infinity();  // bytes per time unit
  double latency = 0;                                          // time units per message
  double time(double bytes) const { return bytes > 0 ? latency + bytes / bandwidth : 0; }
};

struct PipePartition {
  std::vector<int> first;  // first unit of each stage, plus the unit count at the end: stage s = [first[s], first[s+1])
  std::vector<int> stage_rank;  // V-shaped placement: the rank of each stage; empty: stage s on rank s
  std::vector<double> stage_time, stage_memory;
  double bottleneck = 0;   // the slowest rank's time
  int rank_of(int stage) const { return stage_rank.empty() ? stage : stage_rank[stage]; }
};

// `in_flight[s]`: micro-batches stage s holds at its peak (peak_in_flight of the schedule).
PipePartition partition_units(const std::vector<PipeUnit>& units, int stages, const std::vector<int>& in_flight,
                              double memory_limit, const PipeLink& link);

// The V-shaped partition over `ranks` ranks (2 x ranks stages; `in_flight` per stage).
PipePartition partition_units_v(const std::vector<PipeUnit>& units, int ranks, const std::vector<int>& in_flight,
                                double memory_limit, const PipeLink& link);

// The per-stage costs of a partition, for the simulator: stage sums (and I and W of a split
// backward as the runtime runs them, see PipeStageCost); for each cut, the link's time
// for the carry and the skips its next stage reads; a skip route (PipeSkipRoute) for each skip read
// two or more stages after the one that made it. Under V-shaped placement a cut or a skip between
// two stages of one rank costs nothing and needs no route.
PipeCosts costs_of_partition(const std::vector<PipeUnit>& units, const PipePartition& p, const PipeLink& link);

}  // namespace ddm
