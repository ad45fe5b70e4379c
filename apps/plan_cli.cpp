// `ddm plan`: profile a training configuration's backbone units and frozen work on this machine
// (or read a saved profile), search pipeline plans for a machine of --devices devices
// (pipeline/plan.h), print them best first and draw the best one's timeline.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "cli_util.h"
#include "core/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/run_dir.h"
#include "decentral/train_run.h"
#include "eval/grid.h"
#include "pipeline/picture.h"
#include "pipeline/plan.h"
#include "pipeline/schedule.h"
#include "pipeline/profile.h"
#include "pipeline/timeline.h"
#include "pipeline/workload.h"
#include "run/trainer.h"
#include "train/controlnet.h"
#include "train/embed.h"
#include "train/network.h"
#include "train/latent.h"
#include "train/text.h"

namespace ddm {
namespace {

struct PlanArgs {
  std::string config, profile, save_profile, timeline, json, measured;
  std::string device;  // empty: the config's train.device
  std::vector<std::string> sets;
  std::vector<int64_t> rows;
  int repeats = 3, devices = 2, top = 12;
  int64_t batch = 0;
  std::vector<int> stages, micro;
  std::vector<std::string> schedules;
  double speed = 1, memory_gib = 0, bandwidth_gbps = 10, latency_us = 20;
  std::string pipe_wire;  // empty: the config's (a measured run's) parallel.pipe_wire, else float32
};

const char* kPlanFooter =
    "What it models: each candidate splits the backbone's units (ResBlocks, attention, transformer blocks: "
    "`ddm plan` lists them) into S contiguous stages by dynamic programming (slowest stage as fast as possible, "
    "each stage's parameters, optimizer state and in-flight activations under --memory; the V-shaped schedules "
    "1f1b-v and zb-v put 2S stages on S ranks, rank r holding stage r and stage 2S-1-r, so a U-Net's skips "
    "between a down block and its up block stay on one rank), runs the schedule's "
    "per-rank actions in a simulator (the messages between two ranks share their link, one at a time each way), "
    "and places the frozen work (the "
    "training step's prepare phase: a latent encoder, control maps, a ControlNet's locked encoder, an "
    "embedding network, a teacher; a self-conditioned model's no-grad pass) either serially at the start of "
    "each iteration, as data parallelism does, or greedily into the pipeline's bubbles (DiffusionPipe). S = 1 "
    "is data parallelism over all devices. Times are this machine's (or the profile's) divided by --speed.\n"
    "Examples:\n"
    "  ddm plan --config configs/latent-quickstart.toml --devices 2 --timeline plan.png\n"
    "  ddm plan --config c.toml --save-profile prof.json --devices 2\n"
    "  ddm plan --profile prof.json --devices 64 --batch 4096 --bandwidth 25 --speed 50\n"
    "  ddm plan --measured runs/pp2 --timeline measured.png   # a pipelined run against the simulator\n"
    "See docs/pipeline.md.";

std::string fmt_gib(double g) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g GiB", g);
  return b;
}

std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f ms", ms);
  return b;
}

// cached_text: the data holds the captions' text encodings (`ddm encode --text`).
std::string workload_of(const RunConfig& cfg, bool cached_text) {
  const ModelConfig& m = cfg.model;
  std::vector<std::string> w;
  if (!m.latent.empty())
    w.push_back(cfg.data.source == "latents" ? "latent shards"
                                             : cfg.train.cache_latents ? "cached latents" : "latent encoder");
  if (!m.controlnet.empty()) w.push_back("ControlNet (" + m.control + " maps, locked encoder)");
  if (!m.embed.empty()) w.push_back("embedding network");
  if (!m.text_encoder.empty()) w.push_back(cached_text ? "cached text encodings" : "text encoder");
  if (!cfg.train.teacher.empty()) w.push_back("teacher ensemble");
  std::string s;
  for (const std::string& x : w) s += (s.empty() ? "" : " + ") + x;
  if (m.self_cond) s += (s.empty() ? "" : " + ") + std::string("self-conditioning pass");
  return s.empty() ? "no frozen work (the objective's draws only)" : s;
}

