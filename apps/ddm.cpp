// ddm command-line interface: parses flags with CLI11 and calls the library. Subcommands:
//   train       train a diffusion model from a TOML config
//   sample      write a PNG grid (and optionally raw samples) from a checkpoint
//   quickstart  train a small class-conditional model on Fashion-MNIST and write a sample grid
//   presets     list model presets with parameter counts and FLOPs
#include <CLI/CLI.hpp>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <unistd.h>

#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "core/version.h"
#include "data/dataset.h"
#include "diffusion/generate.h"
#include "eval/grid.h"
#include "model/net.h"
#include "model/presets.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

// The quickstart configuration; configs/quickstart.toml holds the same text (a test checks it via
// `ddm quickstart --print-config`).
const char* kQuickstartConfig = R"(# ddm quickstart: a small class-conditional flow-matching U-Net on Fashion-MNIST.
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

// Validators with readable messages (CLI11's numeric ranges print the whole double range).
CLI::Validator number_at_least(double min, const std::string& what) {
  return CLI::Validator(
      [min, what](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && v >= min) return "";
        } catch (const std::exception&) {
        }
        return "must be " + what + ", got '" + value + "'";
      },
      what);
}
const CLI::Validator kPositive = number_at_least(1, "a positive integer");
const CLI::Validator kNonNegative = number_at_least(0, "a number >= 0");

struct SampleArgs {
  std::string ckpt, out = "samples.png", raw, sampler;
  int64_t n = 100, steps = 0, class_id = -1, seed = 0, batch = 250, threads = 0;
  double cfg = -1;
  bool no_ema = false;
};

void write_samples(const SampleArgs& a) {
  set_threads(a.threads);
  LoadedModel m = load_model(a.ckpt, !a.no_ema);
  Denoiser den = make_denoiser(m);
  GenerateOptions g;
  g.n = a.n;
  g.sample.sampler = a.sampler.empty() ? m.cfg.sample.sampler : a.sampler;
  g.sample.steps = a.steps > 0 ? a.steps : m.cfg.sample.steps;
  g.sample.cfg = a.cfg >= 0 ? a.cfg : m.cfg.sample.cfg;
  g.class_id = a.class_id;
  g.batch_size = a.batch;
  g.seed = static_cast<uint64_t>(a.seed);
  const int64_t classes = m.cfg.model.num_classes;
  g.per_class = classes > 0 && a.class_id < 0 ? std::max<int64_t>(1, a.n / classes) : a.n;
  const bool tty = isatty(fileno(stdout));
  g.on_progress = [tty](int64_t done, int64_t total) {
    if (tty) std::printf("\r  sampling %lld/%lld", static_cast<long long>(done), static_cast<long long>(total));
    std::fflush(stdout);
  };
  std::cout << "sampling " << a.n << " images from " << m.checkpoint << " (step " << m.step << ", "
            << (a.no_ema ? "raw" : "EMA") << " weights): " << g.sample.sampler << ", " << g.sample.steps
            << " steps, cfg " << g.sample.cfg << std::endl;
  Generated out = generate(den, m.cfg.model.in_channels, m.cfg.model.image_size, g);
  if (tty) std::printf("\n");
  std::vector<std::string> labels;
  int64_t cols = std::min<int64_t>(a.n, 10);
  if (classes > 0 && a.class_id < 0) {
    cols = g.per_class;
    for (int64_t r = 0; r * cols < a.n; ++r) {
      const int64_t c = out.labels[r * cols].item<int64_t>();
      labels.push_back(c < static_cast<int64_t>(m.class_names.size()) ? m.class_names[c] : "class " + std::to_string(c));
    }
  }
  const std::string parent = fs::path(a.out).parent_path().string();
  if (!parent.empty()) fs::create_directories(parent);
  save_image_grid(a.out, out.images, cols, labels);
  std::cout << "NFE " << out.nfe << " per image" << (g.sample.cfg != 1.0 && classes > 0 ? " (CFG: batch of 2)" : "")
            << ", " << out.seconds << " s, " << a.n / out.seconds << " img/s\n"
            << "wrote " << a.out << std::endl;
  if (!a.raw.empty()) {
    SafetensorsFile f;
    f.tensors["images"] = to_uint8(out.images);
    f.tensors["labels"] = out.labels;
    f.tensors["samples"] = out.images;
    f.metadata["checkpoint"] = m.checkpoint;
    f.metadata["sampler"] = g.sample.sampler;
    f.metadata["steps"] = std::to_string(g.sample.steps);
    f.metadata["cfg"] = std::to_string(g.sample.cfg);
    save_safetensors(a.raw, f);
    std::cout << "wrote " << a.raw << " (images uint8 NCHW, labels, samples float in [-1, 1])" << std::endl;
  }
}

void add_sample_flags(CLI::App* cmd, SampleArgs& a) {
  cmd->add_option("--n", a.n, "number of images")->check(kPositive);
  cmd->add_option("--steps", a.steps, "solver steps (default: the run's sample.steps)")->check(kPositive);
  cmd->add_option("--sampler", a.sampler, "euler | heun | ddim | ddpm (default: the run's sample.sampler)")
      ->check(CLI::IsMember({"euler", "heun", "ddim", "ddpm"}));
  cmd->add_option("--cfg", a.cfg, "classifier-free guidance scale; 1 = off, 0 = unconditional (default: the run's)")
      ->check(kNonNegative);
  cmd->add_option("--class", a.class_id, "sample only this class (default: one row per class)");
  cmd->add_option("--seed", a.seed, "sampling seed")->check(kNonNegative);
  cmd->add_option("--batch", a.batch, "images per network batch")->check(kPositive);
  cmd->add_option("--threads", a.threads, "intra-op threads (0 = all cores)")->check(kNonNegative);
  cmd->add_flag("--no-ema", a.no_ema, "use the raw weights instead of the EMA");
}

