// Partitioning tar shards with memory bounded by the features (see shard_partition.h).
#include "decentral/shard_partition.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/input_check.h"
#include "core/progress.h"
#include "core/weights_dir.h"
#include "data/captions.h"
#include "data/dataset.h"
#include "data/latent_shards.h"
#include "data/origin.h"
#include "data/shard_loader.h"
#include "data/shard_stream.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "decentral/features.h"
#include "decentral/features_file.h"
#include "eval/feature_net.h"
#include "text/encoder.h"
#include "train/latent.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// for_each_in_order (data/shard_loader.h) with a line of progress every 10 s unless quiet.
void stream_samples(const Dataset& opened, const ShardPartitionOptions& o, int64_t stop, const std::string& what,
                    const std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>& f) {
  auto last = std::chrono::steady_clock::now();
  for_each_in_order(opened, o.data, stop, o.threads, [&](const torch::Tensor& x, const torch::Tensor& y, int64_t first) {
    f(x, y, first);
    if (!o.cfg.quiet && seconds_since(last) >= 10) {
      std::printf("  %s: %lld/%lld samples\n", what.c_str(), static_cast<long long>(first + x.size(0)),
                  static_cast<long long>(stop));
      std::fflush(stdout);
      last = std::chrono::steady_clock::now();
    }
  });
}

// Cuts a stream of rows into StreamingPca's blocks of kBlock rows (the last one shorter).
class Blocks {
 public:
  explicit Blocks(std::function<void(const torch::Tensor&)> f) : f_(std::move(f)) {}
  void add(const torch::Tensor& rows) {
    pending_.push_back(rows);
    n_ += rows.size(0);
    while (n_ >= StreamingPca::kBlock) emit(StreamingPca::kBlock);
  }
  void flush() {
    if (n_ > 0) emit(n_);
  }

 private:
  void emit(int64_t m) {
    const auto all = torch::cat(pending_);  // [n_, F]
    f_(all.narrow(0, 0, m));
    pending_.clear();
    n_ -= m;
    if (n_ > 0) pending_.push_back(all.narrow(0, m, n_).clone());
  }
  std::function<void(const torch::Tensor&)> f_;
  std::vector<torch::Tensor> pending_;
  int64_t n_ = 0;
};

// Images float [b, C, S, S] -> pixel rows [b, C s s], s = min(S, kMaxPixelSide) (area averages).
torch::Tensor pixel_rows(const torch::Tensor& x) {
  const auto y = x.size(2) > kMaxPixelSide ? torch::adaptive_avg_pool2d(x, {kMaxPixelSide, kMaxPixelSide}) : x;
  return y.flatten(1).contiguous();
}

// Every sample's label (-1 for none) from the shards' .cls / .json members alone (one pass, no image
// decoded); with `keys` its key, with `captions` its caption (data/captions.h; then .txt is read too),
// and with `pooled` the pooled text encoding that `ddm encode --text` stored (`encoded` says its shape).
torch::Tensor read_labels(const ShardIndex& index, std::vector<std::string>* keys = nullptr,
                          std::vector<std::string>* captions = nullptr, std::vector<torch::Tensor>* pooled = nullptr,
                          const LatentShardsInfo* encoded = nullptr) {
  auto labels = torch::empty({index.samples}, torch::kInt64);
  auto* out = labels.data_ptr<int64_t>();
  if (keys) keys->reserve(static_cast<size_t>(index.samples));
  if (captions) captions->reserve(static_cast<size_t>(index.samples));
  for (size_t s = 0; s < index.shards.size(); ++s) {
    TarShardReader r(index.shards[s]);
    const bool text = captions != nullptr;
    const bool stored = pooled != nullptr;
    r.set_filter([text, stored](int64_t, const std::string& ext) {
      return ext == "cls" || ext == "json" || (text && ext == "txt") || (stored && ext == "safetensors");
    });
    if (pooled) pooled->reserve(static_cast<size_t>(index.samples));
    ShardSample smp;
    for (int64_t i = 0; i < index.counts[s]; ++i) {
      DDM_CHECK(r.next(smp), "shard " << index.shards[s] << " has fewer samples than when it was scanned");
      const std::string what = "shard " + index.shards[s] + ", sample '" + smp.key + "'";
      *out++ = sample_label(smp, what);
      if (keys) keys->push_back(smp.key);
      if (pooled) {
        const auto it = smp.files.find("safetensors");
        DDM_INPUT_CHECK(it != smp.files.end(), what << " has no .safetensors, which `ddm encode --text` writes for every sample");
        pooled->push_back(read_encoded(it->second, *encoded, what).pooled);  // [P]
      }
      if (!captions) continue;
      auto caption = sample_caption(smp, what);
      DDM_INPUT_CHECK(caption, "--features text: " << what << " has no caption (a KEY.txt, or a KEY.json with \"caption\" "
                                             << "or \"text\"); partition by text needs one for every sample (an empty "
                                             << ".txt for a sample meant to go without)");
      captions->push_back(std::move(*caption));
    }
  }
  return labels;
}

