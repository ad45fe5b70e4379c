// Setting up a training run (see setup.h).
#include "run/setup.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <sstream>

#include "comm/env.h"
#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/input_check.h"
#include "core/rng.h"
#include "core/tensor_hash.h"
#include "data/shard_stream.h"
#include "model/unet.h"
#include "train/controlnet.h"
#include "train/embed.h"
#include "train/network.h"
#include "train/text.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// Keys that may differ between the ranks of one job: how many threads each uses, its device, and
// where and how each finds the data (whose content is compared by hash).
RunConfig normalized_for_ranks(RunConfig c) {
  RunConfig d;
  c.train.threads = d.train.threads;
  c.train.device = d.train.device;
  c.data.root = d.data.root;
  c.data.decode_threads = d.data.decode_threads;
  c.data.scan_cache = d.data.scan_cache;
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
  // What --out holds is input: each refusal below fails a retry alike (exit 2, not restarted).
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw InputError("--out " + opt.out_dir + " is a file, not a run directory; name a directory (new or a run's)");
  if (!fs::exists(cfg_path) && fs::exists(dir) && !opt.force) {
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.path().filename() != lock_name)
        throw InputError("'" + opt.out_dir + "' is not empty and holds no ddm run; use another --out or --force");
  }
  as_input_error([&] { create_output_dir(opt.out_dir, "--out"); });
  FileLock lock = as_input_error([&] {
    return FileLock((dir / lock_name).string(), "another `ddm train` is writing to " + opt.out_dir +
                                                    "; wait for it to finish or stop it, or use another --out");
  });
  // A run that saved no checkpoint (it failed early, or was killed before its first one) has nothing to
  // lose and nothing to resume: it never blocks a fresh start, whatever its config was.
  if (fs::exists(cfg_path) && !latest_checkpoint(opt.out_dir)) {
    if (!opt.quiet && !opt.resume)  // (--resume says it below: "no checkpoint in ...")
      std::cout << "note: " << opt.out_dir << " holds a run that saved no checkpoint; starting afresh" << std::endl;
    remove_run_files(dir);
    return lock;
  }
  if (fs::exists(cfg_path)) {
    if (opt.resume) {
      const RunConfig stored = as_input_error([&] { return load_config(cfg_path.string()); });
      if (opt.restarted) {
        // Resumed because a launcher restarted the job, not because the user asked: the run must be the
        // one this job's first attempt started, which recorded this very config. Another (the first
        // attempt refused to touch it) is left as it is.
        const std::string diff = first_difference(to_toml(normalized_for_ranks(stored)), to_toml(normalized_for_ranks(cfg)));
        if (!diff.empty())
          throw InputError("restart of this job: " + opt.out_dir + " holds a run with another config than this job's (" +
                           diff + "), so this job's first attempt did not start it; it is left as it is (a restart "
                           "never overwrites a run: run the command again, with --resume to continue it, --force to "
                           "overwrite it, or another --out)");
      }
      // A frozen part found elsewhere (a moved project, a rebuilt environment) with the weights the run
      // recorded (its sha256): the run goes on with it there, said.
      RunConfig was = stored;
      struct Frozen {
        std::string ModelConfig::*dir;
        std::string ModelConfig::*sha;
        const char* key;
      };
      for (const Frozen& f : {Frozen{&ModelConfig::text_encoder, &ModelConfig::text_sha256, "model.text_encoder"},
                              Frozen{&ModelConfig::latent, &ModelConfig::latent_sha256, "model.latent"},
                              Frozen{&ModelConfig::embed, &ModelConfig::embed_sha256, "model.embed"},
                              Frozen{&ModelConfig::controlnet, &ModelConfig::controlnet_sha256, "model.controlnet"}}) {
        std::string& dir = was.model.*f.dir;
        const std::string& sha = was.model.*f.sha;
        DDM_INPUT_CHECK(sha.empty() || (cfg.model.*f.sha).empty() || sha == cfg.model.*f.sha,
                        "--resume: " << f.key << " = " << cfg.model.*f.dir << " holds other weights (sha256 "
                                     << (cfg.model.*f.sha).substr(0, 12) << ") than those the run trained with (sha256 "
                                     << sha.substr(0, 12) << "): restore them, or start over with --force");
        if (dir.empty() || sha.empty() || sha != cfg.model.*f.sha || cfg.model.*f.dir == dir ||
            absolute_dir(dir) == absolute_dir(cfg.model.*f.dir))
          continue;
        if (!opt.quiet)
          std::cout << "note: --resume: " << f.key << " moves from " << dir << " to " << cfg.model.*f.dir
                    << " (the same weights: sha256 " << sha.substr(0, 12) << ")" << std::endl;
        dir = cfg.model.*f.dir;
      }
      std::string diff = first_difference(to_toml(normalized_for_resume(was)), to_toml(normalized_for_resume(cfg)));
      if (!diff.empty() && was.model.preset != cfg.model.preset)  // named first: it sets many keys
        diff = "[model] preset = '" + stored.model.preset + "'  (stored run)  vs  preset = '" + cfg.model.preset +
               "'  (now), a model of another shape (the first key it sets otherwise: " + diff + ")";
      DDM_INPUT_CHECK(diff.empty(), "--resume: the config differs from the run stored in " << opt.out_dir << ": " << diff
                                  << ". Only train.steps, lr, grad_clip, log_every, ckpt_every, keep_ckpts, threads, device, precision, loss_scale, deterministic, checkpoint_activations, cuda_graphs, grad_accum, sample_every, sample_n, sample_prompts, data.root, data.skip_bad, data.decode_threads, "
                                     "data.scan_cache, sample.*, parallel.* and diloco.* may change on resume; use a new --out or --force to start over");
      // What changes the training from here on is said (and recorded: config.toml is rewritten).
      const auto changed = [&](const char* key, double was, double now) {
        if (was != now && !opt.quiet)
          std::cout << "note: --resume: train." << key << " changes from " << was << " to " << now << std::endl;
      };
      if (absolute_data_root(stored.data.root) != cfg.data.root && !opt.quiet)
        std::cout << "note: --resume: data.root changes from " << stored.data.root << " to " << cfg.data.root
                  << ": the run goes on over the data there (the same data moved goes on exactly)" << std::endl;
      if (stored.data.skip_bad != cfg.data.skip_bad && !opt.quiet)
        std::cout << "note: --resume: data.skip_bad changes from " << std::boolalpha << stored.data.skip_bad << " to "
                  << cfg.data.skip_bad << std::noboolalpha
                  << (cfg.data.skip_bad ? ": a bad sample is skipped from here on (and counted)"
                                        : ": a bad sample stops the run from here on")
                  << std::endl;
      changed("lr", stored.train.lr, cfg.train.lr);
      changed("grad_clip", stored.train.grad_clip, cfg.train.grad_clip);
      // How the processes train together may change too (a DiLoCo run resumed without its --set goes
      // on as data parallelism): said, with the first key that differs.
      RunConfig was_parallel, now_parallel;
      was_parallel.parallel = stored.parallel, was_parallel.diloco = stored.diloco;
      now_parallel.parallel = cfg.parallel, now_parallel.diloco = cfg.diloco;
      std::string how = first_difference(to_toml(was_parallel), to_toml(now_parallel));
      if (stored.parallel.mode != cfg.parallel.mode)  // named first: the other keys follow from it
        how = "[parallel] mode = '" + name_of(stored.parallel.mode) + "'  (stored run)  vs  mode = '" +
              name_of(cfg.parallel.mode) + "'  (now)";
      if (!how.empty() && !opt.quiet)
        std::cout << "note: --resume: the run goes on with other parallel settings than it was trained with (" << how
                  << "); give the same --set as before to keep them" << std::endl;
      return lock;
    }
    DDM_INPUT_CHECK(opt.force, "'" << opt.out_dir << "' already holds a run (" << cfg_path.string()
                             << "); use --resume to continue it, --force to overwrite it, or another --out");
    if (!opt.quiet)
      for (const std::string& ck : list_checkpoints(opt.out_dir))
        for (const std::string& by : checkpoint_pins(ck))
          std::cout << "note: --force removes " << ck << ", which " << by << " is built on (its pinned.txt)" << std::endl;
    remove_run_files(dir);
  }
  return lock;
}

