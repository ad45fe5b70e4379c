// The training subcommands: `ddm train` (a diffusion model from a TOML config: plain, an expert of a
// partition, a ControlNet on a base run; any launcher's ranks take part), `ddm train-autoencoder`
// (latent diffusion's autoencoder, then its report), `ddm train-classifier` (the feature network of
// the evaluation metrics), and `ddm presets` (the model presets with their sizes).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/presets.h"
#include "core/progress.h"
#include "core/run_dir.h"
#include "core/runtime.h"
#include "core/version.h"
#include "data/dataset.h"
#include "data/shard_loader.h"
#include "decentral/train_run.h"
#include "eval/feature_net.h"
#include "model/net.h"
#include "model/router.h"
#include "run/trainer.h"
#include "train/autoencoder_report.h"
#include "train/controlnet.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

struct TrainArgs {
  std::string config_path, out_dir, controlnet, partition, budget, device;
  std::vector<std::string> overrides;
  int64_t expert = -1;
  bool resume = false, force = false, quiet = false, print_config = false, config_reference = false;
};

// "  [data] source, root, ..." a line per section, wrapped at 100 columns.
std::string config_keys_by_section() {
  std::string out, section, line;
  for (const std::string& k : config_keys()) {
    const std::string sec = k.substr(0, k.find('.')), leaf = k.substr(k.find('.') + 1);
    if (sec != section) {
      if (!line.empty()) out += line + "\n";
      section = sec;
      line = "  [" + sec + "] " + leaf;
      continue;
    }
    if (line.size() + leaf.size() + 2 > 100) {
      out += line + ",\n";
      line = std::string(sec.size() + 5, ' ') + leaf;
    } else {
      line += ", " + leaf;
    }
  }
  return out + line + "\n";
}

int train_cmd(TrainArgs a) {
  if (!a.partition.empty()) {  // a TOML literal string, so no path is mistaken for another TOML value
    const std::string abs = fs::absolute(a.partition).string();
    DDM_INPUT_CHECK(abs.find('\'') == std::string::npos, "--partition: a path with a ' is not supported: " << abs);
    a.overrides.push_back("data.partition='" + abs + "'");
  }
  if (a.expert >= 0) a.overrides.push_back("data.expert=" + std::to_string(a.expert));
  if (!a.budget.empty()) a.overrides.push_back("train.expert_budget=" + a.budget);
  if (!a.device.empty()) a.overrides.push_back("train.device=\"" + a.device + "\"");
  if (a.config_reference) {
    std::cout << config_reference();
    return 0;
  }
  // --resume of a run without --config: the config the run recorded.
  if (a.resume && a.config_path.empty() && a.controlnet.empty() && !a.out_dir.empty() &&
      fs::is_regular_file(RunDir(a.out_dir).config())) {
    a.config_path = RunDir(a.out_dir).config();
    if (!a.quiet) std::cout << "note: --resume without --config: the run's own " << a.config_path << std::endl;
  }
  DDM_INPUT_CHECK(!a.config_path.empty() || !a.controlnet.empty(),
            "ddm train: --config is required (or --controlnet BASE; with --resume, a run directory's own config.toml "
            "is used)");
  RunConfig cfg;
  if (a.config_path.empty()) {
    cfg = controlnet_default_config(a.controlnet, a.overrides);
  } else {
    if (!a.controlnet.empty()) {
      const std::string abs = fs::absolute(a.controlnet).string();
      DDM_INPUT_CHECK(abs.find('\'') == std::string::npos, "--controlnet: a path with a ' is not supported: " << abs);
      a.overrides.push_back("model.controlnet='" + abs + "'");
    }
    cfg = load_config(a.config_path, a.overrides);
  }
  if (a.print_config) {  // every key, defaults included, as config.toml records it (before the data fills in its shape)
    validate(cfg);
    std::cout << to_toml(cfg);
    return 0;
  }
  DDM_INPUT_CHECK(!a.out_dir.empty(), "ddm train: --out DIR is required (the run directory)");
  TrainSummary s = train_run(cfg, {a.out_dir, a.resume, a.force, a.quiet, nullptr});
  if (s.rank == 0)  // a stop on a signal is not the end of the run: `stopped:` (its line above says how to go on)
    std::cout << (s.interrupted ? "stopped: step " : "done: step ") << s.last_step << ", checkpoint " << s.checkpoint << ", peak memory "
            << static_cast<int64_t>(peak_rss_mib()) << " MiB"
            << (s.device_peak_bytes > 0 ? " resident, " + format_bytes(static_cast<int64_t>(s.device_peak_bytes)) +
                                              " of tensors on " + s.device
                                        : std::string())
            << std::endl;
  return s.interrupted ? 128 + s.signal : 0;
}

