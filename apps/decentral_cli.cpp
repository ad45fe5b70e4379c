// The decentralized-diffusion subcommands of ddm:
//   partition     cluster a dataset into K subsets, one per expert (two-stage balanced k-means, or random)
//   train-router  train the router p(cluster | x_t, t, class) and report its accuracy per noise level
//   ensemble      check that a partition, its experts and a router belong together; write ensemble.json
//   islands       run | status | slurm: train all experts and the router as independent processes
//   distill       train one dense student on the prediction of each image's own expert
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>

#include <ATen/Parallel.h>

#include "cli_util.h"
#include "core/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/presets.h"
#include "core/run_dir.h"
#include "data/dataset.h"
#include "data/latent_shards.h"
#include "data/shard_loader.h"
#include "decentral/distill.h"
#include "decentral/ensemble_dir.h"
#include "decentral/features.h"
#include "decentral/islands.h"
#include "decentral/partition.h"
#include "decentral/router_eval.h"
#include "decentral/shard_partition.h"
#include "decentral/train_run.h"
#include "eval/grid.h"
#include "launch/process.h"
#include "model/router.h"
#include "run/trainer.h"
#include "train/loaded_model.h"
#include "train/text.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

struct PartitionArgs {
  std::string config, source = "fashion-mnist", root, split = "train", features, out;  // features "": pixels, or latent
  std::string device = "cpu";  // where a feature network / encoder runs
  int64_t limit = 0, threads = 0, shard_size = 10000, min_shards = 1;
  bool unbalanced = false, force = false, reshard = false;
  PartitionConfig cfg;
};

