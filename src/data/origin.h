// Where a dataset's images come from, followed through the copies ddm makes of them: `ddm shards
// write` leaves a record beside the shards it writes (PREFIX.shards.json: the origin, the data's
// description, its class names, each shard's name and size), and `ddm encode` records its data's origin in
// encode.json. So a model trained on tar shards or latent shards of Fashion-MNIST is known to be
// one, and `ddm eval` (whose feature network and reference are Fashion-MNIST's) can score it.
// Shards from elsewhere (webdataset, img2dataset, ...) have no record: their origin is unknown.
#pragma once
#include <string>
#include <vector>

#include "core/config.h"

namespace ddm {

struct ShardsWritten;

// The origin of data.*: "fashion-mnist", "folder" or "safetensors" for those sources; for shards the
// origin their records give (every shard recorded, with its size, and all of one origin), else
// "shards" (unknown); for latent shards the origin their encode.json records, else "latents".
std::string data_origin(const DataConfig& cfg);

// The class names the records of `shards` give (label k is names[k]): every shard recorded with its
// size, all with the same names; else empty (the labels keep generic names, "class 3").
std::vector<std::string> recorded_class_names(const std::vector<std::string>& shards);

// Writes DIR/PREFIX.shards.json for shards just written (`w`, named PREFIX-NNNNNN.tar in `dir`),
// with the data's class names (a folder's sub-folders, Fashion-MNIST's) when it has them.
void write_shards_record(const std::string& dir, const std::string& prefix, const ShardsWritten& w,
                         const std::string& origin, const std::string& description,
                         const std::vector<std::string>& class_names = {});

}  // namespace ddm
