// The training loop (see trainer.h): after run/setup.h has joined the job, built the model and the
// engine (parallel/engine.h) and agreed on where the run starts, it steps, logs, checkpoints and
// stops alike on every rank.
#include "run/trainer.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <iostream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/progress.h"
#include "core/rng.h"
#include "data/shard_loader.h"
#include "parallel/engine.h"
#include "parallel/layout.h"
#include "run/setup.h"

namespace ddm {
namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

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
  const JobProcess proc = join_job(cfg, opt);
  const std::shared_ptr<Comm>& comm = proc.comm;
  const int rank = comm->rank(), world = comm->world_size();
  const bool lead = rank == 0;
  if (!lead) opt.quiet = true;
  const int threads = set_threads(cfg.train.threads, proc.local_processes);
  const TrainConfig& tc = cfg.train;
  const Dataset& data = job.data;
  // Checked alike on every rank, before any collective, so a bad value fails every rank at once.
  const ParallelLayout layout = derive_layout(cfg, world, rank);
  // The model and the engine are built before the run directory is touched, so a config they cannot
  // take leaves nothing.
  configure_math(proc.device, tc.deterministic);
  const BuiltModel model = build_model(job, !opt.quiet, proc.device);
  Net net = model.net;
  const auto identity = run_identity(job.recorded, data, net);  // before a pipeline stage freezes the others'
  // (Declared before the engine, which a DiLoCo replica's transfer hook below leaves holding them.)
  const uint64_t data_seed = derive_seed({static_cast<uint64_t>(tc.seed), static_cast<uint64_t>(RngPurpose::kDataOrder)});
  std::unique_ptr<BatchSource> source;
  ShardLoader* shard_loader = nullptr;  // data.source = shards: each replica streams shards of its own
  if (data.shards) {
    ShardOrder order;
    order.seed = data_seed, order.replica = layout.replica, order.replicas = layout.replicas;
    order.shuffle_buffer = cfg.data.shuffle_buffer;
    order.keep = data.shard_keep;  // a router's held-out samples are never drawn
    ShardLoaderOptions lo = shard_loader_options(cfg.data, data, layout.local_batch, proc.local_processes);
    lo.pin = proc.device.is_cuda();
    if (data.clusters.defined()) {  // a router or a distilled student: each sample's cluster, by position
      const torch::Tensor k = data.clusters.contiguous();
      lo.clusters = std::make_shared<const std::vector<int64_t>>(k.data_ptr<int64_t>(), k.data_ptr<int64_t>() + k.numel());
    }
    auto l = std::make_unique<ShardLoader>(data.shards, order, lo);
    shard_loader = l.get();
    source = std::move(l);
  } else {
    source = std::make_unique<BatchLoader>(data, tc.batch_size, data_seed, cfg.data.hflip);
  }
  BatchSource& loader = *source;
  bool ckpt_due = false;  // a checkpoint waits while the engine cannot take one (a DiLoCo all-reduce in flight)
  // Each replica's data position and bad samples skipped at the last checkpoint it was in (or the one
  // resumed from; at the start, the beginning): [replica] = epoch, index, skipped, step. Rank 0's
  // lets a replica that rejoins go on from its own (the transfer hook below).
  std::vector<std::array<int64_t, 4>> positions;
  bool adopted = false;  // a rejoining replica has taken its position
  const std::unique_ptr<Engine> engine = make_engine({cfg, layout, net, job.objective, comm, data});
  FlatAdamW& optim = engine->optim();
  if (comm->distributed() && !proc.rejoining) comm->check_same(identity, "config, data and model");

