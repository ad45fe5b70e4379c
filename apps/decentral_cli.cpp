// The decentralized-diffusion subcommands of ddm:
//   partition   cluster a dataset into K subsets, one per expert (two-stage balanced k-means, or random)
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include "cli_util.h"
#include "core/config.h"
#include "core/error.h"
#include "data/dataset.h"
#include "decentral/features.h"
#include "decentral/partition.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

struct PartitionArgs {
  std::string config, source = "fashion-mnist", root, split = "train", features = "pixels", out;
  int64_t limit = 0, threads = 0;
  bool unbalanced = false, force = false;
  PartitionConfig cfg;
};

int partition_cmd(const PartitionArgs& a) {
  DDM_CHECK(!a.out.empty(), "--out DIR is required");
  DDM_CHECK(a.force || !fs::exists(a.out), "'" << a.out << "' already exists; use --force to replace it or another --out");
  const FeatureSource src = parse_feature_source(a.features);  // bad specs fail before any work
  set_threads(a.threads);
  DataConfig dc;
  if (!a.config.empty()) {
    dc = load_config(a.config).data;
  } else {
    dc.source = a.source;
    dc.root = a.root;
    dc.split = a.split;
    dc.limit = a.limit;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const Dataset data = load_dataset(dc);
  const int64_t n = data.images.size(0);
  PartitionConfig cfg = a.cfg;
  cfg.balanced = !a.unbalanced;
  DDM_CHECK(cfg.k <= n, "--k " << cfg.k << " is larger than the data (" << data.description << "); use at most " << n);
  std::cout << "partitioning " << data.description << " into " << cfg.k << " clusters ("
            << (cfg.method == "random" ? "random" : std::string(cfg.balanced ? "balanced " : "") + "two-stage k-means, " +
                                                        cfg.metric)
            << ", seed " << cfg.seed << ")" << std::endl;
  Features feats;
  if (cfg.method != "random") feats = compute_features(data, src, cfg.seed, /*quiet=*/false);
  Partition p = make_partition(feats.rows, n, cfg);
  p.data_sha256 = dataset_sha256(data);
  p.data_description = data.description;
  p.features = cfg.method == "random" ? "none (random)" : feats.description;
  if (cfg.method != "random") p.settings["features"] = src.spec();
  const auto summary = partition_summary(p, data);
  save_partition(a.out, p, summary, a.force);
  std::cout << format_summary(summary);
  std::printf("wrote %s/partition.safetensors and summary.json in %.1f s\n", a.out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::cout << "next: ddm train --config CFG --partition " << a.out << " --expert 0 --out runs/expert0" << std::endl;
  return 0;
}

}  // namespace

std::vector<Command> add_decentral_commands(CLI::App& app) {
  std::vector<Command> cmds;

  auto pa = std::make_shared<PartitionArgs>();
  auto* part = app.add_subcommand(
      "partition",
      "Split a dataset into K clusters, one per expert: features (PCA of pixels, the feature network, an "
      "autoencoder, or your own file), k-means into --fine centroids, then those centroids into K clusters; "
      "each image goes to the cluster of its fine centroid. Balanced (equal sizes) by default. Writes "
      "partition.safetensors and summary.json to --out.");
  part->add_option("--k", pa->cfg.k, "number of clusters (experts)")->required()->check(kPositive);
  part->add_option("--out", pa->out, "partition directory to write")->required();
  part->add_option("--features", pa->features,
                   "pixels[:D] (PCA, default D 64) | feature-net[:FILE] | autoencoder[:D] (default 32) | "
                   "file:PATH (.npy or .safetensors, one row per image)")
      ->capture_default_str();
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
  part->add_option("--config", pa->config,
                   "take the data from this training config's [data] section (so the partition matches the "
                   "experts' data exactly); otherwise use the flags below");
  part->add_option("--data", pa->source, "fashion-mnist | folder | safetensors")->capture_default_str();
  part->add_option("--data-root", pa->root, "dataset directory or file (default: the Debian Fashion-MNIST)");
  part->add_option("--split", pa->split, "fashion-mnist split")->capture_default_str();
  part->add_option("--limit", pa->limit, "use only the first N images (0 = all)")->check(kNonNegative);
  part->add_option("--threads", pa->threads, "intra-op threads (0 = all cores)")->check(kNonNegative);
  part->add_flag("--force", pa->force, "replace an existing --out");
  cmds.push_back({part, [pa] { return partition_cmd(*pa); }});

  return cmds;
}

}  // namespace ddm
