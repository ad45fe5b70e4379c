// The weights of a model directory as transformers and diffusers save them: STEM.safetensors, or
// when the model was split, STEM.safetensors.index.json ({"weight_map": {tensor: shard file}}) and
// its shards beside it. Only the tensors `keep` accepts are read, each straight into its tensor.
#pragma once
#include <functional>
#include <string>

#include "core/safetensors.h"

namespace ddm {

// Throws ddm::Error naming the directory and the files looked for when neither exists (and that a
// PyTorch pickle such as pytorch_model.bin is not read: ddm reads safetensors only), or naming the
// index or shard that is malformed.
SafetensorsFile load_weights_dir(const std::string& dir, const std::string& stem,
                                 const std::function<bool(const std::string&)>& keep = nullptr);

}  // namespace ddm
