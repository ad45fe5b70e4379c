// Feature sources for partitioning (see features.h): PCA of pixels, the evaluation feature network,
// an unsupervised conv autoencoder, and features files (.npy read by hand: no Debian package offers a
// C++ .npy reader, and the format is a short text header before raw little-endian data).
#include "decentral/features.h"

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "eval/feature_net.h"
#include "train/latent.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

constexpr const char* kForms =
    "pixels[:D], feature-net[:FILE], autoencoder[:D], latent:RUN, latent (latent shards) or file:PATH";

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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// .npy: magic "\x93NUMPY", version (1|2|3).x, header length (u16 for v1, u32 after), then a Python
// dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (N, D), }.
torch::Tensor load_npy(const std::string& path) {
  const std::string bytes = read_file(path);
  DDM_CHECK(bytes.size() >= 10 && bytes.compare(0, 6, "\x93NUMPY") == 0,
            path << ": not a .npy file (bad magic); save features with numpy.save");
  const int major = static_cast<unsigned char>(bytes[6]);
  DDM_CHECK(major >= 1 && major <= 3, path << ": unsupported .npy version " << major);
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    start = 10;
  } else {
    DDM_CHECK(bytes.size() >= 12, path << ": truncated .npy header");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    start = 12;
  }
  DDM_CHECK(bytes.size() >= start + header_len, path << ": truncated .npy header");
  const std::string header = bytes.substr(start, header_len);
  auto value_of = [&](const std::string& key) -> std::string {
    const size_t k = header.find("'" + key + "'");
    DDM_CHECK(k != std::string::npos, path << ": .npy header lacks '" << key << "': " << header);
    size_t v = header.find(':', k);
    DDM_CHECK(v != std::string::npos, path << ": malformed .npy header: " << header);
    ++v;
    while (v < header.size() && header[v] == ' ') ++v;
    const char open = header[v];
    const char close = open == '(' ? ')' : open == '\'' ? '\'' : ',';
    const size_t end = header.find(close, v + 1);
    DDM_CHECK(end != std::string::npos, path << ": malformed .npy header: " << header);
    return header.substr(open == '(' || open == '\'' ? v + 1 : v, end - (open == '(' || open == '\'' ? v + 1 : v));
  };
  const std::string descr = value_of("descr"), fortran = value_of("fortran_order"), shape = value_of("shape");
  DDM_CHECK(fortran.find("False") != std::string::npos,
            path << ": Fortran-ordered arrays are not supported; save numpy.ascontiguousarray(features)");
  torch::ScalarType dtype;
  size_t elem = 0;
  if (descr == "<f4" || descr == "=f4") {
    dtype = torch::kFloat32, elem = 4;
  } else if (descr == "<f8" || descr == "=f8") {
    dtype = torch::kFloat64, elem = 8;
  } else {
    DDM_FAIL(path << ": .npy dtype '" << descr << "' is not supported; use little-endian float32 or float64");
  }
  std::vector<int64_t> dims;
  size_t pos = 0;
  while (pos < shape.size()) {
    while (pos < shape.size() && (shape[pos] == ' ' || shape[pos] == ',')) ++pos;
    if (pos >= shape.size()) break;
    int64_t d = -1;
    const auto [end, ec] = std::from_chars(shape.data() + pos, shape.data() + shape.size(), d);
    DDM_CHECK(ec == std::errc() && d >= 0,
              path << ": malformed .npy shape (" << shape << "): expected non-negative integers");
    dims.push_back(d);
    pos = static_cast<size_t>(end - shape.data());
  }
  DDM_CHECK(dims.size() == 2, path << ": features must be 2-D [N, D], got shape (" << shape << ")");
  uint64_t need = 0;
  DDM_CHECK(!__builtin_mul_overflow(static_cast<uint64_t>(dims[0]), static_cast<uint64_t>(dims[1]), &need) &&
                !__builtin_mul_overflow(need, static_cast<uint64_t>(elem), &need),
            path << ": .npy shape (" << shape << ") is implausibly large; the file is corrupt");
  DDM_CHECK(bytes.size() - start - header_len == need, path << ": holds " << bytes.size() - start - header_len
                                                               << " data bytes, but shape (" << shape << ") of "
                                                               << descr << " needs " << need << "; the file is truncated");
  auto t = torch::empty({dims[0], dims[1]}, dtype);
  if (need > 0) std::memcpy(t.data_ptr(), bytes.data() + start + header_len, need);
  return t;
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
  if (kind == "feature-net" || kind == "latent") return path.empty() ? kind : kind + ":" + path;
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

torch::Tensor load_features_file(const std::string& path) {
  DDM_CHECK(fs::is_regular_file(path), "features file '" << path << "' does not exist");
  const std::string ext = fs::path(path).extension().string();
  torch::Tensor t;
  if (ext == ".npy") {
    t = load_npy(path);
  } else if (ext == ".safetensors") {
    const SafetensorsFile f = load_safetensors(path);
    if (f.tensors.count("features")) {
      t = f.tensors.at("features");
    } else {
      DDM_CHECK(f.tensors.size() == 1, path << ": holds " << f.tensors.size()
                                            << " tensors; name the features tensor 'features' or store only one");
      t = f.tensors.begin()->second;
    }
    DDM_CHECK(t.dim() == 2, path << ": features must be 2-D [N, D], got " << t.sizes());
    DDM_CHECK(t.is_floating_point(), path << ": features must be floating point, got " << t.scalar_type());
  } else {
    DDM_FAIL("features file '" << path << "': use a .npy or .safetensors file");
  }
  t = t.to(torch::kFloat32).contiguous();
  DDM_CHECK(t.size(0) > 0 && t.size(1) > 0, path << ": features are empty " << t.sizes());
  DDM_CHECK(torch::isfinite(t).all().item<bool>(), path << ": features contain NaN or infinity");
  return t;
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
    out.rows = load_features_file(src.path);
    DDM_CHECK(out.rows.size(0) == n, "features file " << src.path << " has " << out.rows.size(0) << " rows but "
                                                      << data.description
                                                      << " has " << n << " images; it needs one row per image, in "
                                                         "dataset order");
    desc << "file " << src.path << " (" << out.rows.size(1) << "-d)";
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
