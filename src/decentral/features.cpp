// Feature sources for partitioning (see features.h): PCA of pixels, the evaluation feature network,
// an unsupervised conv autoencoder, and features files (decentral/features_file.h).
#include "decentral/features.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <torch/torch.h>

#include "core/error.h"
#include "core/input_check.h"
#include "core/progress.h"
#include "core/rng.h"
#include "decentral/features_file.h"
#include "eval/feature_net.h"
#include "text/encoder.h"
#include "train/latent.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

constexpr const char* kForms =
    "pixels[:D], feature-net[:FILE], autoencoder[:D], latent:RUN, latent (latent shards), file:PATH or "
    "text[:ENCODER]";

int64_t parse_dim(const std::string& spec, const std::string& value) {
  int64_t d = 0;
  size_t used = 0;
  try {
    d = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DDM_CHECK(used == value.size() && d >= 1, "--features " << spec << ": '" << value
                                                          << "' is not a positive dimension; use " << kForms);
  return d;
}

// A small conv autoencoder (encoder: two stride-2 convs and a linear bottleneck; decoder mirrors it)
// trained on the images alone with an MSE loss, for label-free features.
struct AutoencoderImpl : torch::nn::Module {
  AutoencoderImpl(int64_t channels, int64_t size, int64_t dim) : s4(size / 4) {
    namespace nn = torch::nn;
    e1 = register_module("e1", nn::Conv2d(nn::Conv2dOptions(channels, 32, 3).stride(2).padding(1)));
    e2 = register_module("e2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).stride(2).padding(1)));
    ef = register_module("ef", nn::Linear(64 * s4 * s4, dim));
    df = register_module("df", nn::Linear(dim, 64 * s4 * s4));
    d1 = register_module("d1", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(64, 32, 4).stride(2).padding(1)));
    d2 = register_module("d2", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(32, channels, 4).stride(2).padding(1)));
  }
  torch::Tensor encode(const torch::Tensor& x) {
    auto h = torch::silu(e1(x));             // [B, 32, S/2, S/2]
    h = torch::silu(e2(h));                  // [B, 64, S/4, S/4]
    return ef(h.flatten(1));                 // [B, dim]
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::silu(df(encode(x)));     // [B, 64 * S/4 * S/4]
    h = torch::silu(d1(h.view({-1, 64, s4, s4})));  // [B, 32, S/2, S/2]
    return torch::tanh(d2(h));               // [B, C, S, S]
  }
  int64_t s4;
  torch::nn::Conv2d e1{nullptr}, e2{nullptr};
  torch::nn::Linear ef{nullptr}, df{nullptr};
  torch::nn::ConvTranspose2d d1{nullptr}, d2{nullptr};
};
TORCH_MODULE(Autoencoder);

torch::Tensor autoencoder_features(const Dataset& data, int64_t dim, uint64_t seed, bool quiet, double* final_mse) {
  const int64_t n = data.images.size(0), c = data.images.size(1), s = data.images.size(2);
  DDM_CHECK(s % 4 == 0 && data.images.size(3) == s,
            "--features autoencoder needs square images with a size divisible by 4, got " << data.images.sizes());
  constexpr int64_t kEpochs = 3, kBatch = 256;
  torch::manual_seed(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kInit), 0xae}));
  Autoencoder ae(c, s, dim);
  torch::optim::AdamW opt(ae->parameters(), torch::optim::AdamWOptions(2e-3).weight_decay(0));
  const int64_t per_epoch = std::max<int64_t>(1, n / kBatch), total = per_epoch * kEpochs;
  BatchLoader loader(data, std::min(kBatch, n), derive_seed({seed, 0xae0ULL}), /*hflip=*/false);
  double recent = 0;
  for (int64_t step = 0; step < total; ++step) {
    const double lr = 2e-3 * 0.5 * (1.0 + std::cos(M_PI * static_cast<double>(step) / static_cast<double>(total)));
    for (auto& g : opt.param_groups()) g.options().set_lr(lr);
    const auto x = loader.next().x;  // [B, C, S, S] in [-1, 1]
    auto loss = torch::mse_loss(ae->forward(x), x);
    opt.zero_grad();
    loss.backward();
    opt.step();
    recent = loss.item<double>();
    if (!quiet && ((step + 1) % per_epoch == 0)) {
      std::printf("  autoencoder epoch %lld/%lld  mse %.4f\n", static_cast<long long>((step + 1) / per_epoch),
                  static_cast<long long>(kEpochs), recent);
      std::fflush(stdout);
    }
  }
  if (final_mse) *final_mse = recent;
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < n; i += 1000)
    out.push_back(ae->encode(to_unit_range(data.images.narrow(0, i, std::min<int64_t>(1000, n - i)))));
  return torch::cat(out);  // [N, dim]
}

}  // namespace

