// Image-embedding conditioning's frozen network (see embed.h).
#include "train/embed.h"

#include <cmath>
#include <filesystem>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ddm {

std::shared_ptr<const ImageEmbedder> ImageEmbedder::load(const ModelConfig& m, torch::Device device) {
  DDM_CHECK(!m.embed.empty() && !m.embed_sha256.empty(),
            "model.embed = " << m.embed << " is not resolved (model.embed_sha256 unset)");
  DDM_CHECK(fs::is_regular_file(m.embed), "model.embed = " << m.embed << ": the frozen embedding network does not "
                                                           "exist (moved or deleted?); restore it (the model is tied "
                                                           "to its own)");
  const std::string sha = sha256_file(m.embed);
  DDM_CHECK(sha == m.embed_sha256, "the frozen embedding network changed: " << m.embed << " has sha256 " << sha
                                                                           << ", but this model was trained on "
                                                                              "model.embed_sha256 = "
                                                                           << m.embed_sha256
                                                                           << "; restore it (the model is tied to its own)");
  const LoadedFeatureNet loaded = load_feature_net(m.embed, sha);
  auto out = std::make_shared<ImageEmbedder>();
  out->net_ = loaded.net;
  out->net_->eval();
  for (auto& p : out->net_->parameters()) p.set_requires_grad(false);
  out->net_->to(device);
  out->dim_ = loaded.net->shape().feature_dim;
  out->path_ = m.embed;
  DDM_CHECK(m.embed_dim == 0 || m.embed_dim == out->dim_,
            "model.embed_dim = " << m.embed_dim << " but " << m.embed << " gives " << out->dim_ << "-dim features");
  return out;
}

torch::Tensor ImageEmbedder::embed(const torch::Tensor& images) const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < images.size(0); i += 1000) {
    torch::Tensor x = images.slice(0, i, i + 1000).to(net_->parameters().front().device());
    x = x.scalar_type() == torch::kUInt8 ? to_unit_range(x) : x.to(torch::kFloat);  // [b, C, H, W]
    const auto f = net_->features(x);                                               // [b, D]
    out.push_back((torch::nn::functional::normalize(f, torch::nn::functional::NormalizeFuncOptions().dim(1)) *
                   std::sqrt(static_cast<double>(dim_)))
                      .to(images.device()));  // [b, D], norm sqrt(D)
  }
  return torch::cat(out);  // [N, D]
}

void resolve_embed(ModelConfig& m, const Dataset& data) {
  const std::string key = "model.embed = " + m.embed;
  std::string path = m.embed == "feature-net" ? default_feature_net_path() : m.embed;
  DDM_CHECK(fs::is_regular_file(path), key << ": no such file; use \"feature-net\" (the shipped network) or a `ddm "
                                              "train-classifier` file");
  path = fs::absolute(path).lexically_normal().string();
  LoadedFeatureNet net;
  try {
    net = load_feature_net(path);
  } catch (const Error& e) {
    DDM_FAIL(key << ": " << e.what());
  }
  DDM_CHECK(m.embed_sha256.empty() || m.embed_sha256 == net.sha256,
            "the frozen embedding network changed: " << path << " has sha256 " << net.sha256 << ", but model.embed_sha256 = "
                                                     << m.embed_sha256 << "; restore it (the model is tied to its own)");
  const FeatureNetShape& s = net.net->shape();
  DDM_CHECK(m.embed_dim == 0 || m.embed_dim == s.feature_dim,
            "model.embed_dim = " << m.embed_dim << " but " << path << " gives " << s.feature_dim
                                 << "-dim features; remove the key");
  DDM_CHECK(s.in_channels == data.images.size(1) && s.image_size == data.images.size(2),
            key << ": the network takes " << s.in_channels << "x" << s.image_size << "x" << s.image_size
                << " images, but the data is " << data.images.size(1) << "x" << data.images.size(2) << "x"
                << data.images.size(3) << " (" << data.description << ")");
  m.embed = path;
  m.embed_sha256 = net.sha256;
  m.embed_dim = s.feature_dim;
}

std::shared_ptr<const ImageEmbedder> attach_embed(Objective& objective, const ModelConfig& m, torch::Device device) {
  if (m.embed.empty()) return nullptr;
  auto e = ImageEmbedder::load(m, device);
  objective.set_embedder([e](const torch::Tensor& x) { return e->embed(x); });
  return e;
}

double embed_similarity(const ImageEmbedder& e, const torch::Tensor& samples, const torch::Tensor& references) {
  const auto a = e.embed(samples), b = e.embed(references);  // [N, D] each, norm sqrt(D)
  return ((a * b).sum(1) / static_cast<double>(e.dim())).mean().item<double>();
}

}  // namespace ddm
