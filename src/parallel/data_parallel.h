// The data-parallel engine (parallel/engine.h), and what DiLoCo's engine shares with it: a whole
// model per process, stepped by train/step.h's TrainStep.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "parallel/engine.h"

namespace ddm {

// The stop every rank of `comm` makes, given this process's signal (0: none): one small all-reduce
// (none for one process); SIGINT wins over SIGTERM, and a rank that cannot read its next batch
// (cannot_read_stop, engine.h) over both.
int agree_on_stop(Comm& comm, int signal);

class DataParallelEngine : public Engine {
 public:
  // sync_gradients: average the gradients over the job every step (false: DiLoCo's inner steps).
  DataParallelEngine(const EngineParts& parts, bool sync_gradients);
  FlatAdamW& optim() override { return step_.optim(); }
  void take_resumed(const Checkpoint* resumed, const std::string& origin, int64_t optimizer_step) override;
  std::vector<torch::Tensor> initial_weights() override;
  TensorMap lead_ema() override;  // sharded: assembled on rank 0 from every rank's range
  StepResult step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) override;
  // The next step's prepare phase runs at the end of each step (train/step.h): nothing else changes
  // the weights in between.
  bool wants_next() const override { return true; }
  int agree_stop(int64_t done, int64_t last, int signal) override;
  bool agrees_every_step() const override { return true; }
  std::vector<std::string> contribute(Checkpoint& ck, int64_t step, const std::string& mine) override;
  std::string describe() const override;
  int64_t bytes_sent() const override { return comm_->bytes_sent(); }
  Comm& group() override { return *comm_; }

 protected:
  void fill_checkpoint(Checkpoint& ck);  // rank 0: the model, EMA and optimizer tensors
  const RunConfig cfg_;
  Net net_;
  std::shared_ptr<Comm> comm_;
  bool lead_;  // rank 0 of the job: it writes checkpoints
  TrainStep step_;
};

}  // namespace ddm