struct Computed {
  torch::Tensor rows;    // float32 [N, D] (undefined for a random partition)
  torch::Tensor labels;  // int64 [N], the class labels (-1: none)
  std::string description;
};

Computed compute(const Dataset& opened, const ShardPartitionOptions& o) {
  const ShardIndex& index = *opened.shards;
  const int64_t n = index.samples;
  Computed c;
  if (o.cfg.method == "random" || o.features.kind == "file") {
    if (o.cfg.method == "random") {
      c.labels = read_labels(index);
      return c;
    }
    const FeaturesFile file = read_features_file(o.features.path);
    std::vector<std::string> keys;
    c.labels = read_labels(index, file.keys.empty() ? nullptr : &keys);
    std::ostringstream desc;
    desc << "file " << o.features.path << " (" << file.rows.size(1) << "-d";
    if (file.keys.empty()) {
      DDM_CHECK(file.rows.size(0) == n, "features file " << o.features.path << " has " << file.rows.size(0)
                                                          << " rows but " << opened.description << " has " << n
                                                          << " samples; it needs one row per sample, in shard order "
                                                             "(or keys: an .npz with 'features' and 'keys')");
      c.rows = file.rows;
    } else {
      c.rows = rows_by_key(file, keys, o.features.path, opened.description);
      desc << ", rows by key: " << n << " of " << file.rows.size(0);
    }
    desc << ")";
    c.description = desc.str();
    return c;
  }
  if (o.features.kind == "text") {
    // `ddm encode --text` shards hold each caption's pooled encoding: read, not encoded again, where
    // the encoder is the one named (its weights' sha256) and cut captions at the same length.
    const LatentShardsInfo* stored =
        opened.encoded && !opened.encoded->text.encoder.empty() && !o.features.path.empty() ? opened.encoded.get() : nullptr;
    if (stored) {
      const auto enc = as_input_error([&] { return text::load_text_encoder(o.features.path); });
      const bool same_weights = weights_sha256(enc->weight_files()) == stored->text.sha256;
      if (same_weights && enc->context() == stored->text.tokens) {
        std::vector<torch::Tensor> pooled;
        c.labels = read_labels(index, nullptr, nullptr, &pooled, stored);
        c.rows = torch::stack(pooled);  // [N, P]
        std::ostringstream d;
        d << "captions' pooled embeddings by " << enc->describe() << " (" << c.rows.size(1)
          << "-d), as `ddm encode --text` stored them";
        c.description = d.str();
        return c;
      }
      if (!o.cfg.quiet)
        std::cout << "note: the shards hold the text encodings of " << stored->text.encoder << " at "
                  << stored->text.tokens << " tokens, and the partition's encoder (" << o.features.path << ") "
                  << (same_weights ? "cuts captions at " + std::to_string(enc->context()) + " tokens"
                                   : std::string("has other weights"))
                  << ": the captions are encoded again" << std::endl;
    }
    // The captions alone are read (no image is decoded), then encoded a batch at a time.
    std::vector<std::string> captions;
    c.labels = read_labels(index, nullptr, &captions);
    std::string d;
    c.rows = caption_rows(o.features.path, captions, [](size_t i) { return "the caption of sample " + std::to_string(i); },
                          o.cfg.quiet, o.device, &d);
    c.description = d;
    return c;
  }
  const LatentShardsInfo* encoded = opened.latents.get();
  DDM_CHECK(!encoded || o.features.kind == "latent",
            "--features " << o.features.spec() << ": latent shards (" << opened.description << ") hold no images; "
                          << "their features are their own latents: --features latent (the default for latent "
                             "shards), their captions' embeddings (text[:ENCODER]), or file:PATH (one row per sample, "
                             "in shard order, or by key)");
  c.labels = torch::empty({n}, torch::kInt64);
  const auto keep_labels = [&](const torch::Tensor& y, int64_t first) { c.labels.narrow(0, first, y.size(0)).copy_(y); };
  std::ostringstream desc;
  if (o.features.kind == "pixels" || o.features.kind == "latent") {
    // A row per sample: its pixels (downsampled), or the normalized posterior mean of a
    // `ddm train-autoencoder` run's encoder (latent:RUN, as in memory), or of latent shards the
    // posterior mean they hold (the encoder's output over the same batches of 256: the same rows as
    // latent:RUN on the images they were encoded from); then PCA in blocks.
    const bool pixels = o.features.kind == "pixels";
    // The images' side as the loader gives them (images that `ddm encode --text` kept: as encoded,
    // unless data.resolution says otherwise).
    const int64_t resolution = opened.images.size(3);
    const int64_t channels = opened.images.size(1), side = std::min(resolution, kMaxPixelSide);
    ModelConfig m;
    std::shared_ptr<const LatentSpace> latent;
    if (encoded) {
      m.latent = encoded->autoencoder, m.latent_sha256 = encoded->autoencoder_sha256;
      m.in_channels = encoded->latent_channels, m.image_size = encoded->latent_size;
      if (!o.features.path.empty()) {  // latent:RUN names the autoencoder: the one that encoded them
        ModelConfig named;
        named.latent = o.features.path;
        resolve_latent(named, opened);
      }
    } else if (!pixels) {
      DDM_CHECK(!o.features.path.empty(), "--features latent (without a run) is for latent shards (data.source = "
                                          "latents); for images name the autoencoder: latent:RUN");
      m.latent = o.features.path;
      resolve_latent(m, opened);  // checks that the autoencoder takes these images
      latent = LatentSpace::load(m, o.device);
    }
    const int64_t f = pixels ? channels * side * side : m.in_channels * m.image_size * m.image_size;
    const auto rows_of = [&](const torch::Tensor& x) {  // x float [b, C, S, S] (latent shards [b, 2z, h, w]) -> [b, f]
      if (encoded) return normalized_means(x, encoded->latent_scale, encoded->latent_shift).flatten(1).contiguous();
      return pixels ? pixel_rows(x) : latent->encode_mean(x).flatten(1).to(torch::kFloat32);
    };
    const std::string what = pixels ? "pixels" : "latents";
    StreamingPca pca(f);
    const bool keep = n * f * 4 <= o.keep_pixel_bytes;  // else each pass decodes the shards again
    std::vector<torch::Tensor> kept;
    const auto each_block = [&](const std::string& what, const std::function<void(const torch::Tensor&)>& g) {
      if (!kept.empty()) {
        for (const auto& b : kept) g(b);
        return;
      }
      Blocks blocks(g);
      stream_samples(opened, o, n, what, [&](const torch::Tensor& x, const torch::Tensor& y, int64_t first) {
        keep_labels(y, first);
        blocks.add(rows_of(x));
      });
      blocks.flush();
    };
    each_block(what + ", the mean", [&](const torch::Tensor& b) {
      pca.add_mean(b);
      if (keep) kept.push_back(b);
    });
    each_block(what + ", the covariance", [&](const torch::Tensor& b) { pca.add_covariance(b); });
    pca.finish(std::min(o.features.dim, f));
    std::vector<torch::Tensor> rows;
    each_block(what + ", the projection", [&](const torch::Tensor& b) { rows.push_back(pca.project(b)); });
    c.rows = torch::cat(rows);  // [N, D]
    const std::string side_text = std::to_string(side) + "x" + std::to_string(side);
    if (pixels)
      desc << "pixels PCA " << c.rows.size(1) << " of " << f
           << (side < resolution ? " (downsampled to " + side_text + ")" : "");
    else
      desc << "latents of " << m.latent << " (sha256 " << m.latent_sha256.substr(0, 12) << "), PCA " << c.rows.size(1)
           << " of " << f;
    desc << " (" << std::fixed << std::setprecision(1) << 100 * pca.explained() << "% of the variance)";
  } else if (o.features.kind == "feature-net") {
    require_images(opened);
    const std::string path = o.features.path.empty() ? default_feature_net_path() : o.features.path;
    auto fnet = load_feature_net(path, o.features.path.empty() ? kDefaultFeatureNetSha256 : "");
    DDM_CHECK(fnet.net->shape().in_channels == opened.images.size(1) &&
                  fnet.net->shape().image_size == opened.images.size(2),
              "--features feature-net: the network at " << path << " takes " << fnet.net->shape().in_channels << "x"
                                                        << fnet.net->shape().image_size << " images; data.channels and "
                                                        << "data.resolution make these " << opened.images.size(1) << "x"
                                                        << opened.images.size(2));
    fnet.net->to(o.device);
    std::vector<torch::Tensor> rows;
    stream_samples(opened, o, n, "feature network", [&](const torch::Tensor& x, const torch::Tensor& y, int64_t first) {
      keep_labels(y, first);
      rows.push_back(extract_features(fnet.net, x).to(torch::kFloat32));
    });
    c.rows = torch::cat(rows);
    desc << "feature network " << fnet.sha256.substr(0, 12) << " (" << c.rows.size(1) << "-d)";
  } else {
    DDM_FAIL("--features " << o.features.spec() << " is not supported over shards yet (it trains an autoencoder on "
                           "the images in memory); use pixels[:D], feature-net, latent:RUN, text[:ENCODER] or file:PATH "
                           "(one row per sample, in shard order, or by key)");
  }
  c.description = desc.str();
  return c;
}

