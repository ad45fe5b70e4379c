// What the trainer draws its batches from: the in-memory BatchLoader (data/dataset.h) or the
// shards' ShardLoader (data/shard_loader.h). A position is (epoch, index): where the next batch
// starts, saved in checkpoints so that a resumed run draws the batches it would have drawn.
#pragma once
#include <cstdint>

namespace ddm {

struct Batch;

class BatchSource {
 public:
  struct Cursor {
    int64_t epoch = 0;
    int64_t index = 0;  // position within the epoch (its permutation, or its draws from the shards)
  };
  virtual ~BatchSource() = default;
  // This process's rows [begin, begin + count) of the next global batch.
  virtual Batch next(int64_t begin = 0, int64_t count = -1) = 0;
  // The batch next(begin, count) returns next, without advancing.
  virtual Batch peek(int64_t begin, int64_t count) = 0;
  // Whether next() can meet a sample it cannot use mid-run (shards decoded while training; data in
  // memory was checked when it was read).
  virtual bool may_fail() const { return false; }
  virtual Cursor cursor() const = 0;
  virtual void set_cursor(const Cursor& c) = 0;
  // True when each data-parallel replica has a cursor of its own (it reads data of its own), false
  // when one cursor walks the global batch for all.
  virtual bool per_replica() const { return false; }
  // This process's data-parallel replica and their count (per_replica loaders; else 0 of 1).
  virtual int replica() const { return 0; }
  virtual int replicas() const { return 1; }
};

}  // namespace ddm