std::string FeatureSource::spec() const {
  if (kind == "file") return kind + ":" + path;
  if (kind == "feature-net" || kind == "latent" || kind == "text") return path.empty() ? kind : kind + ":" + path;
  return kind + ":" + std::to_string(dim);
}

FeatureSource parse_feature_source(const std::string& spec) {
  FeatureSource f;
  const size_t colon = spec.find(':');
  f.kind = spec.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : spec.substr(colon + 1);
  if (f.kind == "pixels" || f.kind == "autoencoder") {
    f.dim = arg.empty() ? (f.kind == "pixels" ? 64 : 32) : parse_dim(spec, arg);
  } else if (f.kind == "feature-net") {
    f.path = arg;
  } else if (f.kind == "file") {
    DDM_CHECK(!arg.empty(), "--features file: needs a path, e.g. file:dino.npy");
    f.path = arg;
  } else if (f.kind == "latent") {
    f.path = arg;  // empty: latent shards' own posteriors (checked where the data is known)
    f.dim = 64;
  } else if (f.kind == "text") {
    f.path = arg;  // empty: the config's model.text_encoder (filled in where the config is read)
  } else {
    DDM_FAIL("--features '" << spec << "' is not a feature source; use " << kForms);
  }
  return f;
}

StreamingPca::StreamingPca(int64_t features) : f_(features) {
  DDM_CHECK(features >= 1, "PCA: rows need at least one feature");
  sum_ = torch::zeros({f_}, torch::kFloat64);
  cov_ = torch::zeros({f_, f_}, torch::kFloat64);
}

void StreamingPca::add_mean(const torch::Tensor& block) {
  DDM_CHECK(block.dim() == 2 && block.size(1) == f_, "PCA: expected rows [n, " << f_ << "], got " << block.sizes());
  sum_ += block.to(torch::kFloat64).sum(0);
  n_mean_ += block.size(0);
}

void StreamingPca::add_covariance(const torch::Tensor& block) {
  DDM_CHECK(block.dim() == 2 && block.size(1) == f_, "PCA: expected rows [n, " << f_ << "], got " << block.sizes());
  if (!mean32_.defined()) {
    DDM_CHECK(n_mean_ >= 2, "PCA: needs at least 2 rows, got " << n_mean_);
    mean32_ = (sum_ / static_cast<double>(n_mean_)).to(torch::kFloat32);
  }
  const auto xc = block.to(torch::kFloat32) - mean32_;  // float32 products per block, float64 sums across
  cov_ += xc.t().mm(xc).to(torch::kFloat64);
  n_cov_ += block.size(0);
}

void StreamingPca::finish(int64_t dim) {
  DDM_CHECK(n_cov_ == n_mean_ && n_cov_ >= 2,
            "PCA: the covariance saw " << n_cov_ << " rows, the mean " << n_mean_ << "; both need the same >= 2 rows");
  DDM_CHECK(dim >= 1 && dim <= f_, "PCA: cannot keep " << dim << " components of " << f_ << "-d rows; use 1.." << f_);
  const auto cov = cov_ / static_cast<double>(n_cov_ - 1);
  auto [ev, vecs] = torch::linalg_eigh(cov, "L");     // ascending
  auto top = vecs.narrow(1, f_ - dim, dim).flip({1});  // [F, dim], descending variance
  const auto pivot = top.abs().argmax(0);              // sign: largest-magnitude entry positive
  const auto signs = top.gather(0, pivot.unsqueeze(0)).sign().clamp_min(0) * 2 - 1;
  top_ = (top * signs).to(torch::kFloat32);
  explained_ = ev.narrow(0, f_ - dim, dim).sum().item<double>() / ev.clamp_min(0).sum().item<double>();
}

