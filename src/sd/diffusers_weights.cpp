// Reading and writing a diffusers model folder's weights (see diffusers_weights.h).
#include "sd/diffusers_weights.h"

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "core/weights_dir.h"

namespace fs = std::filesystem;

namespace ddm::sd {

void ConfigReader::integer(const char* key, int64_t& out, int64_t lo, int64_t hi) const {
  if (j.contains(key) && !j[key].is_null()) out = json_int(j[key], file + ": " + key, lo, hi);
}

void ConfigReader::boolean(const char* key, bool& out) const {
  if (!j.contains(key)) return;
  DDM_CHECK(j[key].is_boolean(), file << ": " << key << " must be true or false, got " << j[key].dump());
  out = j[key].get<bool>();
}

void ConfigReader::number(const char* key, double& out) const {
  if (!j.contains(key) || j[key].is_null()) return;
  DDM_CHECK(j[key].is_number() && std::isfinite(j[key].get<double>()),
            file << ": " << key << " must be a number, got " << j[key].dump());
  out = j[key].get<double>();
}

void ConfigReader::string(const char* key, std::string& out) const {
  if (!j.contains(key)) return;
  DDM_CHECK(j[key].is_string(), file << ": " << key << " must be a string, got " << j[key].dump());
  out = j[key].get<std::string>();
}

void ConfigReader::widths(const char* key, std::vector<int64_t>& out) const {
  if (!j.contains(key)) return;
  const nlohmann::json& b = j[key];
  DDM_CHECK(b.is_array() && !b.empty() && b.size() <= 16, file << ": " << key << " must be a list of 1 to 16 widths, got "
                                                                << b.dump());
  out.clear();
  for (size_t i = 0; i < b.size(); ++i)
    out.push_back(json_int(b[i], file + ": " + key + "[" + std::to_string(i) + "]", 1, 1 << 16));
}

nlohmann::json read_model_config(const std::string& dir, const std::string& class_name, std::string& file) {
  file = (fs::path(dir) / "config.json").string();
  DDM_CHECK(fs::is_regular_file(file), dir << ": no config.json (a diffusers " << class_name << " directory holds "
                                           << "config.json and diffusion_pytorch_model.safetensors)");
  return read_json_file(file);
}

bool has_diffusers_weights(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("diffusion_pytorch_model.", 0) == 0) return true;
  return false;
}

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
