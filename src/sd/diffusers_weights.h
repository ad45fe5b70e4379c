// A diffusers model folder's weights into a module whose parameters carry diffusers' names, and back:
// diffusion_pytorch_model.safetensors (or its sharded index) read key for key, every tensor checked.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>

namespace ddm::sd {

// Copies DIR's weights into `model`'s parameters (float32, on the CPU). Throws ddm::Error naming the
// weights file and the tensor: one the model has and the file lacks, one of another shape (the shape
// `config_file` makes), one of no floating type, one the file has and the model has no place for.
void load_diffusers_weights(torch::nn::Module& model, const std::string& dir, const std::string& config_file);

// Writes DIR/config.json (`config`) and DIR/diffusion_pytorch_model.safetensors (`model`'s parameters),
// each atomically, creating DIR.
void save_diffusers_model(const torch::nn::Module& model, const nlohmann::json& config, const std::string& dir);

}  // namespace ddm::sd