CommOptions comm_options(const ParallelConfig& p) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(p.timeout * 1000));
  o.connect_timeout = o.timeout;  // a rank started long before rank 0 (a busy Slurm node) waits as long
  // DiLoCo's ElasticGroup regroups after a failure and keeps its own account of who is alive.
  if (p.mode == SyncMode::kDiloco) o.probe_wait = std::chrono::milliseconds(0);
  return o;
}

// train.device for this process, before it joins the others: a device it cannot use fails it alone,
// at once. Every mode trains on a GPU.
torch::Device train_device(const RunConfig& cfg, const DistEnv& env) {
  const std::string key = (env.distributed() ? "rank " + std::to_string(env.rank) + ": " : std::string()) + "train.device";
  return resolve_device(cfg.train.device, env.local_rank, key);
}

// parallel.backend for this process: the GPU whose CUDA tensors go over NCCL, or -1 (Gloo carries
// everything). NCCL needs a GPU per rank: ranks that share one (train.device = cuda:N with several
// processes on a node) stay on Gloo under auto, and nccl is an error for them.
int nccl_device(const RunConfig& cfg, torch::Device device, const DistEnv& env) {
  const CommBackend backend = cfg.parallel.backend;
  if (backend == CommBackend::kGloo || !env.distributed()) return -1;
  const std::string who = "rank " + std::to_string(env.rank) + ": ";
  // DiLoCo survives a lost replica by regrouping, which NCCL's watchdog would prevent (it ends every
  // process of a failed communicator); its outer all-reduce, once per diloco.inner_steps, stays on Gloo.
  // (validate() refuses parallel.backend = nccl with DiLoCo.)
  if (cfg.parallel.mode == SyncMode::kDiloco) return -1;
  if (!device.is_cuda()) {
    DDM_CHECK(backend != CommBackend::kNccl,
              who << "parallel.backend = nccl carries CUDA tensors, but this rank trains on the CPU (train.device = "
                  << cfg.train.device << "): set parallel.backend = gloo or auto");
    return -1;
  }
  const bool shared = cfg.train.device.rfind("cuda:", 0) == 0 && env.local_world_size > 1;
  DDM_CHECK(!(shared && backend == CommBackend::kNccl),
            who << "parallel.backend = nccl, but the " << env.local_world_size << " processes on this node share "
                << device.str() << " (train.device = " << cfg.train.device
                << "), and NCCL cannot put two ranks on one GPU: use train.device = cuda (a GPU per process, by "
                   "LOCAL_RANK) or parallel.backend = gloo");
  return shared ? -1 : device.index();
}

