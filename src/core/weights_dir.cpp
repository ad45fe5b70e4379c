// Reads STEM.safetensors or the shards STEM.safetensors.index.json maps tensors to.
#include "core/weights_dir.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <map>
#include <set>

#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"

namespace ddm {

namespace {

namespace fs = std::filesystem;

// STEM.safetensors.index.json's weight_map: tensor name -> shard file beside it.
std::map<std::string, std::string> weight_map(const std::string& index) {
  const nlohmann::json j = read_json_file(index);
  DDM_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
            index << ": no \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : j["weight_map"].items()) {
    DDM_CHECK(file.is_string(), index << ": weight_map[\"" << name << "\"] is not a file name");
    const std::string f = file.get<std::string>();
    DDM_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "..",
              index << ": weight_map[\"" << name << "\"] = \"" << f << "\" is not a file beside the index");
    out[name] = f;
  }
  return out;
}

void refuse_missing(const std::string& dir, const std::string& stem) {
  const std::string single = dir + "/" + stem + ".safetensors", index = single + ".index.json";
  if (!fs::exists(single) && !fs::exists(index)) {
    std::string pickles;
    for (const char* p : {"pytorch_model.bin", "diffusion_pytorch_model.bin", "open_clip_pytorch_model.bin"})
      if (fs::exists(dir + "/" + p)) pickles += std::string(pickles.empty() ? "" : ", ") + p;
    // The one-line conversion of this model's own pickle, where it has one: STEM.bin (diffusers'), or
    // transformers' pytorch_model.bin for model.safetensors.
    std::string bin = dir + "/" + stem + ".bin";
    if (!fs::exists(bin) && stem == "model") bin = dir + "/pytorch_model.bin";
    const std::string convert =
        fs::exists(bin) ? "; or convert it: python3 -c \"import torch, safetensors.torch as st; st.save_file({k: "
                          "v.contiguous() for k, v in torch.load('" + bin + "', weights_only=True).items()}, '" +
                              single + "')\""
                        : "";
    throw Error(dir + ": no " + stem + ".safetensors and no " + stem + ".safetensors.index.json" +
                (pickles.empty() ? std::string()
                                 : " (it has " + pickles + ", a PyTorch pickle, which ddm does not read: "
                                   "save the model with safetensors, as save_pretrained does by default" + convert + ")"));
  }
}

// Whether a ddm run's config.toml is of diffusers' UNet (model.arch = sd-unet): what `ddm export` writes out.
bool holds_sd_unet_run(const fs::path& config) {
  try {
    return load_config(config.string()).model.arch == "sd-unet";
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

std::string diffusers_folder_hint(const std::string& dir, const std::string& component) {
  const fs::path d(dir);
  if (fs::is_regular_file(d / "config.toml") && fs::is_directory(d / "ckpt") && holds_sd_unet_run(d / "config.toml"))
    return "; it is a ddm run: `ddm export --ckpt " + dir + " --diffusers OUT` writes its UNet, VAE and text encoder "
           "in diffusers' layout, then name OUT";
  if (fs::is_directory(d / component) && !fs::exists(d / "model_index.json"))
    return "; it holds " + component + "/ but no model_index.json, which a pipeline directory needs: restore it, or name " +
           (d / component).string();
  return "";
}

std::vector<std::string> weights_dir_files(const std::string& dir, const std::string& stem) {
  refuse_missing(dir, stem);
  const std::string single = dir + "/" + stem + ".safetensors";
  if (fs::exists(single)) return {single};
  std::set<std::string> shards;
  for (const auto& [name, f] : weight_map(single + ".index.json")) shards.insert(dir + "/" + f);
  return {shards.begin(), shards.end()};
}

SafetensorsFile load_weights_dir(const std::string& dir, const std::string& stem,
                                 const std::function<bool(const std::string&)>& keep) {
  const auto all = [](const std::string&) { return true; };
  const std::function<bool(const std::string&)> wanted = keep ? keep : all;
  refuse_missing(dir, stem);
  const std::string single = dir + "/" + stem + ".safetensors";
  if (fs::exists(single)) return load_safetensors(single, wanted);
  std::set<std::string> shards;
  for (const auto& [name, f] : weight_map(single + ".index.json"))
    if (wanted(name)) shards.insert(f);
  SafetensorsFile out;
  for (const auto& shard : shards) {
    SafetensorsFile part = load_safetensors(dir + "/" + shard, wanted);
    for (auto& [name, t] : part.tensors) {
      DDM_CHECK(!out.tensors.count(name), dir << "/" << shard << ": tensor \"" << name << "\" is also in another shard");
      out.tensors[name] = t;
    }
    out.metadata.insert(part.metadata.begin(), part.metadata.end());
  }
  return out;
}

std::string weights_sha256(const std::vector<std::string>& files) {
  DDM_CHECK(!files.empty(), "weights_sha256: no weight files");
  if (files.size() == 1) return sha256_file(files[0]);
  std::vector<std::string> sorted = files;
  std::sort(sorted.begin(), sorted.end());
  std::string list;
  for (const auto& f : sorted) list += sha256_file(f) + "\n";
  return sha256_hex(list);
}

}  // namespace ddm
