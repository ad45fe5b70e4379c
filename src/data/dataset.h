// Datasets held in memory as uint8 images plus labels, loaded from Fashion-MNIST IDX files, a folder
// of PNGs, or a safetensors file; and BatchLoader, the seeded shuffling batch iterator whose cursor
// is saved in checkpoints so a resumed run sees exactly the same batches.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "core/config.h"
#include "data/batch_source.h"

namespace ddm {

struct ShardIndex;
struct LatentShardsInfo;

struct Dataset {
  torch::Tensor images;                  // uint8 [N, C, H, W] (latent shards: float [N, 2z, h, w], below)
  torch::Tensor labels;                  // int64 [N]; zeros when the source has no labels
  int64_t num_classes = 0;               // 0 = unlabeled
  std::vector<std::string> class_names;  // size num_classes (may be generic "class 3")
  std::string description;               // e.g. "fashion-mnist train: 60000 x 1x28x28, 10 classes"
  torch::Tensor clusters;                // int64 [N]: each image's cluster (routers, distillation; else undefined)
  std::vector<std::string> captions;     // N captions (data/captions.h), or none
  // Tar shards (data.source = "shards"): their index, and `images` holds only the first few samples,
  // as data.resolution and data.channels make them, for the model's shape (open_shards).
  std::shared_ptr<const ShardIndex> shards;
  // Shards: the samples training takes, by position in shard order (a router's data.holdout leaves
  // some out; `clusters` is then indexed by that position too); null: all of them.
  std::shared_ptr<const std::vector<bool>> shard_keep;
  // Latent shards (data.source = "latents", data/latent_shards.h): their encode.json. Then `images`
  // holds the first few samples' posteriors as batches carry them, [mean; logvar] float [n, 2z, h, w].
  std::shared_ptr<const LatentShardsInfo> latents;
  // Any `ddm encode` directory (data.source = "latents"): its encode.json, whether it holds latents
  // (then `latents` is the same) or images with their captions' text encodings (then `latents` is null).
  std::shared_ptr<const LatentShardsInfo> encoded;
};

// The samples a training epoch draws from: the images, the shards' samples, or those of them
// shard_keep keeps (a router's hold-out left out).
int64_t training_samples(const Dataset& data);

// Default root for the Debian package dataset-fashion-mnist.
inline constexpr const char* kFashionMnistRoot = "/usr/share/datasets/fashion-mnist";

// Loads according to cfg (source, root, split, limit). Throws ddm::Error with a clear message, also
// for shards, which are streamed, not loaded (data/shard_loader.h's open_shards).
Dataset load_dataset(const DataConfig& cfg);

// Splits n images into a training part and `holdout` images withheld from it, chosen at random with
// a generator seeded by `seed` (never "the last N": a folder dataset is ordered by class). Returns
// {train, held_out}: sorted int64 index tensors, disjoint, together 0..n-1.
std::pair<torch::Tensor, torch::Tensor> holdout_split(int64_t n, int64_t holdout, uint64_t seed);

// uint8 [..] in 0..255 -> float [..] in [-1, 1].
torch::Tensor to_unit_range(const torch::Tensor& images_u8);
// float [-1, 1] -> uint8 0..255 (clamped, rounded).
torch::Tensor to_uint8(const torch::Tensor& images);

struct Batch {
  torch::Tensor x;  // float [B, C, H, W] in [-1, 1]
  torch::Tensor y;  // int64 [B]
  torch::Tensor k;  // int64 [B]: the images' clusters (routers and distillation; undefined otherwise)
  int64_t first = 0;  // position of x[0] in the step's global batch: per-sample randomness is keyed by it
  torch::Tensor index{};  // int64 [B]: each image's index in its Dataset (latent caching; undefined if unknown)
  std::vector<std::string> captions{};  // B captions when the data has them, else none
  // The captions' text encodings when the data holds them (latent shards `ddm encode --text` wrote),
  // as encode_texts gives them: float [B, T, D], int64 [B, T], float [B, P]; else undefined.
  torch::Tensor context{}, context_mask{}, pooled{};
  // Rows [from, from + n) of every per-image tensor, their positions in the global batch kept.
  Batch rows(int64_t from, int64_t n) const;
  // The same batch with x, y, k and the text encodings on `device` (index stays on the CPU: it looks rows up in host data).
  Batch to(torch::Device device) const;
};

// Epoch-wise shuffling without replacement. The order of epoch e is a permutation drawn from a
// generator seeded with (seed, e); flips are drawn from (seed, e, position). So the batch sequence is
// a pure function of (seed, cursor), and restoring the cursor reproduces it exactly.
class BatchLoader : public BatchSource {
 public:
  BatchLoader(const Dataset& data, int64_t batch_size, uint64_t seed, bool hflip);
  // The next global batch (wraps into the next epoch when the current one runs out: batches stay
  // full), or only its positions [begin, begin + count): a data-parallel rank's shard. The cursor
  // always advances by the whole global batch, so every rank walks the same sequence.
  Batch next(int64_t begin = 0, int64_t count = -1) override;
  Batch peek(int64_t begin, int64_t count) override;
  Cursor cursor() const override { return cursor_; }
  void set_cursor(const Cursor& c) override;

 private:
  void ensure_perm();
  const Dataset& data_;
  int64_t batch_size_;
  uint64_t seed_;
  bool hflip_;
  Cursor cursor_;
  int64_t perm_epoch_ = -1;
  torch::Tensor perm_;  // int64 [N]
};

}  // namespace ddm
