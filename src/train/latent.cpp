// Latent diffusion's frozen autoencoder (see latent.h).
#include "train/latent.h"

#include <filesystem>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/run_dir.h"
#include "core/safetensors.h"
#include "core/weights_dir.h"
#include "data/latent_shards.h"
#include "sd/pipeline_dir.h"
#include "train/autoencoder_record.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// The autoencoder's own resolved config, from its checkpoint.
RunConfig autoencoder_config(const std::string& ckpt, const std::string& key_origin) {
  DDM_CHECK(fs::is_regular_file(fs::path(ckpt) / RunDir::kState),
            key_origin << ": the autoencoder checkpoint " << ckpt << " does not exist (moved or deleted?); "
                       << "point model.latent at a `ddm train-autoencoder` run");
  const Checkpoint ck = read_checkpoint(ckpt, /*weights_only=*/true);
  RunConfig c = parse_config(ck.config_toml, ckpt + "/" + RunDir::kState + " (config)");
  DDM_CHECK(c.model.arch == "autoencoder", key_origin << ": " << ckpt << " holds a " << c.model.arch
                                                      << " model, not an autoencoder (train one with `ddm "
                                                         "train-autoencoder`)");
  return c;
}

bool same_dir(const std::string& a, const std::string& b) {
  return fs::weakly_canonical(fs::absolute(a)) == fs::weakly_canonical(fs::absolute(b));
}

// A diffusers AutoencoderKL folder: its config.json names the class.
bool is_diffusers_vae(const fs::path& dir) {
  const fs::path config = dir / "config.json";
  if (!fs::is_regular_file(config)) return false;
  // ddm's own runs and checkpoints hold no config.json: one without a class is a damaged diffusers folder.
  const auto j = read_json_file(config.string());
  DDM_CHECK(j.is_object() && j.contains("_class_name"),
            config.string() << ": no _class_name, so not the config.json of diffusers' AutoencoderKL; restore it "
                            << "(model.latent takes diffusers' AutoencoderKL or a ddm train-autoencoder run)");
  // Another diffusers class (AutoencoderTiny, a UNet): named, not taken for a ddm run without its files.
  DDM_CHECK(j["_class_name"] == "AutoencoderKL",
            config.string() << ": _class_name " << j["_class_name"].dump() << ": model.latent takes diffusers' "
                            << "AutoencoderKL (or a ddm train-autoencoder run)");
  return true;
}

// model.latent as given: a diffusers pipeline's directory (model_index.json) stands for its vae/.
fs::path diffusers_vae_dir(const fs::path& dir) {
  return sd::is_pipeline_dir(dir.string()) ? fs::path(sd::pipeline_component(dir.string(), "vae", {"AutoencoderKL"})) : dir;
}

sd::AutoencoderKLConfig diffusers_vae_config(const fs::path& dir) {
  const std::string file = (dir / "config.json").string();
  return sd::parse_autoencoder_kl_config(read_json_file(file), file);
}

// A diffusers VAE's design as ddm's autoencoder describes it (the same design), for latents of side
// `latent_size`.
AutoencoderShape shape_of(const sd::AutoencoderKLConfig& c, int64_t latent_size, const std::string& dir) {
  DDM_CHECK(c.in_channels == c.out_channels, dir << ": in_channels " << c.in_channels << " and out_channels "
                                                 << c.out_channels << " differ; ddm's latent models decode to the "
                                                 << "images they encode");
  AutoencoderShape s;
  s.in_channels = c.in_channels;
  s.image_size = latent_size * c.factor();
  s.channels = c.block_out_channels.front();
  s.channel_mult.clear();
  for (int64_t w : c.block_out_channels) {
    DDM_CHECK(w % s.channels == 0, dir << ": block_out_channels " << torch::IntArrayRef(c.block_out_channels)
                                       << " are not multiples of the first; not supported yet");
    s.channel_mult.push_back(w / s.channels);
  }
  s.res_blocks = c.layers_per_block;
  s.latent_channels = c.latent_channels;
  s.groups = c.norm_num_groups;
  s.mid_attention = c.mid_block_add_attention;
  return s;
}

}  // namespace

