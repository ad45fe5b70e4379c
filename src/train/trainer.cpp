// The training loop (see trainer.h).
#include "train/trainer.h"

#include <atomic>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "decentral/distill.h"
#include "decentral/partition.h"
#include "diffusion/path.h"
#include "model/router.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/progress.h"
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
  c.sample = d.sample;
  return c;
}

std::string first_difference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  std::string la, lb, section;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(sa, la)), gb = static_cast<bool>(std::getline(sb, lb));
    if (!ga && !gb) return "";
    if (ga && !la.empty() && la[0] == '[') section = la;
    if (la != lb) return section + " " + la + "  (stored run)  vs  " + lb + "  (now)";
  }
}

// Removes what a run writes into its directory (--force, or a run that saved no checkpoint).
void remove_run_files(const fs::path& dir) {
  std::error_code ec;
  for (const char* name : {"ckpt", "metrics.jsonl", "config.toml", "samples.png", "train.log", "expert.json",
                           "router.json", "router_eval.json", "distill.json"})
    fs::remove_all(dir / name, ec);
}

// Checks and prepares the run directory, and returns the lock that keeps a second `ddm train` from
// writing to it while this one runs. The lock is taken before --force removes anything.
FileLock prepare_run_dir(const TrainOptions& opt, const RunConfig& cfg) {
  const fs::path dir(opt.out_dir);
  const fs::path cfg_path = dir / "config.toml";
  const char* lock_name = "train.lock";
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
                                  << ". Only train.steps, log_every, ckpt_every, keep_ckpts, threads and sample.* may "
                                     "change on resume; use a new --out or --force to start over");
      return lock;
    }
    DDM_CHECK(opt.force, "'" << opt.out_dir << "' already holds a run (" << cfg_path.string()
                             << "); use --resume to continue it, --force to overwrite it, or another --out");
    remove_run_files(dir);
  }
  return lock;
}

// An expert trains on one cluster of a partition: checks that the partition belongs to this data,
// keeps the cluster's images, and applies train.expert_budget. Returns a line for the run header.
std::string select_expert_data(RunConfig& cfg, Dataset& data, const Partition& p) {
  check_partition_matches(p, data);
  data = cluster_subset(data, p, cfg.data.expert);
  DDM_CHECK(data.images.size(0) > 0, "cluster " << cfg.data.expert << " of " << p.origin << " is empty");
  TrainConfig& t = cfg.train;
  std::ostringstream line;
  line << "expert: cluster " << cfg.data.expert << " of " << p.k << " (" << data.images.size(0) << " images), budget "
       << t.expert_budget;
  if (t.expert_budget == "split-batch") {
    DDM_CHECK(t.batch_size % p.k == 0, "train.expert_budget = split-batch: train.batch_size = "
                                           << t.batch_size << " is not divisible by K = " << p.k
                                           << "; use a multiple of " << p.k << " so the experts add up to it");
    t.batch_size /= p.k;
    line << " (global batch / " << p.k << ")";
  } else if (t.expert_budget == "split-steps") {
    DDM_CHECK(t.steps % p.k == 0, "train.expert_budget = split-steps: train.steps = "
                                      << t.steps << " is not divisible by K = " << p.k << "; use a multiple of " << p.k);
    t.steps /= p.k;
    t.warmup = std::min(t.warmup, t.steps);
    line << " (global steps / " << p.k << ")";
  }
  return line.str() + "\n";
}

// A router trains on every cluster: checks the partition, fills model.num_experts, attaches each
// image's cluster and withholds data.holdout images chosen at random (holdout_split, seeded by
// train.seed; evaluate_router_run picks the same ones). Returns a line for the run header.
std::string select_router_data(RunConfig& cfg, Dataset& data, const Partition& p) {
  check_partition_matches(p, data);
  ModelConfig& m = cfg.model;
  DDM_CHECK(m.num_experts == 0 || m.num_experts == p.k, "model.num_experts = " << m.num_experts << " but the partition "
                                                        << p.origin << " has K = " << p.k << "; remove the key");
  m.num_experts = p.k;
  data.clusters = p.labels;
  const int64_t n = data.images.size(0), h = cfg.data.holdout;
  DDM_CHECK(h < n, "data.holdout = " << h << " leaves no training images (the data has " << n << ")");
  if (h > 0) {
    const torch::Tensor keep = holdout_split(n, h, static_cast<uint64_t>(cfg.train.seed)).first;
    data.images = data.images.index_select(0, keep);
    data.labels = data.labels.index_select(0, keep);
    data.clusters = data.clusters.index_select(0, keep);
  }
  std::ostringstream line;
  line << "router: " << p.k << " clusters of " << p.origin << "; trains on " << n - h << " images, " << h
       << " held out at random\n";
  return line.str();
}

