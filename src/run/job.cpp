// A training job's definition (see job.h).
#include "run/job.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "comm/env.h"
#include "core/error.h"
#include "data/shard_loader.h"
#include "model/router.h"
#include "train/controlnet.h"
#include "train/embed.h"
#include "train/latent.h"
#include "train/network.h"
#include "train/text.h"

namespace ddm {

int set_threads(int64_t threads, int local_processes) {
  // 0 = the cores shared among the processes on this machine: two ranks with every core each run
  // at half the speed of two ranks with one core each (docs/results.md, "Data parallel").
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int n = threads > 0 ? static_cast<int>(threads) : std::max(1, cores / std::max(1, local_processes));
  torch::set_num_threads(n);
  return n;
}

namespace {

void resolve_input_shape(RunConfig& cfg, const Dataset& data) {
  ModelConfig& m = cfg.model;
  const int64_t c = data.images.size(1), h = data.images.size(2), w = data.images.size(3);
  DDM_CHECK(h == w, "images must be square, got " << h << "x" << w << " from " << data.description);
  DDM_CHECK(m.num_classes == -1 || m.num_classes == 0 || m.num_classes == data.num_classes,
            "model.num_classes = " << m.num_classes << " but the data has " << data.num_classes
                                   << " classes; use -1 (from data) or 0 (unconditional)");
  if (m.num_classes == -1) m.num_classes = data.num_classes;
  m.self_cond = cfg.train.self_cond > 0;  // derived: the network takes the estimate as more channels
  if (!m.embed.empty()) resolve_embed(m, data);      // on the pixel images, before any latent
  if (!m.text_encoder.empty()) resolve_text(m, data);  // the frozen text encoder: its dims and sha256
  if (!m.controlnet.empty() && m.arch != "sd-unet") {  // the model is the base's U-Net
    resolve_controlnet(cfg, data);
    return;
  }
  DDM_CHECK(!data.latents || !m.latent.empty(),
            "data.source = latents holds the latents of a frozen autoencoder (" << data.description
                << "): set model.latent to the autoencoder that encoded them (" << data.latents->autoencoder
                << ", or its run directory)");
  if (!m.latent.empty()) {  // the model's input is the autoencoder's latents
    resolve_latent(m, data);
    return;
  }
  DDM_CHECK(m.in_channels == 0 || m.in_channels == c,
            "model.in_channels = " << m.in_channels << " but the data has " << c << " channels; remove the key");
  DDM_CHECK(m.image_size == 0 || m.image_size == h,
            "model.image_size = " << m.image_size << " but the data is " << h << "x" << w << "; remove the key");
  m.in_channels = c;
  m.image_size = h;
}

// A DiT's patch must divide the image size, which the data sets. A router's patch is a detail of its
// preset (router-dit-tiny's 7 fits 28 px, not 32 or 64): it becomes the divisor nearest it, said once.
// A model's is the user's to choose: refused before anything is built, with the divisor to use.
void fit_patch(ModelConfig& m) {
  if ((m.arch != "dit" && m.arch != "router-dit") || m.patch <= 0 || m.image_size <= 0 || m.image_size % m.patch == 0)
    return;
  int64_t best = 1;
  for (int64_t d = 1; d <= m.image_size; ++d)
    if (m.image_size % d == 0 && std::abs(d - m.patch) <= std::abs(best - m.patch)) best = d;
  DDM_CHECK(m.arch == "router-dit", "model.image_size = " << m.image_size << " (the data's) is not divisible by model.patch = "
                                                          << m.patch << ": set model.patch to a divisor of it, e.g. "
                                                          << best);
  std::cerr << "note: the router's model.patch " << m.patch << " does not divide the data's " << m.image_size
            << " px: it uses " << best << std::endl;
  m.patch = best;
}

}  // namespace

void resolve_data_shape(RunConfig& cfg, const Dataset& data) {
  if (cfg.model.arch == "sd-unet" && cfg.model.num_classes == -1) cfg.model.num_classes = 0;  // no class embedding
  resolve_input_shape(cfg, data);
  // Captions found, and no encoder to read them: said, so that nobody trains text-to-image by mistake
  // without the text (a router takes the experts' condition; an autoencoder none).
  const auto lead = [] {  // rank 0 of a distributed job, or a process alone: says it once
    try {
      return detect_dist_env().rank == 0;
    } catch (const std::exception&) {
      return true;
    }
  };
  const bool captioned = !data.captions.empty() || (data.shards && data.shards->captioned > 0) ||
                         (data.encoded && !data.encoded->text.encoder.empty());
  if (captioned && cfg.model.text_encoder.empty() && cfg.model.arch != "autoencoder" &&
      !is_router_arch(cfg.model.arch) && lead())
    std::cerr << "note: the data has captions, but model.text_encoder is not set: the model is not conditioned on "
                 "them (to train text-to-image, set model.text_encoder to a text encoder's directory: docs/text.md)"
              << std::endl;
  // A text model's grids (run/train_grids.h) take their rows from train.sample_prompts, else from the
  // data's first distinct captions (in memory, or the first samples' of shards), which become the
  // run's train.sample_prompts (recorded; `ddm sample` of the run takes them too). Said before the
  // run directory is written.
  const ModelConfig& m = cfg.model;
  if (cfg.train.sample_prompts.empty() && !m.text_encoder.empty() && m.controlnet.empty() && m.embed.empty()) {
    cfg.train.sample_prompts = first_captions(data, std::min<int64_t>(4, cfg.train.sample_n));
    DDM_CHECK(cfg.train.sample_every == 0 || !cfg.train.sample_prompts.empty(),
              "train.sample_every = " << cfg.train.sample_every << ": a text model's grid takes its prompts from "
                  << "train.sample_prompts or the data's first captions, and "
                  << (data.shards ? "the first 256 samples hold none" : "the data holds none")
                  << ": set train.sample_prompts = [\"a first prompt\", \"a second\"] (one row each), or "
                  << "train.sample_every = 0");
  }
  fit_patch(cfg.model);
  if (cfg.model.arch == "sd-unet") resolve_sd_unet(cfg.model);  // diffusers' UNet: its folder and sha256
  if (!cfg.diffusion.scheduler.empty()) resolve_scheduler(cfg.diffusion);  // diffusers' training schedule
}


TrainJob plain_job(RunConfig cfg) {
  validate(cfg);
  const int threads = set_threads(cfg.train.threads);
  TrainJob job;
  const bool streamed = cfg.data.source == "shards" || cfg.data.source == "latents";
  job.data = streamed ? open_shards(cfg.data, threads, false) : load_dataset(cfg.data);
  resolve_data_shape(cfg, job.data);
  DDM_CHECK(job.data.images.size(0) > 0, "the dataset " << job.data.description << " is empty");
  job.cfg = cfg;
  job.recorded = cfg;
  return job;
}

}  // namespace ddm
