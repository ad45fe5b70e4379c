// `ddm encode`: the frozen autoencoder's posterior of every sample of a dataset, computed once and
// written as latent shards (data/latent_shards.h), so that a latent model trained on them
// (data.source = "latents") need not run the encoder over every image again each epoch. Sample i is
// the data's sample i in its order (shards in shard order, centre-cropped and never flipped, as
// for_each_in_order gives them). Shards keep the source shards' sizes (so a sample's position, by
// which partitions and hold-outs name samples, is the same in both), or hold `shard_size` samples for
// data held in memory. The directory is written as "<out>.partial" and renamed onto `out` when
// complete: `out` holds all of it or does not exist. Captioned data keeps each sample's caption (KEY.txt);
// with `text`, each caption's encoding by the text encoder the config's model.text_encoder names is
// written too (data/latent_shards.h), so a text model trained on the shards need not run the encoder.
// Without an autoencoder (pixel models), `text` writes the images themselves with their captions'
// encodings (images-000000.tar, ...): from shards each sample's members as they are, from data held in
// memory a PNG per image; either way under the key of its position.
#pragma once
#include <cstdint>
#include <string>

#include <torch/types.h>

#include "core/config.h"
#include "data/latent_shards.h"

namespace ddm {

struct EncodeShardsOptions {
  std::string out;             // a directory that must not exist yet
  int64_t shard_size = 10000;  // samples per shard for data held in memory (shards keep their own sizes)
  int64_t batch = 256;         // images encoded at once
  torch::Device device = torch::kCPU;
  int threads = 1;             // decode threads (shards)
  bool quiet = false;          // no progress lines
  // Cache the captions' text encodings: model.text_encoder, text_skip and text_tokens of this model
  // (resolved here) say which encoder and how, as a text model's training would encode them.
  bool text = false;
  ModelConfig text_model;
};

// Encodes every sample of `data` (any source ddm reads) with the autoencoder of `autoencoder` (a
// `ddm train-autoencoder` run directory, or the checkpoint its record measured; model.latent's forms;
// "" with o.text: none, the images are kept) on `o.device`, and writes the shards into o.out. Refuses
// data.hflip for latents (a flipped image's latent is not the flip of its latent), an existing o.out
// and an autoencoder trained on images of another shape, naming the setting.
LatentShardsInfo encode_latent_shards(const DataConfig& data, const std::string& autoencoder,
                                      const EncodeShardsOptions& o);

}  // namespace ddm
