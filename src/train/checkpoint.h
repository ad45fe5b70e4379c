// Checkpoints: one directory per saved step, RUN/ckpt/step-00001500/ holding
//   model.safetensors  ema.safetensors  optim.safetensors  state.json
// state.json carries the resolved config, the step, the data cursor, the RNG scheme and the sha256
// of each safetensors file, verified on load. A checkpoint is written into a temporary directory,
// fsynced and renamed, so a crash leaves either the whole checkpoint or none of it.
#pragma once
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
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
  std::string state_path;   // where state was read from (for messages)
  // For the writer: a tensor of model / ema / optim (part 0 / 1 / 2) on the meta device is held
  // elsewhere; fetch(part, name) brings it just before it is written and it is let go after, so
  // the writer holds one such tensor at a time (a pipeline's rank 0 gathers the other stages' state
  // so). Parts are written in that order, each in its names' order (the senders need not follow it).
  std::function<torch::Tensor(int part, const std::string& name)> fetch;
  // Fetches every placeholder now and clears `fetch`: the whole checkpoint in memory, for a caller
  // that keeps it rather than writes it.
  void fetch_all();

  // A field of state.json by JSON pointer ("/data_cursor/epoch"), as T. A field that is missing or of
  // another type throws ddm::Error naming state.json and the field.
  template <class T>
  T field(const std::string& pointer) const {
    return state_field<T>(state, pointer, state_path);
  }
  template <class T>
  static T state_field(const nlohmann::json& state, const std::string& pointer, const std::string& path);
};

// The message for a state.json field that is missing or of the wrong type.
[[noreturn]] void bad_state_field(const std::string& path, const std::string& pointer, const nlohmann::json* found,
                                  const char* expected);

template <class T>
T Checkpoint::state_field(const nlohmann::json& state, const std::string& pointer, const std::string& path) {
  const nlohmann::json::json_pointer ptr(pointer);
  const nlohmann::json* v = state.contains(ptr) ? &state.at(ptr) : nullptr;
  const char* expected = std::is_same_v<T, std::string>                ? "a string"
                         : std::is_integral_v<T>                       ? "an integer"
                         : std::is_floating_point_v<T>                 ? "a number"
                         : std::is_same_v<T, std::vector<std::string>> ? "a list of strings"
                                                                       : "a value of another type";
  if (!v) bad_state_field(path, pointer, nullptr, expected);
  try {
    if constexpr (std::is_integral_v<T>) {
      if (!v->is_number_integer()) bad_state_field(path, pointer, v, expected);
    }
    return v->get<T>();
  } catch (const nlohmann::json::exception&) {
    bad_state_field(path, pointer, v, expected);
  }
}

// Writes RUN/ckpt/step-XXXXXXXX atomically; returns its path. Keeps the newest `keep` checkpoints,
// and every older one that is pinned (below).
std::string write_checkpoint(const std::string& run_dir, const Checkpoint& ckpt, int64_t keep);

// A checkpoint that something else is built on (a latent model's or a `ddm encode` directory's
// autoencoder, a ControlNet's locked base, an ensemble's experts and router) is pinned: `by` (that
// run or directory) is added to CKPT/pinned.txt, and the rotation of train.keep_ckpts never removes
// it, however long its own run trains on. Nothing happens for a directory that is not a ddm
// checkpoint, or one this process may not write to.
inline constexpr const char* kPinned = "pinned.txt";
void pin_checkpoint(const std::string& ckpt_dir, const std::string& by);
// Takes `by` out of CKPT/pinned.txt (the file goes with its last line): an ensemble assembled again
// lets go of the members it held before. By hand, deleting a line (or the file) does the same.
void unpin_checkpoint(const std::string& ckpt_dir, const std::string& by);
// What pins a checkpoint (the lines of its pinned.txt), or nothing.
std::vector<std::string> checkpoint_pins(const std::string& ckpt_dir);
// Checkpoint directories of a run, oldest first.
std::vector<std::string> list_checkpoints(const std::string& run_dir);
std::optional<std::string> latest_checkpoint(const std::string& run_dir);
// Reads and verifies a checkpoint directory (checksums, format). Throws ddm::Error naming the file.
// With weights_only, the optimizer state is not read.
Checkpoint read_checkpoint(const std::string& ckpt_dir, bool weights_only = false);
// Accepts a checkpoint directory or a run directory (then its latest checkpoint).
std::string resolve_checkpoint(const std::string& path);

}  // namespace ddm
