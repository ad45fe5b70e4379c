// ShardLoader: a data-parallel replica's batches from tar shards (data.source = "shards"). A thread
// of its own reads the replica's ShardStream (shard_stream.h) and prepares the next batches while
// the trainer computes: each sample decoded on a pool of threads, cropped to a square and resized to
// data.resolution, flipped at random with data.hflip, labelled from its .cls or .json and captioned
// from its .txt or .json (data/captions.h) where the shards have captions. The crop
// offset and the flip are drawn from (seed, epoch, shard, position in the shard), so a resumed run
// draws them again alike. A sample that cannot be used (a damaged image, a bad label) stops the run
// with an error naming shard and key, or, with data.skip_bad, is skipped and counted; the next
// sample takes its row. Latent shards (data.source = "latents", data/latent_shards.h) are read the
// same way, each sample's posterior taken as it is: x = [mean; logvar], float [B, 2z, h, w]; where they
// hold text encodings (`ddm encode --text`), those are read into the batch too.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "data/batch_source.h"
#include "data/dataset.h"
#include "data/decode.h"
#include "data/latent_shards.h"
#include "data/shard_stream.h"

namespace ddm {

struct ShardLoaderOptions {
  int64_t batch = 1;       // rows per batch (this replica's share of the global batch)
  int64_t resolution = 0;  // images become resolution x resolution
  int channels = 3;        // 1 (luma) or 3 (RGB)
  CropMode crop = CropMode::kCenter;
  bool hflip = false;
  bool skip_bad = false;
  int threads = 1;         // decode threads
  int depth = 2;           // batches prepared ahead
  // Each sample's cluster by position in shard order (a router's targets): Batch::k; null: none.
  std::shared_ptr<const std::vector<int64_t>> clusters;
  // Latent shards: samples are posteriors of this record's shape (resolution, channels, crop and
  // flips do not apply); null: images.
  std::shared_ptr<const LatentShardsInfo> posteriors;
  // Image shards that `ddm encode --text` wrote (LatentShardsInfo::holds_images): each sample's text
  // encodings are read from its KEY.safetensors; null: none.
  std::shared_ptr<const LatentShardsInfo> text_encodings;
  bool pin = false;        // batches in page-locked memory (training on CUDA: the copy to the device is then
                           // asynchronous, and the trainer does not wait for a staging copy)
};

class ShardLoader : public BatchSource {
 public:
  ShardLoader(std::shared_ptr<const ShardIndex> index, ShardOrder order, ShardLoaderOptions options);
  ~ShardLoader() override;
  // `count` must be options.batch (or -1); `begin` is recorded as the batch's position (Batch::first).
  Batch next(int64_t begin = 0, int64_t count = -1) override;
  Batch peek(int64_t begin, int64_t count) override;
  bool may_fail() const override { return true; }
  // (epoch, samples drawn in it) before the next batch.
  Cursor cursor() const override;
  void set_cursor(const Cursor& c) override;
  bool per_replica() const override { return true; }
  int replica() const override { return order_.replica; }
  int replicas() const override { return order_.replicas; }
  // Samples skipped as bad so far by the batches handed out (data.skip_bad), and the last one's reason.
  // A resumed run restores the count its checkpoint holds (set_skipped).
  int64_t skipped() const;
  std::string last_skip() const;
  void set_skipped(int64_t n);

 private:
  struct Prepared {
    Batch batch;
    Cursor after;           // the position after it
    int64_t skipped = 0;    // bad samples it skipped
    std::string skip_note;  // the last one's reason
    std::exception_ptr error;
  };
  void start(const Cursor& at);
  void stop();
  void produce(Cursor at);
  Prepared prepare(ShardStream& stream);
  Prepared& front();

  std::shared_ptr<const ShardIndex> index_;
  ShardOrder order_;
  ShardLoaderOptions o_;
  std::vector<int64_t> offsets_;  // shard_offsets(*index_)
  Cursor delivered_;  // the position before the next batch handed out
  int64_t skipped_ = 0;
  std::string last_skip_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Prepared> ready_;
  bool stopping_ = false;
  std::thread producer_;
};

// Opens data.root's shards for training: scans them (shard_stream.h's scan_shards, on `threads`
// threads, with ddm's scan cache unless data.scan_cache = false) and decodes the first few samples as the loader will (data.channels 0 resolved from the
// first image): a Dataset whose `shards` is set and whose `images` are only those samples. Prints the
// scan's notes (skipped shard tails) unless quiet. For data.source = "latents" (data.root a `ddm
// encode` directory), `encoded` is set too; for latents also `latents`, and `images` are then the
// first few posteriors, float [n, 2z, h, w].
Dataset open_shards(const DataConfig& cfg, int threads, bool quiet);

// Samples [0, n) of the shards `opened` (open_shards of cfg) in shard order, decoded as the loader
// decodes them but with a centre crop and no flip, 256 at a time on `threads` threads:
// f(images float [b, C, S, S] in [-1, 1], labels int64 [b], the first one's row). Latent shards give
// their posteriors instead, float [b, 2z, h, w] (require_images refuses them where images are needed).
// With `keep` (by position in shard order), only the samples it keeps, n of them at most. With
// `captions`, the samples' captions are appended to it in the same order (none for uncaptioned shards),
// each batch's before f sees the batch.
void for_each_in_order(const Dataset& opened, const DataConfig& cfg, int64_t n, int threads,
                       const std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>& f,
                       std::shared_ptr<const std::vector<bool>> keep = nullptr,
                       std::vector<std::string>* captions = nullptr);

// Up to `want` distinct non-empty captions of the data in its stored order (the rows of a text
// model's grid): from the captions held in memory, or those of the first samples of tar shards (at
// most 256 read). Fewer, or none, when the data holds fewer.
std::vector<std::string> first_captions(const Dataset& d, int64_t want);

// Throws, naming `opened`, when it is latent shards: for the commands that need images.
void require_images(const Dataset& opened);

// The first `n` samples of data.root's shards (all, if they hold fewer), as for_each_in_order gives
// them, held in memory: for the commands that measure a model on a sample of its data (an
// autoencoder's latent statistics and reconstructions).
Dataset shard_prefix(const DataConfig& cfg, int64_t n, int threads);

// Any data ddm reads, whole in memory (shards: every sample, decoded as training decodes them with a
// centre crop): what train-classifier trains on and eval compares with.
Dataset load_whole_dataset(const DataConfig& cfg, int threads);

// The loader options data.* give for the shards `opened` (open_shards of cfg), in batches of `batch` rows.
ShardLoaderOptions shard_loader_options(const DataConfig& cfg, const Dataset& opened, int64_t batch, int local_processes);

}  // namespace ddm
