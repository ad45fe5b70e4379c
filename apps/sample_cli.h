// `ddm sample` (apps/sample_cli.cpp) and `ddm eval` (apps/eval_cli.cpp): what they share with the
// quickstart, which writes its grid as `ddm sample` does (what they share with each other:
// apps/sample_setup.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cli_util.h"

namespace ddm {

// The flags of `ddm sample` (most also `ddm eval`'s).
struct SampleArgs {
  std::string ckpt, ensemble, routing, out = "samples.png", raw, sampler;
  std::string control_file, control_from, control_type;  // ControlNets (and their fidelity for any model)
  std::string reference_file, reference_from;            // model.embed (and embedding similarity for any model)
  std::vector<std::string> prompts;                       // text models: --prompt, one row each
  std::string prompts_file, negative_prompt;              // --prompts FILE; guidance's unconditional prompt
  std::string init_noise;                                // --init-noise FILE: the noise each sample starts from
  std::string png_dir;                                   // --png-dir DIR: every sample as its own PNG
  std::string text_encoder;                              // --text-encoder DIR: a text model's moved encoder
  int64_t n = 100, steps = 0, class_id = -1, seed = 0, batch = 250, threads = 0;
  std::string device = "auto", precision = "fp32";  // where the network runs, and in what
  double cfg = -1;
  bool no_ema = false, allow_missing = false;
  bool cuda_graphs = false;  // --cuda-graphs: the network's forward replayed from CUDA graphs (model/graphed_net.h)
  bool one_expert_at_a_time = false;  // --one-expert-at-a-time: not side by side (Ensemble::set_side_by_side)
};

// Samples a.n images from a.ckpt or a.ensemble into the PNG grid a.out (and a.raw), printing progress.
void write_samples(const SampleArgs& a);

// `ddm sample` and `ddm eval`.
Command add_sample_command(CLI::App& app);
Command add_eval_command(CLI::App& app);

}  // namespace ddm
