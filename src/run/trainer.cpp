// The generic training loop (see trainer.h).
#include "run/trainer.h"

#include <atomic>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "comm/elastic.h"
#include "comm/env.h"
#include "comm/grad_sync.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/progress.h"
#include "core/rng.h"
#include "model/unet.h"
#include "pipeline/profile.h"
#include "pipeline/routes.h"
#include "parallel/layout.h"
#include "pipeline/runtime.h"
#include "train/checkpoint.h"
#include "train/controlnet.h"
#include "train/diloco.h"
#include "train/embed.h"
#include "train/latent.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

// Keys that may differ between a run and its resumption.
RunConfig normalized_for_resume(RunConfig c) {
  RunConfig d;
  c.train.steps = d.train.steps;
  c.train.log_every = d.train.log_every;
  c.train.ckpt_every = d.train.ckpt_every;
  c.train.keep_ckpts = d.train.keep_ckpts;
  c.train.threads = d.train.threads;
  c.train.grad_accum = d.train.grad_accum;  // the global batch stays; how it is split may change
  c.sample = d.sample;
  c.parallel = d.parallel;
  c.diloco = d.diloco;
  return c;
}

// Keys that may differ between the ranks of one job: how many threads each uses, and where each
// finds the data (whose content is compared by hash).
RunConfig normalized_for_ranks(RunConfig c) {
  RunConfig d;
  c.train.threads = d.train.threads;
  c.data.root = d.data.root;
  return c;
}

// Removes what a run writes into its directory (--force, or a run that saved no checkpoint).
void remove_run_files(const fs::path& dir) {
  std::error_code ec;
  for (const char* name : RunDir::run_files()) fs::remove_all(dir / name, ec);
}

// Checks and prepares the run directory, and returns the lock that keeps a second `ddm train` from
// writing to it while this one runs. The lock is taken before --force removes anything.
FileLock prepare_run_dir(const TrainOptions& opt, const RunConfig& cfg) {
  const fs::path dir(opt.out_dir);
  const fs::path cfg_path = RunDir(opt.out_dir).config();
  const char* lock_name = RunDir::kLock;
  if (!fs::exists(cfg_path) && fs::exists(dir) && !opt.force) {
    for (const auto& entry : fs::directory_iterator(dir))
      DDM_CHECK(entry.path().filename() == lock_name,
                "'" << opt.out_dir << "' is not empty and holds no ddm run; use another --out or --force");
  }
  fs::create_directories(dir);
  FileLock lock((dir / lock_name).string(), "another `ddm train` is writing to " + opt.out_dir +
                                                "; wait for it to finish or stop it, or use another --out");
  // A run that saved no checkpoint (it failed early, or was killed before its first one) has nothing to
  // lose and nothing to resume: it never blocks a fresh start, whatever its config was.
  if (fs::exists(cfg_path) && !latest_checkpoint(opt.out_dir)) {
    if (!opt.quiet)
      std::cout << "note: " << opt.out_dir << " holds a run that saved no checkpoint; starting afresh" << std::endl;
    remove_run_files(dir);
    return lock;
  }
  if (fs::exists(cfg_path)) {
    if (opt.resume) {
      const RunConfig stored = load_config(cfg_path.string());
      const std::string diff =
          first_difference(to_toml(normalized_for_resume(stored)), to_toml(normalized_for_resume(cfg)));
      DDM_CHECK(diff.empty(), "--resume: the config differs from the run stored in " << opt.out_dir << ": " << diff
                                  << ". Only train.steps, log_every, ckpt_every, keep_ckpts, threads, grad_accum, sample.* and "
                                     "parallel.* may change on resume; use a new --out or --force to start over");
      return lock;
    }
    DDM_CHECK(opt.force, "'" << opt.out_dir << "' already holds a run (" << cfg_path.string()
                             << "); use --resume to continue it, --force to overwrite it, or another --out");
    remove_run_files(dir);
  }
  return lock;
}

}  // namespace

int set_threads(int64_t threads, int local_processes) {
  // 0 = the cores shared among the processes on this machine: two ranks with every core each run
  // at half the speed of two ranks with one core each (docs/results.md, "Data parallel").
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int n = threads > 0 ? static_cast<int>(threads) : std::max(1, cores / std::max(1, local_processes));
  torch::set_num_threads(n);
  return n;
}