int run(int argc, char** argv) {
  CLI::App app{"ddm: decentralized diffusion models. Train diffusion models, sample them, and (soon) train "
               "expert ensembles across independent compute islands."};
  app.set_version_flag("--version", std::string("ddm ") + version());
  app.require_subcommand(1);

  // train
  std::string config_path, out_dir;
  std::vector<std::string> overrides;
  bool resume = false, force = false, quiet = false;
  auto* train_cmd = app.add_subcommand("train", "Train a diffusion model from a TOML config.");
  train_cmd->add_option("--config", config_path, "TOML config file (see configs/)")->required();
  train_cmd->add_option("--set", overrides, "override a config key, e.g. --set train.steps=100 (repeatable)");
  train_cmd->add_option("--out", out_dir, "run directory (config, checkpoints, metrics)")->required();
  train_cmd->add_flag("--resume", resume, "continue from the latest checkpoint in --out");
  train_cmd->add_flag("--force", force, "overwrite a different run in --out");
  train_cmd->add_flag("--quiet", quiet, "no progress output");
  train_cmd->footer("Config keys: " + [] {
    std::string s;
    for (const auto& k : config_keys()) s += (s.empty() ? "" : ", ") + k;
    return s;
  }());

  // sample
  SampleArgs sa;
  auto* sample_cmd = app.add_subcommand("sample", "Generate a labelled PNG grid from a trained model.");
  sample_cmd->add_option("--ckpt", sa.ckpt, "run directory (latest checkpoint) or checkpoint directory")->required();
  sample_cmd->add_option("--out", sa.out, "PNG grid to write");
  sample_cmd->add_option("--raw", sa.raw, "also write the samples as safetensors");
  add_sample_flags(sample_cmd, sa);

  // quickstart
  std::string qs_out = "runs/quickstart";
  int64_t qs_steps = 0, qs_threads = 0;
  auto* qs_cmd = app.add_subcommand(
      "quickstart",
      "Train a small class-conditional model on Fashion-MNIST (about 11 minutes on 2 cores), then write a sample "
      "grid with one row per class. Re-running continues an interrupted run.");
  qs_cmd->add_option("--out", qs_out, "run directory");
  qs_cmd->add_option("--steps", qs_steps, "training steps (default 1200)")->check(kPositive);
  qs_cmd->add_option("--threads", qs_threads, "intra-op threads (0 = all cores)")->check(kNonNegative);
  bool qs_print = false;
  qs_cmd->add_flag("--print-config", qs_print, "print the quickstart config (TOML) and exit");

  // presets
  auto* presets_cmd = app.add_subcommand("presets", "List model presets with parameters and FLOPs per image.");

  CLI11_PARSE(app, argc, argv);

  if (*train_cmd) {
    RunConfig cfg = load_config(config_path, overrides);
    TrainSummary s = train(cfg, {out_dir, resume, force, quiet});
    std::cout << "done: step " << s.last_step << ", checkpoint " << s.checkpoint << ", peak memory "
              << static_cast<int64_t>(peak_rss_mib()) << " MiB" << std::endl;
    return s.interrupted ? 130 : 0;
  }
  if (*sample_cmd) {
    write_samples(sa);
    return 0;
  }
  if (*qs_cmd) {
    if (qs_print) {
      std::cout << kQuickstartConfig;
      return 0;
    }
    std::vector<std::string> ov;
    if (qs_steps > 0) ov.push_back("train.steps=" + std::to_string(qs_steps));
    if (qs_threads > 0) ov.push_back("train.threads=" + std::to_string(qs_threads));
    RunConfig cfg = parse_config(kQuickstartConfig, "quickstart config", ov);
    const bool existing = fs::exists(fs::path(qs_out) / "config.toml");
    std::cout << "ddm quickstart: " << (existing ? "continuing" : "training") << " in " << qs_out << std::endl;
    const auto t0 = std::chrono::steady_clock::now();
    TrainSummary s = train(cfg, {qs_out, /*resume=*/existing, /*force=*/false, /*quiet=*/false});
    if (s.interrupted) return 130;
    SampleArgs a;
    a.ckpt = qs_out;
    a.out = (fs::path(qs_out) / "samples.png").string();
    a.threads = qs_threads;
    write_samples(a);
    std::printf("quickstart took %.0f s; peak memory %.0f MiB\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), peak_rss_mib());
    std::cout << "\nNext: ddm sample --ckpt " << qs_out << " --sampler heun --steps 10 --out grid.png\n";
    return 0;
  }
  if (*presets_cmd) {
    std::printf("%-12s %-5s %12s %16s\n", "preset", "arch", "parameters", "MFLOP/img fwd");
    for (const auto& name : preset_names()) {
      ModelConfig m;
      apply_preset(name, m);
      m.preset = name;
      m.in_channels = 1;
      m.image_size = 28;
      m.num_classes = 10;
      Net net = make_net(m);
      std::printf("%-12s %-5s %12lld %16.1f\n", name.c_str(), m.arch.c_str(),
                  static_cast<long long>(count_params(*net)), forward_flops_per_image(m) / 1e6);
    }
    std::printf("(28x28x1 images, 10 classes; training costs about 3x the forward FLOPs)\n");
    return 0;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddm::configure_allocator();
  try {
    return run(argc, argv);
  } catch (const ddm::Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "error (LibTorch): " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
