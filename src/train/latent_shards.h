// Latent shards (`ddm encode`): the frozen autoencoder's posterior of every sample of a dataset,
// computed once and written as WebDataset tar shards, so that a latent model need not run the
// encoder over every image again each epoch. Sample i (in the data's order: shards in shard order,
// centre-cropped and never flipped, as for_each_in_order gives them) has key "%08d" of i and
//   KEY.safetensors  "mean" and "logvar", float32 [z, h, w]: the encoder's posterior itself, neither
//                    sampled nor normalized (a training step samples it with its own keyed noise and
//                    normalizes with the model's latent_scale / latent_shift, as train.cache_latents does)
//   KEY.cls          its label, for labelled data.
// Shards keep the source shards' sizes (so a sample's position, by which partitions and hold-outs
// name samples, is the same in both), or hold `shard_size` samples for data held in memory.
// encode.json beside them names the autoencoder (checkpoint, sha256, scale and shift), the latent
// and image shapes and the data. The directory is written as "<out>.partial" and renamed onto `out`
// when complete: `out` holds all of it or does not exist.
#pragma once
#include <cstdint>
#include <string>

#include <torch/types.h>

#include "core/config.h"

namespace ddm {

struct EncodeShardsOptions {
  std::string out;             // a directory that must not exist yet
  int64_t shard_size = 10000;  // samples per shard for data held in memory (shards keep their own sizes)
  int64_t batch = 256;         // images encoded at once
  torch::Device device = torch::kCPU;
  int threads = 1;             // decode threads (shards)
  bool quiet = false;          // no progress lines
};

// What encode.json records.
struct LatentShardsInfo {
  std::string autoencoder;         // the checkpoint directory (model.latent, resolved)
  std::string autoencoder_sha256;  // of its weights
  double latent_scale = 1, latent_shift = 0;
  int64_t latent_channels = 0, latent_size = 0;  // z and h = w
  int64_t image_channels = 0, image_size = 0;    // what was encoded
  int64_t samples = 0, shards = 0, num_classes = 0, bytes = 0;
  std::string data;     // the source's description
  std::string pattern;  // the brace pattern naming the shards, for data.root
};

inline constexpr const char* kLatentShardsInfo = "encode.json";

// Encodes every sample of `data` (any source ddm reads) with the autoencoder of `autoencoder` (a
// `ddm train-autoencoder` run directory, or the checkpoint its record measured; model.latent's forms)
// on `o.device`, and writes the latent shards into o.out. Refuses data.hflip (a flipped image's
// latent is not the flip of its latent), an existing o.out and an autoencoder trained on images of
// another shape, naming the setting.
LatentShardsInfo encode_latent_shards(const DataConfig& data, const std::string& autoencoder,
                                      const EncodeShardsOptions& o);

// Reads DIR/encode.json; errors name the file and the key.
LatentShardsInfo read_latent_shards_info(const std::string& dir);

}  // namespace ddm
