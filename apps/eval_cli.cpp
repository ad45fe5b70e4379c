// `ddm eval`: FD (FD-fmnist, or in a feature network trained on the user's data), KID,
// precision/recall and class accuracy of a model's samples, a file of samples, or a reference point;
// with --shapes, a text model's prompt accuracy on the shapes dataset.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <unistd.h>

#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/control.h"
#include "data/dataset.h"
#include "data/shard_loader.h"
#include "eval/evaluate.h"
#include "eval/feature_net.h"
#include "eval/grid.h"
#include "eval/shapes_report.h"
#include "run/trainer.h"
#include "sample_setup.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

struct EvalArgs {
  SampleArgs sample;  // --ckpt and the sampling flags
  std::string samples_file, anchor, out, shapes;
  std::string reference_config;              // --reference-config: the real images' data config
  std::vector<std::string> reference_sets;   // --reference-set KEY=VALUE: overrides of it (or of the model's)
  int64_t per_prompt = 8;  // --shapes: samples per prompt
  EvalConfig cfg;
};

// `ddm eval --shapes DIR`: prompt accuracy of a text model on the shapes dataset (eval/shapes_report.h).
int eval_shapes_cmd(EvalArgs a) {
  DDM_INPUT_CHECK(a.sample.ckpt.empty() != a.sample.ensemble.empty() && a.samples_file.empty() && a.anchor.empty(),
            "ddm eval --shapes: give --ckpt DIR or --ensemble DIR (the text model whose prompts are measured)");
  DDM_INPUT_CHECK(!a.cfg.feature_net.empty(),
            "ddm eval --shapes needs --feature-net FILE: a shape classifier trained on the dataset (`ddm "
            "train-classifier --config` on the shards scripts/make_shapes.py --labels wrote; docs/text.md)");
  DDM_INPUT_CHECK(a.sample.prompts.empty() && a.sample.prompts_file.empty(),
            "ddm eval --shapes takes its prompts from " << a.shapes << "/prompts.jsonl; remove --prompt / --prompts");
  set_threads(a.sample.threads);
  const torch::Device device = resolve_device(a.sample.device, 0, "--device");
  const ShapesDataset data = read_shapes_dataset(a.shapes);
  LoadedFeatureNet net = load_feature_net(a.cfg.feature_net);
  const FeatureNetShape& shape = net.net->shape();
  DDM_INPUT_CHECK(shape.in_channels == 3 && shape.image_size == data.size &&
                shape.num_classes == static_cast<int64_t>(data.shapes.size()),
            "--feature-net " << a.cfg.feature_net << " classifies " << shape.in_channels << "x" << shape.image_size << "x"
                             << shape.image_size << " images into " << shape.num_classes << " classes, but "
                             << a.shapes << " has 3x" << data.size << "x" << data.size << " images of "
                             << data.shapes.size() << " shapes: train it on this dataset's shards");
  net.net->to(device);
  Source src = open_source(a.sample);
  const LoadedModel& m = src.defaults();
  const auto p = static_cast<int64_t>(data.prompts.size());
  for (const ShapesPrompt& prompt : data.prompts) a.sample.prompts.push_back(prompt.caption);
  a.sample.n = p * a.per_prompt;
  GenerateOptions g = generate_options(a.sample, m);
  std::cout << "sampling " << a.per_prompt << " images for each of the " << p << " prompts of " << a.shapes
            << "/prompts.jsonl from " << src.name << ": " << g.sample.sampler << ", " << g.sample.steps << " steps, cfg "
            << g.sample.cfg << std::endl;
  const std::vector<std::string> labels = open_prompts(a.sample, src, g);
  Generated out = generate(*src.den, m.cfg.model.in_channels, m.cfg.model.image_size, g);
  if (isatty(fileno(stdout))) std::printf("\n");
  const torch::Tensor images = to_uint8(out.images);  // [n, C, S, S]
  DDM_INPUT_CHECK(images.size(1) == 3 && images.size(2) == data.size,
            src.name << " draws " << images.size(1) << "x" << images.size(2) << "x" << images.size(3) << " images, but "
                     << a.shapes << "'s are 3x" << data.size << "x" << data.size);
  const torch::Tensor classes = predict_classes(net.net, images);  // [n]
  const std::vector<ShapeAttributes> measured = measure_shapes(data, images, classes);
  std::vector<int64_t> prompt_of;
  for (int64_t i = 0; i < a.sample.n; ++i) prompt_of.push_back(i / a.per_prompt);
  const ShapesReport r = shapes_report(data, prompt_of, measured);
  std::cout << "\nprompt accuracy of " << src.name << " (" << g.sample.sampler << ", " << g.sample.steps << " steps, cfg "
            << g.sample.cfg << ", seed " << g.seed << ") on " << a.shapes << "; held out of training: ";
  for (size_t i = 0; i < data.held_out.size(); ++i) std::cout << (i ? "; " : "") << data.held_out[i];
  std::cout << "\n" << r.table();
  if (a.out.empty()) a.out = (fs::path(src.model ? a.sample.ckpt : a.sample.ensemble) / "eval").string();
  fs::create_directories(a.out);
  const std::string stem = "shapes-" + g.sample.sampler + "-" + std::to_string(g.sample.steps) + "steps-cfg" +
                           std::to_string(g.sample.cfg).substr(0, 4) + "-seed" + std::to_string(g.seed);
  auto j = nlohmann::json::parse(r.json());
  j["checkpoint"] = src.name, j["shapes"] = a.shapes, j["feature_net_sha256"] = net.sha256;
  j["sampler"] = g.sample.sampler, j["steps"] = g.sample.steps, j["cfg"] = g.sample.cfg, j["seed"] = g.seed;
  j["per_prompt"] = a.per_prompt;
  nlohmann::json each = nlohmann::json::array();
  for (size_t i = 0; i < measured.size(); ++i) {
    nlohmann::json e{{"prompt", prompt_of[i]}};
    for (int k = 0; k < kNumShapeAttributes; ++k) e[kShapeAttributes[k]] = measured[i][static_cast<size_t>(k)];
    each.push_back(e);
  }
  j["measured"] = each;
  const std::string json_path = (fs::path(a.out) / (stem + ".json")).string();
  write_file_atomic(json_path, j.dump(2) + "\n");
  // The grid: a row per prompt (its caption on the left), the first 12 seen and the first 12 held-out.
  std::vector<torch::Tensor> rows;
  std::vector<std::string> row_labels;
  int64_t shown[2] = {0, 0};
  for (int64_t q = 0; q < p; ++q) {
    int64_t& k = shown[data.prompts[static_cast<size_t>(q)].heldout];
    if (k++ >= 12) continue;
    rows.push_back(images.narrow(0, q * a.per_prompt, a.per_prompt));
    row_labels.push_back(labels[static_cast<size_t>(q)]);
  }
  const std::string png = (fs::path(a.out) / (stem + ".png")).string();
  save_image_grid(png, to_unit_range(torch::cat(rows)), a.per_prompt, row_labels);
  std::cout << "wrote " << json_path << " and " << png << " (a row per prompt: 12 seen, then 12 held-out)" << std::endl;
  return 0;
}

