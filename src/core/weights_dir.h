// The weights of a model directory as transformers and diffusers save them: STEM.safetensors, or
// when the model was split, STEM.safetensors.index.json ({"weight_map": {tensor: shard file}}) and
// its shards beside it. Only the tensors `keep` accepts are read, each straight into its tensor.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace ddm {

// Throws ddm::Error naming the directory and the files looked for when neither exists (and that a
// PyTorch pickle such as pytorch_model.bin is not read: ddm reads safetensors only), or naming the
// index or shard that is malformed.
SafetensorsFile load_weights_dir(const std::string& dir, const std::string& stem,
                                 const std::function<bool(const std::string&)>& keep = nullptr);

// The files load_weights_dir reads for `dir` and `stem` (every shard the index names), for pinning by
// sha256. Throws as load_weights_dir does when there are none.
std::vector<std::string> weights_dir_files(const std::string& dir, const std::string& stem);

// The sha256 naming a frozen model's weights (a text encoder, a diffusers VAE): that of its one file,
// or, for sharded weights, the sha256 of the files' sha256s in name order, one per line.
std::string weights_sha256(const std::vector<std::string>& files);

// For the error that DIR is not the diffusers folder a key wants (`component`: "unet", "vae",
// "text_encoder"): "; it is a ddm run: ..." (an sd-unet run: export it first), "; it holds COMPONENT/ but no
// model_index.json ...", or "" when DIR is neither.
std::string diffusers_folder_hint(const std::string& dir, const std::string& component);

}  // namespace ddm