  RunStart run = start_run(opt, job, net, *engine, loader, *comm, proc.rejoining);
  int64_t step = run.step;
  std::string last_ckpt = run.last_ckpt;
  EngineStart start;
  start.step = step, start.resumed = run.resumed ? &*run.resumed : nullptr;
  start.rejoining = proc.rejoining, start.quiet = opt.quiet;
  positions.assign(static_cast<size_t>(loader.replicas()), {0, 0, 0, run.step});
  for (size_t r = 0; r < run.data_cursors.size() && r < positions.size(); ++r)
    positions[r] = {run.data_cursors[r].epoch, run.data_cursors[r].index,
                    r < run.data_skipped.size() ? run.data_skipped[r] : 0, run.step};
  // A replica joining mid-run also takes the data cursor and whether a checkpoint is due. A replica
  // reading shards of its own goes on from its own position at the last checkpoint, which the sender
  // (rank 0) holds: what it drew after that was lost with it, as a --resume of the whole run would.
  start.transfer = [&](Comm& c, int from) {
    const auto cur = loader.cursor();
    auto t = torch::tensor({cur.epoch, cur.index, static_cast<int64_t>(ckpt_due)}, torch::kLong);
    c.broadcast(t, from);
    if (!loader.per_replica()) loader.set_cursor({t[0].item<int64_t>(), t[1].item<int64_t>()});
    ckpt_due = t[2].item<int64_t>() != 0;
    if (!loader.per_replica()) return;
    auto at = torch::full({loader.replicas(), 4}, -1, torch::kLong);  // [replica] = positions[replica]
    if (c.rank() == from && lead)
      for (size_t r = 0; r < positions.size(); ++r)
        at[static_cast<int64_t>(r)] =
            torch::tensor({positions[r][0], positions[r][1], positions[r][2], positions[r][3]}, torch::kLong);
    c.broadcast(at, from);
    if (!proc.rejoining || adopted) return;
    adopted = true;
    const auto mine = at[loader.replica()];
    const int64_t epoch = mine[0].item<int64_t>(), index = mine[1].item<int64_t>();
    if (epoch < 0) {
      std::cerr << "rank " << rank << ": the replica that sent the state keeps no record of this replica's data "
                << "position; its shards start again from the beginning" << std::endl;
      return;
    }
    loader.set_cursor({epoch, index});
    if (shard_loader) shard_loader->set_skipped(std::max<int64_t>(0, mine[2].item<int64_t>()));
    const int64_t recorded = mine[3].item<int64_t>();
    std::cerr << "rank " << rank << ": replica " << loader.replica() << "'s shards go on from epoch " << epoch
              << ", sample " << index << ": "
              << (recorded > 0 ? "its position at the checkpoint of step " + std::to_string(recorded)
                               : std::string("the beginning (no checkpoint has recorded it yet)"))
              << std::endl;
  };
  const EngineBegun begun = engine->begin(start);
  TrainSummary summary;
  summary.rank = rank;
  if (begun.over) {
    summary.first_step = summary.last_step = begun.step;
    return summary;
  }
  step = begun.step;
  run.resumed.reset();
  // Bytes this rank has sent, over every process group it used.
  auto sent_now = [&] { return run.sent_before + engine->bytes_sent(); };
  summary.first_step = step;
  Progress progress(step, tc.steps, opt.quiet);
  progress.restore_interval(run.interval_loss_sum, run.interval_steps);
  if (!opt.quiet) print_run_header(job, model, layout, *engine, threads, proc.device, opt.out_dir);

  const std::string config_text = to_toml(job.recorded);
  int64_t reported_skips = shard_loader ? shard_loader->skipped() : 0;  // the total the lead last printed
  int64_t noticed_skips = reported_skips;                                // this replica's, last named
  auto save = [&](int64_t at_step) {
    Checkpoint ck;
    // Each replica's own data position (shards) and the bad samples it skipped, gathered from the
    // ranks with their state (a collective: every rank saves alike). DiLoCo: from the replicas in
    // the group; one that is gone keeps its last record.
    const auto c = loader.cursor();
    const std::string mine = std::to_string(loader.replica()) + " " + std::to_string(c.epoch) + " " +
                             std::to_string(c.index) + " " + std::to_string(shard_loader ? shard_loader->skipped() : 0);
    const std::vector<std::string> records = engine->contribute(ck, at_step, mine);
    nlohmann::json replicas = nlohmann::json::array(), skipped = nlohmann::json::array();
    int64_t skipped_total = 0;
    if (loader.per_replica()) {
      for (const std::string& a : records) {
        int64_t r = 0, e = 0, i = 0, k = 0;
        std::istringstream(a) >> r >> e >> i >> k;
        positions[static_cast<size_t>(r)] = {e, i, k, at_step};  // the ranks of a replica (pipeline stages) read alike
      }
      for (const auto& p : positions) {
        replicas.push_back({p[0], p[1]});
        skipped.push_back(p[2]);
        skipped_total += p[2];
      }
    }
    if (!lead) return last_ckpt;
    ck.step = at_step;
    ck.config_toml = config_text;
    ck.state["sent_bytes"] = sent_now();
    const auto cur = loader.cursor();
    ck.state["optimizer_step"] = optim.step_count();
    ck.state["data_cursor"] = {{"epoch", cur.epoch}, {"index", cur.index}};
    if (loader.per_replica()) ck.state["data_cursor"]["replicas"] = replicas;
    if (shard_loader && cfg.data.skip_bad) {
      ck.state["skipped_samples"] = {{"total", skipped_total}, {"replicas", skipped}};
      if (skipped_total > reported_skips && !opt.quiet)
        std::cout << "data: " << skipped_total << " bad sample" << (skipped_total > 1 ? "s" : "")
                  << " skipped so far" << (loader.replicas() > 1 ? ", all replicas together" : "")
                  << " (data.skip_bad; each rank's log names its own)" << std::endl;
      reported_skips = skipped_total;
    }
    ck.state["log_interval"] = {{"loss_sum", progress.interval_loss_sum()}, {"steps", progress.interval_steps()}};
    ck.state["rng"] = {{"seed", tc.seed},
                       {"scheme", "every draw is keyed by (seed, purpose, step, sample position): nothing else to save"}};
    ck.state["class_names"] = data.class_names;
    ck.state["threads"] = threads;
    ck.state["world_size"] = world;
    last_ckpt = write_checkpoint(opt.out_dir, ck, tc.keep_ckpts);
    return last_ckpt;
  };

