// Writing a dataset ddm reads (Fashion-MNIST, a folder, a safetensors file) as WebDataset tar shards
// (`ddm shards write`): sample i is key "%08d" with its image as lossless PNG (grey or RGB, as the
// data is), for labelled data its label as .cls, for captioned data its caption as .txt;
// `shard_size` samples per shard, named
// PREFIX-000000.tar, ... Each shard is written atomically, and the whole set is byte-reproducible.
// Shards themselves are re-sharded as they are: their samples copied, keys and bytes unchanged.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace ddm {

struct ShardsWritten {
  int64_t shards = 0, samples = 0, bytes = 0;
  std::string pattern;  // the brace pattern naming them all, for data.root
};

// Writes `data` into `dir` (created if missing; shards already there under the same names are
// replaced). `progress(samples written)` is called after each shard.
ShardsWritten write_shards(const Dataset& data, const std::string& dir, int64_t shard_size, const std::string& prefix,
                           const std::function<void(int64_t)>& progress = {});

// Refuses (InputError, exit 2) a shard to re-shard that is cut short: one that ends without a tar's
// end-of-archive blocks would give only the samples before the cut, without an error.
void check_whole_tars(const std::vector<std::string>& shards);

// Re-shards: every sample of `shards` (paths, in order), member for member and with its key, into
// shards of `shard_size` samples named as write_shards names them. Refuses to write over one of
// `shards`. `progress(samples written)` is called after each shard.
ShardsWritten reshard(const std::vector<std::string>& shards, const std::string& dir, int64_t shard_size,
                      const std::string& prefix, const std::function<void(int64_t)>& progress = {});

// The PNG bytes of a uint8 [C, H, W] image, C 1 or 3.
std::string png_of(const torch::Tensor& chw_u8);

// i in decimal, zero-padded to `width` digits (shard numbers and sample keys: 000042).
std::string zero_padded(int64_t i, int width);

}  // namespace ddm
