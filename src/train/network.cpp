// The network of a run, whichever room defines it (see network.h).
#include "train/network.h"

#include <filesystem>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "sd/diffusers_weights.h"
#include "sd/pipeline_dir.h"
#include "sd/scheduler.h"
#include "sd/unet_net.h"

namespace fs = std::filesystem;

namespace ddm {

namespace {

// The UNet's config.json of a resolved model, checked against model.unet_sha256.
sd::UNet2DConditionConfig pinned_unet_config(const ModelConfig& m) {
  const std::string file = (fs::path(m.unet) / "config.json").string();
  DDM_CHECK(fs::is_regular_file(file), "model.unet = " << m.unet << ": no config.json (the UNet the model was "
                                                       << "trained as); restore the folder");
  const std::string sha = sha256_file(file);
  DDM_CHECK(m.unet_sha256.empty() || sha == m.unet_sha256,
            "the UNet's architecture changed: " << file << " has sha256 " << sha << ", but model.unet_sha256 = "
                                                << m.unet_sha256 << "; restore it (the model is tied to its own)");
  return sd::load_unet_2d_condition_config(m.unet);
}

}  // namespace

void resolve_sd_unet(ModelConfig& m) {
  const std::string key = "model.unet = " + m.unet;
  DDM_CHECK(fs::is_directory(m.unet), key << ": no such directory (diffusers' UNet2DConditionModel folder, or a "
                                          << "Stable Diffusion pipeline directory)");
  sd::UNet2DConditionConfig c;
  try {
    m.unet = fs::absolute(sd::unet_folder(m.unet)).lexically_normal().string();
    c = pinned_unet_config(m);
  } catch (const Error& e) {
    DDM_FAIL(key << ": " << e.what());
  }
  m.unet_sha256 = sha256_file((fs::path(m.unet) / "config.json").string());
  const int64_t f = int64_t{1} << (c.block_out_channels.size() - 1);
  DDM_CHECK(c.in_channels == m.in_channels && c.out_channels == m.in_channels,
            key << ": the UNet takes " << c.in_channels << " and gives " << c.out_channels << " channels, but the model's "
                << "input has " << m.in_channels << (m.latent.empty() ? " (the images')" : " (model.latent's latents)")
                << "; use a UNet made for them");
  DDM_CHECK(m.image_size % f == 0, key << ": the UNet halves its input " << c.block_out_channels.size() - 1
                                       << " times, which " << m.image_size << "x" << m.image_size << " inputs do not allow; "
                                       << "use a size divisible by " << f);
  DDM_CHECK(c.cross_attention_dim == m.text_dim,
            key << ": the UNet attends to states of width " << c.cross_attention_dim << " (cross_attention_dim), but the "
                << "text encoder " << m.text_encoder << " gives " << m.text_dim << "; use the encoder it was made for");
  DDM_CHECK(m.num_classes <= 0, "model.arch = sd-unet has no class embedding, but model.num_classes = " << m.num_classes
                                                                                                         << "; set it to 0");
  m.num_classes = 0;
}

void resolve_scheduler(DiffusionConfig& d) {
  const std::string key = "diffusion.scheduler = " + d.scheduler;
  fs::path p(d.scheduler);
  try {
    if (sd::is_pipeline_dir(p.string())) p = sd::pipeline_component(p.string(), "scheduler", {});
  } catch (const Error& e) {
    DDM_FAIL(key << ": " << e.what());
  }
  if (fs::is_regular_file(p)) p = p.parent_path();
  DDM_CHECK(fs::is_directory(p), key << ": no such file or directory (a diffusers scheduler_config.json, its folder "
                                     << "or a pipeline directory)");
  sd::SchedulerConfig s;
  try {
    s = sd::load_scheduler_config(p.string());
  } catch (const Error& e) {
    DDM_FAIL(key << ": " << e.what());
  }
  const std::string objective = s.prediction_type == "epsilon" ? "eps" : s.prediction_type == "v_prediction" ? "v" : "";
  DDM_CHECK(!objective.empty(), key << ": prediction_type \"" << s.prediction_type << "\" (the model predicts the "
                                    << "data) is not an objective ddm trains; use epsilon or v_prediction");
  DDM_CHECK(d.objective == objective, key << ": its model predicts " << s.prediction_type << ", so set diffusion.objective = "
                                          << objective << " (it is " << d.objective << ")");
  d.schedule = "discrete";
  d.beta_schedule = s.beta_schedule;
  d.beta_start = s.beta_start;
  d.beta_end = s.beta_end;
  d.timesteps = s.num_train_timesteps;
  d.scheduler = fs::absolute(p / "scheduler_config.json").lexically_normal().string();
}

Net make_network(const RunConfig& cfg) {
  const ModelConfig& m = cfg.model;
  if (m.arch != "sd-unet") return make_net(m);
  DDM_CHECK(!m.unet.empty(), "model.arch = sd-unet needs model.unet");
  sd::UNet2DConditionModel unet(pinned_unet_config(m));
  return std::make_shared<sd::SdUNetNetImpl>(std::move(unet), cfg.diffusion.timesteps);
}

std::string load_pretrained(NetImpl& net, const ModelConfig& m) {
  if (m.arch != "sd-unet" || !sd::has_diffusers_weights(m.unet)) return "";
  auto* s = dynamic_cast<sd::SdUNetNetImpl*>(&net);
  DDM_CHECK(s, "load_pretrained: model.arch = sd-unet but the network is not diffusers' UNet");
  sd::load_diffusers_weights(*s->unet(), m.unet, (fs::path(m.unet) / "config.json").string());
  return "started from the UNet's weights in " + m.unet;
}

std::string network_name(const ModelConfig& m) {
  if (m.arch == "sd-unet") return "sd-unet (diffusers' UNet2DConditionModel of " + m.unet + ")";
  return m.preset + " (" + m.arch + ")";
}

double network_flops_per_image(const ModelConfig& m) {
  if (m.arch != "sd-unet") return forward_flops_per_image(m);
  return sd::unet_2d_condition_flops(pinned_unet_config(m), m.image_size, m.image_size, m.text_tokens);
}

}  // namespace ddm
