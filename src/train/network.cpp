// The network of a run, whichever room defines it (see network.h).
#include "train/network.h"

#include <filesystem>
#include <map>
#include <mutex>

#include <sys/stat.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/weights_dir.h"
#include "sd/controlnet_net.h"
#include "sd/diffusers_weights.h"
#include "sd/pipeline_dir.h"
#include "sd/scheduler.h"
#include "sd/unet_net.h"
#include "train/latent.h"

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

// The ControlNet's architecture for a resolved model.controlnet: its folder's config.json, or
// from_unet's, with a conditioning embedding that takes the control image from the images' size down
// to the UNet's input (diffusers' widths 16, 32, 96, 256, as many as that needs: all four for SD's VAE).
sd::ControlNetModelConfig controlnet_config(const ModelConfig& m, const sd::UNet2DConditionConfig& unet) {
  if (m.controlnet != kControlNetFromUnet) return sd::load_controlnet_model_config(m.controlnet);
  const int64_t f = latent_downsampling(m);
  std::vector<int64_t> widths = {16, 32, 96, 256};
  size_t n = 1;
  while ((int64_t{1} << (n - 1)) < f) ++n;
  DDM_CHECK((int64_t{1} << (n - 1)) == f && n <= widths.size(),
            "model.controlnet = from-unet: the images are " << f << " times the latents' size; diffusers' "
                                                           << "conditioning embedding downsamples by 1, 2, 4 or 8");
  widths.resize(n);
  return sd::controlnet_config_from_unet(unet, 3, widths);
}

// The sha256 of a UNet's weight files. A fresh ControlNet run asks twice (resolving the config, then
// loading the locked UNet), and SD's weights are gigabytes: files whose path, size, modification
// time and inode are those of the last hash are not read again (git's index trusts the same
// signature). A file replaced or rewritten in between changes them and is hashed afresh.
std::string unet_weights_sha256(const std::string& unet) {
  const std::vector<std::string> files = weights_dir_files(unet, "diffusion_pytorch_model");
  std::string signature;
  for (const std::string& f : files) {
    struct stat st {};
    DDM_CHECK(::stat(f.c_str(), &st) == 0, f << ": cannot read it");
    signature += f + '\n' + std::to_string(st.st_size) + ' ' + std::to_string(st.st_mtim.tv_sec) + '.' +
                 std::to_string(st.st_mtim.tv_nsec) + ' ' + std::to_string(st.st_ino) + '\n';
  }
  static std::mutex mutex;
  static std::map<std::string, std::string> known;  // signature -> sha256
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = known.find(signature); it != known.end()) return it->second;
  }
  const std::string sha = weights_sha256(files);
  const std::lock_guard<std::mutex> lock(mutex);
  known[signature] = sha;
  return sha;
}

// model.controlnet of an sd-unet model (see resolve_sd_unet).
void resolve_sd_controlnet(ModelConfig& m, const sd::UNet2DConditionConfig& unet) {
  const std::string key = "model.controlnet = " + m.controlnet;
  DDM_CHECK(sd::has_diffusers_weights(m.unet),
            key << ": a ControlNet steers a trained UNet, but model.unet = " << m.unet << " holds its config.json "
                << "alone; give a UNet with its weights (a Stable Diffusion pipeline directory)");
  if (m.controlnet != kControlNetFromUnet) {
    DDM_CHECK(fs::is_directory(m.controlnet), key << ": no such directory (diffusers' ControlNetModel folder, a pipeline "
                                                  << "directory with a controlnet, or from-unet for a new one)");
    try {
      const std::string dir = sd::is_pipeline_dir(m.controlnet)
                                  ? sd::pipeline_component(m.controlnet, "controlnet", {"ControlNetModel"})
                                  : m.controlnet;
      m.controlnet = fs::absolute(dir).lexically_normal().string();
    } catch (const Error& e) {
      DDM_FAIL(key << ": " << e.what());
    }
  }
  sd::ControlNetModelConfig c;
  try {
    c = controlnet_config(m, unet);
  } catch (const Error& e) {
    DDM_FAIL(key << ": " << e.what());
  }
  const std::string differs = sd::controlnet_mismatch(c, unet);
  DDM_CHECK(differs.empty(), key << ": not a ControlNet of the UNet " << m.unet << ": " << differs);
  const int64_t f = latent_downsampling(m);
  DDM_CHECK(c.hint_factor() == f, key << ": its conditioning embedding takes control images " << c.hint_factor()
                                      << " times the UNet's input size, but the images are " << f
                                      << " times the model's input (the latents'); use a ControlNet made for them");
  const std::string sha = unet_weights_sha256(m.unet);
  DDM_CHECK(m.controlnet_sha256.empty() || m.controlnet_sha256 == sha,
            "the locked UNet changed: the weights of " << m.unet << " have sha256 " << sha << ", but this ControlNet "
                                                       << "was trained on model.controlnet_sha256 = " << m.controlnet_sha256
                                                       << "; restore them (a ControlNet is tied to its UNet)");
  m.controlnet_sha256 = sha;
}

}  // namespace