int partition_cmd(const PartitionArgs& a) {
  // What it was asked to do, and the data's header, are checked first; an error there is bad input
  // (exit status 2: `ddm islands` reports it as its own).
  DataConfig dc;
  const FeatureSource src = as_input_error([&] {
    DDM_INPUT_CHECK(!a.out.empty(), "--out DIR is required");
    PartitionConfig settings = a.cfg;
    settings.balanced = !a.unbalanced;
    check_partition_config(settings);  // before the features, which can take minutes
    check_partition_out(a.out, a.force);
    if (fs::is_regular_file(fs::path(a.out) / "partition.safetensors"))  // --force: said before it is replaced
      std::cout << "note: --force replaces the partition in " << a.out << ": experts, routers and ensembles trained "
                << "on it will refuse the new one (they record its sha256); to keep going with them, partition into "
                << "another --out" << std::endl;
    std::string text_encoder;  // the config's, for --features text
    if (!a.config.empty()) {
      const RunConfig full = load_config(a.config);
      dc = full.data;
      text_encoder = full.model.text_encoder;
    } else {
      dc.source = a.source;
      dc.root = a.root;
      dc.split = a.split;
      dc.limit = a.limit;
    }
    // Latent shards hold no pixels: their own latents are the default features (images that `ddm encode
    // --text` kept are partitioned by their pixels, as any images).
    const bool latent_features = dc.source == "latents" && !read_latent_shards_info(dc.root).holds_images();
    FeatureSource f = parse_feature_source(!a.features.empty() ? a.features : latent_features ? "latent" : "pixels");
    if (f.kind == "text" && f.path.empty()) {
      // The encoder the experts will condition on: the config's, or the one `ddm encode --text` used.
      if (text_encoder.empty() && dc.source == "latents") text_encoder = read_latent_shards_info(dc.root).text.encoder;
      DDM_INPUT_CHECK(!text_encoder.empty(), "--features text: name the text encoder (text:DIR, e.g. a CLIP or "
                                       "sentence-transformers directory), or give --config with model.text_encoder");
      f.path = text_encoder;
    }
    if (f.kind == "text")  // before any data is read
      DDM_INPUT_CHECK(fs::is_directory(f.path), "--features text:" << f.path << ": no such directory (a text encoder's: "
                                                "CLIP, sentence-transformers or a diffusers pipeline)");
    return f;
  });
  const bool latents = dc.source == "latents";
  const torch::Device device = resolve_device(a.device, 0, "--device");
  set_threads(a.threads);
  PartitionConfig cfg = a.cfg;
  cfg.balanced = !a.unbalanced;
  if (dc.source == "shards" || latents) {
    DDM_INPUT_CHECK(!a.config.empty(), "tar shards are partitioned from a training config (--config CONFIG with "
                                 "data.source = \"shards\", data.root and data.resolution, or data.source = "
                                 "\"latents\" and data.root), so that the partition sees the data as the experts will");
    ShardPartitionOptions o;
    o.data = dc;
    o.features = src;
    o.cfg = cfg;
    o.device = device;
    o.threads = at::get_num_threads();
    o.reshard = a.reshard;
    o.shard_size = a.shard_size;
    o.min_shards = a.min_shards;
    o.force = a.force;
    std::cout << format_summary(partition_shards(o, a.out));  // (bad input there exits 2, a failed write 1)
    std::cout << "next: ddm train --config " << a.config << " --partition " << a.out << " --expert 0 --out runs/expert0"
              << (a.reshard ? "" : "  (after partitioning again with --reshard: experts over shards read their own)")
              << std::endl;
    return 0;
  }
  DDM_INPUT_CHECK(!a.reshard, "--reshard applies to tar shards (data.source = \"shards\" or \"latents\" in --config) only");
  const auto t0 = std::chrono::steady_clock::now();
  const Dataset data = as_input_error([&] { return load_dataset(dc); });
  const int64_t n = data.images.size(0);
  if (cfg.k > n)
    throw InputError("--k " + std::to_string(cfg.k) + " is larger than the data (" + data.description + "); use at most " +
                     std::to_string(n));
  std::cout << "partitioning " << data.description << " into " << cfg.k << " clusters ("
            << (cfg.method == "random" ? "random" : std::string(cfg.balanced ? "balanced " : "") + "two-stage k-means, " +
                                                        cfg.metric)
            << ", seed " << cfg.seed << ")" << std::endl;
  Features feats;
  // The features of the given data and the clusters of them: what fails here fails again the same way.
  if (cfg.method != "random")
    feats = as_input_error([&] { return compute_features(data, src, cfg.seed, /*quiet=*/false, device); });
  Partition p = as_input_error([&] { return make_partition(feats.rows, n, cfg); });
  p.data_sha256 = dataset_sha256(data);
  p.data_description = data.description;
  p.features = cfg.method == "random" ? "none (random)" : feats.description;
  if (cfg.method != "random") p.settings["features"] = src.spec();
  const auto summary = partition_summary(p, data);
  save_partition(a.out, p, summary, a.force);
  const auto grid_rows = cluster_grid_rows(p);
  save_cluster_grid((fs::path(a.out) / "clusters.png").string(), data.images.index_select(0, grid_rows), grid_rows, p);
  std::cout << format_summary(summary);
  std::printf("wrote %s/partition.safetensors, summary.json and clusters.png in %.1f s\n", a.out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::cout << "next: ddm train --config CFG --partition " << a.out << " --expert 0 --out runs/expert0" << std::endl;
  return 0;
}

struct RouterArgs {
  std::string config, partition, out, preset;  // "" = router-dit-tiny, or latent-router-dit for latent experts
  std::vector<std::string> overrides;
  int64_t holdout = 1000, buckets = 10;
  bool resume = false, force = false, quiet = false, eval_only = false;
};

// Accuracy and calibration of the trained router (EMA weights) on the held-out images, written to
// router_eval.json in the run directory.
void evaluate_router_run(const std::string& out, int64_t buckets) {
  LoadedModel r = load_model(out, /*use_ema=*/true);
  DataConfig dc = r.cfg.data;
  const bool shards = dc.source == "shards" || dc.source == "latents";
  const int threads = std::max(1, static_cast<int>(torch::get_num_threads()));
  Dataset data = shards ? open_shards(dc, threads, /*quiet=*/true) : load_dataset(dc);
  const Partition p = load_partition(dc.partition);
  check_partition_matches(p, data);
  const int64_t n = shards ? data.shards->samples : data.images.size(0), h = dc.holdout;
  // The images train() withheld (the same seeded split), or without a hold-out the first 2000.
  const torch::Tensor idx = h > 0 ? holdout_split(n, h, static_cast<uint64_t>(r.cfg.train.seed)).second
                                  : torch::arange(std::min<int64_t>(n, 2000), torch::kInt64);
  const std::string note = h > 0 ? "held-out images (" + std::to_string(h) + " chosen at random, never trained on)"
                                 : "training images (data.holdout = 0: none were held out)";
  // uint8 images [N, C, H, W] (latent shards: posteriors float [N, 2z, h, w]), labels int64 [N]
  torch::Tensor images, labels;
  std::vector<std::string> captions;  // a text router's: each image's caption
  if (shards) {  // those samples (idx, in shard order), decoded as training decodes them, centre-cropped
    auto keep = std::make_shared<std::vector<bool>>(static_cast<size_t>(n), false);
    const auto at = idx.accessor<int64_t, 1>();
    for (int64_t i = 0; i < idx.size(0); ++i) (*keep)[static_cast<size_t>(at[i])] = true;
    std::vector<torch::Tensor> xs, ys;
    for_each_in_order(data, dc, idx.size(0), threads, [&](const torch::Tensor& x, const torch::Tensor& y, int64_t) {
      xs.push_back(data.latents ? x.clone() : to_uint8(x));
      ys.push_back(y);
    }, keep, r.text ? &captions : nullptr);
    images = torch::cat(xs), labels = torch::cat(ys);
  } else {
    images = data.images.index_select(0, idx), labels = data.labels.index_select(0, idx);
    if (r.text) {
      const auto at = idx.accessor<int64_t, 1>();
      for (int64_t i = 0; i < idx.size(0); ++i) captions.push_back(data.captions.at(static_cast<size_t>(at[i])));
    }
  }
  // A text router is measured on each image's own caption (and the empty prompt for the null column).
  torch::Tensor pooled, null_pooled;
  if (r.text) {
    std::vector<torch::Tensor> parts;
    for (size_t i = 0; i < captions.size(); i += 64) {
      const std::vector<std::string> some(captions.begin() + i, captions.begin() + std::min(captions.size(), i + 64));
      parts.push_back(encode_texts(*r.text, some, torch::kCPU).pooled);  // [b, P]
    }
    pooled = torch::cat(parts);                                      // [N, P]
    null_pooled = encode_texts(*r.text, {""}, torch::kCPU).pooled;  // [1, P]
  }
  // A latent ensemble's router routes latents: its x_t is built on the encoder's means (latent shards
  // hold them).
  const torch::Tensor x0 = data.latents ? normalized_means(images, r.latent->scale(), r.latent->shift())
                           : r.latent   ? r.latent->encode_mean(images)
                                        : to_unit_range(images);
  const RouterReport rep = evaluate_router(r.net, r.cfg, x0, labels, p.labels.index_select(0, idx), buckets,
                                           static_cast<uint64_t>(r.cfg.train.seed) + 1, note, pooled, null_pooled);
  std::cout << "\n" << rep.table();
  nlohmann::json j = rep.json();
  j["checkpoint"] = r.checkpoint;
  const std::string path = RunDir(out) / RunDir::kRouterEval;
  write_file_atomic(path, j.dump(2) + "\n");
  std::cout << "wrote " << path << std::endl;
}

int train_router_cmd(const RouterArgs& a) {
  if (!a.eval_only) {
    const RunConfig cfg = router_run_config(a.config, a.partition, a.preset, a.holdout, a.overrides);
    TrainSummary s = train_run(cfg, {a.out, a.resume, a.force, a.quiet, nullptr});
    if (s.interrupted) return 128 + s.signal;
    if (s.rank != 0) return 0;  // rank 0 evaluates and writes router_eval.json
    std::cout << "done: step " << s.last_step << ", checkpoint " << s.checkpoint << std::endl;
    // A finished router resumed (`ddm islands run` checks its islands so): its report stands.
    try {
      const std::string report = RunDir(a.out) / RunDir::kRouterEval;
      if (fs::is_regular_file(report) &&
          nlohmann::json::parse(read_file(report)).value("checkpoint", "") == s.checkpoint) {
        std::cout << report << " is the report of this checkpoint already" << std::endl;
        return 0;
      }
    } catch (const std::exception&) {
      // unreadable: written again below
    }
  }
  evaluate_router_run(a.out, a.buckets);
  return 0;
}

// --text-encoder DIR of `ddm ensemble` and `ddm distill`: text experts' frozen encoder where it is now
// (a moved project, a rebuilt environment), checked against each checkpoint's sha256 as it loads.
void use_moved_text_encoder(const std::string& dir) {
  if (dir.empty()) return;
  DDM_INPUT_CHECK(fs::is_directory(dir), "--text-encoder " << dir << ": no such directory");
  use_text_encoder_at(fs::absolute(dir).lexically_normal().string());
}

int ensemble_cmd(const std::string& out, const EnsembleSpec& spec, bool force, const std::string& text_encoder) {
  DDM_INPUT_CHECK(force || !fs::exists(fs::path(out) / "ensemble.json"),
            out << "/ensemble.json already exists; use --force to replace it or another --out");
  use_moved_text_encoder(text_encoder);
  if (!text_encoder.empty() && !spec.experts.empty()) {  // as `ddm sample` refuses it for a model without text
    bool text = true;
    try {
      text = !load_config((fs::path(spec.experts[0]) / "config.toml").string()).model.text_encoder.empty();
    } catch (const Error&) {
      // unreadable: assembling names it
    }
    DDM_INPUT_CHECK(text, "--text-encoder: the experts (" << spec.experts[0] << ", ...) are not conditioned on text "
                                                         "(model.text_encoder)");
  }
  std::vector<std::string> notes;
  // Every refusal is about the parts it was given (and a damaged checkpoint among them): exit 2.
  const nlohmann::json m = assemble_ensemble(out, spec, notes);
  const std::string moved = text_encoder.empty() ? "" : " --text-encoder " + text_encoder;  // sampling needs it too
  for (const auto& n : notes) std::cout << "note: " << n << std::endl;
  std::cout << "ensemble of " << m["k"] << " experts (";
  for (const auto& e : m["experts"]) std::cout << (e["index"] == 0 ? "" : ", ") << e["preset"].get<std::string>() << " "
                                               << e["objective"].get<std::string>();
  std::cout << ") and router " << m["router"]["preset"].get<std::string>() << "; default routing " << spec.routing
            << "\nwrote " << out << "/ensemble.json\n"
            << "next: " << ensemble_sample_command(out) << moved << std::endl;
  return 0;
}

struct DistillArgs {
  std::string ensemble, config, out, preset, text_encoder;
  std::vector<std::string> overrides;
  bool resume = false, force = false, quiet = false;
};

// The student's run config: --config, or else expert 0's config (its data, forward process, time
// distribution, label dropout, seed and the global batch and steps of a monolith), on all the data,
// with train.teacher = the ensemble; --preset swaps the model.
RunConfig distill_config(const DistillArgs& a) {
  const std::string from = a.config.empty() ? (fs::path(ensemble_expert_run(a.ensemble, 0)) / "config.toml").string()
                                            : a.config;
  RunConfig c = load_config(from);
  if (!a.preset.empty()) {
    ModelConfig m = c.model;  // apply_preset keeps what the model learns (the data's shape, model.latent*)
    m.preset = a.preset;
    apply_preset(a.preset, m);
    DDM_INPUT_CHECK(!is_router_arch(m.arch), "--preset " << a.preset << " is a router; the student is a diffusion model "
                                                      "(see `ddm presets`)");
    m.num_classes = c.model.num_classes == 0 ? 0 : -1;
    c.model = m;  // latent teachers: the student learns the same latents
  }
  c.data.partition.clear();
  c.data.expert = -1;
  c.train.expert_budget = "full";
  c.train.teacher = fs::absolute(a.ensemble).lexically_normal().string();
  if (!a.text_encoder.empty()) {  // the teachers' encoder moved: the student's is the same one
    DDM_INPUT_CHECK(!c.model.text_encoder.empty(),
                    "--text-encoder: the student (" << from << ") is not conditioned on text (model.text_encoder)");
    c.model.text_encoder = fs::absolute(a.text_encoder).lexically_normal().string();
  }
  return parse_config(to_toml(c), "the student config made from " + from, a.overrides);
}

int distill_cmd(const DistillArgs& a) {
  use_moved_text_encoder(a.text_encoder);
  const RunConfig cfg = distill_config(a);
  TrainSummary s = train_run(cfg, {a.out, a.resume, a.force, a.quiet, nullptr});
  if (s.interrupted) return 128 + s.signal;
  if (s.rank != 0) return 0;
  std::cout << "done: step " << s.last_step << ", checkpoint " << s.checkpoint << "\nnext: ddm sample --ckpt " << a.out
            << (cfg.model.text_encoder.empty() ? "" : " --prompt 'a prompt of yours'") << " --out student.png   (or ddm "
            << "eval --ckpt " << a.out << ")" << std::endl;
  return 0;
}

struct IslandsArgs {
  std::string file, script;
};

int islands_cmd(const std::string& action, const IslandsArgs& a) {
  const IslandsConfig c = load_islands_config(a.file);
  if (action == "run") return run_islands(c, self_executable());
  if (action == "status") {
    std::cout << islands_status(c);
    return 0;
  }
  check_island_batches(c);
  const int64_t k = ensure_partition(c, self_executable());
  const std::string script = a.script.empty() ? (fs::path(c.out) / "islands.sbatch").string() : a.script;
  if (!fs::path(script).parent_path().empty()) fs::create_directories(fs::path(script).parent_path());
  fs::create_directories(fs::path(c.out) / "logs");
  write_file_atomic(script, slurm_script(c, k, self_executable()));
  fs::permissions(script, fs::perms::owner_exec | fs::perms::group_exec | fs::perms::others_exec, fs::perm_options::add);
  std::cout << "wrote " << script << ": a job array of " << k + 1 << " tasks (experts 0.." << k - 1 << ", router " << k << ")"
            << (c.nproc > 1 ? ", each island " + std::to_string(c.nproc) + " Slurm tasks (srun ranks)" : std::string())
            << "\nsubmit: sbatch " << script << "\nthen:   ddm islands run " << a.file
            << "   (skips finished islands, assembles the ensemble)" << std::endl;
  return 0;
}

}  // namespace

