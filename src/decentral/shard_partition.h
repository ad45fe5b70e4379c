// Partitioning data held in tar shards (data.source = "shards", docs/data.md) with memory bounded by
// the features, not the images. The samples are streamed in shard order and decoded as training
// sees them (centre crop to data.resolution, data.channels), and their features are
//   pixels[:D]    PCA of the images, downsampled to at most 32x32 first (kMaxPixelSide), in
//                 StreamingPca's blocks: the same images give the in-memory partition's features bit
//                 for bit. The pixels are kept for the later passes when they fit in 1 GiB, else the
//                 shards are read again (once for the mean, once for the covariance, once to project)
//   latent:RUN    the normalized posterior means of a `ddm train-autoencoder` run's encoder, PCA in the
//                 same blocks (kept, or encoded again for each pass, as pixels are)
//   feature-net   the evaluation network, a batch at a time
//   file:PATH     one row per sample, in shard order (the order of data.root, then of each tar), or an
//                 .npz with keys: each sample's row found by its key (features_file.h)
// Latent shards (data.source = "latents", a `ddm encode` directory) give their own posterior means,
// normalized, as latent:RUN would (--features latent), and clusters.png shows them decoded.
// The features are clustered as in memory (partition.h). Then each cluster's samples are listed, a
// "SHARD<TAB>KEY" line each (clusters/cluster-K.tsv), and with reshard copied, member for member and
// in shard order, into shards of their own (shards/cluster-K-000000.tar, ...; latent shards into a
// `ddm encode` directory per cluster, shards/cluster-K/). An expert of a
// partition of shards trains on its cluster's own shards (expert_shard_root).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "core/config.h"
#include "decentral/features.h"
#include "decentral/partition.h"

namespace ddm {

inline constexpr int64_t kMaxPixelSide = 32;

struct ShardPartitionOptions {
  DataConfig data;          // source = "shards": root, resolution, channels (crop and flips are not used);
                            // or "latents": root
  FeatureSource features;   // pixels, feature-net, latent or file
  PartitionConfig cfg;
  torch::Device device = torch::kCPU;  // where a feature network runs
  int threads = 1;          // decode threads
  bool reshard = false;     // also copy each cluster's samples into shards of its own
  int64_t shard_size = 10000;  // samples per written shard
  int64_t min_shards = 1;      // at least this many shards per cluster (smaller shards where needed)
  bool force = false;       // replace an existing partition directory
  int64_t keep_pixel_bytes = int64_t(1) << 30;  // pixel or latent rows kept between passes up to this (else read again)
};

// Makes the partition and writes its directory `out` (atomically: lists and shards included).
// Returns the summary (partition.h).
nlohmann::json partition_shards(const ShardPartitionOptions& o, const std::string& out);

// What a partition of shards is tied to: sha256 over each shard's file name and size, in order.
std::string shards_fingerprint(const std::vector<std::string>& shards);

// Checks that `p` was made on `shards` (latent shards if `latents`; `what` names them in the errors):
// a router or a distilled student over shards then takes sample i's cluster from p.labels[i], i in
// shard order.
void check_partition_of_shards(const Partition& p, const std::vector<std::string>& shards, bool latents,
                               const std::string& what);

// The data.root that expert `expert` of a partition of shards reads: its cluster's own shards (an
// absolute brace pattern; for latent shards its `ddm encode` directory). Checks that the partition
// was made on `data`'s shards and with reshard, naming what to do otherwise.
std::string expert_shard_root(const Partition& p, int64_t expert, const DataConfig& data);

}  // namespace ddm
