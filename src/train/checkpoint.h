// Checkpoints: one directory per saved step, RUN/ckpt/step-00001500/ holding
//   model.safetensors  ema.safetensors  optim.safetensors  state.json
// state.json carries the resolved config, the step, the data cursor, the RNG scheme and the sha256
// of each safetensors file, verified on load. A checkpoint is written into a temporary directory,
// fsynced and renamed, so a crash leaves either the whole checkpoint or none of it.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

namespace ddm {

using TensorMap = std::map<std::string, torch::Tensor>;

struct Checkpoint {
  int64_t step = 0;
  std::string config_toml;  // the resolved config of the run
  TensorMap model;          // parameters and buffers by name
  TensorMap ema;            // EMA of the parameters, same names
  TensorMap optim;          // optimizer state (flat tensors)
  nlohmann::json state;     // everything else: data cursor, optimizer step, rng scheme, ...
};

// Writes RUN/ckpt/step-XXXXXXXX atomically; returns its path. Keeps the newest `keep` checkpoints.
std::string write_checkpoint(const std::string& run_dir, const Checkpoint& ckpt, int64_t keep);
// Checkpoint directories of a run, oldest first.
std::vector<std::string> list_checkpoints(const std::string& run_dir);
std::optional<std::string> latest_checkpoint(const std::string& run_dir);
// Reads and verifies a checkpoint directory (checksums, format). Throws ddm::Error naming the file.
// With weights_only, the optimizer state is not read.
Checkpoint read_checkpoint(const std::string& ckpt_dir, bool weights_only = false);
// Accepts a checkpoint directory or a run directory (then its latest checkpoint).
std::string resolve_checkpoint(const std::string& path);

}  // namespace ddm