std::shared_ptr<const LatentSpace> LatentSpace::load(const ModelConfig& cfg, torch::Device device) {
  DDM_CHECK(!cfg.latent.empty(), "LatentSpace::load: model.latent is not set");
  DDM_CHECK(!cfg.latent_sha256.empty() && cfg.latent_scale > 0,
            "model.latent = " << cfg.latent << " is not resolved (latent_sha256 and latent_scale unset)");
  if (is_diffusers_vae(cfg.latent)) {  // diffusers' AutoencoderKL, its weights pinned by weights_sha256
    const std::string sha = weights_sha256(weights_dir_files(cfg.latent, "diffusion_pytorch_model"));
    DDM_CHECK(sha == cfg.latent_sha256,
              "the frozen autoencoder changed: the weights of " << cfg.latent << " have sha256 " << sha
                                                                << ", but this model was trained on model.latent_sha256 = "
                                                                << cfg.latent_sha256 << "; restore that VAE (a latent "
                                                                << "model is tied to its own)");
    auto ls = std::make_shared<LatentSpace>();
    ls->kl_ = sd::load_autoencoder_kl(cfg.latent).ptr();
    for (auto& p : ls->kl_->parameters()) p.set_requires_grad(false);
    ls->kl_->to(device);
    ls->shape_ = shape_of(ls->kl_->config(), cfg.image_size, cfg.latent);
    ls->checkpoint_ = cfg.latent;
    ls->sha256_ = sha;
    ls->scale_ = cfg.latent_scale;
    ls->shift_ = cfg.latent_shift;
    DDM_CHECK(cfg.in_channels == ls->shape_.latent_channels,
              "model.in_channels = " << cfg.in_channels << " is not the latent channels of " << cfg.latent << " ("
                                     << ls->shape_.latent_channels << ")");
    return ls;
  }
  // The pin first: a replaced autoencoder is named as such, whatever else its checkpoint says.
  const std::string weights = (fs::path(cfg.latent) / RunDir::kEma).string();
  DDM_CHECK(fs::is_regular_file(weights), "model.latent = " << cfg.latent << ": the frozen autoencoder's weights "
                                                            << weights << " do not exist (moved or deleted?); "
                                                               "restore them (a latent model is tied to its own)");
  const std::string bytes = read_file(weights);
  const std::string sha = sha256_hex(bytes);
  DDM_CHECK(sha == cfg.latent_sha256,
            "the frozen autoencoder changed: " << weights << " has sha256 " << sha << ", but this model was trained "
                                               << "on model.latent_sha256 = " << cfg.latent_sha256
                                               << "; restore that autoencoder (a latent model is tied to its own)");
  const RunConfig ae_cfg = autoencoder_config(cfg.latent, "model.latent = " + cfg.latent);
  auto ls = std::make_shared<LatentSpace>();
  ls->ae_ = std::make_shared<AutoencoderImpl>(autoencoder_shape(ae_cfg.model));
  load_module_state(*ls->ae_, parse_safetensors(bytes, weights).tensors, weights);
  for (auto& p : ls->ae_->parameters()) p.set_requires_grad(false);
  ls->ae_->eval();
  ls->ae_->to(device);
  ls->shape_ = ls->ae_->shape();
  ls->checkpoint_ = cfg.latent;
  ls->sha256_ = sha;
  ls->scale_ = cfg.latent_scale;
  ls->shift_ = cfg.latent_shift;
  const AutoencoderShape& s = ls->shape();
  DDM_CHECK(cfg.in_channels == s.latent_channels && cfg.image_size == s.latent_size(),
            "model.in_channels = " << cfg.in_channels << " and model.image_size = " << cfg.image_size
                                   << " are not the latents of " << cfg.latent << " (" << s.latent_channels << "x"
                                   << s.latent_size() << "x" << s.latent_size() << ")");
  return ls;
}

LatentSpace::LatentSpace(std::shared_ptr<AutoencoderImpl> ae, double scale, double shift)
    : ae_(std::move(ae)), shape_(ae_->shape()), scale_(scale), shift_(shift) {
  for (auto& p : ae_->parameters()) p.set_requires_grad(false);
  ae_->eval();
}

