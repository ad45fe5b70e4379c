// The training run (see trainer.h): run/setup.h joins the job, builds the model and the engine
// (parallel/engine.h) and agrees on where the run starts; run/data_position.h keeps where each
// replica is in its data; run/loop.h steps, logs (run/run_log.h) and checkpoints alike on every
// rank; this file puts them together and writes the checkpoints.
#include "run/trainer.h"

#include <chrono>
#include <csignal>
#include <iostream>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/stop_signal.h"
#include "parallel/engine.h"
#include "parallel/layout.h"
#include "run/data_position.h"
#include "run/loop.h"
#include "run/run_log.h"
#include "run/setup.h"
#include "run/train_grids.h"

namespace ddm {
namespace {

void on_signal(int sig) { set_stop_signal(sig); }

// SIGINT and SIGTERM set the process's stop signal while it lives (core/stop_signal.h; the loop stops
// every rank after the same step).
struct SignalsCaught {
  SignalsCaught() : int_(std::signal(SIGINT, on_signal)), term_(std::signal(SIGTERM, on_signal)) { set_stop_signal(0); }
  ~SignalsCaught() {
    std::signal(SIGINT, int_);
    std::signal(SIGTERM, term_);
  }
  using Handler = void (*)(int);
  Handler int_, term_;
};

}  // namespace

TrainSummary train(TrainJob job, const TrainOptions& options) {
  TrainOptions opt = options;
  DDM_CHECK(!opt.out_dir.empty(), "an output directory is required (--out DIR)");
  RunConfig& cfg = job.cfg;
  validate(cfg);
  const JobProcess proc = join_job(cfg, opt);
  const std::shared_ptr<Comm>& comm = proc.comm;
  const int rank = comm->rank(), world = comm->world_size();
  const bool lead = rank == 0;
  if (!lead) opt.quiet = true;
  const int threads = set_threads(cfg.train.threads, proc.local_processes);
  const TrainConfig& tc = cfg.train;
  // Checked alike on every rank, before any collective, so a bad value fails every rank at once.
  // (A layout the config and the process count cannot make is bad input: exit 2, not restarted.)
  const ParallelLayout layout = as_input_error([&] { return derive_layout(cfg, world, rank); });
  // The model and the engine are built before the run directory is touched, so a config they cannot
  // take leaves nothing.
  configure_math(proc.device, tc.deterministic);
  // (Resuming from a checkpoint, a fine-tuned network's pretrained weights are not read: 3.4 GB for SD's UNet.)
  const BuiltModel model = build_model(job, !opt.quiet, proc.device, !proc.from_checkpoint);
  Net net = model.net;
  const auto identity = run_identity(job.recorded, job.data, net);  // before a pipeline stage freezes the others'
  // (Made before the engine, which a DiLoCo replica's transfer hook below leaves holding them.)
  const std::unique_ptr<BatchSource> source =
      make_batch_source(cfg, job.data, layout, proc.local_processes, proc.device.is_cuda());
  DataPosition data(*source);
  LoopState state;
  const std::unique_ptr<Engine> engine = make_engine({cfg, layout, net, job.objective, comm, job.data, proc.from_checkpoint});
  if (comm->distributed() && !proc.rejoining) comm->check_same(identity, "config, data and model");

  RunStart run = start_run(opt, job, net, *engine, data, *comm, proc.rejoining, proc.from_checkpoint);
  state.step = run.step;
  state.last_ckpt = run.last_ckpt;
  EngineStart start;
  start.step = run.step, start.resumed = run.resumed ? &*run.resumed : nullptr;
  start.rejoining = proc.rejoining, start.quiet = opt.quiet;
  // A replica joining mid-run takes whether a checkpoint is due and its data position from the group.
  start.transfer = [&](Comm& c, int from) {
    auto due = torch::tensor({static_cast<int64_t>(state.ckpt_due)}, torch::kLong);
    c.broadcast(due, from);
    state.ckpt_due = due.item<int64_t>() != 0;
    data.hand_over(c, from, lead, proc.rejoining, rank);
  };
  const EngineBegun begun = engine->begin(start);
  TrainSummary summary;
  summary.rank = rank;
  if (begun.over) {
    summary.first_step = summary.last_step = begun.step;
    return summary;
  }
  state.step = summary.first_step = begun.step;
  run.resumed.reset();
  // Bytes this rank has sent, over every process group it used.
  auto sent_now = [&] { return run.sent_before + engine->bytes_sent(); };

  RunLogSpec ls;
  ls.first_step = state.step, ls.steps = tc.steps, ls.log_every = tc.log_every, ls.batch_size = tc.batch_size;
  ls.quiet = opt.quiet, ls.lead = lead, ls.name_skips = !options.quiet, ls.skip_bad = cfg.data.skip_bad;
  ls.world = world, ls.replica = layout.replica, ls.device = proc.device;
  if (lead) {
    const RunDir dir(opt.out_dir);
    ls.metrics_path = dir.metrics(), ls.tensorboard_dir = dir / RunDir::kTensorBoard, ls.grids_dir = dir / RunDir::kGrids;
  }
  RunLog log(ls, sent_now, data, *source);
  log.restore_interval(run.interval_loss_sum, run.interval_steps, run.interval_skipped);
  if (!opt.quiet) print_run_header(job, model, layout, *engine, threads, proc.device, opt.out_dir);
  // Rank 0 holds the whole model (train.sample_every refuses pipeline stages), and samples its grids.
  std::optional<TrainingGrids> grids;
  if (lead && tc.sample_every > 0) {
    grids.emplace(cfg, net, model.latent, job.data, proc.device, opt.out_dir);
    if (!opt.quiet) std::cout << grids->describe() << std::endl;
  }
  auto after_step = [&](int64_t at_step) {
    if (!TrainingGrids::due(tc.sample_every, at_step, tc.steps)) return;
    const auto t0 = std::chrono::steady_clock::now();
    // On every rank: a sharded EMA (parallel.shard_optimizer) is assembled on rank 0 from all of them.
    const TensorMap ema = cfg.sample.use_ema ? engine->lead_ema() : TensorMap{};
    if (!grids) return;
    try {
      const TrainingGrids::Written w = grids->write(at_step, ema);
      log.grid(at_step, w.path, w.png, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    } catch (const Error& e) {  // a grid is for watching: training goes on without it
      std::cout << "step " << at_step << ": no grid (" << e.what() << "); training goes on" << std::endl;
    }
  };

  const std::string config_text = to_toml(job.recorded);
  // A checkpoint: a collective (the engine gathers every rank's state and data position); rank 0
  // writes it.
  auto save = [&](int64_t at_step) {
    Checkpoint ck;
    const std::vector<std::string> positions = engine->contribute(ck, at_step, data.mine());
    data.record(positions, at_step, cfg.data.skip_bad, ck.state);
    ck.state["data_cursor"]["samples"] = training_samples(job.data);  // a resume over changed data says so
    if (!lead) return state.last_ckpt;
    if (cfg.data.skip_bad) log.skipped_at_checkpoint(data.skipped_recorded(), source->replicas());
    ck.step = at_step;
    ck.config_toml = config_text;
    ck.state["sent_bytes"] = sent_now();
    ck.state["optimizer_step"] = engine->optim().step_count();
    if (engine->optim().loss_scale().on()) ck.state["loss_scale"] = engine->optim().loss_scale().to_json();
    ck.state["log_interval"] = {{"loss_sum", log.interval_loss_sum()}, {"steps", log.interval_steps()}};
    if (engine->optim().loss_scale().on()) ck.state["log_interval"]["skipped"] = log.interval_skipped();
    ck.state["rng"] = {{"seed", tc.seed},
                       {"scheme", "every draw is keyed by (seed, purpose, step, sample position): nothing else to save"}};
    ck.state["class_names"] = job.data.class_names;
    ck.state["threads"] = threads;
    ck.state["world_size"] = world;
    return write_checkpoint(opt.out_dir, ck, tc.keep_ckpts);
  };

  LoopSpec spec;
  spec.steps = tc.steps, spec.ckpt_every = tc.ckpt_every, spec.grad_accum = tc.grad_accum;
  spec.shard_offset = layout.shard_offset(), spec.local_batch = layout.local_batch, spec.device = proc.device;
  spec.who = world > 1 ? "rank " + std::to_string(rank) + ": " : std::string();
  spec.alone = world == 1;
  spec.rank = rank;
  spec.lr = tc.lr;
  spec.grad_clip = tc.grad_clip;
  spec.loss_scale = tc.loss_scale;
  int stopped_by = 0;
  {
    const SignalsCaught signals;
    stopped_by = run_loop(*engine, *source, spec, begun, state, log, {save, [] { return stop_signal(); }, after_step});
  }
  summary.interrupted = stopped_by != 0;
  summary.signal = stopped_by;
  engine->finish(RunDir(opt.out_dir), summary.first_step, state.step, threads);
  try {
    summary.bytes_sent = engine->group().max_int(sent_now());
  } catch (const Error&) {
    summary.bytes_sent = sent_now();  // a replica left after the last synchronization: this rank's own
  }
  log.finish(state.step - summary.first_step, run.sent_before, summary.bytes_sent);
  summary.final_loss = log.final_loss();
  summary.device = proc.device.str();
  if (proc.device.is_cuda()) summary.device_peak_bytes = peak_memory_bytes_on(proc.device);
  summary.last_step = state.step;
  summary.checkpoint = state.last_ckpt;
  return summary;
}

}  // namespace ddm
