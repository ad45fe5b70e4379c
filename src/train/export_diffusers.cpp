// A run's model as a diffusers Stable Diffusion pipeline directory (see export_diffusers.h).
#include "train/export_diffusers.h"

#include <unistd.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/weights_dir.h"
#include "sd/controlnet_net.h"
#include "sd/scheduler.h"
#include "sd/unet_net.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ddm {

namespace {

// The diffusers release whose pipeline layout this writes (as its own save_pretrained records it).
constexpr const char* kDiffusersVersion = "0.42.1";

json read_json_object(const fs::path& file) {
  const json j = read_json_file(file.string());
  DDM_INPUT_CHECK(j.is_object(), file.string() << ": not a JSON object");
  return j;
}

// config.json and the weights (every shard and the index) of a model folder, into `to`.
void copy_model_folder(const fs::path& from, const std::string& stem, const fs::path& to) {
  fs::create_directories(to);
  fs::copy_file(from / "config.json", to / "config.json");
  for (const std::string& f : weights_dir_files(from.string(), stem)) fs::copy_file(f, to / fs::path(f).filename());
}

// Where a pinned text encoder keeps its transformers CLIPTextModel and its tokenizer.
struct TextParts {
  fs::path encoder, tokenizer;
  std::string encoder_class, tokenizer_class;
};

TextParts text_parts(const fs::path& dir) {
  TextParts p;
  if (fs::is_regular_file(dir / "model_index.json")) {
    p.encoder = dir / "text_encoder";
    p.tokenizer = dir / "tokenizer";
  } else {
    p.encoder = dir;
    p.tokenizer = fs::exists(dir / "tokenizer.json") || fs::exists(dir / "vocab.json") ? dir : dir.parent_path() / "tokenizer";
  }
  const fs::path config = p.encoder / "config.json";
  const json c = fs::is_regular_file(config) ? read_json_object(config) : json::object();
  if (c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty() &&
      c["architectures"][0].is_string())
    p.encoder_class = c["architectures"][0].get<std::string>();
  DDM_INPUT_CHECK(p.encoder_class == "CLIPTextModel" || p.encoder_class == "CLIPTextModelWithProjection",
            "model.text_encoder = " << dir.string() << ": a Stable Diffusion pipeline's text encoder is transformers' "
                                    << "CLIPTextModel, and this one is "
                                    << (p.encoder_class.empty() ? std::string("not a transformers model") : p.encoder_class));
  const fs::path tconf = p.tokenizer / "tokenizer_config.json";
  DDM_INPUT_CHECK(fs::is_regular_file(tconf), "model.text_encoder = " << dir.string() << ": no tokenizer_config.json in "
                                                                << p.tokenizer.string() << " (its CLIPTokenizer)");
  const json t = read_json_object(tconf);
  p.tokenizer_class = t.contains("tokenizer_class") && t["tokenizer_class"].is_string()
                          ? t["tokenizer_class"].get<std::string>() : "CLIPTokenizer";
  return p;
}

// The scheduler's config: the file the run was trained with, or an Euler scheduler of its schedule.
json scheduler_config(const RunConfig& cfg) {
  const DiffusionConfig& d = cfg.diffusion;
  DDM_INPUT_CHECK(d.objective != "flow" && d.schedule == "discrete",
            "a Stable Diffusion pipeline's schedulers follow a discrete schedule (diffusion.schedule = discrete), and "
            "this run trained " << (d.objective == "flow" ? "flow matching" : "the continuous " + d.schedule + " schedule"));
  const std::string prediction = d.objective == "eps" ? "epsilon" : "v_prediction";
  if (!d.scheduler.empty() && fs::is_regular_file(d.scheduler)) {
    json j = read_json_object(d.scheduler);
    const sd::SchedulerConfig s = sd::parse_scheduler_config(j, d.scheduler);
    DDM_INPUT_CHECK(s.beta_schedule == d.beta_schedule && s.beta_start == d.beta_start && s.beta_end == d.beta_end &&
                  s.num_train_timesteps == d.timesteps && s.prediction_type == prediction,
              d.scheduler << " (diffusion.scheduler) no longer holds the schedule the run was trained with ("
                          << d.beta_schedule << " " << d.beta_start << ".." << d.beta_end << " over " << d.timesteps
                          << ", " << prediction << "); restore it");
    return j;
  }
  return json{{"_class_name", "EulerDiscreteScheduler"},
              {"_diffusers_version", kDiffusersVersion},
              {"num_train_timesteps", d.timesteps},
              {"beta_start", d.beta_start},
              {"beta_end", d.beta_end},
              {"beta_schedule", d.beta_schedule},
              {"prediction_type", prediction},
              {"timestep_spacing", "linspace"},
              {"steps_offset", 0}};
}

}  // namespace