PipeProfile measure(const PlanArgs& a, int64_t* batch) {
  std::vector<std::string> sets = a.sets;
  TrainJob job = prepare_train_job(load_config(a.config, sets));
  RunConfig& cfg = job.cfg;
  if (*batch == 0) *batch = cfg.train.batch_size;
  // train.threads = 0: the cores shared by --devices processes, as data-parallel ranks here would run.
  const int threads = set_threads(cfg.train.threads, a.devices);
  cfg.train.threads = threads;
  std::vector<int64_t> rows = a.rows;
  if (rows.empty())
    for (int64_t r : {1, 4, 16, 64})
      if (r <= *batch) rows.push_back(r);
  // Where a stage of the planned run would compute: --device, else the config's train.device.
  const torch::Device device = resolve_device(a.device.empty() ? cfg.train.device : a.device, 0,
                                              a.device.empty() ? "train.device" : "--device");
  configure_math(device, cfg.train.deterministic);
  torch::manual_seed(0);
  Net net = make_network(cfg);
  attach_controlnet(*net, cfg.model);
  auto objective = job.objective ? job.objective : make_objective(cfg);
  const auto latent = attach_latent(*objective, cfg.model, device, cfg.train.cache_latents ? &job.data : nullptr,
                                    job.data.latents != nullptr);
  const auto embedder = attach_embed(*objective, cfg.model, device);
  const auto text = attach_text(*objective, cfg.model, job.data, device);  // the frozen text encoder (or cached encodings)
  net->to(device);  // (initialized on the CPU)
  std::cout << "profiling " << network_name(cfg.model) << " and its frozen work (" << workload_of(cfg, cached_text(cfg.model, job.data))
            << ") at micro-batches of";
  for (int64_t r : rows) std::cout << " " << r;
  std::cout << " rows on " << (device.is_cuda() ? machine_name(device) + " (" + device.str() + ")" : "the CPU") << ", "
            << threads << " thread" << (threads == 1 ? "" : "s") << " ..." << std::endl;
  return profile_workload(cfg, job.data, net, objective, rows, a.repeats, workload_of(cfg, cached_text(cfg.model, job.data)));
}

// A pipelined run's measured last step (pipeline/timeline.h).
MeasuredPipeTimeline read_measured(const std::string& run) {
  const std::string path = RunDir(run) / RunDir::kPipeTimeline;
  DDM_INPUT_CHECK(std::filesystem::exists(path), "ddm plan --measured: " << path << " does not exist; it is written at the end of a `ddm train` "
                                                        "with parallel.pp > 1 (the run may not have finished a step)");
  return read_pipe_timeline(path);
}

// A saved profile compared with a measured run must be of the run's model (the same units, by name)
// and machine (the same CPU and threads): another's predicts another step.
void check_profile_fits_run(const PipeProfile& prof, const PipeTimelineRun& run, const std::string& profile_path,
                            const std::string& run_dir) {
  const std::string fix = "; give a profile saved from this run's config on this machine (ddm plan --config ... "
                          "--save-profile), or leave out --profile to profile the run's config now";
  if (!run.units.empty()) {
    const std::vector<std::string>& units = run.units;
    std::vector<std::string> names;
    for (const PipeUnitProfile& u : prof.units) names.push_back(u.name);
    size_t k = 0;
    while (k < units.size() && k < names.size() && units[k] == names[k]) ++k;
    DDM_INPUT_CHECK(units == names, "ddm plan --measured: the profile " << profile_path << " is of another model ("
                                  << prof.model << "): it has " << names.size() << " units, the run " << run_dir << " "
                                  << units.size() << ", and unit " << k << " is '" << (k < names.size() ? names[k] : "-")
                                  << "' there but '" << (k < units.size() ? units[k] : "-") << "' in the run" << fix);
  }
  DDM_INPUT_CHECK(prof.threads == run.threads,
            "ddm plan --measured: the profile " << profile_path << " was taken with " << prof.threads << " thread(s), the run "
                                                << run_dir << " ran " << run.threads << " per process" << fix);
  if (!run.machine.empty()) {
    DDM_INPUT_CHECK(prof.machine.rfind(run.machine + ",", 0) == 0,
              "ddm plan --measured: the profile " << profile_path << " was taken on another machine (" << prof.machine
                                                  << "), the run " << run_dir << " on " << run.machine << fix);
  }
}

