// Loading trained models (see loaded_model.h).
#include "train/loaded_model.h"

#include "core/error.h"
#include "core/input_check.h"
#include "core/run_dir.h"
#include "diffusion/path.h"
#include "model/router.h"
#include "train/checkpoint.h"
#include "train/controlnet.h"
#include "train/network.h"
#include "train/optimizer.h"
#include "train/text.h"

namespace ddm {
namespace {

std::string g_text_encoder_at;  // use_text_encoder_at: set once by a command before it loads

LoadedModel load_model_files(const std::string& path, bool use_ema, torch::Device device) {
  LoadedModel m;
  Checkpoint ck;
  for (int attempt = 1;; ++attempt) {
    m.checkpoint = resolve_checkpoint(path);
    try {
      ck = read_checkpoint(m.checkpoint, /*weights_only=*/true);
      break;
    } catch (const Error&) {
      // A run that trains writes a newer checkpoint and then prunes the older ones (train.keep_ckpts):
      // the one read may be pruned under it. Then the newer one; a checkpoint still the latest is
      // damaged.
      if (attempt == 5 || m.checkpoint == path || resolve_checkpoint(path) == m.checkpoint) throw;
    }
  }
  m.cfg = parse_config(ck.config_toml, m.checkpoint + "/" + RunDir::kState + " (config)");
  if (!g_text_encoder_at.empty() && !m.cfg.model.text_encoder.empty()) m.cfg.model.text_encoder = g_text_encoder_at;
  m.step = ck.step;
  if (ck.state.contains("class_names")) m.class_names = ck.field<std::vector<std::string>>("/class_names");
  m.net = make_network(m.cfg);
  attach_controlnet(*m.net, m.cfg.model);  // a ControlNet's locked base, pinned by sha256
  load_module_state(*m.net, ck.model, RunDir(m.checkpoint) / RunDir::kModel);
  if (use_ema) load_module_state(*m.net, ck.ema, RunDir(m.checkpoint) / RunDir::kEma, LoadScope::kTrainable);
  m.net->eval();
  m.net->to(device);
  if (!m.cfg.model.latent.empty()) m.latent = LatentSpace::load(m.cfg.model, device);  // pinned by sha256
  if (!m.cfg.model.embed.empty()) m.embedder = ImageEmbedder::load(m.cfg.model, device);  // pinned by sha256
  if (!m.cfg.model.text_encoder.empty()) m.text = load_pinned_text_encoder(m.cfg.model, device);  // pinned by sha256
  return m;
}

}  // namespace

void use_text_encoder_at(const std::string& dir) { g_text_encoder_at = dir; }

LoadedModel load_model(const std::string& path, bool use_ema, torch::Device device) {
  // A checkpoint, or a frozen part it pins, that cannot be read fails every retry alike: bad input.
  return as_input_error([&] { return load_model_files(path, use_ema, device); });
}

std::function<torch::Tensor(const torch::Tensor&)> image_decoder(const LoadedModel& m) {
  if (!m.latent) return {};
  return [latent = m.latent](const torch::Tensor& z) { return latent->decode(z); };  // [B, C, H, W]
}

Denoiser make_denoiser(const LoadedModel& m) {
  DDM_INPUT_CHECK(!is_router_arch(m.cfg.model.arch), m.checkpoint << " holds a router (" << m.cfg.model.arch
                                                << "), not a diffusion model; sample an ensemble with --ensemble DIR");
  DDM_INPUT_CHECK(m.cfg.model.arch != "autoencoder",
            m.checkpoint << " holds an autoencoder, not a diffusion model: it reconstructs images (`ddm "
                            "train-autoencoder --config RUN/config.toml --out RUN --resume` reports it) and latent models train on it "
                            "(model.latent = RUN)");
  Denoiser den(m.net, make_path(m.cfg.diffusion), prediction_for(m.cfg.diffusion), m.cfg.model.num_classes);
  if (m.text) den.set_null_text(encode_texts(*m.text, {""}, den.device()));  // [1, T, D], [1, T], [1, P]
  return den;
}

}  // namespace ddm