  std::optional<MetricsLog> metrics;
  if (lead) metrics.emplace(RunDir(opt.out_dir).metrics(), step);
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
  // The end of every step: a checkpoint if one is due and the engine can take one, then the agreed
  // stop (true: the run stops here).
  auto end_step = [&](int sig) {
    ckpt_due = ckpt_due || step % tc.ckpt_every == 0 || step == tc.steps || sig != 0;
    if (ckpt_due && engine->can_checkpoint()) {
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
  // A replica that joined a running group: the rest of the step the group was at.
  bool stopped = begun.joined && end_step(step == tc.steps ? engine->agree_stop(step, tc.steps, 0) : begun.stop);
  // The time this rank waits for its batches, as a share of each logging interval's wall time
  // (metrics.jsonl's data_wait): how far the loader is from being the bottleneck.
  using WaitClock = std::chrono::steady_clock;
  double waited = 0;
  auto interval_start = WaitClock::now();
  const auto seconds_since = [](WaitClock::time_point t) { return std::chrono::duration<double>(WaitClock::now() - t).count(); };
  while (!stopped && step < tc.steps) {
    const int64_t shard_at = layout.shard_offset();
    const auto wait_start = WaitClock::now();
    const Batch shard = loader.next(shard_at, layout.local_batch).to(proc.device);
    std::vector<Batch> next;  // a filled pipeline prepares parts of the next step's batch in this step's bubbles
    if (engine->wants_next() && step + 1 < tc.steps)
      next = split_micro(loader.peek(shard_at, layout.local_batch).to(proc.device), tc.grad_accum);
    waited += seconds_since(wait_start);
    const StepResult r = engine->step(split_micro(shard, tc.grad_accum), step, next);
    // Data parallel: the loss and the gradient norm are global, so every rank stops here alike. DiLoCo:
    // they are this replica's; the others learn of its exit at their next synchronization.
    DDM_CHECK(r.finite, (world > 1 ? "rank " + std::to_string(rank) + ": " : std::string())
                            << "step " << step + 1 << ": the " << (std::isfinite(r.loss) ? "gradient norm" : "loss")
                            << " is " << (std::isfinite(r.loss) ? r.grad_norm : r.loss)
                            << "; training stopped. The last good checkpoint (" << last_ckpt
                            << ") is intact. Lower train.lr (now " << tc.lr
                            << ") or set train.grad_clip, then --resume");
    ++step;
    // A signal to any rank stops every rank after the same step: agreed every step with data
    // parallelism, at the next synchronization with DiLoCo.
    const int sig = engine->agree_stop(step, tc.steps, g_signal.load());
    const std::string news = engine->news(step);
    if (!news.empty() && lead && !opt.quiet) {
      progress.finish();
      std::cout << news << std::endl;
    }
    progress.step(step, r.loss, r.lr, r.grad_norm, tc.batch_size);
    // Every replica names its own skipped samples (data.skip_bad) in its own output, as they come.
    if (shard_loader && !options.quiet && shard_loader->skipped() > noticed_skips) {
      progress.finish();
      noticed_skips = shard_loader->skipped();
      std::cout << (world > 1 ? "replica " + std::to_string(layout.replica) + ": " : std::string()) << "skipped "
                << noticed_skips << " bad sample" << (noticed_skips > 1 ? "s" : "") << " so far; the last: "
                << shard_loader->last_skip() << std::endl;
    }
    if (step % tc.log_every == 0 || step == tc.steps) {
      const int64_t sent = sent_now();
      if (metrics) {
        nlohmann::json rec = {{"step", step},          {"loss", progress.interval_loss()}, {"lr", r.lr},
                              {"grad_norm", r.grad_norm}, {"img_per_s", progress.interval_img_per_s()},
                              {"epoch", loader.cursor().epoch}};
        rec["data_wait"] = waited / std::max(1e-9, seconds_since(interval_start));
        // Replica 0's, since the run began (the total of all replicas: each checkpoint's state.json).
        if (shard_loader && cfg.data.skip_bad) rec["skipped_samples"] = shard_loader->skipped();
        if (world > 1) {
          rec["sent_bytes"] = sent;
          rec["sent_bytes_per_step"] = (sent - interval_sent) / std::max<int64_t>(1, step - interval_first);
        }
        metrics->write(rec.dump());
      }
      interval_sent = sent;
      interval_first = step;
      waited = 0;
      interval_start = WaitClock::now();
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
  engine->finish(RunDir(opt.out_dir), summary.first_step, step, threads);
  const int64_t sent_here = sent_now() - run.sent_before;
  try {
    summary.bytes_sent = engine->group().max_int(sent_now());
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