// Whether rank 0 will resume from a checkpoint, known to every rank (collectives, first the ranks'
// agreement on --resume, unless rejoining: a
// rejoining replica takes the group's weights and loads the pretrained ones as on a fresh start). A
// directory rank 0 cannot list counts as none here; start_run then reports it.
bool finds_checkpoint(const TrainOptions& opt, Comm& comm, bool rejoining) {
  if (rejoining) return false;
  // Every rank of a job resumes, or none: a rank started without --resume would start another run
  // (and wait at other collectives than the others, until the timeout).
  if (comm.distributed()) comm.check_same({{"--resume", opt.resume ? "--resume" : "no --resume"}}, "command line");
  if (!opt.resume) return false;
  int64_t found = 0;
  if (comm.rank() == 0) {
    try {
      found = latest_checkpoint(opt.out_dir) ? 1 : 0;
    } catch (const std::exception&) {
    }
  }
  return (comm.distributed() ? comm.max_int(found) : found) != 0;
}

}  // namespace

RunConfig normalized_for_resume(RunConfig c) {
  c = normalized_for_ranks(std::move(c));  // what may differ between ranks may change on resume too
  RunConfig d;
  c.train.steps = d.train.steps;
  c.train.log_every = d.train.log_every;
  c.train.ckpt_every = d.train.ckpt_every;
  c.train.keep_ckpts = d.train.keep_ckpts;
  c.train.precision = d.train.precision;
  c.train.loss_scale = d.train.loss_scale;  // fp16's starting scale: a checkpoint's own scale goes on
  c.train.deterministic = d.train.deterministic;
  c.train.checkpoint_activations = d.train.checkpoint_activations;  // what backward keeps, not what it computes
  c.train.cuda_graphs = d.train.cuda_graphs;  // how the same step is launched
  c.train.grad_accum = d.train.grad_accum;  // the global batch stays; how it is split may change
  c.train.lr = d.train.lr;  // the way on after a loss that was not finite (said when it changes)
  c.train.grad_clip = d.train.grad_clip;
  c.train.sample_every = d.train.sample_every;  // what is watched, not what is trained
  c.train.sample_n = d.train.sample_n;
  c.train.sample_prompts = d.train.sample_prompts;
  c.data.skip_bad = d.data.skip_bad;  // the way on past a bad sample that stopped the run (said when it changes)
  c.sample = d.sample;
  c.parallel = d.parallel;
  c.diloco = d.diloco;
  // Folders recorded with a trailing slash by earlier versions, which now record them without.
  for (std::string* dir : {&c.model.text_encoder, &c.model.unet})
    if (!dir->empty()) *dir = absolute_dir(*dir);
  return c;
}