int run_plan(PlanArgs a) {
  std::optional<MeasuredPipeTimeline> measured;
  if (!a.measured.empty()) {
    measured = read_measured(a.measured);
    const PipeTimelineRun& r = measured->run;
    if (a.config.empty() && a.profile.empty()) a.config = RunDir(a.measured).config();  // profiled now
    // The run as it ran: r.replicas pipelines of r.stages processes, each its r.micro micro-batches of
    // r.rows rows (its share of the global batch), so that the simulator's micro-batches are the run's.
    if (a.batch == 0) a.batch = static_cast<int64_t>(r.replicas) * r.micro * r.rows;
    a.devices = r.stages * r.replicas;
    a.stages = {r.stages};
    a.micro = {r.micro};
    a.schedules = {r.schedule};
    if (a.pipe_wire.empty()) a.pipe_wire = r.pipe_wire;
    if (!a.config.empty()) {
      a.sets.push_back("train.threads=" + std::to_string(r.threads));
      if (a.rows.empty()) a.rows = {r.rows};
    }
  }
  DDM_INPUT_CHECK(a.config.empty() != a.profile.empty(), "ddm plan: give --config (profile now) or --profile (a saved profile), not both");
  if (!a.timeline.empty()) as_input_error([&] { check_png_path(a.timeline, "--timeline"); });
  int64_t batch = a.batch;
  PipeProfile prof;
  if (!a.profile.empty()) {
    DDM_INPUT_CHECK(a.sets.empty() && a.rows.empty(), "ddm plan: --set and --rows apply to --config, not to a saved --profile");
    prof = read_profile(a.profile);
    if (measured) check_profile_fits_run(prof, measured->run, a.profile, a.measured);
    DDM_INPUT_CHECK(batch > 0, "ddm plan --profile: give the global batch with --batch");
  } else {
    prof = measure(a, &batch);
    if (!a.save_profile.empty()) {
      write_profile(prof, a.save_profile);
      std::cout << "wrote the profile to " << a.save_profile << std::endl;
    }
  }
  PipeMachine m;
  m.devices = a.devices, m.speed = a.speed;
  if (a.memory_gib > 0) m.memory = a.memory_gib * (1ull << 30);
  m.link.bandwidth = a.bandwidth_gbps * 1e9 / 1e3;  // bytes per ms
  m.link.latency = a.latency_us / 1e3;
  if (a.pipe_wire.empty() && !a.config.empty()) a.pipe_wire = name_of(load_config(a.config, a.sets).parallel.pipe_wire);
  m.activation_bytes = a.pipe_wire == "bfloat16" ? 0.5 : 1;
  PipePlanOptions o;
  o.batch = batch, o.stages = a.stages, o.micro = a.micro, o.schedules = a.schedules;
  if (measured) o.first = measured->run.first_units;
  const std::vector<std::string>& known = schedule_names();
  for (const std::string& s : o.schedules)  // a clear error for an unknown name
    DDM_INPUT_CHECK(s == "data-parallel" || s == "dp-sharded" || std::find(known.begin(), known.end(), s) != known.end(),
                    "--schedule " << s << ": not a schedule; use gpipe, 1f1b, zb-h1, 1f1b-v, zb-v, or for one stage "
                                     "data-parallel or dp-sharded");
  const std::vector<PipePlan> plans = plan_pipeline(prof, m, o);

  std::printf("model     %s\nworkload  %s\nprofiled  %s\nmachine   %d devices at %.3gx that speed, %s per device, link %.3g GB/s + %.3g us"
              "%s\nbatch     %lld (global)\n\n",
              prof.model.c_str(), prof.workload.c_str(), prof.machine.c_str(), m.devices, m.speed,
              a.memory_gib > 0 ? (fmt_gib(a.memory_gib)).c_str() : "unlimited memory", a.bandwidth_gbps, a.latency_us,
              m.activation_bytes < 1 ? ", activations in bfloat16" : "", static_cast<long long>(batch));
  std::printf("%4s %9s %5s %5s %-13s %11s %11s %8s %8s %9s %9s\n", "#", "ranks*dp", "micro", "rows", "schedule",
              "serial ms", "filled ms", "bubble", "filled", "img/s", "frozen in");
  std::printf("%4s %9s %5s %5s %-13s %11s %11s %8s %8s %9s %9s\n", "", "", "", "", "", "(iteration)", "(iteration)",
              "serial", "bubble", "(filled)", "bubbles");
  for (size_t i = 0; i < plans.size() && static_cast<int>(i) < a.top; ++i) {
    const PipePlan& p = plans[i];
    int64_t filled = 0, total = 0;
    for (size_t t = 0; t < p.filled.filled_rows.size(); ++t) filled += p.filled.filled_rows[t], total += p.filled.filled_rows[t] + p.filled.serial_rows[t];
    std::printf("%4zu %6d*%-2d %5d %5lld %-13s %11.1f %11.1f %7.1f%% %7.1f%% %9.1f %8.0f%%\n", i + 1, p.stages, p.replicas, p.micro,
                static_cast<long long>(p.rows), p.schedule.c_str(), p.serial_iteration(), p.filled_iteration(),
                100 * p.serial.bubble_fraction(), 100 * p.filled.timeline.bubble_fraction(),
                batch / (p.filled_iteration() / 1e3), total ? 100.0 * filled / total : 0.0);
  }
  if (static_cast<int>(plans.size()) > a.top) std::printf("(%zu more; --top N shows more)\n", plans.size() - a.top);
  const PipePlan& best = plans.front();
  std::printf("\nbest: %d %s%s x %d replica%s, %s, %d micro-batch%s of %lld rows: %.1f ms per iteration (%.1f img/s)\n"
              "  stages: %s\n",
              best.stages, is_v_schedule(best.schedule) ? "rank" : "stage", best.stages == 1 ? "" : "s", best.replicas, best.replicas == 1 ? "" : "s", best.schedule.c_str(),
              best.micro, best.micro == 1 ? "" : "es", static_cast<long long>(best.rows), best.filled_iteration(), batch / (best.filled_iteration() / 1e3),
              best.cuts_text().c_str());
  // The flags that train it.
  if (best.stages == 1) {  // data parallelism: its micro-batches are train.grad_accum's
    std::string flags = best.schedule == "dp-sharded" ? " parallel.shard_optimizer=true" : "";
    if (best.micro > 1) flags += " train.grad_accum=" + std::to_string(best.micro);
    if (flags.empty())
      std::printf("  train it: %d process%s, no --set needed\n", best.replicas, best.replicas == 1 ? "" : "es");
    else
      std::printf("  train it: --set%s (%d process%s)\n", flags.c_str(), best.replicas, best.replicas == 1 ? "" : "es");
  }
  if (best.stages > 1) {
    std::printf("  train it: --set parallel.pp=%d parallel.schedule=%s train.grad_accum=%d parallel.cuts=[", best.stages,
                best.schedule.c_str(), best.micro);
    for (size_t s = 1; s + 1 < best.partition.first.size(); ++s)
      std::printf("%s%d", s > 1 ? "," : "", best.partition.first[s]);
    std::printf("]");
    if (m.activation_bytes < 1) std::printf(" parallel.pipe_wire=bfloat16");
    if (best.replicas > 1) std::printf(" parallel.dp=%d (%d processes)", best.replicas, best.stages * best.replicas);
    std::printf("\n");
  }
  // The three references: plain data parallelism, the best pipeline with its frozen work serial, and
  // the best pipeline with it filled into the bubbles.
  const PipePlan* dp = nullptr;
  const PipePlan* sharded = nullptr;
  const PipePlan* serial = nullptr;
  const PipePlan* filled = nullptr;
  for (const PipePlan& p : plans) {
    if (p.stages == 1 && p.schedule != "dp-sharded" && (!dp || p.serial_iteration() < dp->serial_iteration())) dp = &p;
    if (p.schedule == "dp-sharded" && (!sharded || p.serial_iteration() < sharded->serial_iteration())) sharded = &p;
    if (p.stages > 1 && (!serial || p.serial_iteration() < serial->serial_iteration())) serial = &p;
    if (p.stages > 1 && (!filled || p.filled_iteration() < filled->filled_iteration())) filled = &p;
  }
  auto describe = [](const PipePlan& p) {
    return std::to_string(p.stages) + (is_v_schedule(p.schedule) ? " ranks" : " stages") + " x " +
           std::to_string(p.replicas) + ", " + p.schedule + ", " +
           std::to_string(p.micro) + " micro-batches";
  };
  // (The trainable part's state and activations on a device, as the memory limit counts them.)
  auto held = [](const PipePlan& p) {
    return fmt_gib(p.partition.stage_memory.empty() ? 0 : p.partition.stage_memory[0] / (1ull << 30));
  };
  if (dp)
    std::printf("  data parallelism (%d devices, %d micro-batch%s): %.1f ms, %s of state and activations per device\n",
                dp->replicas, dp->micro, dp->micro == 1 ? "" : "es", dp->serial_iteration(), held(*dp).c_str());
  if (sharded)
    std::printf("  data parallelism, optimizer state sharded (%d devices, %d micro-batch%s): %.1f ms, %s per device\n",
                sharded->replicas, sharded->micro, sharded->micro == 1 ? "" : "es", sharded->serial_iteration(), held(*sharded).c_str());
  if (serial) std::printf("  best pipeline, frozen work serial (%s): %.1f ms\n", describe(*serial).c_str(), serial->serial_iteration());
  if (filled) {
    std::printf("  best pipeline, frozen work filled (%s): %.1f ms, bubbles %.1f%% of the iteration", describe(*filled).c_str(),
                filled->filled_iteration(), 100 * filled->filled.timeline.bubble_fraction());
    if (serial) std::printf("; %.2fx the serial pipeline", serial->serial_iteration() / filled->filled_iteration());
    if (dp) std::printf(", %.2fx data parallelism", dp->serial_iteration() / filled->filled_iteration());
    else if (sharded)
      std::printf(", %.2fx data parallelism with its optimizer state sharded", sharded->serial_iteration() / filled->filled_iteration());
    std::printf("\n");
  }
  if (measured) {
    // A run with a fill plan against the profile's filled prediction and its own plan; a run without
    // one (parallel.fill = false, or a run too short to plan) against the serial prediction.
    const PipePlan& p = plans.front();
    const bool filled = measured->planned.has_value();
    const PipeTimeline& predicted = filled ? p.filled.timeline : p.serial;
    const double step_ms = measured->run.step_ms;
    const char* how = filled ? "frozen work filled into the bubbles" : "frozen work serial";
    std::printf("\nmeasured %s: %.1f ms per step (mean of %lld steps), last step %.1f ms, bubbles %.1f%%\n"
                "predicted from the profile (%s, as the run): %.1f ms, bubbles %.1f%%: %+.1f%% of the measured\n",
                a.measured.c_str(), step_ms, static_cast<long long>(measured->run.steps_timed),
                measured->timeline.iteration, 100 * measured->timeline.bubble_fraction(), how, predicted.iteration,
                100 * predicted.bubble_fraction(), 100 * (predicted.iteration - step_ms) / step_ms);
    if (filled)
      std::printf("planned in the run from the costs it measured: %.1f ms, bubbles %.1f%%: %+.1f%% of the measured\n",
                  measured->planned->iteration, 100 * measured->planned->bubble_fraction(),
                  100 * (measured->planned->iteration - step_ms) / step_ms);
    if (!a.timeline.empty()) {
      std::vector<PipePanel> panels{{std::string("simulated from the profile (") + how + "): " + fmt_ms(predicted.iteration),
                                     predicted, p.costs.optimizer}};
      if (filled)
        panels.push_back({"planned in the run from its measured costs: " + fmt_ms(measured->planned->iteration),
                          *measured->planned, measured->planned_optimizer});
      panels.push_back({"measured, last step of " + a.measured + ": " + fmt_ms(measured->timeline.iteration) +
                            " (mean step " + fmt_ms(step_ms) + ")",
                        measured->timeline, measured->optimizer});
      save_pipe_picture(a.timeline,
                        prof.model + ", " + std::to_string(p.stages) + (is_v_schedule(p.schedule) ? " ranks, " : " stages, ") +
                            p.schedule + ", " +
                            std::to_string(p.micro) + (p.micro == 1 ? " micro-batch of " : " micro-batches of ") +
                            std::to_string(p.rows),
                        panels);
      std::cout << "wrote " << a.timeline << std::endl;
    }
    return 0;
  }
  if (!a.timeline.empty()) {
    std::vector<PipePanel> panels;
    if (dp)
      panels.push_back({"data parallelism, each of " + std::to_string(dp->replicas) + " replicas (" + std::to_string(dp->micro) +
                            " micro-batches): " + fmt_ms(dp->serial_iteration()),
                        dp->serial, dp->costs.optimizer});
    if (serial)
      panels.push_back({"best pipeline, frozen work serial (" + describe(*serial) + "): " + fmt_ms(serial->serial_iteration()),
                        serial->serial, serial->costs.optimizer});
    if (filled)
      panels.push_back({"best pipeline, frozen work filled into bubbles (" + describe(*filled) + "): " +
                            fmt_ms(filled->filled_iteration()),
                        filled->filled.timeline, filled->costs.optimizer});
    save_pipe_picture(a.timeline, prof.model + ", " + prof.workload + ", batch " + std::to_string(batch) + " on " +
                                      std::to_string(a.devices) + " devices",
                      panels);
    std::cout << "wrote " << a.timeline << std::endl;
  }
  if (!a.json.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const PipePlan& p : plans)
      j.push_back({{"stages", p.stages}, {"replicas", p.replicas}, {"micro", p.micro}, {"rows", p.rows}, {"schedule", p.schedule},
                   {"serial_ms", p.serial_iteration()}, {"filled_ms", p.filled_iteration()},
                   {"serial_bubble", p.serial.bubble_fraction()}, {"filled_bubble", p.filled.timeline.bubble_fraction()},
                   {"cuts", p.cuts_text()}, {"first_units", p.partition.first},
                   {"stage_memory_bytes", p.partition.stage_memory}});
    write_file_atomic(a.json, j.dump(1) + "\n");
    std::cout << "wrote " << a.json << std::endl;
  }
  return 0;
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Plan pipeline-parallel training without running it.\nProfile a config's units and frozen work, "
                                         "search stage splits, schedules and micro-batch counts, and predict each "
                                         "plan's iteration time with and without bubble filling (no training runs).");
  cmd->add_option("--config", a->config,
                  "TOML config of the training to plan, profiled on this machine now with train.threads threads "
                  "(0: this machine's cores / --devices, at least 1)");
  cmd->add_option("--set", a->sets, "override a config key (repeatable)");
  cmd->add_option("--profile", a->profile, "plan from a profile saved with --save-profile instead of measuring");
  cmd->add_option("--save-profile", a->save_profile, "write the measured profile (JSON) here, to reuse or inspect");
  cmd->add_option("--device", a->device,
                  "auto | cpu | cuda | cuda:N: where to profile (default: the config's train.device, itself auto by "
                  "default: the GPU if LibTorch sees one, else the CPU)")
      ->check(kDeviceSpec);
  cmd->add_option("--rows", a->rows, "micro-batch sizes to profile (default: the sizes 1, 4, 16 and 64 up to the batch)")->check(kPositive);
  cmd->add_option("--repeats", a->repeats, "timed runs per measurement; the median is kept")->check(kPositive);
  cmd->add_option("--devices", a->devices, "devices (processes) of the machine to plan for")->check(kPositive);
  cmd->add_option("--batch", a->batch, "global batch (default: the config's train.batch_size)")->default_str("")->check(kPositive);
  cmd->add_option("--stages", a->stages, "stage counts to try, each dividing --devices (default: all divisors)")->check(kPositive);
  cmd->add_option("--micro", a->micro, "micro-batch counts to try (default: every divisor of a replica's batch up to 64)")
      ->check(kPositive);
  cmd->add_option("--schedule", a->schedules,
                  "schedules to try: gpipe, 1f1b, zb-h1, and the V-shaped 1f1b-v, zb-v; for one stage data-parallel "
                  "and dp-sharded (default: all)");
  cmd->add_option("--speed", a->speed, "each device's compute speed relative to the profiled one")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--memory", a->memory_gib, "memory per device in GiB (default: unlimited)")
      ->default_str("")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--bandwidth", a->bandwidth_gbps, "link bandwidth between devices in GB/s")->check(CLI::PositiveNumber);
  cmd->add_option("--latency", a->latency_us, "link latency per message in microseconds")->check(CLI::NonNegativeNumber);
  cmd->add_option("--pipe-wire", a->pipe_wire,
                  "what a pipeline's activations travel as: float32 or bfloat16 (half the bytes; default: the config's "
                  "parallel.pipe_wire, a measured run's, else float32)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  cmd->add_option("--top", a->top, "plans to print")->check(kPositive);
  cmd->add_option("--timeline", a->timeline, "draw the best plan's timeline, serial and filled, as a PNG");
  cmd->add_option("--json", a->json, "write every plan as JSON");
  cmd->add_option("--measured", a->measured,
                  "a run trained with parallel.pp > 1: profile its config (or use --profile), simulate its split, "
                  "schedule and micro-batches, and compare with its measured steps (--timeline draws both)");
  cmd->footer(kPlanFooter);
  return Command{cmd, [a] { return run_plan(*a); }};
}

}  // namespace ddm