void resolve_data_shape(RunConfig& cfg, const Dataset& data) {
  ModelConfig& m = cfg.model;
  const int64_t c = data.images.size(1), h = data.images.size(2), w = data.images.size(3);
  DDM_CHECK(h == w, "images must be square, got " << h << "x" << w << " from " << data.description);
  DDM_CHECK(m.num_classes == -1 || m.num_classes == 0 || m.num_classes == data.num_classes,
            "model.num_classes = " << m.num_classes << " but the data has " << data.num_classes
                                   << " classes; use -1 (from data) or 0 (unconditional)");
  if (m.num_classes == -1) m.num_classes = data.num_classes;
  m.self_cond = cfg.train.self_cond > 0;  // derived: the network takes the estimate as more channels
  if (!m.embed.empty()) resolve_embed(m, data);      // on the pixel images, before any latent
  if (!m.controlnet.empty()) {  // the model is the base's U-Net
    resolve_controlnet(cfg, data);
    return;
  }
  if (!m.latent.empty()) {  // the model's input is the autoencoder's latents
    resolve_latent(m, data);
    return;
  }
  DDM_CHECK(m.in_channels == 0 || m.in_channels == c,
            "model.in_channels = " << m.in_channels << " but the data has " << c << " channels; remove the key");
  DDM_CHECK(m.image_size == 0 || m.image_size == h,
            "model.image_size = " << m.image_size << " but the data is " << h << "x" << w << "; remove the key");
  m.in_channels = c;
  m.image_size = h;
}


TrainJob plain_job(RunConfig cfg) {
  validate(cfg);
  set_threads(cfg.train.threads);
  TrainJob job;
  job.data = load_dataset(cfg.data);
  resolve_data_shape(cfg, job.data);
  DDM_CHECK(job.data.images.size(0) > 0, "the dataset " << job.data.description << " is empty");
  job.cfg = cfg;
  job.recorded = cfg;
  return job;
}

namespace {

CommOptions comm_options(const ParallelConfig& p) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(p.timeout * 1000));
  o.connect_timeout = o.timeout;  // a rank started long before rank 0 (a busy Slurm node) waits as long
  return o;
}

// What every rank must agree on before the first step: each config key, the data and the model.
std::vector<std::pair<std::string, std::string>> run_identity(const RunConfig& recorded, const Dataset& data,
                                                              const Net& net) {
  std::vector<std::pair<std::string, std::string>> kv;
  std::istringstream in(to_toml(normalized_for_ranks(recorded)));
  std::string line, section;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line[0] == '[') {
      section = line.substr(1, line.find(']') - 1);
      continue;
    }
    const auto eq = line.find(" = ");
    if (eq != std::string::npos) kv.emplace_back(section + "." + line.substr(0, eq), line.substr(eq + 3));
  }
  const torch::Tensor images = data.images.contiguous(), labels = data.labels.contiguous();
  kv.emplace_back("data (sha256 of the images and labels)",
                  sha256_hex(std::string(static_cast<const char*>(images.data_ptr()), images.nbytes()) +
                             std::string(static_cast<const char*>(labels.data_ptr()), labels.nbytes())));
  kv.emplace_back("model (parameters)", std::to_string(count_params(*net)));
  return kv;
}

// This process's share of a global batch, split into equal micro-batches with their global positions.
std::vector<Batch> split_micro(const Batch& shard, int64_t n) {
  std::vector<Batch> out;
  const int64_t b = shard.x.size(0) / n;
  for (int64_t i = 0; i < n; ++i) out.push_back(shard.rows(i * b, b));
  return out;
}

}  // namespace

