// What `ddm sample` and `ddm eval` share (apps/sample_cli.cpp defines it, apps/eval_cli.cpp uses it):
// the source of the samples (a checkpoint or a routed ensemble), its conditions and prompts, the
// sampling options as a run's defaults fill them in, and the sampling flags.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli_util.h"
#include "core/config.h"
#include "decentral/ensemble_dir.h"
#include "diffusion/denoiser.h"
#include "diffusion/generate.h"
#include "sample_cli.h"
#include "train/embed.h"
#include "train/loaded_model.h"

namespace ddm {

// What is sampled: one model (--ckpt) or a routed expert ensemble (--ensemble).
struct Source {
  std::optional<LoadedModel> model;
  std::unique_ptr<LoadedEnsemble> members;
  std::unique_ptr<Ensemble> ensemble;
  std::optional<Denoiser> den;
  std::string name;  // for messages and metadata
  Routing routing;
  const LoadedModel& defaults() const { return model ? *model : members->first_expert(); }
  int64_t num_classes() const { return defaults().cfg.model.num_classes; }
};

// Control maps for sampling (--control FILE | --control-from SPLIT): what a ControlNet is given and what
// any model's samples are measured against (control fidelity).
struct ControlSet {
  std::string type;      // edges | lowres
  torch::Tensor maps;    // float [n, Cc, S, S] in [-1, 1]
  torch::Tensor labels;  // int64 [n] (--control-from: the images'; else undefined)
  std::string origin;
};

// Reference images for sampling (--reference FILE | --reference-from SPLIT): what a model.embed model is
// conditioned on (their embeddings) and what any model's samples are compared with (embedding similarity).
struct ReferenceSet {
  torch::Tensor images;  // float [n, C, S, S] in [-1, 1]
  torch::Tensor labels;  // int64 [n] (--reference-from: the images'; else undefined)
  std::shared_ptr<const ImageEmbedder> embedder;  // the model's, or the shipped network for a baseline
  std::string origin;
};

// Where a model's data came from (data/origin.h), which `ddm eval` needs; data.source itself when
// that data is gone (its shards moved or deleted), which eval then refuses, naming it.
std::string origin_of(const DataConfig& data);

// Opens --ckpt or --ensemble on --device, as the flags say (bad input: InputError, exit 2).
Source open_source(const SampleArgs& a);

// A text model's prompts (--prompt, --prompts) into g, as classes are laid out: n / P samples of each
// of the P prompts in a row, cycling if n is not a multiple; guidance's unconditional branch takes
// --negative-prompt's encoding instead of the empty prompt's. Returns the rows' labels; nothing for
// a model without text, which refuses the flags. `each` gets every sample's prompt, in sample order.
std::vector<std::string> open_prompts(const SampleArgs& a, Source& src, GenerateOptions& g,
                                      std::vector<std::string>* each = nullptr);

// The control maps and reference images of the --control* / --reference* flags (a model only, not an
// ensemble), put into g: what the model is conditioned on, and the labels they come with.
std::pair<std::optional<ControlSet>, std::optional<ReferenceSet>> open_conditions(const SampleArgs& a, const Source& src,
                                                                                  GenerateOptions& g);

// The sampling flags as the run's defaults fill them in: a.n images (per_class for `ddm eval`'s rows).
GenerateOptions generate_options(const SampleArgs& a, const LoadedModel& m);

// The flags `ddm sample` and `ddm eval` share.
void add_sample_flags(CLI::App* cmd, SampleArgs& a);

}  // namespace ddm