std::string shard_name(int64_t cluster, int64_t i) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "cluster-%lld-%06lld.tar", static_cast<long long>(cluster), static_cast<long long>(i));
  return buf;
}

// Cluster c's latent shards with reshard: a `ddm encode` directory of its own, whose encode.json is
// the source's with this cluster's samples and shards.
std::string latent_cluster_dir(int64_t cluster) { return "shards/cluster-" + std::to_string(cluster); }

// The lists (and with reshard the shards) of every cluster, written into `dir`.
void write_clusters(const Dataset& opened, const Partition& p, const ShardPartitionOptions& o, const fs::path& dir) {
  const ShardIndex& index = *opened.shards;
  const LatentShardsInfo* encoded = opened.encoded.get();  // latents, or images with text encodings
  fs::create_directories(dir / "clusters");
  if (o.reshard) fs::create_directories(dir / "shards");
  // A `ddm encode` directory: each cluster's own, its shards o.shard_size samples each.
  std::vector<std::unique_ptr<LatentShardsWriter>> latent_out(static_cast<size_t>(p.k));
  if (encoded && o.reshard)
    for (int64_t c = 0; c < p.k; ++c) {
      std::vector<int64_t> sizes;
      for (int64_t left = p.sizes[c].item<int64_t>(); left > 0; left -= o.shard_size)
        sizes.push_back(std::min(left, o.shard_size));
      const fs::path cdir = dir / latent_cluster_dir(c);
      fs::create_directories(cdir);
      latent_out[static_cast<size_t>(c)] =
          std::make_unique<LatentShardsWriter>(cdir.string(), std::move(sizes), encoded->holds_images());
    }
  std::vector<std::ofstream> lists(static_cast<size_t>(p.k));
  for (int64_t c = 0; c < p.k; ++c) {
    const auto path = dir / "clusters" / ("cluster-" + std::to_string(c) + ".tsv");
    lists[static_cast<size_t>(c)].open(path);
    DDM_CHECK(lists[static_cast<size_t>(c)], "cannot write " << path.string());
  }
  std::vector<std::unique_ptr<TarShardWriter>> writers(static_cast<size_t>(p.k));
  std::vector<int64_t> written(static_cast<size_t>(p.k), 0);
  const auto* label = p.labels.data_ptr<int64_t>();
  auto last = std::chrono::steady_clock::now();
  int64_t row = 0;
  for (size_t s = 0; s < index.shards.size(); ++s) {
    const std::string shard = fs::absolute(index.shards[s]).lexically_normal().string();
    TarShardReader r(index.shards[s]);
    if (!o.reshard) r.set_filter([](int64_t, const std::string&) { return false; });  // keys only
    ShardSample smp;
    for (int64_t i = 0; i < index.counts[s]; ++i, ++row) {
      DDM_CHECK(r.next(smp), "shard " << index.shards[s] << " has fewer samples than when it was scanned");
      const auto c = static_cast<size_t>(label[row]);
      lists[c] << shard << '\t' << smp.key << '\n';
      if (!o.reshard) continue;
      if (encoded) {
        latent_out[c]->add(smp);
        continue;
      }
      if (written[c] % o.shard_size == 0) {
        if (writers[c]) writers[c]->finish();
        writers[c] = std::make_unique<TarShardWriter>(
            (dir / "shards" / shard_name(static_cast<int64_t>(c), written[c] / o.shard_size)).string());
      }
      writers[c]->add(smp);
      ++written[c];
    }
    if (!o.cfg.quiet && seconds_since(last) >= 10) {
      std::printf("  %s: %lld/%lld samples\n", o.reshard ? "resharding" : "listing", static_cast<long long>(row),
                  static_cast<long long>(index.samples));
      std::fflush(stdout);
      last = std::chrono::steady_clock::now();
    }
  }
  for (auto& w : writers)
    if (w) w->finish();
  // Each cluster's image shards keep the source's record (its origin, as `ddm eval` reads it, and
  // its class names): CLUSTER.shards.json beside them, as `ddm shards write` leaves.
  if (!encoded && o.reshard) {
    const std::string origin = data_origin(o.data);
    const std::vector<std::string> names = recorded_class_names(index.shards);
    for (int64_t c = 0; c < p.k && (origin != "shards" || !names.empty()); ++c) {  // (nothing known: no record)
      const int64_t n = written[static_cast<size_t>(c)];
      if (n == 0) continue;
      ShardsWritten w;
      w.samples = n;
      w.shards = (n + o.shard_size - 1) / o.shard_size;
      write_shards_record((dir / "shards").string(), "cluster-" + std::to_string(c), w, origin,
                          "cluster " + std::to_string(c) + " of " + std::to_string(p.k) + " of " + opened.description,
                          names);
    }
  }
  for (int64_t c = 0; encoded && o.reshard && c < p.k; ++c) {
    const LatentShardsWriter& w = *latent_out[static_cast<size_t>(c)];
    LatentShardsInfo info = *encoded;
    info.samples = p.sizes[c].item<int64_t>();
    info.shards = static_cast<int64_t>(w.done());
    info.bytes = w.bytes();
    info.data = "cluster " + std::to_string(c) + " of " + std::to_string(p.k) + " of " + encoded->data;
    info.pattern = std::string(encoded->holds_images() ? "images" : "latents") + "-{" + zero_padded(0, 6) + ".." + zero_padded(std::max<int64_t>(info.shards - 1, 0), 6) + "}.tar";
    write_file_atomic((dir / latent_cluster_dir(c) / kLatentShardsInfo).string(), latent_shards_json(info).dump(2) + "\n");
  }
  for (int64_t c = 0; c < p.k; ++c) {
    lists[static_cast<size_t>(c)].close();
    DDM_CHECK(lists[static_cast<size_t>(c)], "writing the list of cluster " << c << " in " << dir.string() << " failed");
  }
}

}  // namespace

