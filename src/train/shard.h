// The optimizer state sharded over data-parallel ranks (parallel.shard_optimizer; ZeRO stage 1,
// Rajbhandari et al. 2020). Each of the W ranks keeps AdamW's two moments and the EMA for one W-th
// of FlatAdamW's flat buffer and updates only that range of the parameters; after every update
// each rank broadcasts its range, so that every rank holds all the weights again for the next
// forward. The gradients are still all-reduced whole during backward (GradSync), so a step sends one
// more copy of the parameters than plain data parallelism, and each rank holds 3 (W - 1) / W float32
// copies of the trainable model fewer (of 5: weights, gradients, two moments, EMA).
// Checkpoints hold the whole state as an unsharded run's do, by name: rank 0 writes each tensor
// while the ranks whose ranges hold a part of it send that part (Checkpoint::fetch), so no rank
// holds more than its own range and one tensor. Resuming, from a sharded or unsharded run of any
// world size, rank 0 sends each rank its range of the checkpoint it read.
#pragma once
#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"

namespace ddm {

struct ShardRange {
  int64_t begin = 0, end = 0;  // [begin, end) of the flat buffer
  int64_t size() const { return end - begin; }
};

// Rank `rank`'s range of a flat buffer of n elements over `world` ranks: consecutive ranges of
// ceil(n / world) elements rounded up to a multiple of 16 (64 bytes, so that every range starts
// where a whole-buffer kernel's vector would), the last ones shorter or empty.
ShardRange shard_range(int64_t n, int world, int rank);

// Collective, after every rank updated its range: every rank's range of the parameters broadcast
// from it, in place.
void gather_parameters(Comm& comm, FlatAdamW& optim);

// Collective, on resuming: rank 0, which loaded `resumed` (its checkpoint; null elsewhere) into its
// optimizer, sends every other rank that rank's range of the EMA and both moments; the parameters
// are broadcast whole. Errors name `origin`.
void share_resumed(Comm& comm, FlatAdamW& optim, const Checkpoint* resumed, const std::string& origin);

// Collective, for a checkpoint: on rank 0, ck.ema and ck.optim (by name, as FlatAdamW::named_ema and
// optimizer_state) get placeholders that ck.fetch assembles from every rank's range as the writer
// reaches them; the other ranks send the parts of their ranges and return once rank 0 has them all.
// (ck.model, the whole parameters, is the caller's.)
void contribute_shards(Comm& comm, const FlatAdamW& optim, Checkpoint& ck);

// Collective: the whole EMA by name on rank 0 (on the host; a new buffer), empty elsewhere.
TensorMap gather_ema(Comm& comm, const FlatAdamW& optim);

}  // namespace ddm
