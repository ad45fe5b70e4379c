// `ddm quickstart`: decentralized diffusion end to end on Fashion-MNIST (a partition, four experts
// trained in isolation, a router, a routed sample grid), or with --monolith the single-model
// baseline at the same budget; re-running continues an interrupted one.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/run_dir.h"
#include "core/runtime.h"
#include "decentral/train_run.h"
#include "run/trainer.h"
#include "sample_cli.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// The quickstart's training config: each of its four experts' (with the global batch split four
// ways), and with --monolith the single model's. configs/quickstart.toml holds the same text (a test
// checks it via `ddm quickstart --print-config`).
const char* kQuickstartConfig = R"(# ddm quickstart: a small class-conditional flow-matching U-Net on Fashion-MNIST.
# `ddm quickstart` trains four such experts on four clusters of the data, each on a quarter of the
# batch (together the cost of one model with these numbers), and a router; --monolith trains one.
[data]
source = "fashion-mnist"

[model]
preset = "unet-tiny"

[diffusion]
objective = "flow"

[train]
steps = 1200
batch_size = 128
lr = 2e-3
warmup = 100
ema_decay = 0.999
label_dropout = 0.1
log_every = 50
ckpt_every = 200

[sample]
sampler = "euler"
steps = 20
cfg = 2.0
)";

struct QuickstartArgs {
  std::string out = "runs/quickstart";
  std::string device = "auto";  // train.device of every run, and where the samples are drawn
  std::string data_root;        // Fashion-MNIST's directory, when not Debian's
  int64_t steps = 0, threads = 0;
  int64_t sample_steps = 0;  // the grid's solver steps (0: the config's sample.steps, 20)
  int64_t old_steps = 0;  // --steps: renamed --train-steps
  bool print = false, monolith = false;
};

int quickstart_cmd(const QuickstartArgs& q) {
  if (q.old_steps != 0)
    throw InputError("quickstart's --steps is now --train-steps (training steps; `ddm sample --steps` counts "
                     "sampling steps)");
  if (q.print) {
    std::cout << kQuickstartConfig;
    return 0;
  }
  const bool single = fs::exists(RunDir(q.out).config()), islands = fs::exists(fs::path(q.out) / "islands.toml");
  DDM_INPUT_CHECK(!(single && !q.monolith), q.out << " holds a single-model quickstart (" << q.out
                                            << "/config.toml); continue it with --monolith, or use another --out");
  DDM_INPUT_CHECK(!(islands && q.monolith), q.out << " holds a decentralized quickstart (" << q.out
                                             << "/islands.toml); drop --monolith to continue it, or use another --out");
  // A device this machine lacks fails here, before any island starts.
  const bool gpu = resolve_device(q.device, 0, "--device").is_cuda();
  const auto t0 = std::chrono::steady_clock::now();
  SampleArgs a;
  a.out = RunDir(q.out) / RunDir::kSamples;
  a.threads = q.threads;
  a.device = q.device;
  a.steps = q.sample_steps;
  if (q.monolith) {
    std::vector<std::string> ov;
    if (q.steps > 0) ov.push_back("train.steps=" + std::to_string(q.steps));
    if (q.threads > 0) ov.push_back("train.threads=" + std::to_string(q.threads));
    ov.push_back("train.device=" + q.device);
    if (!q.data_root.empty()) ov.push_back("data.root=" + q.data_root);
    RunConfig cfg = parse_config(kQuickstartConfig, "quickstart config", ov);
    std::cout << "ddm quickstart --monolith: " << (single ? "continuing" : "training") << " in " << q.out << std::endl;
    TrainSummary s = train_run(cfg, {q.out, /*resume=*/single, /*force=*/false, /*quiet=*/false, nullptr});
    if (s.interrupted) return 128 + s.signal;
    a.ckpt = q.out;
  } else {
    std::cout << "ddm quickstart: " << (islands ? "continuing" : "training")
              << " a decentralized ensemble in " << q.out
              << ": a partition of Fashion-MNIST into 4 clusters, 4 experts trained in isolation (batch 32 each) "
              << (gpu ? "and a router, all at once on the GPU" : "one after another, then a router")
              << ". Progress every 30 s; each island logs to "
              << q.out << "/logs." << std::endl;
    // Another Fashion-MNIST directory goes into the experts' config, which every island reads.
    std::string config = kQuickstartConfig;
    if (!q.data_root.empty()) {
      const std::string root = fs::absolute(q.data_root).lexically_normal().string();
      DDM_INPUT_CHECK(fs::is_directory(root), "--data-root " << q.data_root << " is not a directory");
      DDM_INPUT_CHECK(root.find('\'') == std::string::npos && root.find('\n') == std::string::npos,
                "--data-root: a path with a ' or a line break is not supported: " << root);
      const std::string source = "source = \"fashion-mnist\"\n";
      config.insert(config.find(source) + source.size(), "root = '" + root + "'\n");
    }
    const int rc = run_quickstart_islands(q.out, config, q.steps, q.steps > 0 ? std::max<int64_t>(1, q.steps / 2) : 0,
                                          q.threads, q.device, gpu ? 5 : 1);
    if (rc != 0) return rc;
    a.ensemble = q.out;
  }
  write_samples(a);
  rusage children{};
  getrusage(RUSAGE_CHILDREN, &children);
  std::printf("quickstart took %.0f s; peak memory %.0f MiB\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              std::max(peak_rss_mib(), static_cast<double>(children.ru_maxrss) / 1024.0));
  if (q.monolith) {
    std::cout << "\nNext: ddm sample --ckpt " << q.out << " --sampler heun --steps 10 --out grid.png\n";
  } else {
    std::cout << "\nNext:\n  ddm sample --ensemble " << q.out << " --routing full --out grid.png   (other routings)\n"
              << "  ddm eval --ensemble " << q.out << "                            (FD-fmnist, KID, precision/recall)\n"
              << "  ddm distill --ensemble " << q.out << " --out runs/student        (one dense model)\n"
              << "  ddm islands status " << q.out << "/islands.toml\n";
  }
  return 0;
}

}  // namespace

