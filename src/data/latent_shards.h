// The latent shards `ddm encode` writes (train/encode_shards.h) and data.source = "latents" reads:
// a directory of WebDataset tar shards latents-000000.tar, ... and encode.json beside them. Sample i
// (the source's sample i in shard order) has key "%08d" of i and
//   KEY.safetensors  "mean" and "logvar", float32 [z, h, w]: the frozen encoder's posterior itself,
//                    neither sampled nor normalized (a training step samples it with its own keyed
//                    noise and normalizes it with the model's latent_scale / latent_shift)
//   KEY.cls          its label, for labelled data
//   KEY.txt          its caption, for captioned data
// and, when encode.json names a text encoder (`ddm encode --text`), KEY.safetensors also holds the
// frozen text encoder's encoding of the caption, as the model would get it in a step:
//   "context" float32 [T, D], "context_mask" bool [T] (the tokens that are not padding) and
//   "pooled" float32 [P].
// encode.json names the autoencoder (checkpoint, sha256, scale and shift), the latent and image
// shapes, the data and its class names. A training batch of latent shards is x = [mean; logvar],
// float [B, 2z, h, w].
//
// For pixel models, `ddm encode --text` without an autoencoder writes the same directory with the
// images kept instead of latents (images-000000.tar, ...): each sample as the source had it (its image
// file's bytes, .cls, its caption) and KEY.safetensors holding only the caption's encoding; encode.json
// then names no autoencoder (holds_images()). Such shards are read as image shards are (crops and
// flips as data.* says), with each step's text encodings read instead of computed.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/types.h>

namespace ddm {

// What encode.json records.
struct LatentShardsInfo {
  std::string autoencoder;         // the checkpoint directory (model.latent, resolved)
  std::string autoencoder_sha256;  // of its weights
  double latent_scale = 1, latent_shift = 0;
  int64_t latent_channels = 0, latent_size = 0;  // z and h = w
  int64_t image_channels = 0, image_size = 0;    // what was encoded
  int64_t samples = 0, shards = 0, num_classes = 0, bytes = 0;
  std::string data;     // the source's description
  std::string origin;   // where its images come from (data/origin.h; "" in records written before it)
  std::string pattern;  // the brace pattern naming the shards (as written; latent_shard_paths reads them)
  // The source's class names, size num_classes (so a model trained on the latents labels its grids
  // as one trained on the images would); empty in records written before them.
  std::vector<std::string> class_names;
  bool captioned = false;  // each sample has its caption (KEY.txt)
  // The text encoder whose encodings the samples hold (model.text_encoder's resolved keys); empty
  // encoder: none (a text model then encodes the captions in each step).
  struct Text {
    std::string encoder, sha256;  // the directory and weights_sha256 of its weights
    int64_t skip = 0, tokens = 0, dim = 0, pooled_dim = 0;  // model.text_skip, text_tokens, text_dim, text_pooled_dim
  } text;
  // No autoencoder: the shards keep the images themselves, with the captions' text encodings.
  bool holds_images() const { return autoencoder.empty(); }
};

inline constexpr const char* kLatentShardsInfo = "encode.json";

// encode.json's content.
nlohmann::json latent_shards_json(const LatentShardsInfo& info);
// Reads DIR/encode.json; errors name the file and the key.
LatentShardsInfo read_latent_shards_info(const std::string& dir);
// The name of latent shard `i` in `dir` (images-... where the shards hold images), and the paths of all
// of them (each must exist: the first missing one is named).
std::string latent_shard_path(const std::string& dir, int64_t i, bool images = false);
std::vector<std::string> latent_shard_paths(const std::string& dir, const LatentShardsInfo& info);

// The normalized posterior means (mean - shift) * scale, [B, z, h, w], of a batch of posteriors
// [B, 2z, h, w] (what LatentSpace::encode_mean gives the images they were encoded from, up to float32
// rounding of the encoder over another batch; bit for bit over the same batch).
torch::Tensor normalized_means(const torch::Tensor& posteriors, double scale, double shift);

struct ShardSample;
class TarShardWriter;

// Writes samples into DIR/latents-000000.tar (images-000000.tar with `images`), ... of the given
// sizes, in turn (each shard complete before the next is opened). `ddm encode` and a partition's
// per-cluster latent shards use it.
class LatentShardsWriter {
 public:
  LatentShardsWriter(std::string dir, std::vector<int64_t> sizes, bool images = false);
  ~LatentShardsWriter();
  void add(const ShardSample& s);
  size_t done() const { return shard_; }  // shards complete
  int64_t bytes() const { return bytes_; }  // their bytes

 private:
  std::string dir_;
  std::vector<int64_t> sizes_;
  bool images_ = false;
  std::unique_ptr<TarShardWriter> w_;
  size_t shard_ = 0;
  int64_t in_shard_ = 0, bytes_ = 0;
};

// One sample's KEY.safetensors, checked against the shapes encode.json gives; errors name `what`
// (shard and key).
struct EncodedSample {
  torch::Tensor posterior;                      // [mean; logvar], float [2z, h, w]; undefined where holds_images()
  torch::Tensor context, context_mask, pooled;  // float [T, D], bool [T], float [P]; undefined without info.text
};
EncodedSample read_encoded(const std::string& bytes, const LatentShardsInfo& info, const std::string& what);

}  // namespace ddm
