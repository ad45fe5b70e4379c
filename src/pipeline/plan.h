// The pipeline planner (DiffusionPipe's outer search): for a profiled model and workload
// (profile.h) on a machine of D devices, tries every stage count S dividing D (D/S data-parallel
// replicas of the pipeline), every micro-batch count M dividing a replica's batch, and every
// schedule; partitions the units into S stages by the DP (partition.h, memory limit counting
// the schedule's in-flight micro-batches); and scores each candidate by its simulated iteration
// time with the non-trainable work run serially (data parallelism's and an unfilled pipeline's
// way) and with it filled into the bubbles (fill.h). S = 1 is plain data parallelism (with M
// gradient-accumulation micro-batches), and "dp-sharded" the same with the optimizer state sharded
// (parallel.shard_optimizer: 2 + 3/d of the state's 5 copies per device, AdamW on 1/d of the
// parameters, their all-gather after it). A V-shaped schedule (1f1b-v, zb-v) spreads 2S stages over
// the S ranks of a pipeline (partition_units_v); S counts ranks throughout.
//   tasks      each profiled task, per micro-batch, on any rank, its output sent to stage 0; weight-
//              independent ones may fill the previous iteration's bubbles. A self-conditioned model
//              adds a no-grad pass of every stage (its units' no-grad forward), in partial batches
//              where a bubble holds only part, stage s after s-1 (stage 0 after this iteration's
//              prepared rows), on the rank of stage s, the estimate sent back to stage 0: it uses
//              this step's weights.
//   after the last action  each rank's AdamW + EMA (its parameters x the profiled rate) and, with
//              replicas, the all-reduce of its stages' gradients over the link (ring: 2(d-1)/d of the
//              bytes, 2(d-1) latencies), less the last backward it overlaps (the bucketed sync runs
//              during the backward of the last micro-batch).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "pipeline/fill.h"
#include "pipeline/partition.h"
#include "pipeline/profile.h"
#include "pipeline/schedule.h"

namespace ddm {

struct PipeMachine {
  int devices = 2;
  double speed = 1;  // compute speed relative to the profile's machine
  double memory = std::numeric_limits<double>::infinity();  // bytes per device
  PipeLink link;     // between any two devices: bytes per ms, ms per message
  // Bytes on the wire per float32 byte of an activation or its gradient (0.5: parallel.pipe_wire =
  // bfloat16); the prepared rows and data parallelism's gradients travel as float32.
  double activation_bytes = 1;
};

struct PipePlanOptions {
  int64_t batch = 0;                   // global batch (rows)
  std::vector<int> stages;             // candidate pipeline depths (ranks); empty: every divisor of devices
  std::vector<int> micro;              // candidate micro-batch counts; empty: every divisor of the replica batch up to 64
  std::vector<std::string> schedules;  // empty: all of schedule_names()
  // A fixed split (the first unit of each stage, then the unit count) instead of the DP's, for the
  // schedules whose stage count it fits (e.g. a measured run's, to compare its timeline with the simulator's).
  std::vector<int> first;
};

struct PipePlan {
  int stages = 1, replicas = 1, micro = 1;  // stages: ranks per pipeline (actions.stages counts V's 2S)
  int64_t rows = 0;  // per micro-batch
  std::string schedule;  // a pipeline's; with 1 stage "single", "data-parallel" or "dp-sharded"
  std::vector<PipeUnit> units;  // at `rows` rows, on this machine
  PipePartition partition;
  PipeCosts costs;
  PipeSchedule actions;    // the backbone's schedule
  PipeTimeline serial;     // tasks run serially at the front
  PipeFill filled;         // tasks filled into the bubbles
  double sync = 0;         // the slowest rank's optimizer + exposed all-reduce (in both iterations)
  double serial_iteration() const { return serial.iteration; }
  double filled_iteration() const { return filled.timeline.iteration; }
  // The "cuts" text: unit names of each stage, e.g. "in..down0 | enc1_0..out".
  std::string cuts_text() const;
};

// Every feasible candidate, best (shortest filled iteration) first. Throws ddm::Error when none is
// feasible, with the reason of the last rejection (a memory limit no partition meets names the
// smallest that works), or when an option is out of range (e.g. a stage count not dividing devices).
std::vector<PipePlan> plan_pipeline(const PipeProfile& p, const PipeMachine& m, const PipePlanOptions& o);

}  // namespace ddm