// The real images to compare with, when they are not Fashion-MNIST's test split: --reference-config's
// data, else (for a model trained on other data) the model's own training data; either with the
// --reference-set overrides (e.g. data.root=TEST). Null: Fashion-MNIST.
std::shared_ptr<const Dataset> open_reference(const EvalArgs& a, const RunConfig* model_cfg, const std::string& what) {
  std::optional<RunConfig> cfg;
  // (The overrides' errors name them as --set does: here they are --reference-set's.)
  const auto as_reference_sets = [&](const std::function<RunConfig()>& f) {
    try {
      return f();
    } catch (const Error& e) {
      std::string m = e.what();
      for (const std::string& ov : a.reference_sets)
        for (size_t at = m.find("--set " + ov); at != std::string::npos; at = m.find("--set " + ov, at + 1))
          m.replace(at, 5, "--reference-set");
      throw InputError(m);
    }
  };
  if (!a.reference_config.empty()) {
    cfg = as_reference_sets([&] { return load_config(a.reference_config, a.reference_sets); });
  } else if (model_cfg && origin_of(model_cfg->data) != "fashion-mnist") {
    // A model of `ddm encode` latent shards: their images are elsewhere (encode.json names only where
    // they came from), so the reference is named.
    DDM_INPUT_CHECK(model_cfg->data.source != "latents",
                    what << " was trained on latent shards (`ddm encode`, " << model_cfg->data.root
                         << "), which hold no images to compare its samples with: give --reference-config, the "
                            "config of the data they were encoded from (and --reference-set data.root=HELD_OUT for "
                            "images it never saw)");
    DDM_INPUT_CHECK(!a.cfg.feature_net.empty(),
              what << " was trained on data from \"" << origin_of(model_cfg->data) << "\", not Fashion-MNIST: give "
                   << "--feature-net FILE, a network trained on that data (`ddm train-classifier --config RUN/config.toml --out "
                   << "F.safetensors`), and optionally --reference-set data.root=HELD_OUT to compare with images "
                   << "the model never saw (default: its training data)");
    cfg = as_reference_sets([&] { return parse_config(to_toml(*model_cfg), what + " (its config)", a.reference_sets); });
  } else {
    DDM_INPUT_CHECK(a.reference_sets.empty(), "--reference-set applies to --reference-config's data or to a model trained "
                                        "on data other than Fashion-MNIST");
    return nullptr;
  }
  auto d = std::make_shared<Dataset>(load_whole_dataset(cfg->data, static_cast<int>(std::max<int64_t>(1, a.sample.threads))));
  std::cout << "reference: " << d->description << std::endl;
  return d;
}