TrainSummary train(TrainJob job, const TrainOptions& options) {
  TrainOptions opt = options;
  DDM_CHECK(!opt.out_dir.empty(), "an output directory is required (--out DIR)");
  RunConfig& cfg = job.cfg;
  validate(cfg);
  std::shared_ptr<Comm> comm = opt.comm;
  int local_processes = 1;  // processes of this job on this machine, sharing its cores
  bool rejoining = false;   // restarted alone into a running DiLoCo job (DistEnv::rejoin)
  if (!comm) {
    const DistEnv env = detect_dist_env();
    local_processes = env.local_world_size;
    rejoining = env.rejoin && env.distributed();
    DDM_CHECK(!rejoining || cfg.parallel.mode == "diloco",
              "rank " << env.rank << ": this process was restarted alone into a running job (DDM_REJOIN=1, `ddm launch "
                         "--restart failed`), which only DiLoCo replicas can join (parallel.mode = \"diloco\"); "
                         "data parallelism restarts every process: use `ddm launch --restart all`");
    DDM_CHECK(!rejoining || env.rank != 0, "rank 0 writes the run and cannot rejoin it alone: restart the whole job");
    if (env.restart_count > 0 && !opt.resume) {
      // Restarted by the launcher after a failure (torchelastic's semantics): continue from the last
      // checkpoint; never re-apply --force to the run the first attempt started.
      opt.resume = true;
      opt.force = false;
      if (env.rank == 0 && !opt.quiet)
        std::cout << "restart " << env.restart_count << " of this job: resuming from the last checkpoint" << std::endl;
    }
    comm = rejoining ? Comm::create_store_only(env, comm_options(cfg.parallel)) : Comm::create(env, comm_options(cfg.parallel));
  }
  const int rank = comm->rank(), world = comm->world_size();
  const bool lead = rank == 0;
  if (!lead) opt.quiet = true;
  const int threads = set_threads(cfg.train.threads, local_processes);
  const TrainConfig& tc = cfg.train;
  const Dataset& data = job.data;
  // Checked alike on every rank, before any collective, so a bad value fails every rank at once.
  const ParallelLayout layout = derive_layout(cfg, world, rank);
  const bool diloco_mode = layout.diloco(), pipelined = layout.pipelined();
  const int pp = layout.pp, replicas = layout.replicas, stage = layout.stage, replica = layout.replica;
  const int data_world = replicas;
  const int64_t local_batch = layout.local_batch;
  const std::string config_text = to_toml(job.recorded);

  // The model is built before the run directory is touched, so a config it cannot take leaves nothing.
  const uint64_t seed = static_cast<uint64_t>(tc.seed);
  Net net;
  if (!job.objective) job.objective = make_objective(cfg);
  std::shared_ptr<const LatentSpace> latent;
  {
    static std::mutex init_mutex;  // the global generator: ranks may be threads of one process (tests)
    std::lock_guard<std::mutex> guard(init_mutex);
    torch::manual_seed(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kInit)}));
    net = make_net(cfg.model);
    // Latent models: the frozen encoder runs in every step's prepare phase. Loaded under the lock
    // too: building it draws (then overwritten) initial weights from the global generator.
    if (tc.cache_latents && !opt.quiet && rank == 0)
      std::cout << "caching the latents of " << data.images.size(0) << " images (train.cache_latents)..." << std::endl;
    latent = attach_latent(*job.objective, cfg.model, tc.cache_latents ? &data : nullptr);
    attach_controlnet(*net, cfg.model);  // the locked base, and the trainable copy's initial weights
    attach_embed(*job.objective, cfg.model);  // image-embedding conditioning: the frozen feature network
  }
  net->train();
  // The whole model's identity, before a pipeline stage freezes the other stages' parameters.
  const auto identity = run_identity(job.recorded, data, net);
  const int64_t model_params = count_params(*net);
  std::unique_ptr<TrainStep> trainer_step;
  std::unique_ptr<PipeStep> pipe;
  if (pipelined) {
    // Stage bounds from parallel.cuts, or balanced on one prepared sample row (the same on every stage).
    Prepared sample;
    {
      torch::NoGradGuard no_grad;
      BatchLoader probe(data, 1, seed, false);
      sample = job.objective->prepare(probe.next(), 0);
      sample.cond = net->precompute(sample.xt, sample.t, sample.cond);
    }
    PipeSchedule schedule = make_schedule(cfg.parallel.schedule, pp, static_cast<int>(tc.grad_accum));
    std::vector<int> bounds = pipe_stage_bounds(*net, sample, schedule.stages, cfg.parallel.cuts, schedule.several_per_rank());
    // Replicas: the groups of this process's pipeline (its stages) and of its stage (its replicas).
    std::shared_ptr<Comm> line = comm, same_stage;
    if (replicas > 1) {
      line = comm->subgroup("pipeline" + std::to_string(replica), layout.pipeline_ranks());
      same_stage = comm->subgroup("stage" + std::to_string(stage), layout.stage_ranks());
    }
    PipeSkipRoutes routes = pipe_skip_routes(*net, sample, bounds);
    pipe = std::make_unique<PipeStep>(cfg, net, job.objective, line, std::move(bounds),
                                      std::move(schedule),
                                      same_stage, comm, std::move(routes));
  } else {
    trainer_step = std::make_unique<TrainStep>(cfg, net, job.objective);
  }
  FlatAdamW& optim = pipe ? pipe->optim() : trainer_step->optim();
  auto run_step = [&](const std::vector<Batch>& micro, int64_t at, const std::vector<Batch>& next) {
    return pipe ? pipe->run(micro, at, next) : trainer_step->run(micro, at);
  };
  if (diloco_mode) {
    trainer_step->set_ema(false);  // the EMA follows the global weights, at each synchronization
    Diloco::split_fragments(optim.params(), cfg.diloco.fragments);  // a bad fragment count fails before any file is touched
  }
  if (comm->distributed() && !rejoining)
    comm->check_same(identity, "config, data and model");
  if (comm->distributed() && !diloco_mode && !pipelined) {
    GradSyncOptions so;
    so.first_bucket_bytes = static_cast<int64_t>(cfg.parallel.first_bucket_mb * (1 << 20));
    so.bucket_cap_bytes = static_cast<int64_t>(cfg.parallel.bucket_mb * (1 << 20));
    so.fp16_wire = cfg.parallel.wire == "float16";
    trainer_step->set_data_parallel(comm, std::make_shared<GradSync>(comm, optim.params(), optim.flat_grad(), so));
  }

  BatchLoader loader(data, tc.batch_size, derive_seed({seed, static_cast<uint64_t>(RngPurpose::kDataOrder)}),
                     cfg.data.hflip);
  const RunDir dir(opt.out_dir);
  std::optional<FileLock> run_lock;
  TrainSummary summary;
  int64_t step = 0;
  std::string last_ckpt = "none yet";
  double interval_loss_sum = 0;  // the logging interval the checkpoint was written in, so far
  int64_t interval_steps = 0;
  int64_t sent_before = 0;       // bytes rank 0 sent before this run resumed (for the totals)
  std::optional<Checkpoint> resumed;  // rank 0: the checkpoint this run resumes from
  std::string resumed_from;           // rank 0: its directory
  // Only rank 0 touches the run directory: lock, config, records, the checkpoint to resume from.
  std::string setup_error;
  if (lead) {
    try {
      run_lock.emplace(prepare_run_dir(opt, job.recorded));
      write_file_atomic(dir.config(), config_text);
      if (job.records) job.records(dir, opt.resume);
      if (opt.resume) {
        if (auto latest = latest_checkpoint(opt.out_dir)) {
          const Checkpoint& ck = resumed.emplace(read_checkpoint(*latest));
          resumed_from = *latest;
          load_module_state(*net, ck.model, RunDir(*latest) / RunDir::kModel);
          optim.load(ck.model, ck.ema, ck.optim, ck.field<int64_t>("/optimizer_step"), *latest);
          loader.set_cursor({ck.field<int64_t>("/data_cursor/epoch"), ck.field<int64_t>("/data_cursor/index")});
          if (ck.state.contains("log_interval")) {  // absent in checkpoints of older versions
            interval_loss_sum = ck.field<double>("/log_interval/loss_sum");
            interval_steps = ck.field<int64_t>("/log_interval/steps");
          }
          if (ck.state.contains("sent_bytes")) sent_before = ck.field<int64_t>("/sent_bytes");
          step = ck.step;
          last_ckpt = *latest;
          if (!opt.quiet) std::cout << "resuming from " << *latest << " (step " << step << ")\n";
        } else if (!opt.quiet) {
          std::cout << "no checkpoint in " << opt.out_dir << ": starting from step 0\n";
        }
      }
    } catch (const std::exception& e) {
      if (!comm->distributed()) throw;
      setup_error = e.what();
    }
  }
  if (comm->distributed() && !rejoining) {
    // Every rank learns whether rank 0 could set up the run, then starts from rank 0's state (its
    // checkpoint, or the same seeded initialization).
    if (comm->max_int(setup_error.empty() ? 0 : 1) != 0) {
      DDM_CHECK(!lead, setup_error);
      DDM_FAIL("rank 0 could not set up the run in " << opt.out_dir << " (its message says why); nothing was trained");
    }
    torch::NoGradGuard no_grad;
    const auto cur = loader.cursor();
    const int64_t loaded = resumed ? 1 : 0;
    auto ints = torch::tensor({step, optim.step_count(), cur.epoch, cur.index, interval_steps, sent_before, loaded},
                              torch::kLong);
    auto sums = torch::tensor({interval_loss_sum}, torch::kDouble);
    comm->broadcast(ints, 0);
    comm->broadcast(sums, 0);
    if (ints[6].item<int64_t>() != 0 && pipe) {
      // Stage 0 read the checkpoint: every stage of its pipeline takes its own parameters' state from
      // it, by name (whatever split, or none, wrote it); the other replicas then from that pipeline.
      const TensorMap none;
      const std::string origin = resumed ? resumed_from : "the checkpoint";
      if (replica == 0) {
        const TensorMap params = pipe->share(resumed ? resumed->model : none, "", origin);
        const TensorMap ema = pipe->share(resumed ? resumed->ema : none, "", origin);
        TensorMap moments = pipe->share(resumed ? resumed->optim : none, "exp_avg.", origin);
        moments.merge(pipe->share(resumed ? resumed->optim : none, "exp_avg_sq.", origin));
        optim.load(params, ema, moments, ints[1].item<int64_t>(), origin);
      }
      if (replicas > 1) pipe->share_with_replicas();
      for (auto& b : net->named_buffers(true)) {
        torch::Tensor t = b.value();
        comm->broadcast(t, 0);
      }
    } else if (ints[6].item<int64_t>() != 0) {
      for (torch::Tensor t : optim.state_buffers()) comm->broadcast(t, 0);
      for (auto& b : net->named_buffers(true)) {
        torch::Tensor t = b.value();
        comm->broadcast(t, 0);
      }
    } else {
      // A fresh start: every rank made the same seeded initialization (EMA = weights, zero moments),
      // so a hash proves it instead of sending 4 copies of the parameters (6.5 s at 10 Mbit/s).
      std::string blob;
      std::vector<torch::Tensor> weights{optim.flat_params(), optim.flat_ema()};
      if (pipe) weights = net->parameters();  // a stage's optimizer holds only its own: hash the whole model
      for (const torch::Tensor& w : weights) {
        const torch::Tensor t = w.detach().contiguous();
        blob += std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
      }
      for (const auto& b : net->named_buffers(true)) {
        const torch::Tensor t = b.value().contiguous();
        blob += std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
      }
      comm->check_same({{"initial weights (sha256)", sha256_hex(blob)}}, "seeded initialization");
    }
    step = ints[0].item<int64_t>();
    optim.set_step_count(ints[1].item<int64_t>());
    loader.set_cursor({ints[2].item<int64_t>(), ints[3].item<int64_t>()});
    interval_steps = ints[4].item<int64_t>();
    sent_before = ints[5].item<int64_t>();
    interval_loss_sum = sums[0].item<double>();
  }
  bool ckpt_due = false;  // a checkpoint waits for a DiLoCo all-reduce in flight (at most diloco.overlap steps)
  std::unique_ptr<Diloco> diloco;
  int joined_signal = 0;  // a rejoining replica: the stop its group agreed on when it was admitted
  if (diloco_mode) {
    auto group = std::make_shared<ElasticGroup>(
        comm, world, std::chrono::milliseconds(static_cast<int64_t>(cfg.diloco.peer_wait * 1000)));
    diloco = std::make_unique<Diloco>(cfg.diloco, group, optim, tc.ema_decay, step);
    // A joining replica also takes the data cursor and whether a checkpoint is due.
    diloco->set_transfer_hook([&](Comm& c, int source) {
      const auto cur = loader.cursor();
      auto t = torch::tensor({cur.epoch, cur.index, static_cast<int64_t>(ckpt_due)}, torch::kLong);
      c.broadcast(t, source);
      loader.set_cursor({t[0].item<int64_t>(), t[1].item<int64_t>()});
      ckpt_due = t[2].item<int64_t>() != 0;
    });
    if (rejoining) {
      std::cerr << "rank " << rank << ": asking the running job to take this replica back" << std::endl;
      const auto [at, report] = diloco->rejoin(comm_options(cfg.parallel).timeout, tc.steps);
      if (at < 0) {
        std::cerr << "rank " << rank << ": the job finished before this replica could rejoin it; nothing to do"
                  << std::endl;
        summary.rank = rank;
        summary.first_step = summary.last_step = tc.steps;
        return summary;
      }
      step = at;
      joined_signal = report.stop;
      std::cerr << "rank " << rank << ": rejoined at step " << step << " with " << diloco->group().members().size()
                << " of " << world << " replicas" << std::endl;
    } else {
      restore_diloco(*diloco, optim, diloco->group().comm(), resumed ? &*resumed : nullptr, step, opt.quiet);
    }
  }
  resumed.reset();
  // Bytes this rank has sent, over every process group it used.
  auto sent_now = [&] {
    return sent_before + (diloco ? diloco->group().bytes_sent() : comm->bytes_sent()) + (pipe ? pipe->group_bytes_sent() : 0);
  };
  summary.first_step = step;
  summary.rank = rank;
  Progress progress(step, tc.steps, opt.quiet);
  progress.restore_interval(interval_loss_sum, interval_steps);

  if (!opt.quiet) {
    std::cout << "data:  " << data.description << "\n"
              << "model: " << cfg.model.preset << " (" << cfg.model.arch << "), " << model_params
              << " parameters, " << forward_flops_per_image(cfg.model) / 1e6 << " MFLOP/image forward\n"
              << "objective: " << job.objective->describe() << "\n";
    if (latent) {
      const AutoencoderShape& a = latent->shape();
      std::cout << "latent: " << a.latent_channels << "x" << a.latent_size() << "x" << a.latent_size()
                << " latents of the frozen autoencoder " << latent->checkpoint() << " (sha256 "
                << latent->sha256().substr(0, 12) << "..., scale " << latent->scale() << ", shift " << latent->shift()
                << "; its encoder " << encoder_flops_per_image(a) / 1e6 << " MFLOP/image)\n";
    }
    if (!cfg.model.embed.empty())
      std::cout << "embed: conditioned on the " << cfg.model.embed_dim << "-dim embedding of each image by the frozen "
                << cfg.model.embed << " (sha256 " << cfg.model.embed_sha256.substr(0, 12)
                << "...), dropped with the label\n";
    if (!cfg.model.controlnet.empty())
      std::cout << "controlnet: the locked base " << cfg.model.controlnet << " (sha256 "
                << cfg.model.controlnet_sha256.substr(0, 12) << "..., " << unet_forward_flops(cfg.model) / 1e6
                << " MFLOP/image) steered by " << cfg.model.control << " maps; the parameters above are the "
                << "trainable copy, hint block and zero convolutions\n";
    std::cout
              << job.header << "train: " << tc.steps << " steps, batch " << tc.batch_size;
    if (data_world > 1) std::cout << " (" << data_world << (pipelined ? " replicas" : " ranks") << " x " << local_batch << ")";
    if (tc.grad_accum > 1) std::cout << " in " << tc.grad_accum << " micro-batches";
    std::cout << ", lr " << tc.lr << ", " << threads << " thread" << (threads > 1 ? "s" : "")
              << (world > 1 ? " per rank" : "") << ", seed " << tc.seed << "\n";
    if (diloco_mode) {
      const DilocoConfig& d = cfg.diloco;
      std::cout << "parallel: " << (d.fragments > 1 ? "Streaming DiLoCo" : "DiLoCo") << " over " << world
                << " replica" << (world > 1 ? "s" : "") << ", " << d.inner_steps << " inner steps between syncs";
      if (d.fragments > 1) std::cout << " of each of " << d.fragments << " fragments";
      if (d.overlap > 0) std::cout << ", each all-reduce overlapping " << d.overlap << " step" << (d.overlap > 1 ? "s" : "") << " (mix " << d.mix << ")";
      std::cout << ", outer Nesterov lr " << d.outer_lr << " momentum " << d.outer_momentum << ", " << d.wire
                << " on the wire, collective timeout " << cfg.parallel.timeout << " s\n";
    } else if (pipe) {
      const std::vector<int>& b = pipe->bounds();
      const int stages = pipe->stages();
      std::cout << "parallel: " << (replicas > 1 ? std::to_string(replicas) + " data-parallel replicas of a pipeline" : "a pipeline")
                << " of " << stages << " stages" << (stages > pp ? " on " + std::to_string(pp) + " processes, V-shaped" : "")
                << " (" << cfg.parallel.schedule << ", " << tc.grad_accum << " micro-batches of " << local_batch / tc.grad_accum
                << "), units";
      for (int s = 0; s < stages; ++s)
        std::cout << (s ? " | " : " ") << pipe->unit_names()[static_cast<size_t>(b[static_cast<size_t>(s)])] << ".."
                  << pipe->unit_names()[static_cast<size_t>(b[static_cast<size_t>(s) + 1] - 1)]
                  << (stages > pp ? " (rank " + std::to_string(pipe->rank_of_stage(s)) + ")" : "");
      std::cout << " (parallel.cuts = [";
      for (int s = 1; s < stages; ++s) std::cout << (s > 1 ? ", " : "") << b[static_cast<size_t>(s)];
      std::cout << "]), activations in " << cfg.parallel.pipe_wire << " on the wire"
                << (replicas > 1 ? ", gradients in " + cfg.parallel.wire : "") << ", collective timeout "
                << cfg.parallel.timeout << " s\n";
    } else if (world > 1) {
      std::cout << "parallel: data parallel over " << world << " processes, gradient buckets up to "
                << cfg.parallel.bucket_mb << " MiB (first " << cfg.parallel.first_bucket_mb << " MiB), "
                << cfg.parallel.wire << " on the wire, collective timeout " << cfg.parallel.timeout << " s\n";
    }
    std::cout << "out:   " << opt.out_dir << std::endl;
  }

  auto save = [&](int64_t at_step) {
    // DiLoCo: every replica sends its inner state to rank 0 (a collective: every rank saves alike).
    const DilocoReplicas replicas = diloco ? diloco->gather_replicas(at_step) : DilocoReplicas{};
    // A pipeline: every stage contributes its parameters' state, assembled by name (a collective).
    TensorMap params, ema, moments;
    if (pipe && replica == 0) {  // every replica holds the same
      params = pipe->assemble(optim.named_params(), "");
      ema = pipe->assemble(optim.named_ema(), "");
      const TensorMap mine = optim.optimizer_state();
      moments = pipe->assemble(mine, "exp_avg.");
      moments.merge(pipe->assemble(mine, "exp_avg_sq."));
    }
    if (!lead) return last_ckpt;
    Checkpoint ck;
    ck.step = at_step;
    ck.config_toml = config_text;
    ck.model = module_state(*net);
    ck.ema = pipe ? ema : optim.named_ema();
    ck.optim = pipe ? moments : optim.optimizer_state();
    for (const auto& [name, t] : params) ck.model[name] = t;  // the other stages' parameters, current
    if (diloco) add_diloco_state(ck, *diloco, optim, replicas);
    ck.state["sent_bytes"] = sent_now();
    const auto cur = loader.cursor();
    ck.state["optimizer_step"] = optim.step_count();
    ck.state["data_cursor"] = {{"epoch", cur.epoch}, {"index", cur.index}};
    ck.state["log_interval"] = {{"loss_sum", progress.interval_loss_sum()}, {"steps", progress.interval_steps()}};
    ck.state["rng"] = {{"seed", tc.seed},
                       {"scheme", "every draw is keyed by (seed, purpose, step, sample position): nothing else to save"}};
    ck.state["class_names"] = data.class_names;
    ck.state["threads"] = threads;
    ck.state["world_size"] = world;
    if (pipe) {
      ck.state["pipeline"] = {{"stages", pipe->stages()}, {"processes", pp}, {"schedule", cfg.parallel.schedule}, {"first_units", pipe->bounds()}};
    }
    last_ckpt = write_checkpoint(opt.out_dir, ck, tc.keep_ckpts);
    return last_ckpt;
  };

  std::optional<MetricsLog> metrics;
  if (lead) metrics.emplace(dir.metrics(), step);
  g_signal = 0;
  auto old_int = std::signal(SIGINT, on_signal);
  auto old_term = std::signal(SIGTERM, on_signal);
  struct RestoreSignals {
    decltype(old_int) i, t;
    ~RestoreSignals() {
      std::signal(SIGINT, i);
      std::signal(SIGTERM, t);
    }
  } restore{old_int, old_term};

  int64_t interval_sent = sent_now();  // at the start of the logging interval
  int64_t interval_first = step;
  // The end of every step: a checkpoint if one is due and no DiLoCo all-reduce is in flight, then
  // the agreed stop (true: the run stops here).
  auto end_step = [&](int sig) {
    ckpt_due = ckpt_due || step % tc.ckpt_every == 0 || step == tc.steps || sig != 0;
    if (ckpt_due && !(diloco && diloco->in_flight())) {
      save(step);
      ckpt_due = false;
    }
    if (sig == 0) return false;
    progress.finish();
    if (lead)
      std::cout << "stopped by signal " << sig << " at step " << step << "; checkpoint " << last_ckpt
                << " written; continue with --resume" << std::endl;
    summary.interrupted = true;
    summary.signal = sig;
    return true;
  };
  // Wall time of this run's steps after its first, for the pipeline timeline; with a fill plan, of
  // the steps after the first that runs it (which prepares its ahead rows itself).
  double timed_ms = 0;
  int64_t timed_steps = 0, timed_from = summary.first_step + 1;
  bool stopped = false;
  if (rejoining) {
    // The rest of the step the group was at: the other final synchronizations, a checkpoint, a stop.
    stopped = end_step(step == tc.steps ? diloco->after_step(step, tc.steps, 0).stop : joined_signal);
  }
  while (!stopped && step < tc.steps) {
    const int64_t shard_at = layout.shard_offset();
    const Batch shard = loader.next(shard_at, local_batch);
    std::vector<Batch> next;  // a filled pipeline prepares parts of the next step's batch in this step's bubbles
    if (pipe && pipe->wants_next() && step + 1 < tc.steps) {
      const BatchLoader::Cursor at = loader.cursor();
      next = split_micro(loader.next(shard_at, local_batch), tc.grad_accum);
      loader.set_cursor(at);
    }
    const auto step_start = std::chrono::steady_clock::now();
    const StepResult r = run_step(split_micro(shard, tc.grad_accum), step, next);
    if (step >= timed_from) {  // the first step of a run warms up: not timed
      timed_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count();
      ++timed_steps;
    }
    if (pipe && pipe->fill_news() && pipe->fill_plan()->used) timed_ms = 0, timed_steps = 0, timed_from = step + 2;
    // Data parallel: the loss and the gradient norm are global, so every rank stops here alike. DiLoCo:
    // they are this replica's; the others learn of its exit at their next synchronization.
    DDM_CHECK(r.finite, (world > 1 ? "rank " + std::to_string(rank) + ": " : std::string())
                            << "step " << step + 1 << ": the " << (std::isfinite(r.loss) ? "gradient norm" : "loss")
                            << " is " << (std::isfinite(r.loss) ? r.grad_norm : r.loss)
                            << "; training stopped. The last good checkpoint (" << last_ckpt
                            << ") is intact. Lower train.lr (now " << tc.lr
                            << ") or set train.grad_clip, then --resume");
    ++step;
    // A signal to any rank stops every rank after the same step (SIGINT wins over SIGTERM): agreed
    // every step with data parallelism, at the next synchronization with DiLoCo.
    int sig = g_signal.load();
    if (diloco) {
      sig = diloco->after_step(step, tc.steps, sig).stop;
    } else if (comm->distributed()) {
      const int64_t agreed = comm->max_int(sig == SIGINT ? 2 : sig != 0 ? 1 : 0);
      sig = agreed == 2 ? SIGINT : agreed == 1 ? (sig != 0 ? sig : SIGTERM) : 0;
    }

    if (pipe && pipe->fill_news() && lead && !opt.quiet) {
      progress.finish();
      std::cout << "parallel.fill after step " << step << ": " << pipe->fill_plan()->summary << std::endl;
    }
    progress.step(step, r.loss, r.lr, r.grad_norm, tc.batch_size);
    if (step % tc.log_every == 0 || step == tc.steps) {
      const int64_t sent = sent_now();
      if (metrics) {
        nlohmann::json rec = {{"step", step},          {"loss", progress.interval_loss()}, {"lr", r.lr},
                              {"grad_norm", r.grad_norm}, {"img_per_s", progress.interval_img_per_s()},
                              {"epoch", loader.cursor().epoch}};
        if (world > 1) {
          rec["sent_bytes"] = sent;
          rec["sent_bytes_per_step"] = (sent - interval_sent) / std::max<int64_t>(1, step - interval_first);
        }
        metrics->write(rec.dump());
      }
      interval_sent = sent;
      interval_first = step;
      if (!progress.tty() && !opt.quiet) {
        std::printf("step %lld/%lld  loss %.4f  lr %.2e  |g| %.3f  %.0f img/s  ETA %s\n",
                    static_cast<long long>(step), static_cast<long long>(tc.steps), progress.interval_loss(), r.lr,
                    r.grad_norm, progress.interval_img_per_s(), format_duration(progress.eta_seconds(step)).c_str());
        std::fflush(stdout);
      }
      summary.final_loss = progress.interval_loss();
      progress.reset_interval();
    }
    if (end_step(sig)) break;
  }
  if (diloco) diloco->group().finished();  // a replica waiting to rejoin stops waiting
  if (pipe && step > summary.first_step) {
    // The measured timeline of the last step, every stage's, for `ddm plan --measured` to draw and to
    // compare with the simulator's.
    const std::vector<std::string> stages = pipe->all_last_steps();  // of each replica's pipeline: rank 0 writes its own
    if (lead) {
      PipeTimelineRun run;
      run.stages = pp, run.replicas = replicas, run.schedule = cfg.parallel.schedule;
      run.micro = static_cast<int>(tc.grad_accum), run.rows = tc.batch_size / tc.grad_accum, run.threads = threads;
      run.pipe_wire = cfg.parallel.pipe_wire, run.machine = cpu_model_name();
      run.first_units = pipe->bounds(), run.units = pipe->unit_names(), run.step = step;
      run.steps_timed = timed_steps, run.timed_from = timed_from + 1;
      run.step_ms = timed_steps > 0 ? timed_ms / timed_steps : 0.0;
      write_pipe_timeline(dir / RunDir::kPipeTimeline, run, stages, pipe->fill_json());
    }
  }
  const int64_t sent_here = sent_now() - sent_before;
  try {
    summary.bytes_sent = (diloco ? diloco->group().comm() : *comm).max_int(sent_now());
  } catch (const Error&) {
    summary.bytes_sent = sent_now();  // a replica left after the last synchronization: this rank's own
  }
  if (!opt.quiet && world > 1) {
    const int64_t steps_run = std::max<int64_t>(1, step - summary.first_step);
    std::printf("communication: rank 0 sent %s in this run (%s per step over %lld steps); the most any rank sent "
                "over the whole run: %s\n",
                format_bytes(sent_here).c_str(), format_bytes(sent_here / steps_run).c_str(),
                static_cast<long long>(step - summary.first_step), format_bytes(summary.bytes_sent).c_str());
    std::fflush(stdout);
  }
  progress.finish();
  summary.last_step = step;
  summary.checkpoint = last_ckpt;
  return summary;
}

}  // namespace ddm