std::string absolute_data_root(const std::string& root) {
  // A brace pattern may list absolute alternatives ({/mnt/a,/mnt/b}/x.tar): left as it is.
  if (root.empty() || root[0] == '{' || fs::path(root).is_absolute()) return root;
  return (fs::current_path() / root).string();
}

JobProcess join_job(const RunConfig& cfg, TrainOptions& opt) {
  JobProcess p;
  p.comm = opt.comm;
  if (p.comm) {
    p.device = train_device(cfg, DistEnv{});
    p.from_checkpoint = finds_checkpoint(opt, *p.comm, false);
    return p;
  }
  const DistEnv env = detect_dist_env();
  p.device = train_device(cfg, env);
  p.local_processes = env.local_world_size;
  p.rejoining = env.rejoin && env.distributed();
  DDM_CHECK(!p.rejoining || cfg.parallel.mode == SyncMode::kDiloco,
            "rank " << env.rank << ": this process was restarted alone into a running job (DDM_REJOIN=1, `ddm launch "
                       "--restart failed`), which only DiLoCo replicas can join (parallel.mode = \"diloco\"); "
                       "data parallelism restarts every process: use `ddm launch --restart all`");
  DDM_CHECK(!p.rejoining || env.rank != 0, "rank 0 writes the run and cannot rejoin it alone: restart the whole job");
  if (env.restart_count > 0 && !opt.resume) {
    // Restarted by the launcher after a failure (torchelastic's semantics): continue from the last
    // checkpoint; never re-apply --force to the run the first attempt started.
    opt.resume = true;
    opt.restarted = true;
    opt.force = false;
    if (env.rank == 0 && !opt.quiet)
      std::cout << "restart " << env.restart_count << " of this job: resuming from the last checkpoint" << std::endl;
  }
  CommOptions copts = comm_options(cfg.parallel);
  copts.nccl_device = nccl_device(cfg, p.device, env);
  p.comm = p.rejoining ? Comm::create_store_only(env, copts) : Comm::create(env, copts);
  p.from_checkpoint = finds_checkpoint(opt, *p.comm, p.rejoining);
  return p;
}