// expert.json (router.json for a router) records the partition file's hash; a resumed run must see
// the same partition.
void check_partition_record(const TrainOptions& opt, const RunConfig& cfg, const Partition& p) {
  const std::string sha = sha256_file(p.origin);
  const bool router = is_router_arch(cfg.model.arch);
  const fs::path record = fs::path(opt.out_dir) / (router ? "router.json" : "expert.json");
  if (opt.resume && fs::exists(record)) {
    const auto stored = nlohmann::json::parse(read_file(record.string()));
    DDM_CHECK(stored.at("partition_sha256") == sha,
              "--resume: the partition " << p.origin << " changed since this run started (sha256 "
                                         << stored.at("partition_sha256").get<std::string>().substr(0, 12) << ", now "
                                         << sha.substr(0, 12)
                                         << "); an expert or router must finish on the partition it started with. Restore "
                                            "it, or start over with --force");
    return;
  }
  if (router) {
    const nlohmann::json j = {{"partition", p.origin}, {"partition_sha256", sha}, {"k", p.k},
                              {"holdout", cfg.data.holdout},
                              {"holdout_selection", "random, seeded by train.seed"}};
    write_file_atomic(record.string(), j.dump(2) + "\n");
    return;
  }
  const nlohmann::json j = {{"partition", p.origin},           {"partition_sha256", sha},
                            {"k", p.k},                        {"expert", cfg.data.expert},
                            {"images", p.sizes[cfg.data.expert].item<int64_t>()},
                            {"expert_budget", cfg.train.expert_budget},
                            {"batch_size", cfg.train.batch_size}, {"steps", cfg.train.steps}};
  write_file_atomic(record.string(), j.dump(2) + "\n");
}

}  // namespace

int set_threads(int64_t threads) {
  int n = threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(n);
  return n;
}

void resolve_data_shape(RunConfig& cfg, const Dataset& data) {
  ModelConfig& m = cfg.model;
  const int64_t c = data.images.size(1), h = data.images.size(2), w = data.images.size(3);
  DDM_CHECK(h == w, "images must be square, got " << h << "x" << w << " from " << data.description);
  DDM_CHECK(m.in_channels == 0 || m.in_channels == c,
            "model.in_channels = " << m.in_channels << " but the data has " << c << " channels; remove the key");
  DDM_CHECK(m.image_size == 0 || m.image_size == h,
            "model.image_size = " << m.image_size << " but the data is " << h << "x" << w << "; remove the key");
  DDM_CHECK(m.num_classes == -1 || m.num_classes == 0 || m.num_classes == data.num_classes,
            "model.num_classes = " << m.num_classes << " but the data has " << data.num_classes
                                   << " classes; use -1 (from data) or 0 (unconditional)");
  m.in_channels = c;
  m.image_size = h;
  if (m.num_classes == -1) m.num_classes = data.num_classes;
}

