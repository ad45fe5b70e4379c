// GradSync: data-parallel gradient averaging with buckets that overlap backward, as PyTorch's DDP
// does it (c10d::Reducer does not compile against Debian's headers, so this is ddm's own). The
// gradients already live in one flat float buffer (FlatAdamW's), so a bucket is a contiguous range
// of it and needs no copies. Buckets hold parameters in reverse order (their gradients are ready
// first); a post-hook on each parameter's gradient accumulator marks it ready, a bucket whose
// parameters are all ready is all-reduced at once, strictly in bucket order on every rank, and the
// end of backward launches what is left and waits.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "comm/comm.h"
#include "core/config.h"

namespace ddm {

struct GradSyncOptions {
  int64_t first_bucket_bytes = 1 << 20;  // the first bucket (last parameters) starts communication early
  int64_t bucket_cap_bytes = 25 << 20;   // the others; sizes count float32 bytes of the flat buffer
  bool fp16_wire = false;  // send float16 (half the bytes, ~3 decimal digits); Gloo has no bfloat16
};
// The options parallel.* asks for (bucket_mb, first_bucket_mb, wire).
GradSyncOptions grad_sync_options(const ParallelConfig& p);

// One bucket: the flat-buffer range [begin, end) (elements) holding `params` (indices into the
// parameter list, last parameter first).
struct GradBucket {
  int64_t begin = 0, end = 0;
  std::vector<int> params;
  int64_t numel() const { return end - begin; }
};

// What one step's synchronization did, for benchmarks. Times are milliseconds after the first
// gradient of the backward became ready (steady clock); -1 where it did not happen.
struct GradSyncStats {
  int64_t bytes = 0;              // bytes this rank handed to all-reduce (wire dtype)
  std::vector<int> launch_order;  // bucket indices in the order they were launched
  std::vector<double> launch_ms;  // per bucket
  std::vector<double> done_ms;    // per bucket: when its all-reduce completed
  double wait_ms = 0;             // blocked at the end of backward: communication not hidden
  int launched_early = 0;         // buckets launched by hooks, before the end of backward
  int ready_params = 0;           // parameters marked ready by hooks (each at most once)
  int repeated_hooks = 0;         // hook firings for a parameter already marked (ignored)
  bool from_hooks = false;        // false: synchronized by sync_now() / finish() without hooks
  std::chrono::steady_clock::time_point origin;  // the 0 of the times above (the first gradient ready)
};

class GradSync {
 public:
  // params: the trainable parameters in flat-buffer order, each .grad() a view of flat_grad
  // (float32 [P]) at consecutive offsets, as FlatAdamW lays them out. Frozen parameters are not
  // passed. With world size 1 everything is a no-op and no hooks are registered.
  GradSync(std::shared_ptr<Comm> comm, std::vector<torch::Tensor> params, torch::Tensor flat_grad,
           GradSyncOptions options = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // false: hooks do nothing (gradient accumulation over micro-batches: only the last one syncs).
  void set_enabled(bool enabled);
  bool enabled() const;
  // Waits until this step's gradients are averaged. Idempotent: a no-op once they are (backward's
  // end already waits), and while disabled. When no hook fired since the last synchronization but
  // the gradients changed (zeroed or accumulated), it all-reduces every bucket, so a rank whose
  // backward touched no trainable parameter still matches the other ranks' collectives.
  void finish();
  // All-reduces every bucket now and waits (no overlap), whatever the hooks did: e.g. after
  // accumulating with set_enabled(false). Every rank must call it.
  void sync_now();

  const std::vector<GradBucket>& buckets() const;
  const GradSyncStats& last_stats() const;  // of the last completed synchronization

  struct State;  // shared with the hooks, which hold it weakly

 private:
  std::shared_ptr<State> state_;
};

// The bucket layout GradSync uses, exposed for tests and benchmarks: numels of the parameters in
// flat order -> buckets in reverse order; a bucket is closed before a parameter that would take it
// past its limit (first_bucket_bytes for bucket 0, bucket_cap_bytes after); a parameter is never
// split, so one larger than the limit gets a bucket of its own.
std::vector<GradBucket> make_grad_buckets(const std::vector<int64_t>& numels, const GradSyncOptions& options);

}  // namespace ddm