BuiltModel build_model(TrainJob& job, bool announce, torch::Device device, bool pretrained) {
  const RunConfig& cfg = job.cfg;
  const Dataset& data = job.data;
  if (!job.objective) job.objective = make_objective(cfg);
  BuiltModel m;
  static std::mutex init_mutex;  // the global generator: ranks may be threads of one process (tests)
  std::lock_guard<std::mutex> guard(init_mutex);
  torch::manual_seed(derive_seed({static_cast<uint64_t>(cfg.train.seed), static_cast<uint64_t>(RngPurpose::kInit)}));
  // What the user's files hold (pretrained and frozen weights) is input: a file that does not fit
  // fails every retry alike, so it exits as bad input and supervisors do not restart it.
  as_input_error([&] {
    m.net = make_network(cfg);
    attach_controlnet(*m.net, cfg.model);  // the locked base, and (ddm's) the trainable copy's initial weights
    if (pretrained) {  // fine-tuning: the folder's weights (an SD ControlNet's: after its locked UNet)
      const std::string from = load_pretrained(*m.net, cfg.model);
      if (!from.empty() && announce) std::cout << from << std::endl;
      if (!from.empty() && announce && cfg.model.controlnet.empty() && cfg.train.lr > 1e-4)
        std::cout << "note: fine-tuning pretrained weights at train.lr = " << cfg.train.lr << ", which soon undoes what "
                  << "they learnt; diffusers' train_text_to_image.py uses 1e-5 (configs/sd-finetune.toml)" << std::endl;
    }
    // Latent models: the frozen encoder runs in every step's prepare phase. Loaded under the lock
    // too: building it draws (then overwritten) initial weights from the global generator.
    if (cfg.train.cache_latents && announce)
      std::cout << "caching the latents of " << data.images.size(0) << " images (train.cache_latents)..." << std::endl;
    m.latent = attach_latent(*job.objective, cfg.model, device, cfg.train.cache_latents ? &data : nullptr,
                             data.latents != nullptr);
    attach_embed(*job.objective, cfg.model, device);  // image-embedding conditioning: the frozen feature network
    attach_text(*job.objective, cfg.model, data, device);  // text conditioning: the frozen text encoder
  });
  m.net->to(device);  // initialized on the CPU, so every device starts from the same weights
  m.net->train();
  m.params = count_params(*m.net);  // the whole model's, before a pipeline stage freezes the others'
  return m;
}

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
  // model.preset first: it sets many keys, so ranks given other presets are told that, not the first
  // key it sets.
  std::stable_partition(kv.begin(), kv.end(), [](const auto& p) { return p.first == "model.preset"; });
  Sha256 data_hash;
  hash_tensor(data_hash, data.images);
  hash_tensor(data_hash, data.labels);
  kv.emplace_back("data (sha256 of the images and labels)", data_hash.hex());
  if (data.shards) {  // the images above are only the first few: each rank's scan must agree too
    std::string counts;
    for (const int64_t n : data.shards->counts) counts += std::to_string(n) + " ";
    kv.emplace_back("data (samples per shard)", sha256_hex(counts));
  }
  kv.emplace_back("model (parameters)", std::to_string(count_params(*net)));
  return kv;
}