torch::Tensor StreamingPca::project(const torch::Tensor& rows) const {
  DDM_CHECK(top_.defined(), "PCA: project before finish");
  return (rows.to(torch::kFloat32) - mean32_).mm(top_);  // [n, dim]
}

torch::Tensor pca_project(const torch::Tensor& x_in, int64_t dim, double* explained) {
  DDM_CHECK(x_in.dim() == 2 && x_in.size(0) >= 2, "PCA: expected rows [N >= 2, F], got " << x_in.sizes());
  const int64_t n = x_in.size(0), f = x_in.size(1);
  DDM_CHECK(dim >= 1 && dim <= f, "PCA: cannot keep " << dim << " components of " << f << "-d rows; use 1.." << f);
  const auto x = x_in.to(torch::kFloat32).contiguous();
  StreamingPca pca(f);
  const auto block = [&](int64_t i) { return x.narrow(0, i, std::min(StreamingPca::kBlock, n - i)); };
  for (int64_t i = 0; i < n; i += StreamingPca::kBlock) pca.add_mean(block(i));
  for (int64_t i = 0; i < n; i += StreamingPca::kBlock) pca.add_covariance(block(i));
  pca.finish(dim);
  if (explained) *explained = pca.explained();
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < n; i += StreamingPca::kBlock) out.push_back(pca.project(block(i)));
  return torch::cat(out);  // [N, dim]
}

torch::Tensor caption_rows(const std::string& encoder, const std::vector<std::string>& captions,
                           const std::function<std::string(size_t)>& what, bool quiet, torch::Device device,
                           std::string* description) {
  DDM_INPUT_CHECK(!encoder.empty(), "--features text: name the text encoder, text:DIR, or set model.text_encoder in --config");
  auto enc = as_input_error([&] { return text::load_text_encoder(encoder); });
  enc->to(device);
  torch::NoGradGuard no_grad;
  const size_t n = captions.size();
  if (!quiet) std::cout << "  encoding " << n << " captions with " << enc->describe() << std::endl;
  constexpr size_t kBatch = 256;
  std::vector<torch::Tensor> rows;
  auto last = std::chrono::steady_clock::now();
  for (size_t i = 0; i < n; i += kBatch) {
    std::vector<std::string> batch, names;
    for (size_t k = i; k < std::min(n, i + kBatch); ++k) {
      batch.push_back(captions[k]);
      names.push_back(what(k));
    }
    rows.push_back(enc->encode(batch, names).pooled.to(torch::kCPU, torch::kFloat32));  // [b, P]
    if (!quiet && seconds_since(last) >= 10) {
      std::printf("  captions: %zu/%zu\n", std::min(n, i + kBatch), n);
      std::fflush(stdout);
      last = std::chrono::steady_clock::now();
    }
  }
  auto out = torch::cat(rows);  // [N, P]
  if (description) {
    std::ostringstream d;
    d << "captions' pooled embeddings by " << enc->describe() << " (" << out.size(1) << "-d)";
    *description = d.str();
  }
  return out;
}

