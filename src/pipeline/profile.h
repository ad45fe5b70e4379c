// Pipeline profiles: what the planner (plan.h) needs to know about a model and a workload,
// measured on this machine and kept as a JSON file a user can read and reuse (`ddm plan --profile`).
//   units  per backbone unit (NetImpl::units) and per profiled micro-batch size: the forward time, the
//          input-gradient time I (autograd of the unit's inputs alone), the weight-gradient time
//          W = (full backward) - I, the time of autograd of its parameters alone (the runtime's W
//          pass, a second walk back through the unit), the no-grad forward time (a self-conditioning pass), the bytes
//          the forward keeps alive for the backward (the allocator's bytes in use after the forward, less
//          before, with the graph held), and the bytes live after the unit (what a cut there sends:
//          h, the conditioning embedding, every open U-Net skip); its parameter count; and the skips
//          it makes (model/net.h's skip_lives): the unit that reads each and its bytes per row, so
//          the planner sends each skip straight to its reader as the runtime does (profiles
//          without them plan every open skip as carried across every cut)
//   tasks  non-trainable work per micro-batch, (rows, time) points: the training step's prepare
//          phase (an autoencoder's encoder, control maps, a ControlNet's locked encoder, an
//          embedding network, a teacher); whether it depends on this step's weights
//   optimizer_ms_per_mparam  AdamW + EMA time per million parameters
// Times are milliseconds with the profile's thread count; medians of `repeats` runs after a warm-up.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/net.h"
#include "pipeline/partition.h"
#include "pipeline/simulate.h"

namespace ddm {

struct PipeUnitSample {
  int64_t rows = 0;
  double forward = 0, input_grad = 0, weight_grad = 0, forward_nograd = 0;
  double activation_bytes = 0, cut_bytes = 0;
  double weight_pass = -1;  // autograd of the unit's parameters alone (how the runtime runs W); < 0: not profiled
};

struct PipeUnitProfile {
  std::string name;
  int64_t params = 0;
  std::vector<PipeUnitSample> samples;  // rows ascending
  std::vector<PipeSkip> skips;          // the U-Net skips it makes; `bytes` per row
};

struct PipeTaskProfile {
  std::string name;
  std::vector<std::pair<int64_t, double>> cost;  // (rows, ms), rows ascending
  bool uses_weights = false;  // self-conditioning: may not move to the previous iteration
  double output_bytes_per_row = 0;  // what it hands the first stage (x_t, the target, conditioning)
};

struct PipeProfile {
  std::string model;     // e.g. "unet-small (unet) 1x28x28, 10 classes"
  std::string workload;  // what the tasks are, e.g. "ControlNet (edges)"
  std::string machine;   // CPU model and thread count
  int threads = 1;
  std::vector<PipeUnitProfile> units;
  std::vector<PipeTaskProfile> tasks;
  double optimizer_ms_per_mparam = 0;
  double x_bytes_per_row = 0;  // one input (and output) of the backbone: C x S x S float32
  bool self_cond = false;  // the model is self-conditioned: a no-grad pass of every stage precedes training

  // The units at `rows` rows per micro-batch (times and bytes interpolated linearly between the
  // profiled sizes, proportionally beyond them; skips' bytes x rows), with state bytes of 5
  // float32 per parameter (weights, gradient, EMA, Adam's two moments), times divided by `speed`.
  std::vector<PipeUnit> units_at(int64_t rows, double speed = 1) const;
};

// Measures every unit of `net` at each of `rows` (ascending) rows per micro-batch on random inputs
// shaped by cfg (x [r, C, S, S], t, labels, self-conditioning estimates, embeddings, control maps),
// after net.precompute (a ControlNet's locked encoder, whose features its units read). On `device`
// (the net's): inputs drawn on the CPU and moved there, times and bytes read after its queued work;
// under `precision`'s autocast.
std::vector<PipeUnitProfile> profile_units(NetImpl& net, const ModelConfig& cfg, const std::vector<int64_t>& rows,
                                           int repeats, torch::Device device = torch::kCPU,
                                           Precision precision = Precision::kFp32);

// JSON files; read_profile throws ddm::Error naming the file and the key that is missing or wrong.
void write_profile(const PipeProfile& p, const std::string& path);
PipeProfile read_profile(const std::string& path);

// This machine's CPU model name (/proc/cpuinfo), or "unknown CPU"; machine_name: the GPU's name for a
// CUDA device, else the CPU's (what profiles and measured timelines record as their machine).
std::string cpu_model_name();
std::string machine_name(torch::Device device);

}  // namespace ddm