torch::Device LatentSpace::device() const {
  return (ae_ ? ae_->parameters() : kl_->parameters()).front().device();
}

Posterior LatentSpace::posterior(const torch::Tensor& x) const {
  torch::NoGradGuard no_grad;
  if (ae_) return ae_->encode(x);
  auto [mean, logvar] = kl_->encode(x);  // [B, z, h, w] each
  return {mean, logvar};
}

Posterior LatentSpace::posteriors(const torch::Tensor& images) const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> mean, logvar;
  for (int64_t i = 0; i < images.size(0); i += 1000) {
    const Posterior q = posterior(to_unit_range(images.slice(0, i, i + 1000).to(device())));  // [b, z, h, w] each
    mean.push_back(q.mean.to(images.device()));
    logvar.push_back(q.logvar.to(images.device()));
  }
  return {torch::cat(mean), torch::cat(logvar)};  // [N, z, h, w] each
}

torch::Tensor LatentSpace::encode_cached(const Posterior& cache, const torch::Tensor& index,
                                         const torch::Tensor& eps) const {
  DDM_CHECK(index.defined(), "train.cache_latents: the batch does not say which images it holds (Batch::index)");
  const torch::Tensor at = index.to(cache.mean.device());
  const Posterior q{cache.mean.index_select(0, at).to(eps.device()),
                    cache.logvar.index_select(0, at).to(eps.device())};  // [B, z, h, w]
  return (q.sample(eps) - shift_) * scale_;                                                    // [B, z, h, w]
}

torch::Tensor LatentSpace::sample_posterior(const torch::Tensor& x, const torch::Tensor& eps) const {
  const int64_t z = shape().latent_channels;
  DDM_CHECK(x.dim() == 4 && x.size(1) == 2 * z, "latent shards: a batch of posteriors must be [B, " << 2 * z
                                                    << ", h, w] (mean and logvar), got " << x.sizes());
  const Posterior q{x.narrow(1, 0, z), x.narrow(1, z, z)};       // [B, z, h, w] each
  return (q.sample(eps.to(x.device())) - shift_) * scale_;  // [B, z, h, w]
}

torch::Tensor LatentSpace::encode(const torch::Tensor& x, const torch::Tensor& eps) const {
  torch::NoGradGuard no_grad;
  return ((posterior(x.to(device())).sample(eps.to(device())) - shift_) * scale_).to(x.device());  // [B, z, h, w]
}

torch::Tensor LatentSpace::encode_mean(const torch::Tensor& images) const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> z;
  for (int64_t i = 0; i < images.size(0); i += 1000) {
    torch::Tensor x = images.slice(0, i, i + 1000);
    if (x.scalar_type() == torch::kUInt8) x = to_unit_range(x.to(device()));  // [b, C, H, W] in [-1, 1]
    z.push_back(((posterior(x.to(device())).mean - shift_) * scale_).to(images.device()));  // [b, z, h, w]
  }
  return torch::cat(z);  // [N, z, h, w]
}

torch::Tensor LatentSpace::decode(const torch::Tensor& z) const {
  torch::NoGradGuard no_grad;
  const torch::Tensor u = z.to(device()) / scale_ + shift_;                                   // [B, z, h, w]
  return (ae_ ? ae_->decode(u) : kl_->decode(u)).clamp(-1, 1).to(z.device());  // [B, C, H, W]
}

int64_t latent_downsampling(const ModelConfig& m) {
  if (m.latent.empty()) return 1;
  if (is_diffusers_vae(m.latent)) return diffusers_vae_config(m.latent).factor();
  return autoencoder_shape(autoencoder_config(m.latent, "model.latent = " + m.latent).model).factor();
}