Features compute_features(const Dataset& data, const FeatureSource& src, uint64_t seed, bool quiet,
                          torch::Device device) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = data.images.size(0);
  Features out;
  std::ostringstream desc;
  if (src.kind == "pixels") {
    const auto flat = to_unit_range(data.images).flatten(1);  // [N, C*H*W]
    double kept = 0;
    out.rows = pca_project(flat, std::min(src.dim, flat.size(1)), &kept);
    desc << "pixels PCA " << out.rows.size(1) << " of " << flat.size(1) << " (" << std::fixed << std::setprecision(1)
         << 100 * kept << "% of the variance)";
  } else if (src.kind == "feature-net") {
    const std::string path = src.path.empty() ? default_feature_net_path() : src.path;
    auto fnet = load_feature_net(path, src.path.empty() ? kDefaultFeatureNetSha256 : "");
    DDM_CHECK(fnet.net->shape().in_channels == data.images.size(1) && fnet.net->shape().image_size == data.images.size(2),
              "--features feature-net: the network at " << path << " takes " << fnet.net->shape().in_channels << "x"
                                                        << fnet.net->shape().image_size << " images, the data is "
                                                        << data.images.sizes());
    fnet.net->to(device);
    if (!quiet) std::cout << "  feature network " << fnet.sha256.substr(0, 12) << " on " << n << " images" << std::endl;
    out.rows = extract_features(fnet.net, data.images).to(torch::kFloat32);
    desc << "feature network " << fnet.sha256.substr(0, 12) << " (" << out.rows.size(1) << "-d)";
  } else if (src.kind == "autoencoder") {
    double mse = 0;
    out.rows = autoencoder_features(data, src.dim, seed, quiet, &mse);
    desc << "autoencoder " << src.dim << "-d (3 epochs, reconstruction mse " << std::setprecision(3) << mse << ")";
  } else if (src.kind == "latent") {
    // The latents a latent model learns (the posterior means, normalized), projected on their top
    // principal components as pixels are: clusters in the space the experts will train in.
    DDM_CHECK(!src.path.empty(), "--features latent: needs a `ddm train-autoencoder` run, e.g. latent:runs/ae ("
                                 "`latent` alone is for latent shards, which hold their own)");
    ModelConfig m;
    m.latent = src.path;
    resolve_latent(m, data);
    const auto latent = LatentSpace::load(m, device);
    if (!quiet) std::cout << "  encoding " << n << " images with the autoencoder " << m.latent << std::endl;
    const auto flat = latent->encode_mean(data.images).flatten(1);  // [N, z*h*w]
    double kept = 0;
    out.rows = pca_project(flat, std::min(src.dim, flat.size(1)), &kept);
    desc << "latents of " << m.latent << " (sha256 " << m.latent_sha256.substr(0, 12) << "), PCA " << out.rows.size(1)
         << " of " << flat.size(1) << " (" << std::fixed << std::setprecision(1) << 100 * kept << "% of the variance)";
  } else if (src.kind == "file") {
    const FeaturesFile file = read_features_file(src.path);
    DDM_CHECK(file.keys.empty(), src.path << ": its rows are matched to samples by key, which only sharded data have "
                                          "(data.source = shards or latents); for " << data.description << ", give "
                                          "one row per image in dataset order (an .npy, or an .npz without keys)");
    out.rows = file.rows;
    DDM_CHECK(out.rows.size(0) == n, "features file " << src.path << " has " << out.rows.size(0) << " rows but "
                                                      << data.description
                                                      << " has " << n << " images; it needs one row per image, in "
                                                         "dataset order");
    desc << "file " << src.path << " (" << out.rows.size(1) << "-d)";
  } else if (src.kind == "text") {
    DDM_INPUT_CHECK(static_cast<int64_t>(data.captions.size()) == n,
              "--features text: " << data.description << " has no captions (a .txt beside each image, or a "
                                  << "captions.jsonl: docs/data.md); partition it by its images instead (pixels, "
                                  << "feature-net, latent:RUN) or by your own rows (file:PATH)");
    std::string d;
    out.rows = caption_rows(src.path, data.captions, [](size_t i) { return "the caption of image " + std::to_string(i); }, quiet,
                            device, &d);
    desc << d;
  } else {
    DDM_FAIL("unknown feature source '" << src.kind << "'");
  }
  out.description = desc.str();
  if (!quiet)
    std::printf("features: %s, %lld x %lld in %.1f s\n", out.description.c_str(), static_cast<long long>(n),
                static_cast<long long>(out.rows.size(1)), seconds_since(t0));
  return out;
}

}  // namespace ddm