std::string shards_fingerprint(const std::vector<std::string>& shards) {
  std::string s;
  for (const std::string& path : shards)
    s += fs::path(path).filename().string() + "\t" + std::to_string(fs::file_size(path)) + "\n";
  return sha256_hex(s);
}

namespace {

// What partition_shards decides before it writes anything.
struct Planned {
  ShardPartitionOptions o;  // the shard size may shrink to give each cluster --min-shards
  Dataset opened;
  std::shared_ptr<const LatentSpace> decoder;  // latent shards: clusters.png shows the decoded means
  Partition p;
  nlohmann::json summary;
};

// Reads the shards and partitions them; writes nothing (so every failure here is the input's).
Planned plan_partition(const ShardPartitionOptions& options, const std::string& out,
                       std::chrono::steady_clock::time_point t0) {
  Planned planned;
  planned.o = options;
  ShardPartitionOptions& o = planned.o;
  DDM_CHECK(o.data.source == "shards" || o.data.source == "latents", "partition_shards: data.source is " << o.data.source);
  DDM_CHECK(!o.data.skip_bad, "ddm partition places every sample of the shards; data.skip_bad = true would leave "
                              "some out: set it to false (a bad sample is then named) and mend or drop it");
  DDM_CHECK(o.shard_size >= 1, "--shard-size must be >= 1, got " << o.shard_size);
  DDM_CHECK(o.min_shards >= 1, "--min-shards must be >= 1, got " << o.min_shards);
  check_partition_out(out, o.force);
  planned.opened = open_shards(o.data, o.threads, o.cfg.quiet);
  const Dataset& opened = planned.opened;
  const ShardIndex& index = *opened.shards;
  const int64_t n = index.samples;
  // Latent shards: clusters.png shows the decoded means, so the autoencoder must load (before the work).
  if (opened.latents) {
    ModelConfig m;
    m.latent = opened.latents->autoencoder, m.latent_sha256 = opened.latents->autoencoder_sha256;
    m.latent_scale = opened.latents->latent_scale, m.latent_shift = opened.latents->latent_shift;
    m.in_channels = opened.latents->latent_channels, m.image_size = opened.latents->latent_size;
    planned.decoder = LatentSpace::load(m, o.device);
  }
  DDM_CHECK(o.cfg.k <= n, "--k " << o.cfg.k << " is larger than the data (" << opened.description << "); use at most " << n);
  if (!o.cfg.quiet)
    std::cout << "partitioning " << opened.description << " into " << o.cfg.k << " clusters ("
              << (o.cfg.method == "random" ? "random"
                                           : std::string(o.cfg.balanced ? "balanced " : "") + "two-stage k-means, " + o.cfg.metric)
              << ", seed " << o.cfg.seed << ")" << std::endl;
  const Computed c = compute(opened, o);
  if (!o.cfg.quiet && c.rows.defined())
    std::printf("features: %s, %lld x %lld in %.1f s\n", c.description.c_str(), static_cast<long long>(n),
                static_cast<long long>(c.rows.size(1)), seconds_since(t0));
  planned.p = make_partition(c.rows, n, o.cfg);
  Partition& p = planned.p;
  if (o.reshard && o.min_shards > 1) {  // e.g. an island of N data-parallel processes needs N shards
    const int64_t smallest = p.sizes.min().item<int64_t>();
    const int64_t fit = std::max<int64_t>(1, smallest / o.min_shards);
    if (fit < o.shard_size) {
      if (!o.cfg.quiet)
        std::cout << "shards of " << fit << " samples: the smallest cluster (" << smallest << ") in at least "
                  << o.min_shards << " (--min-shards)" << std::endl;
      o.shard_size = fit;
    }
  }
  p.data_sha256 = shards_fingerprint(index.shards);
  p.data_description = opened.description;
  p.features = o.cfg.method == "random" ? "none (random)" : c.description;
  if (o.cfg.method != "random") p.settings["features"] = o.features.spec();
  nlohmann::json clusters = nlohmann::json::array();
  for (int64_t k = 0; k < p.k; ++k) {
    const int64_t size = p.sizes[k].item<int64_t>();
    nlohmann::json e = {{"list", "clusters/cluster-" + std::to_string(k) + ".tsv"}, {"samples", size}};
    if (o.reshard && opened.encoded) {
      e["shards"] = latent_cluster_dir(k);  // a `ddm encode` directory
    } else if (o.reshard) {
      char last[16];
      std::snprintf(last, sizeof last, "%06lld", static_cast<long long>((size - 1) / o.shard_size));
      e["shards"] = "shards/cluster-" + std::to_string(k) + "-{000000.." + last + "}.tar";
    }
    clusters.push_back(e);
  }
  p.shards = {{"root", o.data.root}, {"resolution", o.data.resolution}, {"num_classes", opened.num_classes}, {"reshard", o.reshard},
              {"shard_size", o.shard_size}, {"latents", opened.latents != nullptr}, {"clusters", clusters}};
  // The summary's class agreement, from the samples' labels.
  Dataset labelled;
  labelled.labels = c.labels.clamp_min(0);
  labelled.num_classes = c.labels.lt(0).any().item<bool>() ? 0 : opened.num_classes;
  labelled.class_names = opened.class_names;
  labelled.latents = opened.latents;  // the summary then counts latents, not images
  planned.summary = partition_summary(p, labelled);
  return planned;
}

}  // namespace

