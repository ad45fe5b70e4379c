// Setting up a training run, everything before its first step (run/trainer.cpp's loop runs after):
// joining the job's processes, building the model alike on every rank, the run directory (rank 0:
// lock, config, records, the checkpoint to resume from), every rank agreeing on where the run
// starts, and the run's header.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "core/fileio.h"
#include "parallel/engine.h"
#include "run/data_position.h"
#include "run/job.h"
#include "train/checkpoint.h"
#include "train/latent.h"

namespace ddm {

// This process in its job.
struct JobProcess {
  std::shared_ptr<Comm> comm;
  int local_processes = 1;  // processes of this job on this machine, sharing its cores
  bool rejoining = false;   // restarted alone into a running DiLoCo job (DistEnv::rejoin)
  // --resume and rank 0 found a checkpoint in the run directory (every rank knows): the weights come from
  // it, so build_model skips a fine-tuned network's pretrained ones.
  bool from_checkpoint = false;
  torch::Device device = torch::kCPU;  // train.device, resolved for this process
};
// opt.comm, or the job the environment describes (a launcher's variables, else one process). A job
// the launcher restarted after a failure resumes: opt.resume on, opt.force off.
JobProcess join_job(const RunConfig& cfg, TrainOptions& opt);

// data.root made absolute (a relative one is read from the current directory; a pattern keeps its
// braces and globs): what a run records, so that it resumes and is evaluated from any directory.
std::string absolute_data_root(const std::string& root);

// A recorded config less what may change between a run and its resumption (train.steps, lr,
// threads, device, data.root, sample.*, parallel.*, ...): two runs whose normalized configs are
// equal train the same model, and a resume is refused where they differ.
RunConfig normalized_for_resume(RunConfig c);

// The model, built alike on every rank from the seed, with the frozen parts attached: a latent
// model's encoder (job.objective, made if null), a ControlNet's locked base, an embedding network.
// With pretrained off (a run resuming from its checkpoint), model.unet's weights are not read.
struct BuiltModel {
  Net net;
  std::shared_ptr<const LatentSpace> latent;  // null: a pixel model
  int64_t params = 0;                         // the whole model's trainable parameters
};
BuiltModel build_model(TrainJob& job, bool announce, torch::Device device = torch::kCPU, bool pretrained = true);

// What every rank must agree on before the first step: each config key, the data and the model.
std::vector<std::pair<std::string, std::string>> run_identity(const RunConfig& recorded, const Dataset& data,
                                                              const Net& net);

// Where this run starts, as every rank agreed.
struct RunStart {
  std::optional<FileLock> lock;       // rank 0: the run directory's, held for the whole run
  int64_t step = 0;                   // the step to continue after
  std::string last_ckpt = "none yet"; // the checkpoint it resumed from
  double interval_loss_sum = 0;       // the logging interval that checkpoint was written in, so far
  int64_t interval_steps = 0;
  int64_t interval_skipped = 0;       // fp16: its steps skipped for an overflow
  int64_t sent_before = 0;            // bytes rank 0 had sent before this run resumed
  std::optional<Checkpoint> resumed;  // rank 0: the checkpoint it resumed from
};

// Rank 0 prepares the run directory (lock, config.toml, job.records) and, with opt.resume, loads the
// latest checkpoint into net, the engine's optimizer and the data position. With several processes
// (and not rejoining) every rank then learns whether that worked (rank 0's error, or one naming rank
// 0) and takes rank 0's state: the resumed one (Engine::take_resumed and the model's buffers), or,
// on a fresh start, a hash proves every rank's seeded initialization identical; and each replica's
// data position. from_checkpoint: JobProcess's (a checkpoint that has gone since is an error, not a
// start from the network's initialization).
RunStart start_run(const TrainOptions& opt, const TrainJob& job, Net& net, Engine& engine, DataPosition& data,
                   Comm& comm, bool rejoining, bool from_checkpoint);

// The run's header (data, model, objective, conditioning, batch and threads, the engine, out).
void print_run_header(const TrainJob& job, const BuiltModel& model, const ParallelLayout& layout, const Engine& engine,
                      int threads, torch::Device device, const std::string& out_dir);

}  // namespace ddm
