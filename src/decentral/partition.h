// Partitioning a dataset into K clusters, one per expert (method-ddm.md, "Partition"): two-stage
// k-means (fine centroids, then the fine centroids into K coarse clusters, each image going to the
// coarse cluster of its fine centroid), balanced to equal sizes by default, or a seeded random
// partition for ablations. A partition is a directory:
//   partition.safetensors  labels [N], sizes [K], centroids [K, D], fine_labels [N], fine_centroids,
//                          with metadata naming the data (row count, sha256), settings and features
//   summary.json           sizes and agreement with the dataset's class labels (for information)
//   clusters.png           the first images of each cluster
// and, for a partition of tar shards (shard_partition.h), clusters/ and shards/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "data/dataset.h"

namespace ddm {

struct PartitionConfig {
  int64_t k = 8;
  std::string method = "kmeans";  // kmeans | random
  int64_t fine = 1024;            // fine centroids of the first stage (clamped to the row count)
  bool balanced = true;           // equal cluster sizes (differ by at most one image)
  std::string metric = "euclidean";  // euclidean | cosine
  int64_t max_iter = 30;          // Lloyd iterations per stage
  uint64_t seed = 0;
  bool quiet = false;
};

struct Partition {
  int64_t k = 0;
  torch::Tensor labels;          // int64 [N], in 0..K-1
  torch::Tensor sizes;           // int64 [K]
  torch::Tensor centroids;       // float32 [K, D] (k-means only)
  torch::Tensor fine_labels;     // int64 [N] (k-means only)
  torch::Tensor fine_centroids;  // float32 [F, D] (k-means only)
  int64_t n = 0;
  std::string data_sha256;       // of the images' bytes
  std::string data_description;
  std::string features;          // how the features were made
  nlohmann::json settings;       // the PartitionConfig used
  std::string origin;            // the file it was loaded from
  nlohmann::json shards;         // made on tar shards: where each cluster's list and shards are (else null)
};

// Throws, naming the flag, for settings no data can make a partition of (--k < 2, --fine < --k, an
// unknown --method or --metric): checked before any data is read.
void check_partition_config(const PartitionConfig& cfg);

// Clusters feature rows [N, D] (k-means) or just N rows (random). Fills labels, sizes, centroids and
// settings; the caller fills the data fields.
Partition make_partition(const torch::Tensor& features, int64_t n, const PartitionConfig& cfg);

// sha256 of a dataset's image bytes: what a partition is tied to.
std::string dataset_sha256(const Dataset& data);

// Sizes, a size histogram and agreement with the class labels (purity, NMI, per-cluster classes);
// "items" says what was partitioned: "latents" for latent shards (data.latents), else "images".
nlohmann::json partition_summary(const Partition& p, const Dataset& data);
// The summary as a few human-readable lines.
std::string format_summary(const nlohmann::json& summary);

// Refuses --out DIR for a partition unless it is new, or `force` and DIR holds a partition (or
// nothing): --force replaces a partition, never another directory (an islands run, experts).
void check_partition_out(const std::string& dir, bool force);

// Writes a partition directory atomically (a temporary directory renamed into place). An existing
// `dir` is replaced only with force, and only a partition (check_partition_out). `extra(temporary directory)` may add files before the rename.
void save_partition(const std::string& dir, const Partition& p, const nlohmann::json& summary, bool force,
                    const std::function<void(const std::string&)>& extra = {});
// A look at the clusters: a row of the first 12 images of each cluster (at most 64 rows), as PNG.
// `images` [M, C, H, W] (uint8) are rows `rows` [M] of the data p.labels labels.
void save_cluster_grid(const std::string& path, const torch::Tensor& images, const torch::Tensor& rows,
                       const Partition& p);
// The rows whose images save_cluster_grid shows, sorted.
torch::Tensor cluster_grid_rows(const Partition& p);
// Loads a partition directory (or its partition.safetensors), checking its contents.
Partition load_partition(const std::string& path);
// Throws ddm::Error unless the partition was made on exactly this dataset (row count and hash).
void check_partition_matches(const Partition& p, const Dataset& data);
// The images (and labels) of cluster `cluster` of the partition, in dataset order.
Dataset cluster_subset(const Dataset& data, const Partition& p, int64_t cluster);

}  // namespace ddm
