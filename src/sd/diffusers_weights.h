// A diffusers model folder: its config.json's keys read with their types checked, and its weights
// into a module whose parameters carry diffusers' names, and back: diffusion_pytorch_model.safetensors
// (or its sharded index) read key for key, every tensor checked.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>

namespace ddm::sd {

// Typed reads of a config.json's keys: a key that is absent (or null) leaves `out` as it is; one of
// the wrong type or out of range is a ddm::Error naming the file and the key.
struct ConfigReader {
  const nlohmann::json& j;
  std::string file;
  void integer(const char* key, int64_t& out, int64_t lo, int64_t hi) const;
  void boolean(const char* key, bool& out) const;
  void number(const char* key, double& out) const;  // finite
  void string(const char* key, std::string& out) const;
  void widths(const char* key, std::vector<int64_t>& out) const;  // a list of 1 to 16 widths
};

// DIR/config.json of a diffusers model folder of class `class_name`, read (errors name the folder
// and what it should hold); `file` is set to its path.
nlohmann::json read_model_config(const std::string& dir, const std::string& class_name, std::string& file);

// Whether DIR holds weights of any kind (diffusion_pytorch_model.*: safetensors, their index, or a
// pickle that load_diffusers_weights refuses with the conversion): a folder with none holds a config only.
bool has_diffusers_weights(const std::string& dir);

// Copies DIR's weights into `model`'s parameters (float32, on the CPU). Throws ddm::Error naming the
// weights file and the tensor: one the model has and the file lacks, one of another shape (the shape
// `config_file` makes), one of no floating type, one the file has and the model has no place for.
void load_diffusers_weights(torch::nn::Module& model, const std::string& dir, const std::string& config_file);

// Writes DIR/config.json (`config`) and DIR/diffusion_pytorch_model.safetensors (`model`'s parameters),
// each atomically, creating DIR.
void save_diffusers_model(const torch::nn::Module& model, const nlohmann::json& config, const std::string& dir);

}  // namespace ddm::sd