int run_quickstart_islands(const std::string& out, const std::string& experts_config, int64_t expert_steps,
                           int64_t router_steps, int64_t threads, const std::string& device,
                           int64_t concurrency) {
  const std::string abs = fs::absolute(out).lexically_normal().string();
  DDM_INPUT_CHECK(abs.find('\'') == std::string::npos && abs.find('\n') == std::string::npos,
            "--out: a path with a ' or a line break is not supported: " << abs);
  fs::create_directories(abs);
  const std::string config = (fs::path(abs) / "quickstart.toml").string();
  write_file_atomic(config, experts_config);
  std::ostringstream f;  // TOML literal strings: no escapes in paths
  f << "# Written by `ddm quickstart`: the islands of this run. Inspect with: ddm islands status THIS_FILE\n"
    << "out = '" << abs << "'\nconfig = '" << config << "'\n\n[partition]\npath = '" << abs
    << "/partition'\nk = 4\nfeatures = \"pixels:64\"\n\n[experts]\nbudget = \"split-batch\"\nset = ["
    << (expert_steps > 0 ? "\"train.steps=" + std::to_string(expert_steps) + "\", " : std::string())
    << "\"train.device=" << device << "\"]\n\n"
    << "[router]\npreset = \"router-dit-tiny\"\nholdout = 1000\nset = [\"train.steps="
    << (router_steps > 0 ? router_steps : 600) << "\", \"train.device=" << device << "\"]\n\n[run]\nconcurrency = " << concurrency << "\nretries = 2\nthreads = " << threads
    << "\nrouting = \"top1\"\n";
  const std::string file = (fs::path(abs) / "islands.toml").string();
  write_file_atomic(file, f.str());
  return run_islands(load_islands_config(file), self_executable());
}