std::string export_diffusers(const LoadedModel& m, const std::string& out) {
  const ModelConfig& mc = m.cfg.model;
  DDM_INPUT_CHECK(mc.arch == "sd-unet", m.checkpoint << " holds a " << mc.arch << " model; a Stable Diffusion pipeline "
                                               << "holds diffusers' UNet (model.arch = sd-unet)");
  auto* net = dynamic_cast<sd::SdUNetNetImpl*>(m.net.get());
  auto* controlnet = dynamic_cast<sd::SdControlNetNetImpl*>(m.net.get());
  DDM_INPUT_CHECK(net || controlnet, "export_diffusers: the network of " << m.checkpoint << " is not diffusers' UNet");
  const fs::path vae(mc.latent);
  DDM_INPUT_CHECK(!mc.latent.empty(), m.checkpoint << " is a pixel model, and a Stable Diffusion pipeline samples latents "
                                             << "of diffusers' AutoencoderKL (model.latent)");
  DDM_INPUT_CHECK(fs::is_regular_file(vae / "config.json") && read_json_object(vae / "config.json").value("_class_name", "") == "AutoencoderKL",
            "model.latent = " << mc.latent << " is ddm's own autoencoder; a Stable Diffusion pipeline needs diffusers' "
                              << "AutoencoderKL");
  const TextParts text = text_parts(mc.text_encoder);
  const json scheduler = scheduler_config(m.cfg);
  DDM_INPUT_CHECK(!fs::exists(out), out << " exists: remove it or name another directory (nothing was written)");

  const fs::path final_dir = absolute_dir(out);
  const fs::path tmp = final_dir.string() + ".tmp-" + std::to_string(getpid());
  fs::remove_all(tmp);
  try {
    fs::create_directories(tmp);
    if (controlnet) {  // the locked UNet as it is, and the trained ControlNet
      copy_model_folder(mc.unet, "diffusion_pytorch_model", tmp / "unet");
      sd::save_controlnet_model(controlnet->controlnet(), (tmp / "controlnet").string());
    } else {
      sd::save_unet_2d_condition(net->unet(), (tmp / "unet").string());
    }
    copy_model_folder(vae, "diffusion_pytorch_model", tmp / "vae");
    json vc = read_json_object(vae / "config.json");  // the run's latent scale and shift are what it sampled with
    vc["scaling_factor"] = mc.latent_scale;
    vc["shift_factor"] = mc.latent_shift == 0 && vc.value("shift_factor", json()).is_null() ? json() : json(mc.latent_shift);
    write_file_atomic((tmp / "vae/config.json").string(), vc.dump(2) + "\n");
    copy_model_folder(text.encoder, "model", tmp / "text_encoder");
    fs::create_directories(tmp / "tokenizer");
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                          "added_tokens.json"})
      if (fs::is_regular_file(text.tokenizer / f)) fs::copy_file(text.tokenizer / f, tmp / "tokenizer" / f);
    fs::create_directories(tmp / "scheduler");
    write_file_atomic((tmp / "scheduler/scheduler_config.json").string(), scheduler.dump(2) + "\n");
    const json none = json::array({nullptr, nullptr});
    json index{{"_class_name", controlnet ? "StableDiffusionControlNetPipeline" : "StableDiffusionPipeline"},
                     {"_diffusers_version", kDiffusersVersion},
                     {"feature_extractor", none},
                     {"image_encoder", none},
                     {"requires_safety_checker", false},
                     {"safety_checker", none},
                     {"scheduler", {"diffusers", scheduler.value("_class_name", "EulerDiscreteScheduler")}},
                     {"text_encoder", {"transformers", text.encoder_class}},
                     {"tokenizer", {"transformers", text.tokenizer_class}},
                     {"unet", {"diffusers", "UNet2DConditionModel"}},
                     {"vae", {"diffusers", "AutoencoderKL"}}};
    if (controlnet) index["controlnet"] = {"diffusers", "ControlNetModel"};
    write_file_atomic((tmp / "model_index.json").string(), index.dump(2) + "\n");
    fs::rename(tmp, final_dir);
    fsync_dir(final_dir.parent_path().string());
  } catch (const std::exception& e) {
    // A full disk shows as an I/O error when a file is copied (the kernel's short write): said.
    std::error_code ec;
    const fs::path under = final_dir.has_parent_path() ? final_dir.parent_path() : fs::path(".");
    const fs::space_info space = fs::space(under, ec);
    const bool full = !ec && space.available < (uintmax_t(1) << 20);
    fs::remove_all(tmp, ec);
    if (!full) throw;
    throw Error(std::string(e.what()) + "; the disk under " + under.string() + " is full (" +
                std::to_string(space.available) + " bytes free): free space and export again (nothing was written)");
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  const std::string parts = controlnet ? "a StableDiffusionControlNetPipeline (controlnet/ from step " + std::to_string(m.step) +
                                             ", unet/ the locked UNet's"
                                       : "a StableDiffusionPipeline (unet/ from step " + std::to_string(m.step);
  return "wrote " + final_dir.string() + ": " + parts + ", vae/, text_encoder/, tokenizer/, scheduler/ " +
         scheduler.value("_class_name", "") + ")" +
         (mc.text_skip > 0 ? "; the run used the text encoder's states " + std::to_string(mc.text_skip) +
                                 (mc.text_skip == 1 ? " layer" : " layers") + " before the last: pass clip_skip=" + std::to_string(mc.text_skip) + " to the pipeline, or prompt_embeds (" +
                                 "docs/stable-diffusion.md: clip_skip fails in diffusers 0.42.1 with transformers 5)"
                           : "");
}

}  // namespace ddm