int eval_cmd(EvalArgs a) {
  if (!a.shapes.empty()) return eval_shapes_cmd(std::move(a));
  DDM_INPUT_CHECK(a.sample.ckpt.empty() + a.sample.ensemble.empty() + a.samples_file.empty() + a.anchor.empty() == 3,
            "ddm eval: give exactly one of --ckpt DIR, --ensemble DIR, --samples FILE or --anchor train|noise");
  set_threads(a.sample.threads);
  a.cfg.device = resolve_device(a.sample.device, 0, "--device");  // the feature network's too
  SampleSet set;
  std::string stem;
  if (!a.anchor.empty()) {
    if (a.reference_config.empty()) {
      DDM_INPUT_CHECK(a.reference_sets.empty(), "--reference-set applies to --reference-config's data");
      set = as_input_error([&] { return anchor_samples(a.anchor, a.sample.n, static_cast<uint64_t>(a.sample.seed), a.cfg.data_root); });
    } else {
      // Your own data: the anchor's images are the config's data (its training images), the reference
      // that data with --reference-set's overrides (e.g. data.root=HELD_OUT; without any, itself).
      a.cfg.reference = as_input_error([&] { return open_reference(a, nullptr, "--anchor"); });
      const Dataset own = as_input_error([&] {
        return load_whole_dataset(load_config(a.reference_config).data, static_cast<int>(std::max<int64_t>(1, a.sample.threads)));
      });
      set = as_input_error([&] { return anchor_samples(a.anchor, a.sample.n, static_cast<uint64_t>(a.sample.seed), own); });
    }
    stem = "anchor-" + a.anchor + "-n" + std::to_string(a.sample.n) + (a.sample.seed != 0 ? "-seed" + std::to_string(a.sample.seed) : "");
    if (a.out.empty()) a.out = "eval";
  } else if (!a.samples_file.empty()) {
    a.cfg.reference = as_input_error([&] { return open_reference(a, nullptr, a.samples_file); });
    set = load_samples(a.samples_file, /*any_source=*/a.cfg.reference != nullptr);
    if (set.images.size(0) > a.sample.n) {
      std::cout << "using the first " << a.sample.n << " of " << set.images.size(0) << " images (--n)" << std::endl;
      set.images = set.images.narrow(0, 0, a.sample.n);
      if (set.labels.defined()) set.labels = set.labels.narrow(0, 0, a.sample.n);
    }
    stem = fs::path(a.samples_file).stem().string();
    if (a.out.empty()) {  // beside the samples (in eval/ already when `ddm eval` wrote them)
      const fs::path dir = fs::path(a.samples_file).parent_path();
      a.out = (dir.filename() == "eval" ? dir : dir / "eval").string();
    }
  } else {
    Source src = open_source(a.sample);
    const LoadedModel& m = src.defaults();
    a.cfg.reference = as_input_error([&] { return open_reference(a, &m.cfg, src.name); });
    const Denoiser& den = *src.den;
    // Everything that would refuse the samples is checked before they are made (hours at --n 10000).
    // The images the samples will be (a latent model's: decoded, of its autoencoder's image shape).
    const int64_t channels = m.latent ? m.latent->shape().in_channels : m.cfg.model.in_channels;
    const int64_t size = m.latent ? m.latent->shape().image_size : m.cfg.model.image_size;
    as_input_error([&] { check_eval_inputs(a.cfg, channels, size, a.sample.n, src.name); });
    if (a.out.empty()) a.out = (fs::path(src.model ? a.sample.ckpt : a.sample.ensemble) / "eval").string();
    create_output_dir(a.out, "--out");
    GenerateOptions g = generate_options(a.sample, m);
    const int64_t classes = m.cfg.model.num_classes;
    const bool tty = isatty(fileno(stdout));
    std::cout << "sampling " << a.sample.n << " images from " << src.name << ": " << g.sample.sampler << ", "
              << g.sample.steps << " steps, cfg " << g.sample.cfg << std::endl;
    const auto [controls, refs] = open_conditions(a.sample, src, g);
    open_prompts(a.sample, src, g);  // a text model: a row of samples per prompt
    Generated out = generate(den, m.cfg.model.in_channels, m.cfg.model.image_size, g);
    if (tty) std::printf("\n");
    std::printf("NFE %lld per image, %.0f s (%.1f img/s)\n", static_cast<long long>(out.nfe), out.seconds,
                a.sample.n / out.seconds);
    if (src.ensemble) std::cout << src.ensemble->usage_report(a.sample.n);
    set.images = to_uint8(out.images);
    if (classes > 0) set.labels = out.labels;
    set.origin = src.name + " (" + g.sample.sampler + ", " + std::to_string(g.sample.steps) + " steps, cfg " +
                 std::to_string(g.sample.cfg).substr(0, 4) + ", NFE " + std::to_string(out.nfe) + ")";
    set.info = {{"checkpoint", src.name},
                {"sampler", g.sample.sampler},
                {"steps", std::to_string(g.sample.steps)},
                {"cfg", std::to_string(g.sample.cfg)},
                {"nfe", std::to_string(out.nfe)},
                {"seed", std::to_string(g.seed)},
                {"sampling_seconds", std::to_string(out.seconds)}};
    if (controls) {
      const double err = control_error(controls->type, out.images, controls->maps);
      std::printf("control fidelity: %s-map MSE %.4f of the samples against the given maps (%s)\n",
                  controls->type.c_str(), err, m.cfg.model.controlnet.empty() ? "not a ControlNet: a baseline"
                                                                             : "ControlNet");
      set.info["control"] = controls->origin;
      set.info["control_mse"] = std::to_string(err);
    }
    if (refs) {
      const double sim = embed_similarity(*refs->embedder, out.images, refs->images);
      std::printf("embedding similarity: %.4f (mean cosine of the samples' and their references' embeddings; %s)\n",
                  sim, m.embedder ? "model.embed" : "not a model.embed model: a baseline");
      set.info["reference"] = refs->origin;
      set.info["embed_similarity"] = std::to_string(sim);
      set.info["embed_similarity_network"] = "sha256 " + std::string(kDefaultFeatureNetSha256);
    }
    if (src.ensemble) {
      const EnsembleUsage& u = src.ensemble->usage();
      set.info["routing"] = src.routing.spec;
      set.info["gflop_per_image"] = std::to_string((u.expert_flops + u.router_flops) / a.sample.n / 1e9);
      set.info["router_gflop_per_image"] = std::to_string(u.router_flops / a.sample.n / 1e9);
      std::string usage;
      for (int64_t v : u.expert_evals) usage += (usage.empty() ? "" : " ") + std::to_string(v);
      set.info["expert_sample_steps"] = usage;
    }
    std::string routing_name = src.routing.spec;  // no ':' in file names: topk:2 -> topk2
    routing_name.erase(std::remove(routing_name.begin(), routing_name.end(), ':'), routing_name.end());
    stem = (src.ensemble ? "routing-" + routing_name + "-" : std::string()) + g.sample.sampler + "-" +
           std::to_string(g.sample.steps) + "steps-cfg" +
           std::to_string(g.sample.cfg).substr(0, 4) + "-n" + std::to_string(a.sample.n) +
           (controls ? "-control-" + controls->type + (a.sample.control_from.empty() ? "-file" : "-" + a.sample.control_from) : "") +
           (refs ? "-reference" + (a.sample.reference_from.empty() ? std::string("-file") : "-" + a.sample.reference_from) : "") +
           (a.sample.seed != 0 ? "-seed" + std::to_string(a.sample.seed) : "");
    SafetensorsFile f;
    f.tensors["images"] = set.images;
    f.tensors["labels"] = out.labels;
    f.metadata["origin"] = set.origin;
    f.metadata["data_source"] = origin_of(m.cfg.data);
    save_safetensors((fs::path(a.out) / (stem + ".safetensors")).string(), f);
    std::cout << "wrote " << (fs::path(a.out) / (stem + ".safetensors")).string() << " (the samples)" << std::endl;
  }
  EvalReport r = evaluate_samples(set, a.cfg);
  std::cout << "\n" << r.table();
  std::printf("(features and statistics: %.1f s)\n", r.seconds);
  create_output_dir(a.out, "--out");
  const std::string json_path = (fs::path(a.out) / (stem + ".json")).string();
  // (The name says how the samples were made, not what they were measured against: another
  // --feature-net or reference lands on the same name.)
  if (fs::exists(json_path))
    std::cout << "note: " << json_path << " held an earlier evaluation with the same sampling settings; it is "
              << "replaced, with its samples (give another --out to keep both)" << std::endl;
  write_file_atomic(json_path, r.json() + "\n");
  std::cout << "wrote " << json_path << std::endl;
  // One row of up to 10 images per requested class, so a person can look as well as read.
  if (set.labels.defined() && !r.class_names.empty()) {
    std::vector<torch::Tensor> rows;
    std::vector<std::string> names;
    for (size_t c = 0; c < r.class_names.size(); ++c) {
      auto idx = set.labels.eq(static_cast<int64_t>(c)).nonzero().flatten();
      if (idx.numel() == 0) continue;
      idx = idx.narrow(0, 0, std::min<int64_t>(10, idx.numel()));
      auto imgs = set.images.index_select(0, idx);  // [<= 10, C, H, W]
      imgs = imgs.scalar_type() == torch::kUInt8 ? to_unit_range(imgs) : imgs.to(torch::kFloat32);
      if (imgs.size(0) < 10)  // pad the row with background
        imgs = torch::cat({imgs, -torch::ones({10 - imgs.size(0), imgs.size(1), imgs.size(2), imgs.size(3)})});
      rows.push_back(imgs);
      names.push_back(r.class_names[c]);
    }
    const std::string png = (fs::path(a.out) / (stem + ".png")).string();
    save_image_grid(png, torch::cat(rows), 10, names);
    std::cout << "wrote " << png << " (one row per requested class)" << std::endl;
  }
  return 0;
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  EvalArgs& ea = *a;
  ea.sample.n = 10000;
  auto* cmd = app.add_subcommand(
      "eval",
      "Measure sample quality: FD, KID, precision/recall, class accuracy.\n"
      "Measure sample quality against real images: FD (Frechet distance in a feature network's space; not "
      "Inception FID), KID, precision/recall and, for class-conditional samples, the feature network's accuracy "
      "on each requested class. Fashion-MNIST models are compared with its test split in the shipped network's "
      "space (FD-fmnist); a model trained on other data with its training data (or --reference-set's) in the "
      "space of --feature-net, trained on that data by `ddm train-classifier --config` (docs/evaluation.md). "
      "Samples a checkpoint (--ckpt), reads a file (--samples) or draws a reference point (--anchor). Prints a table and writes JSON, the samples and, for class-conditional samples, a per-class PNG grid "
      "to --out. With --shapes, a text model's prompt accuracy on the shapes dataset instead (docs/text.md).");
  cmd->add_option("--ckpt", ea.sample.ckpt, "run or checkpoint directory to sample from");
  cmd->add_option("--samples", ea.samples_file,
                  "safetensors file with images (uint8, or float in [-1, 1]) and optional labels, e.g. "
                  "from `ddm sample --raw`");
  cmd->add_option("--anchor", ea.anchor,
                  "evaluate a reference point instead: train (random train images: the floor) or noise "
                  "(per-pixel Gaussian with the data's mean and variance: a ceiling); of Fashion-MNIST, or of "
                  "--reference-config's data (the reference then that data with --reference-set's overrides)")
      ->check(CLI::IsMember({"train", "noise"}));
  cmd->add_option("--out", ea.out,
                  "output directory (default: eval/ in the run directory, next to --samples, or in the "
                  "current directory for --anchor)");
  cmd->add_option("--feature-net", ea.cfg.feature_net,
                  "feature network file (default: the shipped Fashion-MNIST one; for other data, one "
                  "`ddm train-classifier --config` trained on it)");
  cmd->add_option("--reference-config", ea.reference_config,
                  "compare with this config's data (default: Fashion-MNIST's test split, or the model's own data)");
  cmd->add_option("--reference-set", ea.reference_sets,
                  "override a key of the reference's config, e.g. --reference-set data.root=HELD_OUT (repeatable)");
  cmd->add_option("--cache-dir", ea.cfg.cache_dir, "reference-feature cache (default: ~/.cache/ddm)");
  cmd->add_option("--data-root", ea.cfg.data_root, "Fashion-MNIST directory (default: the Debian package's)");
  cmd->add_flag("--cas", ea.cfg.cas,
                "also compute CAS: train a fresh classifier on the labelled samples and report its accuracy "
                "on the real test split (about 1-2 minutes per 10000 samples on 2 cores)");
  cmd->add_option("--cas-epochs", ea.cfg.cas_epochs, "epochs of the CAS classifier")->check(kPositive);
  cmd->add_option("--shapes", ea.shapes,
                  "prompt accuracy instead, on the shapes dataset DIR (scripts/make_shapes.py): each prompt of "
                  "DIR/prompts.jsonl sampled --per-prompt times, the shape judged by --feature-net (a shape "
                  "classifier: `ddm train-classifier --config`), colour, size, position and background measured "
                  "from pixels; seen against held-out compositions (docs/text.md)");
  cmd->add_option("--per-prompt", ea.per_prompt, "--shapes: samples per prompt")->check(kPositive);
  add_sample_flags(cmd, ea.sample);
  cmd->get_option("--n")->description("number of images (report results at 10000)");
  cmd->footer("\nExamples:\n"
              "  ddm eval --ensemble runs/quickstart                  # Fashion-MNIST: FD-fmnist against its test split\n"
              "  ddm eval --ckpt runs/photos --feature-net photos-net.safetensors --reference-set data.root=held-out.tar\n"
              "  ddm eval --samples samples.safetensors --cas\n"
              "  ddm eval --anchor train                              # the floor: real images");
  return Command{cmd, [a] { return eval_cmd(*a); }};
}

}  // namespace ddm
