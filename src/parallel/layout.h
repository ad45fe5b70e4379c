// How the processes of a job divide the training: derived and checked once, from the config, the world
// size and this process's rank, before anything else runs (as torchtitan's ParallelDims); every other
// part then asks it named questions instead of re-deriving them from parallel.* keys.
//
// The modes: data parallel (every process a whole model on its share of the batch; world 1 is its
// trivial case), DiLoCo (every process a whole model, synchronized every few steps) and a pipeline
// (parallel.pp processes per model, one stage each, V-shaped: two; with world / pp data-parallel
// replicas of it, rank = stage x replicas + replica).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"

namespace ddm {

enum class ParallelMode { kData, kDiloco, kPipeline };

struct ParallelLayout {
  ParallelMode mode = ParallelMode::kData;
  int world = 1, rank = 0;
  int pp = 1;        // processes per pipeline (1: no pipeline)
  int replicas = 1;  // copies of the model that split the global batch (the data-parallel world)
  int stage = 0;     // this process's rank within its pipeline (0 without one)
  int replica = 0;   // which copy this process belongs to
  int64_t local_batch = 0;  // rows of the global batch each replica takes per step (train.grad_accum micro-batches)

  bool pipelined() const { return mode == ParallelMode::kPipeline; }
  bool diloco() const { return mode == ParallelMode::kDiloco; }
  // The first row of the global batch this replica takes.
  int64_t shard_offset() const { return replica * local_batch; }
  // The ranks of this replica's pipeline, by stage; of this stage, by replica.
  std::vector<int> pipeline_ranks() const;
  std::vector<int> stage_ranks() const;
};

// Checks that the job's process count fits parallel.pp / parallel.dp and that train.batch_size splits
// into the replicas' equal micro-batches; a clear ddm::Error (naming the keys and what to launch)
// otherwise. The config is validated before (validate()).
ParallelLayout derive_layout(const RunConfig& cfg, int world, int rank);

}  // namespace ddm
