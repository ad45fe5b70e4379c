// Reading and writing a diffusers model folder's weights (see diffusers_weights.h).
#include "sd/diffusers_weights.h"

#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "core/weights_dir.h"

namespace fs = std::filesystem;

namespace ddm::sd {

void load_diffusers_weights(torch::nn::Module& model, const std::string& dir, const std::string& config_file) {
  SafetensorsFile w = load_weights_dir(dir, "diffusion_pytorch_model");
  const std::string weights = (fs::path(dir) / "diffusion_pytorch_model.safetensors").string();
  torch::NoGradGuard no_grad;
  for (auto& p : model.named_parameters()) {
    const auto it = w.tensors.find(p.key());
    DDM_CHECK(it != w.tensors.end(), weights << ": no tensor \"" << p.key() << "\", which " << config_file
                                             << " makes the model hold");
    DDM_CHECK(it->second.sizes() == p.value().sizes(),
              weights << ": \"" << p.key() << "\" has shape " << it->second.sizes() << ", but " << config_file
                      << " makes it " << p.value().sizes());
    DDM_CHECK(it->second.is_floating_point(), weights << ": \"" << p.key() << "\" is " << it->second.scalar_type()
                                                      << ", not floating point");
    p.value().copy_(it->second);
    w.tensors.erase(it);
  }
  DDM_CHECK(w.tensors.empty(), weights << ": \"" << w.tensors.begin()->first << "\" (and " << w.tensors.size() - 1
                                       << " more) has no place in the model " << config_file << " describes");
}

void save_diffusers_model(const torch::nn::Module& model, const nlohmann::json& config, const std::string& dir) {
  fs::create_directories(dir);
  SafetensorsFile f;
  for (const auto& p : model.named_parameters()) f.tensors[p.key()] = p.value().detach().to(torch::kCPU).contiguous();
  f.metadata["format"] = "pt";
  save_safetensors((fs::path(dir) / "diffusion_pytorch_model.safetensors").string(), f);
  write_file_atomic((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

}  // namespace ddm::sd