std::vector<Command> add_decentral_commands(CLI::App& app) {
  std::vector<Command> cmds;

  auto pa = std::make_shared<PartitionArgs>();
  auto* part = app.add_subcommand(
      "partition",
      "Split a dataset into K clusters, one per expert.\n"
      "Split a dataset into K clusters, one per expert: features (PCA of pixels, the feature network, an "
      "autoencoder, the captions' text embeddings, or your own file), k-means into --fine centroids, then those centroids into K clusters; "
      "each image goes to the cluster of its fine centroid. Balanced (equal sizes) by default. Writes "
      "partition.safetensors, summary.json and clusters.png (the first images of each cluster) to --out. Tar "
      "shards (a --config with data.source = \"shards\") are streamed, with memory bounded by the features; "
      "each cluster's samples are listed in clusters/cluster-K.tsv (shard and key), and with --reshard also "
      "copied into shards of their own (shards/), which the experts then train on.");
  part->add_option("--k", pa->cfg.k, "number of clusters (experts), at least 2")->required()->default_str("");
  part->add_option("--out", pa->out, "partition directory to write")->required();
  part->add_option("--features", pa->features,
                   "pixels[:D] (PCA, default D 64; the default) | feature-net[:FILE] | autoencoder[:D] (D 32 unless given) | "
                   "latent:RUN (a `ddm train-autoencoder` run's latents, PCA 64: the space latent experts train in) | "
                   "latent (latent shards' own, PCA 64; the default for data.source = \"latents\") | "
                   "text[:ENCODER] (the captions' pooled embeddings by a text encoder's directory; `text` alone: "
                   "--config's model.text_encoder) | "
                   "file:PATH (.npy or .safetensors, one row per image in data order, `ddm text encode`'s output "
                   "included; or, for shards, an .npz of "
                   "numpy.savez(PATH, features=F, keys=K): row i for the sample with key K[i], in any order)");
  part->add_option("--method", pa->cfg.method, "kmeans | random (a seeded balanced random split, for ablations)")
      ->check(CLI::IsMember({"kmeans", "random"}))
      ->capture_default_str();
  part->add_option("--fine", pa->cfg.fine, "fine centroids of the first stage")->check(kPositive)->capture_default_str();
  part->add_option("--metric", pa->cfg.metric, "euclidean | cosine")
      ->check(CLI::IsMember({"euclidean", "cosine"}))
      ->capture_default_str();
  part->add_flag("--unbalanced", pa->unbalanced, "plain k-means: clusters may differ in size");
  part->add_option("--iters", pa->cfg.max_iter, "maximum Lloyd iterations per stage")->check(kPositive)->capture_default_str();
  part->add_option("--seed", pa->cfg.seed, "seed (k-means++ seeding, subsets, random partitions)")->capture_default_str();
  CLI::Option* from_config = part->add_option("--config", pa->config,
                                               "take the data from this training config's [data] section (so the "
                                               "partition matches the experts' data exactly); otherwise use the "
                                               "flags below");
  // (With --config its [data] names the data: these would be ignored, so they are refused.)
  part->add_option("--data", pa->source, "fashion-mnist | folder | safetensors")->capture_default_str()->excludes(from_config);
  part->add_option("--data-root", pa->root, "dataset directory or file (default: the Debian Fashion-MNIST)")
      ->excludes(from_config);
  part->add_option("--split", pa->split, "fashion-mnist split")->capture_default_str()->excludes(from_config);
  part->add_option("--limit", pa->limit, "use only the first N images (0 = all)")->check(kNonNegative)->excludes(from_config);
  part->add_option("--threads", pa->threads, "intra-op threads (0 = all cores)")->check(kNonNegative);
  part->add_option("--device", pa->device,
                   "cpu | auto | cuda | cuda:N: where feature-net, latent and text features are computed. The default, "
                   "cpu, gives the same partition on every machine; a GPU's features differ within float32 "
                   "rounding, which may move an image lying on a cluster boundary")
      ->capture_default_str()
      ->check(kDeviceSpec);
  part->add_flag("--reshard", pa->reshard,
                 "shards only: copy each cluster's samples, member for member, into shards of its own "
                 "(OUT/shards/cluster-K-000000.tar, ...; latent shards into a `ddm encode` directory "
                 "OUT/shards/cluster-K): what `ddm train --partition OUT --expert K` reads");
  part->add_option("--shard-size", pa->shard_size, "samples per shard written by --reshard")
      ->check(kPositive)
      ->capture_default_str();
  part->add_option("--min-shards", pa->min_shards,
                   "--reshard: at least this many shards per cluster, smaller than --shard-size where a cluster "
                   "needs it (an expert trained by N data-parallel processes needs N; `ddm islands run` passes "
                   "its run.nproc)")
      ->check(kPositive)
      ->capture_default_str();
  part->add_flag("--force", pa->force, "replace an existing --out");
  part->footer("\nExamples:\n"
               "  ddm partition --k 4 --out runs/parts                                  # Fashion-MNIST, PCA of pixels\n"
               "  ddm partition --config shards.toml --k 8 --reshard --out parts8       # tar shards, streamed\n"
               "  ddm partition --config configs/own-64.toml --k 8 --features feature-net:net.safetensors --reshard "
               "--out parts8  # by a network of your data (ddm train-classifier)\n"
               "  ddm partition --config text.toml --k 4 --features text --out parts4   # by what the captions say\n");
  cmds.push_back({part, [pa] { return partition_cmd(*pa); }});

  auto ra = std::make_shared<RouterArgs>();
  auto* router = app.add_subcommand(
      "train-router",
      "Train the router that weighs the experts at each sampling step.\n"
      "Train the router of a decentralized ensemble: a small classifier of p(cluster | x_t, t, class or prompt) on every "
      "image of the partition's data, with noisy inputs from the experts' own forward process, time distribution "
      "and label dropout (all taken from --config, the experts' config; the model is --preset). Then reports its "
      "accuracy and calibration per noise level on --holdout images it never saw (router_eval.json).");
  router->add_option("--config", ra->config, "the experts' training config (TOML)")->required();
  router->add_option("--partition", ra->partition, "the `ddm partition` directory the experts were trained on")
      ->required();
  router->add_option("--out", ra->out, "run directory (config, checkpoints, metrics, router_eval.json)")->required();
  router->add_option("--preset", ra->preset,
                     "router-dit-tiny (DiT with a CLS token) | router-conv-tiny | latent-router-dit (default: "
                     "router-dit-tiny, or latent-router-dit when the experts' config sets model.latent)");
  router->add_option("--holdout", ra->holdout,
                     "withhold N images, chosen at random (seeded by train.seed), from training and measure the router on "
                     "them (sets data.holdout)")
      ->check(kNonNegative)
      ->capture_default_str();
  router->add_option("--set", ra->overrides, "override a config key, e.g. --set train.steps=600 (repeatable)");
  router->add_option("--buckets", ra->buckets, "noise-level buckets in the report")->check(kPositive)->capture_default_str();
  router->add_flag("--resume", ra->resume, "continue from the latest checkpoint in --out");
  router->add_flag("--force", ra->force, "overwrite a different run in --out");
  router->add_flag("--quiet", ra->quiet, "no training progress output");
  router->add_flag("--eval-only", ra->eval_only, "only (re)compute the report of the router in --out");
  router->footer("\nExamples:\n"
                 "  ddm train-router --config configs/quickstart.toml --partition runs/parts --out runs/router\n"
                 "  ddm train-router --config c.toml --partition parts --preset router-conv-tiny --holdout 500 --out r\n");
  cmds.push_back({router, [ra] { return train_router_cmd(*ra); }});

  auto es = std::make_shared<EnsembleSpec>();
  auto eout = std::make_shared<std::string>();
  auto eforce = std::make_shared<bool>(false);
  auto* ens = app.add_subcommand(
      "ensemble",
      "Assemble experts and their router into an ensemble to sample.\n"
      "Assemble a decentralized ensemble: checks that the experts (one per cluster, in order) and the router were "
      "trained on --partition and share the image shape, pins each to its latest checkpoint with the sha256 of its "
      "weights, and writes ensemble.json to --out. Then sample it with ddm sample --ensemble DIR.");
  ens->add_option("--out", *eout, "ensemble directory (may already hold the runs)")->required();
  ens->add_option("--partition", es->partition, "the `ddm partition` directory")->required();
  ens->add_option("--router", es->router, "the `ddm train-router` run directory")->required();
  ens->add_option("--expert", es->experts, "an expert run directory; repeat once per cluster, in order 0..K-1")
      ->required();
  ens->add_option("--routing", es->routing, "default routing: top1 | topk:K | full | threshold:P | sample | oracle")
      ->capture_default_str();
  ens->add_flag("--force", *eforce, "replace an existing ensemble.json");
  auto etext = std::make_shared<std::string>();
  ens->add_option("--text-encoder", *etext,
                  "text experts' frozen encoder where it is now, if it moved since training (the same weights: "
                  "checked against the sha256 each checkpoint records)");
  ens->footer("\nExamples:\n"
              "  ddm ensemble --out runs/ens --partition runs/parts --router runs/router \\\n"
              "    --expert runs/e0 --expert runs/e1 --expert runs/e2 --expert runs/e3   # in cluster order\n");
  cmds.push_back({ens, [es, eout, eforce, etext] { return ensemble_cmd(*eout, *es, *eforce, *etext); }});

  auto* isl = app.add_subcommand(
      "islands",
      "Train a whole ensemble as independent processes (compute islands).\n"
      "Train a whole decentralized ensemble as independent processes (\"compute islands\"): the K experts and the "
      "router, each with its own directory, log and checkpoints and no communication (each optionally "
      "data-parallel over run.nproc processes), from one islands file (see docs/decentralized.md and "
      "configs/islands-k4.toml).");
  isl->require_subcommand(1);
  auto ia = std::make_shared<IslandsArgs>();
  auto* irun = isl->add_subcommand(
      "run",
      "Run every unfinished island, at most run.concurrency at a time. With run.nproc = N > 1 each island trains "
      "data-parallel on N processes under `ddm launch` (its own rendezvous port; the island's batch must be a "
      "multiple of N). A crashed island (any of its processes) restarts from its last checkpoint (at most "
      "run.retries times) while the others go on. run.threads = 0 gives each process cores / (concurrency x "
      "nproc) threads, at least 1; set by hand, keep concurrency x nproc x threads at about the cores. When all "
      "are done, writes OUT/ensemble.json. Running it again skips finished islands and resumes the rest.");
  irun->add_option("file", ia->file, "islands file (TOML)")->required();
  irun->footer("\nExamples:\n"
               "  ddm islands run configs/islands-k4.toml        # again after a stop or a crash: it continues\n"
               "  ddm islands status configs/islands-k4.toml\n"
               "configs/islands-k4.toml shows the file's keys, each with a comment (configs/islands-gpu.toml also its\n"
               "[slurm] table for `ddm islands slurm`); relative paths are relative to the working directory.\n");
  cmds.push_back({irun, [ia] { return islands_cmd("run", *ia); }});
  auto* istat = isl->add_subcommand("status", "Show each island's state, step, attempts and last failure.");
  istat->add_option("file", ia->file, "islands file (TOML)")->required();
  istat->footer("\nExamples:\n"
                "  ddm islands status configs/islands-k4.toml\n");
  cmds.push_back({istat, [ia] { return islands_cmd("status", *ia); }});
  auto* islurm = isl->add_subcommand(
      "slurm",
      "Write an sbatch script with one array task per island (tasks 0..K-1 the experts, task K the router); makes "
      "the partition first if needed. With run.nproc = N > 1 each array task asks for --ntasks=N and runs its "
      "island as one srun step of N ranks, restarted from its last checkpoint up to run.retries times if a rank "
      "fails; --cpus-per-task is run.threads (2 when 0).");
  islurm->add_option("file", ia->file, "islands file (TOML)")->required();
  islurm->add_option("--script", ia->script, "script to write (default OUT/islands.sbatch)");
  islurm->footer("\nExamples:\n"
                 "  ddm islands slurm configs/islands-k4.toml && sbatch runs/islands-k4/islands.sbatch\n");
  cmds.push_back({islurm, [ia] { return islands_cmd("slurm", *ia); }});

  auto da = std::make_shared<DistillArgs>();
  auto* dist = app.add_subcommand(
      "distill",
      "Distill an ensemble into one dense model.\n"
      "Distill a decentralized ensemble into one dense model: the student trains on every image of the ensemble's "
      "data, regressing the prediction of the expert of that image's cluster at the same noisy input (converted "
      "to the student's path and parameterization) instead of the data target. By default the student is expert 0's "
      "config on all the data (same model, forward process and the monolith's batch and steps).");
  dist->add_option("--ensemble", da->ensemble, "the ensemble directory (ddm ensemble, or an islands run)")->required();
  dist->add_option("--out", da->out, "run directory of the student")->required();
  dist->add_option("--config", da->config, "the student's training config (default: expert 0's)");
  dist->add_option("--preset", da->preset, "the student's model preset (default: the config's; see `ddm presets`)");
  dist->add_option("--set", da->overrides, "override a config key, e.g. --set train.steps=600 (repeatable)");
  dist->add_option("--text-encoder", da->text_encoder,
                   "text teachers' frozen encoder where it is now, if it moved since training (the same weights: "
                   "checked against the sha256 each checkpoint records); the student's too");
  dist->add_flag("--resume", da->resume, "continue from the latest checkpoint in --out");
  dist->add_flag("--force", da->force, "overwrite a different run in --out");
  dist->add_flag("--quiet", da->quiet, "no training progress output");
  dist->footer("\nExamples:\n"
               "  ddm distill --ensemble runs/islands-k4 --out runs/student                 # expert 0's config\n"
               "  ddm distill --ensemble runs/ens --preset unet-small --set train.steps=5000 --out runs/student\n");
  cmds.push_back({dist, [da] { return distill_cmd(*da); }});

  return cmds;
}

}  // namespace ddm