void resolve_sd_unet(ModelConfig& m) {
  const std::string key = "model.unet = " + m.unet;
  DDM_CHECK(fs::is_directory(m.unet), key << ": no such directory (diffusers' UNet2DConditionModel folder, or a "
                                          << "Stable Diffusion pipeline directory)");
  sd::UNet2DConditionConfig c;
  try {
    const std::string folder = absolute_dir(sd::unet_folder(m.unet));
    DDM_CHECK(fs::is_regular_file(fs::path(folder) / "config.json"),
              "no config.json, so neither diffusers' UNet2DConditionModel folder nor a Stable Diffusion pipeline directory"
                  << diffusers_folder_hint(m.unet, "unet"));
    m.unet = folder;
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
  if (!m.controlnet.empty()) resolve_sd_controlnet(m, c);
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
  const sd::UNet2DConditionConfig uc = pinned_unet_config(m);
  sd::UNet2DConditionModel unet(uc);
  if (!m.controlnet.empty())
    return std::make_shared<sd::SdControlNetNetImpl>(std::move(unet), sd::ControlNetModel(controlnet_config(m, uc)),
                                                     cfg.diffusion.timesteps);
  return std::make_shared<sd::SdUNetNetImpl>(std::move(unet), cfg.diffusion.timesteps);
}

void attach_sd_controlnet(NetImpl& net, const ModelConfig& m) {
  auto* s = dynamic_cast<sd::SdControlNetNetImpl*>(&net);
  DDM_CHECK(s, "attach_sd_controlnet: the network is not a ControlNet on diffusers' UNet");
  DDM_CHECK(!m.controlnet_sha256.empty(), "model.controlnet = " << m.controlnet << " is not resolved (controlnet_sha256 unset)");
  std::string sha;
  try {
    sha = unet_weights_sha256(m.unet);
  } catch (const Error& e) {
    DDM_FAIL("model.unet = " << m.unet << ": the locked UNet's weights: " << e.what() << "; restore them (a ControlNet "
                                                                                         "is tied to its UNet)");
  }
  DDM_CHECK(sha == m.controlnet_sha256,
            "the locked UNet changed: the weights of " << m.unet << " have sha256 " << sha << ", but this ControlNet was "
                                                       << "trained on model.controlnet_sha256 = " << m.controlnet_sha256
                                                       << "; restore them (a ControlNet is tied to its UNet)");
  sd::load_diffusers_weights(*s->unet(), m.unet, (fs::path(m.unet) / "config.json").string());
  s->set_unet_loaded();
}

std::string load_pretrained(NetImpl& net, const ModelConfig& m) {
  if (m.arch == "sd-unet" && !m.controlnet.empty()) {
    auto* s = dynamic_cast<sd::SdControlNetNetImpl*>(&net);
    DDM_CHECK(s, "load_pretrained: model.controlnet is set but the network is not a ControlNet on diffusers' UNet");
    if (m.controlnet == kControlNetFromUnet) {
      s->controlnet()->copy_encoder_from(*s->unet());
      return "started the ControlNet as a copy of the UNet's encoder (diffusers' from_unet), its zero convolutions zero";
    }
    sd::load_diffusers_weights(*s->controlnet(), m.controlnet, (fs::path(m.controlnet) / "config.json").string());
    return "started from the ControlNet's weights in " + m.controlnet;
  }
  if (m.arch != "sd-unet" || !sd::has_diffusers_weights(m.unet)) return "";
  auto* s = dynamic_cast<sd::SdUNetNetImpl*>(&net);
  DDM_CHECK(s, "load_pretrained: model.arch = sd-unet but the network is not diffusers' UNet");
  sd::load_diffusers_weights(*s->unet(), m.unet, (fs::path(m.unet) / "config.json").string());
  return "started from the UNet's weights in " + m.unet;
}

std::string network_name(const ModelConfig& m) {
  if (m.arch == "sd-unet" && !m.controlnet.empty())
    return "sd-unet ControlNet (diffusers' ControlNetModel on the locked UNet2DConditionModel of " + m.unet + ")";
  if (m.arch == "sd-unet") return "sd-unet (diffusers' UNet2DConditionModel of " + m.unet + ")";
  return m.preset + " (" + m.arch + ")";
}

double network_flops_per_image(const ModelConfig& m) {
  if (m.arch != "sd-unet") return forward_flops_per_image(m);
  const sd::UNet2DConditionConfig uc = pinned_unet_config(m);
  const double unet = sd::unet_2d_condition_flops(uc, m.image_size, m.image_size, m.text_tokens);
  if (m.controlnet.empty()) return unet;
  return unet + sd::controlnet_model_flops(controlnet_config(m, uc), m.image_size, m.image_size, m.text_tokens);
}

}  // namespace ddm