void resolve_latent(ModelConfig& m, const Dataset& data) {
  const std::string key = "model.latent = " + m.latent;
  DDM_CHECK(fs::exists(m.latent), key << ": no such directory; give a `ddm train-autoencoder` run directory (make "
                                        "one with: ddm train-autoencoder --config configs/autoencoder.toml --out "
                                     << m.latent << ")");
  // Absolute and without a trailing slash: the resolved config is read from other directories too.
  fs::path dir = absolute_dir(m.latent);
  bool diffusers = false;
  sd::AutoencoderKLConfig vae;
  try {
    dir = diffusers_vae_dir(dir);
    diffusers = is_diffusers_vae(dir);
    if (diffusers) vae = diffusers_vae_config(dir);
  } catch (const Error& e) {
    DDM_FAIL(key << ": " << e.what());
  }
  if (diffusers) {  // diffusers' AutoencoderKL: any image size its downsampling divides
    const std::string sha = weights_sha256(weights_dir_files(dir.string(), "diffusion_pytorch_model"));
    DDM_CHECK(m.latent_sha256.empty() || m.latent_sha256 == sha,
              "the frozen autoencoder changed: model.latent_sha256 = " << m.latent_sha256 << ", but the weights of "
                                                                      << dir.string() << " now have sha256 " << sha);
    int64_t latent_size = 0;
    if (data.latents) {  // encoded by this VAE: checked by its sha256 below
      latent_size = data.latents->latent_size;
    } else {
      const int64_t c = data.images.size(1), h = data.images.size(2), w = data.images.size(3), f = vae.factor();
      DDM_CHECK(c == vae.in_channels, key << ": the VAE takes " << vae.in_channels << "-channel images, but the data is "
                                          << c << "x" << h << "x" << w << " (" << data.description << ")");
      DDM_CHECK(h == w && h % f == 0, key << ": the VAE downsamples by " << f << ", so the images must be square with a "
                                          << "side that " << f << " divides, but the data is " << c << "x" << h << "x"
                                          << w << "; set data.resolution to a multiple of " << f);
      latent_size = h / f;
    }
    DDM_CHECK(m.in_channels == 0 || m.in_channels == vae.latent_channels,
              "model.in_channels = " << m.in_channels << " but the latents of " << dir.string() << " have "
                                     << vae.latent_channels << " channels; remove the key");
    DDM_CHECK(m.image_size == 0 || m.image_size == latent_size,
              "model.image_size = " << m.image_size << " but the latents of " << dir.string() << " are " << latent_size
                                    << "x" << latent_size << "; remove the key");
    if (data.latents)
      DDM_CHECK(sha == data.latents->autoencoder_sha256,
                key << " (sha256 " << sha.substr(0, 12) << ") is not the autoencoder that encoded the latent shards "
                    << data.description << ": their " << kLatentShardsInfo << " names " << data.latents->autoencoder
                    << "; set model.latent to it, or encode the data again with `ddm encode --ae " << m.latent << "`");
    m.in_channels = vae.latent_channels;
    m.image_size = latent_size;
    m.latent = dir.string();
    m.latent_sha256 = sha;
    if (m.latent_scale == 0) {
      m.latent_scale = vae.scaling_factor;
      m.latent_shift = vae.shift_factor;
    }
    return;
  }
  const bool is_ckpt = fs::is_regular_file(dir / RunDir::kState);
  const int64_t c = data.images.size(1), h = data.images.size(2);
  auto check_data = [&](const RunConfig& ae) {
    if (data.latents) return;  // encoded by this autoencoder: checked by its sha256 below
    DDM_CHECK(c == ae.model.in_channels && h == ae.model.image_size && data.images.size(3) == h,
              key << ": the autoencoder was trained on " << ae.model.in_channels << "x" << ae.model.image_size << "x"
                  << ae.model.image_size << " images, but the data is " << c << "x" << h << "x"
                  << data.images.size(3) << " (" << data.description << ")");
  };
  // The model's input: the autoencoder's latents.
  auto set_shape = [&](const RunConfig& ae) {
    const AutoencoderShape s = autoencoder_shape(ae.model);
    DDM_CHECK(m.in_channels == 0 || m.in_channels == s.latent_channels,
              "model.in_channels = " << m.in_channels << " but the latents of " << m.latent << " have "
                                     << s.latent_channels << " channels; remove the key");
    DDM_CHECK(m.image_size == 0 || m.image_size == s.latent_size(),
              "model.image_size = " << m.image_size << " but the latents of " << m.latent << " are "
                                    << s.latent_size() << "x" << s.latent_size() << "; remove the key");
    m.in_channels = s.latent_channels;
    m.image_size = s.latent_size();
  };
  // Latent shards: the autoencoder that encoded them must be this one.
  auto check_encoded = [&](const std::string& sha) {
    if (!data.latents) return;
    DDM_CHECK(sha == data.latents->autoencoder_sha256,
              key << " (sha256 " << sha.substr(0, 12) << ") is not the autoencoder that encoded the latent shards "
                  << data.description << ": their " << kLatentShardsInfo << " names " << data.latents->autoencoder
                  << " (sha256 " << data.latents->autoencoder_sha256.substr(0, 12) << "); set model.latent to that "
                  << "run, or encode the data again with `ddm encode --ae " << m.latent << "`");
  };
  if (is_ckpt && !m.latent_sha256.empty() && m.latent_scale > 0) {
    // Already resolved (a run's own config.toml, e.g. on resume): the pinned checkpoint must still be
    // what it was; the autoencoder run's later checkpoints or reports do not matter.
    m.latent = dir.string();
    const RunConfig ae = autoencoder_config(m.latent, key);
    check_data(ae);
    set_shape(ae);
    LatentSpace::load(m);  // checks the sha256
    check_encoded(m.latent_sha256);
    return;
  }
  // A run directory (with the record), or a checkpoint directory whose run's record measured it.
  const std::string run = is_ckpt ? dir.parent_path().parent_path().string() : dir.string();
  if (!is_ckpt && !fs::exists(RunDir(run) / RunDir::kAutoencoder))  // a diffusers pipeline without its index?
    if (const std::string hint = diffusers_folder_hint(run, "vae"); !hint.empty())
      DDM_FAIL(key << ": neither a `ddm train-autoencoder` run nor diffusers' AutoencoderKL" << hint);
  const AutoencoderRecord rec = read_autoencoder_record(run);
  DDM_CHECK(!is_ckpt || same_dir(dir.string(), rec.checkpoint),
            key << ": " << RunDir(run) / RunDir::kAutoencoder << " measured " << rec.checkpoint
                << ", not this checkpoint; use the run directory " << run);
  const RunConfig ae = autoencoder_config(rec.checkpoint, key);
  const std::string sha = sha256_file(rec.weights);
  DDM_CHECK(sha == rec.weights_sha256, rec.weights << " has sha256 " << sha << ", but "
                                                   << RunDir(run) / RunDir::kAutoencoder << " recorded "
                                                   << rec.weights_sha256 << "; measure it again with `ddm train-autoencoder --config "
                                                   << run << "/config.toml --out " << run << " --resume`");
  DDM_CHECK(m.latent_sha256.empty() || m.latent_sha256 == sha,
            "the frozen autoencoder changed: model.latent_sha256 = " << m.latent_sha256 << ", but " << rec.weights
                                                                    << " now has sha256 " << sha);
  check_data(ae);
  check_encoded(sha);
  set_shape(ae);
  m.latent = rec.checkpoint;
  m.latent_sha256 = sha;
  if (m.latent_scale == 0) {
    m.latent_scale = rec.latent.scale;
    m.latent_shift = rec.latent.shift;
  }
}

std::shared_ptr<const LatentSpace> attach_latent(Objective& objective, const ModelConfig& m, torch::Device device,
                                                 const Dataset* cache, bool posteriors) {
  if (m.latent.empty()) return nullptr;
  auto latent = LatentSpace::load(m, device);
  if (posteriors) {
    objective.set_encoder([latent](const Batch& b, const torch::Tensor& eps) { return latent->sample_posterior(b.x, eps); });
  } else if (cache) {
    auto q = std::make_shared<Posterior>(latent->posteriors(cache->images));  // [N, z, h, w] each
    objective.set_encoder([latent, q](const Batch& b, const torch::Tensor& eps) {
      return latent->encode_cached(*q, b.index, eps);
    });
  } else {
    objective.set_encoder([latent](const Batch& b, const torch::Tensor& eps) { return latent->encode(b.x, eps); });
  }
  return latent;
}

}  // namespace ddm