TrainSummary train(RunConfig cfg, const TrainOptions& opt) {
  DDM_CHECK(!opt.out_dir.empty(), "an output directory is required (--out DIR)");
  validate(cfg);
  const int threads = set_threads(cfg.train.threads);
  const TrainConfig& tc = cfg.train;

  Dataset data = load_dataset(cfg.data);
  resolve_data_shape(cfg, data);
  DDM_CHECK(data.images.size(0) > 0, "the dataset " << data.description << " is empty");

  const bool router = is_router_arch(cfg.model.arch);
  std::string expert_line;
  Partition partition;
  if (!cfg.data.partition.empty()) partition = load_partition(cfg.data.partition);
  if (router) expert_line = select_router_data(cfg, data, partition);
  std::shared_ptr<DistillTeacher> teacher;
  if (!cfg.train.teacher.empty()) {
    teacher = load_distill_teacher(cfg, data);
    expert_line = describe(*teacher);
  }
  const std::string config_text = to_toml(cfg);
  const RunConfig stored_cfg = cfg;  // an expert's config keeps the global budget; it runs on its share
  if (!cfg.data.partition.empty() && !router) expert_line = select_expert_data(cfg, data, partition);
  // The model is built before the run directory is touched, so a config it cannot take leaves nothing.
  const uint64_t seed = static_cast<uint64_t>(tc.seed);
  torch::manual_seed(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kInit)}));
  Net net = make_net(cfg.model);
  net->train();
  DiffusionStep stepper(cfg, net);
  if (teacher) stepper.set_teacher(teacher_fn(teacher, cfg));

  const FileLock run_lock = prepare_run_dir(opt, stored_cfg);
  const fs::path dir(opt.out_dir);
  write_file_atomic((dir / "config.toml").string(), config_text);
  if (!cfg.data.partition.empty()) check_partition_record(opt, cfg, partition);
  if (teacher) check_distill_record(opt.out_dir, opt.resume, *teacher);
  FlatAdamW& optim = stepper.optim();
  BatchLoader loader(data, tc.batch_size, derive_seed({seed, static_cast<uint64_t>(RngPurpose::kDataOrder)}),
                     cfg.data.hflip);
  const NoisePath path = make_path(cfg.diffusion);

  TrainSummary summary;
  int64_t step = 0;
  std::string last_ckpt = "none yet";
  double interval_loss_sum = 0;  // the logging interval the checkpoint was written in, so far
  int64_t interval_steps = 0;
  if (opt.resume) {
    if (auto latest = latest_checkpoint(opt.out_dir)) {
      const Checkpoint ck = read_checkpoint(*latest);
      load_module_state(*net, ck.model, *latest + "/model.safetensors");
      optim.load(ck.model, ck.ema, ck.optim, ck.field<int64_t>("/optimizer_step"), *latest);
      loader.set_cursor({ck.field<int64_t>("/data_cursor/epoch"), ck.field<int64_t>("/data_cursor/index")});
      if (ck.state.contains("log_interval")) {  // absent in checkpoints of older versions
        interval_loss_sum = ck.field<double>("/log_interval/loss_sum");
        interval_steps = ck.field<int64_t>("/log_interval/steps");
      }
      step = ck.step;
      last_ckpt = *latest;
      if (!opt.quiet) std::cout << "resuming from " << *latest << " (step " << step << ")\n";
    } else if (!opt.quiet) {
      std::cout << "no checkpoint in " << opt.out_dir << ": starting from step 0\n";
    }
  }
  summary.first_step = step;
  Progress progress(step, tc.steps, opt.quiet);
  progress.restore_interval(interval_loss_sum, interval_steps);

  if (!opt.quiet) {
    std::cout << "data:  " << data.description << "\n"
              << "model: " << cfg.model.preset << " (" << cfg.model.arch << "), " << count_params(*net)
              << " parameters, " << forward_flops_per_image(cfg.model) / 1e6 << " MFLOP/image forward\n"
              << "diffusion: " << cfg.diffusion.objective << " on path " << path.name() << ", t "
              << cfg.diffusion.time_dist << "\n"
              << expert_line << "train: " << tc.steps << " steps, batch " << tc.batch_size << ", lr " << tc.lr << ", "
              << threads << " threads, seed " << tc.seed << "\n"
              << "out:   " << opt.out_dir << std::endl;
  }

  auto save = [&](int64_t at_step) {
    Checkpoint ck;
    ck.step = at_step;
    ck.config_toml = config_text;
    ck.model = module_state(*net);
    ck.ema = optim.named_ema();
    ck.optim = optim.optimizer_state();
    const auto cur = loader.cursor();
    ck.state["optimizer_step"] = optim.step_count();
    ck.state["data_cursor"] = {{"epoch", cur.epoch}, {"index", cur.index}};
    ck.state["log_interval"] = {{"loss_sum", progress.interval_loss_sum()}, {"steps", progress.interval_steps()}};
    ck.state["rng"] = {{"seed", tc.seed},
                       {"scheme", "every draw uses a generator seeded from (seed, purpose, step): nothing else to save"}};
    ck.state["class_names"] = data.class_names;
    ck.state["threads"] = threads;
    last_ckpt = write_checkpoint(opt.out_dir, ck, tc.keep_ckpts);
    return last_ckpt;
  };

  MetricsLog metrics((dir / "metrics.jsonl").string(), step);
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

  while (step < tc.steps) {
    Batch batch = loader.next();
    const int64_t b = batch.x.size(0);
    const StepResult r = stepper.run(batch, step);
    DDM_CHECK(r.finite, "step " << step + 1 << ": the " << (std::isfinite(r.loss) ? "gradient norm" : "loss") << " is "
                                << (std::isfinite(r.loss) ? r.grad_norm : r.loss)
                                << "; training stopped. The last good checkpoint (" << last_ckpt
                                << ") is intact. Lower train.lr (now " << tc.lr
                                << ") or set train.grad_clip, then --resume");
    const double loss_val = r.loss, lr = r.lr, gnorm = r.grad_norm;
    ++step;

    progress.step(step, loss_val, lr, gnorm, b);
    if (step % tc.log_every == 0 || step == tc.steps) {
      nlohmann::json rec = {{"step", step},          {"loss", progress.interval_loss()}, {"lr", lr},
                            {"grad_norm", gnorm},    {"img_per_s", progress.interval_img_per_s()},
                            {"epoch", loader.cursor().epoch}};
      metrics.write(rec.dump());
      if (!progress.tty() && !opt.quiet) {
        std::printf("step %lld/%lld  loss %.4f  lr %.2e  |g| %.3f  %.0f img/s  ETA %s\n",
                    static_cast<long long>(step), static_cast<long long>(tc.steps), progress.interval_loss(), lr,
                    gnorm, progress.interval_img_per_s(), format_duration(progress.eta_seconds(step)).c_str());
        std::fflush(stdout);
      }
      summary.final_loss = progress.interval_loss();
      progress.reset_interval();
    }
    if (step % tc.ckpt_every == 0 || step == tc.steps) save(step);
    if (g_signal != 0) {
      progress.finish();
      if (step % tc.ckpt_every != 0 && step != tc.steps) save(step);
      std::cout << "stopped by signal " << g_signal.load() << " at step " << step << "; checkpoint " << last_ckpt
                << " written; continue with --resume" << std::endl;
      summary.interrupted = true;
      summary.signal = g_signal.load();
      break;
    }
  }
  progress.finish();
  summary.last_step = step;
  summary.checkpoint = last_ckpt;
  return summary;
}

LoadedModel load_model(const std::string& path, bool use_ema) {
  LoadedModel m;
  m.checkpoint = resolve_checkpoint(path);
  Checkpoint ck = read_checkpoint(m.checkpoint, /*weights_only=*/true);
  m.cfg = parse_config(ck.config_toml, m.checkpoint + "/state.json (config)");
  m.step = ck.step;
  if (ck.state.contains("class_names")) m.class_names = ck.field<std::vector<std::string>>("/class_names");
  m.net = make_net(m.cfg.model);
  load_module_state(*m.net, ck.model, m.checkpoint + "/model.safetensors");
  if (use_ema) load_module_state(*m.net, ck.ema, m.checkpoint + "/ema.safetensors");
  m.net->eval();
  return m;
}

Denoiser make_denoiser(const LoadedModel& m) {
  DDM_CHECK(!is_router_arch(m.cfg.model.arch), m.checkpoint << " holds a router (" << m.cfg.model.arch
                                                << "), not a diffusion model; sample an ensemble with --ensemble DIR");
  return Denoiser(m.net, make_path(m.cfg.diffusion), prediction_for(m.cfg.diffusion), m.cfg.model.num_classes);
}

}  // namespace ddm