Command add_quickstart_command(CLI::App& app) {
  auto a = std::make_shared<QuickstartArgs>();
  auto* cmd = app.add_subcommand(
      "quickstart",
      "Decentralized diffusion end to end on Fashion-MNIST, with a sample grid.\n"
      "Partition the data into 4 clusters, train 4 small class-conditional experts in isolation (independent processes, a quarter of "
      "the batch each: together one model's budget) and a router, assemble the ensemble, and write a sample grid "
      "(top-1 routing, one row per class) to OUT/samples.png. Re-running continues an interrupted run. "
      "--monolith trains the single-model baseline with the same budget instead.");
  cmd->add_option("--out", a->out, "run directory");
  cmd->add_option("--train-steps", a->steps, "training steps of each expert, or of the monolith (the router trains half "
                                                "as many)")
      ->default_str("1200")
      ->check(kPositive);
  cmd->add_option("--sample-steps", a->sample_steps,
                  "solver steps of the sample grid at the end (fewer: a faster, rougher grid; `ddm sample` draws "
                  "others later)")
      ->default_str("20")
      ->check(kPositive);
  // The name it had: `ddm sample --steps` counts sampling steps, so training steps have their own name.
  cmd->add_option("--steps", a->old_steps)->group("");
  cmd->add_option("--threads", a->threads, "intra-op threads (0 = all cores)")->check(kNonNegative);
  cmd->add_option("--device", a->device,
                  "auto | cpu | cuda | cuda:N: where the experts, the router and the sampling run (auto: the GPU "
                  "if LibTorch sees one, else the CPU)")
      ->check(kDeviceSpec);
  cmd->add_option("--data-root", a->data_root,
                  "Fashion-MNIST's directory (its four .gz files), when not Debian's dataset-fashion-mnist");
  cmd->add_flag("--print-config", a->print, "print the quickstart's training config (TOML) and exit");
  cmd->add_flag("--monolith", a->monolith, "train one model on all the data instead of the ensemble");
  cmd->footer("\nExamples:\n"
              "  ddm quickstart                                 # the ensemble, into runs/quickstart\n"
              "  ddm quickstart --monolith --out runs/monolith  # one model with the same budget\n"
              "  ddm quickstart --train-steps 200 --out runs/qs-short   # a quick look, blurrier samples");
  return Command{cmd, [a] { return quickstart_cmd(*a); }};
}

}  // namespace ddm