RunStart start_run(const TrainOptions& opt, const TrainJob& job, Net& net, Engine& engine, DataPosition& data,
                   Comm& comm, bool rejoining, bool from_checkpoint) {
  const RunDir dir(opt.out_dir);
  const bool lead = comm.rank() == 0;
  FlatAdamW& optim = engine.optim();
  RunStart s;
  std::string resumed_from;  // rank 0: the checkpoint's directory
  // Only rank 0 touches the run directory: lock, config, records, the checkpoint to resume from.
  std::string setup_error;
  int64_t failure = 0;  // rank 0: 1 it failed, 2 it refused its input
  if (lead) {
    try {
      s.lock.emplace(prepare_run_dir(opt, job.recorded));
      // The checkpoints this run is built on stay where its config points, however long their own
      // runs train on (train.keep_ckpts keeps pinned ones).
      for (const std::string* ckpt : {&job.recorded.model.latent, &job.recorded.model.controlnet})
        if (!ckpt->empty()) pin_checkpoint(*ckpt, opt.out_dir);
      if (job.records) job.records(dir, opt.resume);
      if (opt.resume) {
        if (auto latest = latest_checkpoint(opt.out_dir)) {
          // (A damaged checkpoint fails every restart alike: bad input, exit 2.)
          Checkpoint& ck = s.resumed.emplace(as_input_error([&] { return read_checkpoint(*latest); }));
          // fp16: a train.loss_scale other than the one the checkpoint was trained with starts the
          // scale again from it (the way on after a run stopped for overflowing; compared with the
          // checkpoint's config, so a resume that dies before its next checkpoint does it again);
          // else the checkpoint's scale goes on. DiLoCo's replicas too: restore_diloco finds none.
          const double was = parse_config(ck.config_toml, ck.state_path).train.loss_scale;
          if (optim.loss_scale().on() && ck.state.contains("loss_scale") && was != job.recorded.train.loss_scale) {
            if (!opt.quiet)
              std::cout << "note: --resume: train.loss_scale changes from " << was << " to "
                        << job.recorded.train.loss_scale << ": the loss scale starts again from it (the checkpoint's "
                        << "was " << ck.state["loss_scale"].value("scale", 0.0) << ")" << std::endl;
            ck.state.erase("loss_scale");
            if (ck.state.contains("diloco")) ck.state["diloco"].erase("loss_scales");
          }
          resumed_from = *latest;
          load_module_state(*net, ck.model, RunDir(*latest) / RunDir::kModel, LoadScope::kHeld);
          optim.load(ck.model, ck.ema, ck.optim, ck.field<int64_t>("/optimizer_step"), *latest);
          // Data that gained or lost samples since (a bad one removed, shards added): the epoch goes on
          // at the same position of a new order, which is said (recorded since 2026-12-06); a position
          // past the end of the smaller data's epoch starts the next epoch.
          const int64_t samples = training_samples(job.data);
          const int64_t then = ck.state.contains("data_cursor") && ck.state["data_cursor"].contains("samples")
                                   ? ck.field<int64_t>("/data_cursor/samples")
                                   : samples;
          bool past_the_end = false;
          try {
            data.resume(ck, opt.quiet);
          } catch (const Error& e) {
            if (then == samples)  // the same data: the checkpoint's position is not one of it
              throw InputError(ck.state_path + ": " + e.what() + " (or its state.json was changed: delete " +
                               *latest + " to resume from the previous checkpoint)");
            nlohmann::json& c = ck.state["data_cursor"];
            c["epoch"] = c["epoch"].get<int64_t>() + 1, c["index"] = 0;
            if (c.contains("replicas"))
              for (auto& r : c["replicas"]) r = {r[0].get<int64_t>() + 1, 0};
            data.resume(ck, opt.quiet);
            past_the_end = true;
          }
          if (then != samples && !opt.quiet)
            std::cout << "note: --resume: the data holds " << samples << " samples, the run's had " << then
                      << " at the checkpoint: "
                      << (past_the_end ? "its position there is past the end of the new data's epoch, so the run "
                                         "starts its next epoch"
                                       : "the rest of this epoch is drawn in an order of the new data (some samples "
                                         "may come twice in it and some not at all); every later epoch draws each once")
                      << std::endl;
          if (ck.state.contains("log_interval")) {  // absent in checkpoints of older versions
            s.interval_loss_sum = ck.field<double>("/log_interval/loss_sum");
            s.interval_steps = ck.field<int64_t>("/log_interval/steps");
            if (ck.state["log_interval"].contains("skipped"))
              s.interval_skipped = ck.field<int64_t>("/log_interval/skipped");
          }
          if (ck.state.contains("sent_bytes")) s.sent_before = ck.field<int64_t>("/sent_bytes");
          // fp16: the loss scale goes on from where it was (a checkpoint of another precision has none:
          // the scale starts at train.loss_scale).
          if (optim.loss_scale().on() && ck.state.contains("loss_scale"))
            optim.loss_scale().from_json(ck.state["loss_scale"], RunDir(*latest) / RunDir::kState);
          s.step = ck.step;
          s.last_ckpt = *latest;
          if (!opt.quiet) std::cout << "resuming from " << *latest << " (step " << s.step << ")\n";
          if (s.step >= job.recorded.train.steps && !opt.quiet)
            std::cout << "note: --resume: the run is at step " << s.step << ", train.steps is "
                      << job.recorded.train.steps << ": nothing more to train (--set train.steps=N to go on)"
                      << std::endl;
        } else {
          DDM_CHECK(!from_checkpoint, "the checkpoints in " << opt.out_dir
                                          << " went away while this run started (another process removed them?); "
                                             "nothing was trained: check the directory and run again");
          if (!opt.quiet) std::cout << "no checkpoint in " << opt.out_dir << ": starting from step 0\n";
        }
      }
      // The config is recorded once the checkpoint it goes on from is read: a resume refused over a
      // damaged checkpoint leaves the run's config as it was (its next resume says what changes).
      write_file_atomic(dir.config(), to_toml(job.recorded));
    } catch (const std::exception& e) {
      if (!comm.distributed()) throw;
      setup_error = e.what();
      failure = dynamic_cast<const InputError*>(&e) ? 2 : 1;
    }
  }
  if (!comm.distributed() || rejoining) return s;
  // Every rank learns whether rank 0 could set up the run (and whether it refused its input, which
  // every rank then exits as), then starts from rank 0's state (its checkpoint, or the same seeded
  // initialization).
  if (const int64_t worst = comm.max_int(failure); worst != 0) {
    const std::string why = lead ? setup_error
                                 : "rank 0 could not set up the run in " + opt.out_dir +
                                       " (its message says why); nothing was trained";
    if (worst == 2) throw InputError(why);
    throw Error(why);
  }
  torch::NoGradGuard no_grad;
  const int64_t loaded = s.resumed ? 1 : 0;
  const LossScale& scale = optim.loss_scale();
  auto ints = torch::tensor({s.step, optim.step_count(), s.interval_steps, s.sent_before, loaded, scale.good_steps(),
                             scale.skips_in_a_row(), s.interval_skipped},
                            torch::kLong);
  auto sums = torch::tensor({s.interval_loss_sum, scale.scale()}, torch::kDouble);
  comm.broadcast(ints, 0);
  comm.broadcast(sums, 0);
  if (ints[4].item<int64_t>() != 0) {
    engine.take_resumed(s.resumed ? &*s.resumed : nullptr, s.resumed ? resumed_from : "the checkpoint",
                         ints[1].item<int64_t>());
    for (auto& b : net->named_buffers(true)) {
      torch::Tensor t = b.value();
      comm.broadcast(t, 0);
    }
  } else {
    // A fresh start: every rank made the same seeded initialization (EMA = weights, zero moments),
    // so a hash proves it instead of sending 4 copies of the parameters (6.5 s at 10 Mbit/s).
    // Hashed tensor by tensor: joining them first held another copy of the weights (1.4 GB for a
    // ControlNet v1.0), which on a big model is what ran a machine out of memory.
    Sha256 hash;
    for (const torch::Tensor& w : engine.initial_weights()) hash_tensor(hash, w);
    for (const auto& b : net->named_buffers(true)) hash_tensor(hash, b.value());
    comm.check_same({{"initial weights (sha256)", hash.hex()}}, "seeded initialization");
  }
  s.step = ints[0].item<int64_t>();
  optim.set_step_count(ints[1].item<int64_t>());
  if (optim.loss_scale().on())
    optim.loss_scale().set(sums[1].item<double>(), ints[5].item<int64_t>(), ints[6].item<int64_t>());
  data.share(comm);  // each replica's data position, rank 0's
  s.interval_steps = ints[2].item<int64_t>();
  s.interval_skipped = ints[7].item<int64_t>();
  s.sent_before = ints[3].item<int64_t>();
  s.interval_loss_sum = sums[0].item<double>();
  return s;
}