nlohmann::json partition_shards(const ShardPartitionOptions& options, const std::string& out) {
  const auto t0 = std::chrono::steady_clock::now();
  // Bad input exits 2 and a failed write 1 (main.cpp): only the planning reads the input.
  const Planned planned = as_input_error([&] { return plan_partition(options, out, t0); });
  const ShardPartitionOptions& o = planned.o;
  const Dataset& opened = planned.opened;
  const Partition& p = planned.p;
  save_partition(out, p, planned.summary, o.force, [&](const std::string& tmp) {
    // clusters.png: the first images of each cluster, decoded again up to the last one shown.
    const auto rows = cluster_grid_rows(p);
    const auto* wanted = rows.data_ptr<int64_t>();
    const int64_t m = rows.size(0);
    std::vector<torch::Tensor> shown;  // images float [C, S, S] (latent shards: posteriors [2z, h, w])
    stream_samples(opened, o, wanted[m - 1] + 1, "clusters.png",
                   [&](const torch::Tensor& x, const torch::Tensor&, int64_t first) {
                     while (static_cast<int64_t>(shown.size()) < m && wanted[shown.size()] < first + x.size(0))
                       shown.push_back(x[wanted[shown.size()] - first].clone());
                   });
    torch::Tensor images = torch::stack(shown);  // [m, C, S, S] in [-1, 1]
    if (const auto& decoder = planned.decoder)
      images = decoder->decode(normalized_means(images, decoder->scale(), decoder->shift()));  // the means, decoded
    save_cluster_grid((fs::path(tmp) / "clusters.png").string(), to_uint8(images), rows, p);
    write_clusters(opened, p, o, tmp);
  });
  if (!o.cfg.quiet)
    std::printf("wrote %s in %.1f s: partition.safetensors, summary.json, clusters.png, clusters/ (each cluster's "
                "shard and key per line)%s\n",
                out.c_str(), seconds_since(t0),
                !o.reshard       ? ""
                : opened.latents ? " and shards/ (each cluster's latents as a `ddm encode` directory)"
                : opened.encoded ? " and shards/ (each cluster's images and text encodings as a `ddm encode` directory)"
                                 : " and shards/ (each cluster's samples as shards)");
  return planned.summary;
}