struct AutoencoderArgs {
  std::string config, out;
  std::vector<std::string> overrides;
  bool resume = false, force = false, quiet = false;
  AutoencoderReportOptions report;
};

// ddm train-autoencoder: train (any launcher's ranks take part), then rank 0 measures the result.
int train_autoencoder_cmd(const std::string& config, const std::vector<std::string>& overrides, const std::string& out,
                          const TrainOptions& topt, AutoencoderReportOptions opt) {
  RunConfig cfg = load_config(config, overrides);
  DDM_INPUT_CHECK(cfg.model.arch == "autoencoder",
            config << ": model.arch = " << cfg.model.arch << ", but train-autoencoder trains an autoencoder; set "
                   << "model.preset = \"ae-f4\" (or model.arch = \"autoencoder\"), or train this model with `ddm train`");
  TrainSummary s = train_run(cfg, topt);
  if (s.interrupted) return 128 + s.signal;
  if (s.rank != 0) return 0;
  std::cout << "done: step " << s.last_step << ", checkpoint " << s.checkpoint << "; measuring the autoencoder"
            << std::endl;
  opt.png = RunDir(out) / RunDir::kReconstructions;
  opt.eval.quiet = topt.quiet;
  opt.eval.data_root = cfg.data.source == "fashion-mnist" ? cfg.data.root : "";
  const AutoencoderReport r = report_autoencoder(s.checkpoint, opt);
  write_file_atomic(RunDir(out) / RunDir::kAutoencoder, r.json().dump(2) + "\n");
  std::cout << r.table() << "wrote " << RunDir(out) / RunDir::kAutoencoder << " and " << opt.png
            << "\nNext: train a latent model on it with --set model.latent=" << out << std::endl;
  return 0;
}

struct ClassifierArgs {
  std::string out = "feature-net.safetensors", root, config;
  std::vector<std::string> overrides, test_overrides;
  int64_t threads = 0;  // 0: every core
  bool force = false, no_hflip = false;
  ClassifierTrainConfig cfg;
};

