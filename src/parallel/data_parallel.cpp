// The data-parallel engine (parallel/engine.h): every process a whole model on its share of the
// global batch; gradients averaged over the job by GradSync's buckets during backward
// (comm/grad_sync.h), the loss and the gradient norm over the job too, so every rank steps alike.
// One process is its trivial case: no sync, no collectives. parallel/diloco_engine.cpp builds on it.
// parallel.shard_optimizer: each rank keeps a range of the optimizer state (train/shard.h).
#include "parallel/data_parallel.h"

#include <csignal>
#include <sstream>

#include "comm/grad_sync.h"
#include "train/shard.h"

namespace ddm {

int agree_on_stop(Comm& comm, int signal) {
  // One all-reduce of the strongest: 0 none, 1 a signal, 2 SIGINT, 3 + 2 r + b: rank r cannot read its
  // next batch (b = 1: bad input).
  const int64_t level = is_cannot_read_stop(signal) ? 3 + 2 * comm.rank() + (signal - kStopCannotRead)
                        : signal == SIGINT          ? 2
                        : signal != 0               ? 1
                                                    : 0;
  const int64_t agreed = comm.distributed() ? comm.max_int(level) : level;
  if (agreed >= 3) return kStopCannotRead + static_cast<int>(agreed - 3);
  return agreed == 2 ? SIGINT : agreed == 1 ? (signal != 0 ? signal : SIGTERM) : 0;
}

namespace {
// parallel.shard_optimizer: this rank's share of the optimizer state, allocated so from the start.
ShardOf shard_of(const EngineParts& parts, bool sync_gradients) {
  if (!sync_gradients || !parts.cfg.parallel.shard_optimizer || !parts.comm->distributed()) return {};
  return {parts.comm->world_size(), parts.comm->rank()};
}
}  // namespace

DataParallelEngine::DataParallelEngine(const EngineParts& parts, bool sync_gradients)
    : cfg_(parts.cfg), net_(parts.net), comm_(parts.comm), lead_(parts.layout.rank == 0),
      step_(parts.cfg, parts.net, parts.objective, shard_of(parts, sync_gradients)) {
  if (sync_gradients && comm_->distributed()) {
    FlatAdamW& o = step_.optim();
    step_.set_data_parallel(comm_,
                            std::make_shared<GradSync>(comm_, o.params(), o.flat_grad(), grad_sync_options(cfg_.parallel)));
  }
}

void DataParallelEngine::take_resumed(const Checkpoint* resumed, const std::string& origin, int64_t) {
  if (step_.optim().sharded()) return share_resumed(*comm_, step_.optim(), resumed, origin);
  for (torch::Tensor t : step_.optim().state_buffers()) comm_->broadcast(t, 0);
}

std::vector<torch::Tensor> DataParallelEngine::initial_weights() {
  // (A sharded EMA is a range of the same weights.)
  if (step_.optim().sharded()) return {step_.optim().flat_params()};
  return {step_.optim().flat_params(), step_.optim().flat_ema()};
}

TensorMap DataParallelEngine::lead_ema() {
  return step_.optim().sharded() ? gather_ema(*comm_, step_.optim()) : step_.optim().named_ema();
}

StepResult DataParallelEngine::step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) {
  return step_.run(micro, step, next);  // the next step's prepare phase at this one's end (train/step.h)
}

int DataParallelEngine::agree_stop(int64_t, int64_t, int signal) { return agree_on_stop(*comm_, signal); }

void DataParallelEngine::fill_checkpoint(Checkpoint& ck) {
  if (!lead_) return;
  ck.model = module_state(*net_);
  ck.ema = step_.optim().named_ema();
  ck.optim = step_.optim().optimizer_state();
}

std::vector<std::string> DataParallelEngine::contribute(Checkpoint& ck, int64_t, const std::string& mine) {
  std::vector<std::string> records =
      comm_->world_size() > 1 ? comm_->all_gather_strings(mine) : std::vector<std::string>{mine};
  if (!step_.optim().sharded()) {
    fill_checkpoint(ck);
    return records;
  }
  // After the records: the other ranks return from here only once rank 0 has written their parts.
  if (lead_) ck.model = module_state(*net_);
  contribute_shards(*comm_, step_.optim(), ck);
  return records;
}

std::string DataParallelEngine::describe() const {
  if (comm_->world_size() == 1) return {};
  const ParallelConfig& p = cfg_.parallel;
  std::ostringstream s;
  s << "parallel: data parallel over " << comm_->world_size() << " processes, gradient buckets up to " << p.bucket_mb
    << " MiB (first " << p.first_bucket_mb << " MiB), " << name_of(p.wire) << " on the wire, collective timeout " << p.timeout
    << " s, over " << comm_->backend_description();
  const FlatAdamW& o = step_.optim();
  if (o.sharded())
    s << "; optimizer state sharded (parallel.shard_optimizer): this rank keeps AdamW's moments and the EMA of "
      << o.shard_end() - o.shard_begin() << " of the " << o.numel() << " trainable parameters (flat range "
      << o.shard_begin() << ".." << o.shard_end() << ")";
  return s.str();
}

std::unique_ptr<Engine> make_data_parallel_engine(const EngineParts& parts) {
  return std::make_unique<DataParallelEngine>(parts, true);
}

}  // namespace ddm