void check_partition_of_shards(const Partition& p, const std::vector<std::string>& shards, bool latents,
                               const std::string& what) {
  DDM_CHECK(p.shards.is_object(), "partition " << p.origin << " was made on in-memory data (" << p.data_description
                                               << "), not on the shards of " << what
                                               << "; partition them with ddm partition --config CONFIG");
  const bool made_on_latents = p.shards.value("latents", false);
  DDM_CHECK(made_on_latents == latents,
            "partition " << p.origin << " was made on " << (made_on_latents ? "latent shards" : "image shards") << " ("
                         << p.data_description << "), but " << what << " are "
                         << (latents ? "latent shards; partition these" : "images; partition them")
                         << " with ddm partition --config CONFIG (the same data.source and data.root)");
  DDM_CHECK(shards_fingerprint(shards) == p.data_sha256,
            "partition " << p.origin << " was made on other shards (" << p.data_description << ") than those of "
                         << what << " (their names or sizes differ); partition these with ddm partition --config CONFIG");
}

std::string expert_shard_root(const Partition& p, int64_t expert, const DataConfig& data) {
  const bool encoded = data.source == "latents";  // a `ddm encode` directory: latents, or images with text encodings
  const LatentShardsInfo info = encoded ? read_latent_shards_info(data.root) : LatentShardsInfo{};
  check_partition_of_shards(p, encoded ? latent_shard_paths(data.root, info) : expand_shards(data.root, "data.root"),
                            encoded && !info.holds_images(), "data.root = " + data.root);
  DDM_CHECK(p.shards.value("reshard", false),
            "partition " << p.origin << " lists each cluster's samples but has no shards of their own: an expert "
                         << "over shards reads its cluster's shards; make the partition again with --reshard");
  DDM_CHECK(expert >= 0 && expert < p.k,
            "expert " << expert << " does not exist: partition " << p.origin << " has clusters 0.." << p.k - 1);
  const fs::path dir = fs::path(p.origin).parent_path();
  return (dir / p.shards.at("clusters").at(expert).at("shards").get<std::string>()).string();
}

}  // namespace ddm