int train_classifier_cmd(ClassifierArgs a, const std::string& command) {
  if (a.threads == 0) a.threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  DDM_INPUT_CHECK(a.force || !fs::exists(a.out),
            a.out << " already exists; pass --force to replace it, or choose another --out");
  create_output_dir(fs::path(a.out).parent_path().string(), "--out");  // before the training
  set_threads(a.threads);
  Dataset train, test;
  std::string task = "classes";  // or "rotation" (unlabelled data)
  if (a.config.empty()) {  // Fashion-MNIST: train and test splits
    DDM_INPUT_CHECK(a.overrides.empty() && a.test_overrides.empty(), "--set and --test-set need --config");
    DataConfig dc;
    dc.root = a.root;
    train = load_dataset(dc);
    dc.split = "test";
    test = load_dataset(dc);
  } else {
    DDM_INPUT_CHECK(a.root.empty(), "--data-root is for Fashion-MNIST; with --config the config's data.root names the data");
    const RunConfig cfg = load_config(a.config, a.overrides);
    train = load_whole_dataset(cfg.data, static_cast<int>(a.threads));
    if (a.test_overrides.empty()) {
      // A tenth is held out, drawn at random with the seed (a folder is ordered by class: its last
      // tenth would be one class): measured on, never trained on.
      const int64_t n = train.images.size(0), held = std::max<int64_t>(1, n / 10);
      DDM_INPUT_CHECK(n >= 20, "train-classifier: " << train.description << " holds " << n << " images; at least 20 are "
                                              "needed (a tenth is held out to measure the network on)");
      const auto [keep, out] = holdout_split(n, held, static_cast<uint64_t>(a.cfg.seed));
      test = train;
      test.images = train.images.index_select(0, out);
      test.description = std::to_string(held) + " images of " + train.description + " drawn at random (held out)";
      std::cout << "measuring on " << test.description << ", training on the others (--test-set names other data)"
                << std::endl;
      train.images = train.images.index_select(0, keep);
      if (train.labels.defined()) {
        test.labels = train.labels.index_select(0, out);
        train.labels = train.labels.index_select(0, keep);
      }
      if (!train.captions.empty()) train.captions.clear(), test.captions.clear();  // not read here
    } else {
      std::vector<std::string> test_keys = a.overrides;
      test_keys.insert(test_keys.end(), a.test_overrides.begin(), a.test_overrides.end());
      test = load_whole_dataset(load_config(a.config, test_keys).data, static_cast<int>(a.threads));
    }
    DDM_INPUT_CHECK(test.images.sizes().slice(1) == train.images.sizes().slice(1),
              "the test data (" << test.description << ") has images of " << test.images.sizes().slice(1)
                                << ", the training data " << train.images.sizes().slice(1) << "; set data.resolution");
    if (train.num_classes < 2) {  // unlabelled: learn which way each image was turned
      std::cout << train.description << " has no class labels: the network learns the self-supervised task of "
                << "telling how far each image was turned (0/90/180/270 degrees), whose features serve the metrics "
                << "as a classifier's do" << std::endl;
      train = rotation_dataset(train);
      test = rotation_dataset(test);
      task = "rotation";
    }
    DDM_INPUT_CHECK(test.num_classes <= train.num_classes,
              "the test data has " << test.num_classes << " classes, the training data " << train.num_classes);
  }
  ClassifierTrainConfig tc = a.cfg;
  tc.hflip = !a.no_hflip && task == "classes";  // a flip of a turned image looks like the opposite turn
  std::cout << "training the feature network on " << train.description << ": " << a.cfg.epochs << " epochs of batch "
            << a.cfg.batch_size << ", seed " << a.cfg.seed << ", " << a.threads << " threads" << std::endl;
  const auto t0 = std::chrono::steady_clock::now();
  FeatureNet net = train_classifier(train, tc);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t correct = count_correct(net, test), total = test.images.size(0);
  const double acc = static_cast<double>(correct) / static_cast<double>(total);
  const std::string sha = save_feature_net(
      a.out, net,
      {{"command", command},
       {"seed", std::to_string(a.cfg.seed)},
       {"threads", std::to_string(a.threads)},
       {"epochs", std::to_string(a.cfg.epochs)},
       {"train_data", train.description},
       {"test_data", test.description},
       {"image_shape", std::to_string(train.images.size(1)) + "x" + std::to_string(train.images.size(2)) + "x" +
                           std::to_string(train.images.size(3))},
       {"num_classes", std::to_string(train.num_classes)},
       {"task", task},
       {"class_names", nlohmann::json(train.class_names).dump()},
       {"test_correct", std::to_string(correct)},
       {"test_total", std::to_string(total)},
       {"ddm_version", version()}});
  std::printf("test accuracy %.2f%% (%lld / %lld) after %.0f s\nwrote %s\nsha256 %s\n", 100.0 * acc,
              static_cast<long long>(correct), static_cast<long long>(total), seconds, a.out.c_str(), sha.c_str());
  const std::string warning = feature_net_warning(task, acc, train.num_classes);
  if (!warning.empty()) std::cout << warning << std::endl;
  return 0;
}

int presets_cmd() {
  std::printf("%-17s %-11s %12s %16s  %s\n", "preset", "arch", "parameters", "MFLOP/img fwd", "sized for");
  for (const auto& name : preset_names()) {
    ModelConfig m;
    apply_preset(name, m);
    m.preset = name;
    const PresetShape shape = preset_shape(name);
    m.in_channels = m.arch == "autoencoder" ? 1 : shape.channels;
    m.image_size = shape.side;
    m.num_classes = 10;
    if (is_router_arch(m.arch)) m.num_experts = 4;
    Net net = make_net(m);
    std::printf("%-17s %-11s %12lld %16.1f  %s\n", name.c_str(), m.arch.c_str(),
                static_cast<long long>(count_params(*net)), forward_flops_per_image(m) / 1e6,
                m.arch == "autoencoder" ? "28 px grey -> 7x7x4" : shape.what.c_str());
  }
  std::printf("(10 classes, routers with K = 4 experts; training costs about 3x the forward FLOPs; a preset trains "
              "at any size its levels divide)\n");
  return 0;
}

}  // namespace