void print_run_header(const TrainJob& job, const BuiltModel& model, const ParallelLayout& layout, const Engine& engine,
                      int threads, torch::Device device, const std::string& out_dir) {
  const RunConfig& cfg = job.cfg;
  const TrainConfig& tc = cfg.train;
  const Dataset& data = job.data;
  std::cout << "data:  " << data.description << "\n";
  // (A small cluster, a router's data.holdout, or data.limit can leave fewer samples than one batch.)
  const int64_t samples = training_samples(data);
  if (samples < tc.batch_size)
    std::cout << "note: training takes " << samples << (samples == 1 ? " sample" : " samples")
              << ", fewer than a batch of " << tc.batch_size
              << ": each batch holds some of them more than once (lower train.batch_size, or give it more data)\n";
  std::cout << "model: " << network_name(cfg.model) << ", " << model.params
            << " parameters, " << network_flops_per_image(cfg.model) / 1e6 << " MFLOP/image forward\n"
            << "objective: " << job.objective->describe() << "\n";
  if (model.latent) {
    const AutoencoderShape& a = model.latent->shape();
    std::cout << "latent: " << a.latent_channels << "x" << a.latent_size() << "x" << a.latent_size()
              << " latents of the frozen autoencoder " << model.latent->checkpoint() << " (sha256 "
              << model.latent->sha256().substr(0, 12) << "..., scale " << model.latent->scale() << ", shift "
              << model.latent->shift() << "; ";
    if (data.latents)
      std::cout << "encoded once by `ddm encode`: its encoder does not run)\n";
    else
      std::cout << "its encoder " << encoder_flops_per_image(a) / 1e6 << " MFLOP/image)\n";
  }
  if (!cfg.model.text_encoder.empty())
    std::cout << "text: conditioned on the captions through the frozen " << cfg.model.text_encoder << " (sha256 "
              << cfg.model.text_sha256.substr(0, 12) << "...; states " << cfg.model.text_tokens << " x "
              << cfg.model.text_dim << ", pooled " << cfg.model.text_pooled_dim << "), captions dropped with probability "
              << cfg.train.caption_dropout
              << (cached_text(cfg.model, data) ? "; the encodings cached in the data are used (the encoder encoded "
                                                 "only the empty prompt)"
                                               : "")
              << std::endl;
  if (!cfg.model.embed.empty())
    std::cout << "embed: conditioned on the " << cfg.model.embed_dim << "-dim embedding of each image by the frozen "
              << cfg.model.embed << " (sha256 " << cfg.model.embed_sha256.substr(0, 12)
              << "...), dropped with the label\n";
  if (!cfg.model.controlnet.empty() && cfg.model.arch == "sd-unet")
    std::cout << "controlnet: "
              << (cfg.model.controlnet == kControlNetFromUnet ? "new, from the UNet's encoder (diffusers' from_unet)"
                                                              : "started from " + cfg.model.controlnet)
              << ", steering the locked UNet (weights sha256 " << cfg.model.controlnet_sha256.substr(0, 12)
              << "...) with " << cfg.model.control << " maps; the parameters above are the ControlNet's\n";
  else if (!cfg.model.controlnet.empty())
    std::cout << "controlnet: the locked base " << cfg.model.controlnet << " (sha256 "
              << cfg.model.controlnet_sha256.substr(0, 12) << "..., " << unet_forward_flops(cfg.model) / 1e6
              << " MFLOP/image) steered by " << cfg.model.control << " maps; the parameters above are the "
              << "trainable copy, hint block and zero convolutions\n";
  std::cout << job.header << "train: " << tc.steps << " steps, batch " << tc.batch_size;
  if (layout.replicas > 1)
    std::cout << " (" << layout.replicas << (layout.pipelined() ? " replicas" : " ranks") << " x "
              << layout.local_batch << ")";
  if (tc.grad_accum > 1) std::cout << " in " << tc.grad_accum << " micro-batches";
  std::cout << ", lr " << tc.lr << ", " << threads << " thread" << (threads > 1 ? "s" : "")
            << (layout.world > 1 ? " per rank" : "") << ", seed " << tc.seed << "\n";
  if (!device.is_cpu() || tc.precision != Precision::kFp32)
    std::cout << "device: " << device.str() << (layout.world > 1 ? " (this rank's)" : "") << ", "
              << (tc.precision == Precision::kBf16   ? "bf16 autocast (weights, gradients, AdamW and EMA in float32)"
                  : tc.precision == Precision::kFp16 ? "fp16 autocast with dynamic loss scaling (weights, gradients, "
                                                       "AdamW and EMA in float32)"
                                                     : "fp32")
              << (tc.deterministic ? ", deterministic algorithms" : "") << "\n";
  if (device.is_cpu() && tc.precision == Precision::kFp16)
    std::cout << "note: float16 has no fast kernels on the CPU (small U-Net and DiT steps took 12x and 22x as long as "
                 "in fp32 on the CPU of docs/results.md): fp16 is for GPUs without bfloat16 tensor cores; on the CPU train in fp32 "
                 "or bf16\n";
  const std::string parallel = engine.describe();
  if (!parallel.empty()) std::cout << parallel << "\n";

  std::cout << "out:   " << out_dir << std::endl;
}

}  // namespace ddm