Command add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a diffusion model from a TOML config.\n"
                                          "Writes checkpoints, metrics, TensorBoard files and (train.sample_every) sample "
                                          "grids into --out; Ctrl-C checkpoints and stops; --resume goes on.");
  cmd->add_option("--config", a->config_path,
                        "TOML config file (see configs/); with --controlnet it defaults to the base run's own config");
  cmd->add_option("--controlnet", a->controlnet,
                        "train a ControlNet on this trained U-Net run (or checkpoint), which stays locked: a trainable "
                        "copy of its encoder steers it with control maps of model.control (edges | lowres), computed "
                        "from each batch (sets model.controlnet; the model keys become the base's). Sample it with "
                        "`ddm sample --control-from test`; see docs/conditioning.md. For Stable Diffusion's UNet "
                        "(model.arch = sd-unet) set model.controlnet = \"from-unet\" in its config instead "
                        "(docs/stable-diffusion.md)");
  cmd->add_option("--set", a->overrides, "override a config key, e.g. --set train.steps=100 (repeatable)");
  cmd->add_option("--out", a->out_dir, "run directory (config, checkpoints, metrics, grids, TensorBoard files); required");
  cmd->add_option("--device", a->device, "auto | cpu | cuda | cuda:N (sets train.device)")->check(kDeviceSpec);
  cmd->add_flag("--print-config", a->print_config,
                "print the config with --set applied and every key's value, defaults included (TOML), and exit");
  cmd->add_flag("--config-reference", a->config_reference,
                "print every config key with its type, default and meaning (Markdown: docs/config.md), and exit");
  cmd->add_option("--partition", a->partition,
                        "train an expert: a `ddm partition` directory (sets data.partition; needs --expert)");
  cmd->add_option("--expert", a->expert, "the cluster this expert trains on, 0..K-1 (sets data.expert)")
      ->default_str("")
      ->check(kNonNegative);
  cmd->add_option("--budget", a->budget,
                        "full (train.* as written, per expert) | split-batch (batch_size / K) | split-steps "
                        "(steps / K): with a split, K experts together cost what train.* describes "
                        "(sets train.expert_budget)")
      ->check(CLI::IsMember({"full", "split-batch", "split-steps"}));
  cmd->add_flag("--resume", a->resume, "continue from the latest checkpoint in --out");
  cmd->add_flag("--force", a->force, "overwrite a different run in --out");
  cmd->add_flag("--quiet", a->quiet, "no progress output");
  cmd->footer("\nExamples:\n"
              "  ddm train --config configs/quickstart.toml --out runs/mine\n"
              "  ddm train --config configs/own-64.toml --set data.root='photos-{000000..000009}.tar' --out runs/photos\n"
              "  ddm train --config configs/quickstart.toml --out runs/mine --resume      # after a stop or a crash\n"
              "  ddm train --config configs/quickstart.toml --print-config               # every key and its value\n"
              "  ddm launch --nproc 4 -- train --config configs/quickstart.toml --out runs/dp4   # data parallel\n"
              "  ddm train --config configs/sd-finetune.toml --set model.unet=SD --set model.latent=SD \\\n"
              "    --set model.text_encoder=SD --set diffusion.scheduler=SD --out runs/sd   # fine-tune a diffusers SD pipeline\n"
              "\nConfig keys, section by section (`--print-config` shows their values, docs/config.md what they mean):\n" +
              config_keys_by_section() +
              "\nSeveral processes: `ddm launch --nproc N -- train ...`, torchrun, srun or mpirun run one job, each "
              "process one rank (train.batch_size is the global batch; only rank 0 writes --out). parallel.mode = "
              "diloco makes each a DiLoCo replica (docs/distributed.md); parallel.pp = S runs the model as S "
              "pipeline stages whose bubbles the frozen work fills (docs/pipeline.md).");
  return Command{cmd, [a] { return train_cmd(*a); }};
}

Command add_autoencoder_command(CLI::App& app) {
  auto a = std::make_shared<AutoencoderArgs>();
  auto* cmd = app.add_subcommand(
      "train-autoencoder",
      "Train the autoencoder latent models learn on, and report it.\n"
      "Train the KL autoencoder of latent diffusion (model.arch = autoencoder, e.g. model.preset = \"ae-f4\": "
      "28x28x1 -> 7x7x4), then report it: PSNR and FD-fmnist of its reconstructions of the test split (a bound on "
      "the FD of any latent model built on it), the latent scale and shift that latent models normalize by, to "
      "OUT/autoencoder.json, and OUT/reconstructions.png (originals beside reconstructions). A latent model then "
      "trains on it with model.latent = OUT. Re-run with --resume on a finished run to report it again.");
  cmd->add_option("--config", a->config, "TOML config file (see configs/autoencoder.toml)")->required();
  cmd->add_option("--set", a->overrides, "override a config key, e.g. --set train.steps=100 (repeatable)");
  cmd->add_option("--out", a->out, "run directory (config, checkpoints, metrics, report)")->required();
  cmd->add_option("--n", a->report.n, "test images to reconstruct for the report")->check(kPositive);
  cmd->add_option("--stats-n", a->report.stats_n, "training images to measure the latent statistics on")
      ->check(kPositive);
  cmd->add_flag("--resume", a->resume, "continue from the latest checkpoint in --out");
  cmd->add_flag("--force", a->force, "overwrite a different run in --out");
  cmd->add_flag("--quiet", a->quiet, "no progress output");
  cmd->footer("\nExamples:\n"
              "  ddm train-autoencoder --config configs/autoencoder.toml --out runs/ae\n"
              "  ddm train --config configs/latent-quickstart.toml --out runs/latent   # then, on its latents (model.latent)\n");
  return Command{cmd, [a] {
                   return train_autoencoder_cmd(a->config, a->overrides, a->out,
                                                {a->out, a->resume, a->force, a->quiet, nullptr}, a->report);
                 }};
}

Command add_classifier_command(CLI::App& app, int argc, char** argv) {
  auto a = std::make_shared<ClassifierArgs>();
  auto* cmd = app.add_subcommand(
      "train-classifier",
      "Train the feature network the quality metrics use.\n"
      "Train the CNN classifier whose features the evaluation metrics (FD-fmnist, KID, precision/recall) use, on "
      "the Fashion-MNIST train split, and report its accuracy on the test split; or, with --config, on any "
      "data ddm reads, measured on --test-set's or on a held-out tenth: its classes, or for unlabelled data which "
      "way each image was turned (docs/evaluation.md). "
      "Deterministic for a given seed and thread count. ddm ships one in assets/feature-net/ (see its README for "
      "the command that made it).");
  cmd->add_option("--out", a->out, "safetensors file to write");
  cmd->add_option("--data-root", a->root, "Fashion-MNIST directory (default: the Debian package's)");
  cmd->add_option("--config", a->config, "train on this config's data (any source; labelled data trains a classifier of its classes, unlabelled data one of the image's rotation) instead of Fashion-MNIST");
  cmd->add_option("--set", a->overrides, "override a key of --config's, e.g. --set data.resolution=32 (repeatable)");
  cmd->add_option("--test-set", a->test_overrides,
                  "with --config: the overrides that make it name the test data, e.g. --test-set data.root=TEST "
                  "(repeatable; default: a tenth of the data drawn at random with --seed, held out)");
  cmd->add_flag("--no-hflip", a->no_hflip, "no random horizontal flips while training (they are on without it)");
  cmd->add_option("--epochs", a->cfg.epochs, "training epochs")->check(kPositive);
  cmd->add_option("--batch", a->cfg.batch_size, "batch size")->check(kPositive);
  cmd->add_option("--lr", a->cfg.lr, "peak AdamW learning rate")->check(kNonNegative);
  cmd->add_option("--seed", a->cfg.seed, "seed (initialization, data order, augmentation, dropout)");
  cmd->add_option("--threads", a->threads, "intra-op threads (0 = every core); the result depends on the number, which the "
                  "network records (give it again to train the same network)")->check(kNonNegative);
  cmd->add_flag("--force", a->force, "replace an existing --out file");
  std::string command = "ddm";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  cmd->footer("\nExamples:\n"
              "  ddm train-classifier                                  # Fashion-MNIST: feature-net.safetensors\n"
              "  ddm train-classifier --config configs/own-64.toml --set data.root=photos-000000.tar --out net.safetensors\n"
              "  ddm eval --ckpt runs/mine --feature-net net.safetensors                                  # then\n");
  return Command{cmd, [a, command] { return train_classifier_cmd(*a, command); }};
}

Command add_presets_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("presets", "List model presets with their parameters and FLOPs per image.");
  cmd->footer("\nExamples:\n"
              "  ddm presets\n"
              "  ddm train --config configs/quickstart.toml --set model.preset=dit-small --out runs/dit   # use one\n");
  return Command{cmd, [] { return presets_cmd(); }};
}

}  // namespace ddm
