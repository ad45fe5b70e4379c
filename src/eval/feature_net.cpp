// The feature network: model, deterministic training, feature extraction, and its safetensors
// file (see feature_net.h).
#include "eval/feature_net.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include <torch/torch.h>

#include "core/assets.h"
#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "eval/grid.h"

namespace ddm {

namespace nn = torch::nn;

namespace {
nn::Conv2d conv3x3(int64_t in, int64_t out) { return nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(false)); }

// 2x2 max pooling with stride 2 of [B, C, H, W] (H, W even) as two element-wise maxima of strided
// views: the values of torch::max_pool2d(x, 2) exactly (a maximum rounds nothing), in a fifth of its
// time on CPU, whose max_pool2d kernel for this layout is scalar (250 images at 32 x 28 x 28: 5 ms
// against 28 ms). Where two elements of a window are equal, the gradient is shared between them
// rather than sent to the first.
torch::Tensor max_pool_2x2(const torch::Tensor& x) {
  const auto rows = torch::maximum(x.slice(2, 0, x.size(2), 2), x.slice(2, 1, x.size(2), 2));  // [B, C, H/2, W]
  return torch::maximum(rows.slice(3, 0, x.size(3), 2), rows.slice(3, 1, x.size(3), 2));      // [B, C, H/2, W/2]
}
}  // namespace

int64_t pooled_side(int64_t image_size) { return std::min(image_size / 4, kMaxPooledSide); }

Dataset rotation_dataset(const Dataset& d) {
  DDM_CHECK(d.images.dim() == 4 && d.images.size(2) == d.images.size(3),
            d.description << ": rotations need square images, got " << d.images.sizes());
  Dataset r;
  std::vector<torch::Tensor> images, labels;
  for (int64_t k = 0; k < 4; ++k) {
    images.push_back(torch::rot90(d.images, k, {2, 3}).contiguous());  // [N, C, S, S], turned k x 90 degrees
    labels.push_back(torch::full({d.images.size(0)}, k, torch::kLong));
  }
  r.images = torch::cat(images);  // [4N, C, S, S]
  r.labels = torch::cat(labels);  // [4N]
  r.num_classes = 4;
  r.class_names = {"0 deg", "90 deg", "180 deg", "270 deg"};
  r.description = d.description + ", each image turned 0/90/180/270 degrees";
  return r;
}

FeatureNetImpl::FeatureNetImpl(const FeatureNetShape& shape) : shape_(shape) {
  DDM_CHECK(shape.in_channels >= 1 && shape.image_size >= 4 && shape.image_size % 4 == 0,
            "feature network: needs image_size divisible by 4 and >= 1 channel, got " << shape.in_channels << "x"
                                                                                       << shape.image_size);
  DDM_CHECK(shape.num_classes >= 2 && shape.feature_dim >= 1,
            "feature network: needs >= 2 classes and feature_dim >= 1, got " << shape.num_classes << " and "
                                                                              << shape.feature_dim);
  c1_ = register_module("c1", conv3x3(shape.in_channels, 32));
  b1_ = register_module("b1", nn::BatchNorm2d(32));
  c2_ = register_module("c2", conv3x3(32, 32));
  b2_ = register_module("b2", nn::BatchNorm2d(32));
  c3_ = register_module("c3", conv3x3(32, 64));
  b3_ = register_module("b3", nn::BatchNorm2d(64));
  c4_ = register_module("c4", conv3x3(64, 64));
  b4_ = register_module("b4", nn::BatchNorm2d(64));
  const int64_t flat = 64 * pooled_side(shape.image_size) * pooled_side(shape.image_size);
  fc_ = register_module("fc", nn::Linear(nn::LinearOptions(flat, shape.feature_dim).bias(false)));
  bf_ = register_module("bf", nn::BatchNorm1d(shape.feature_dim));
  drop_ = register_module("drop", nn::Dropout(0.3));
  head_ = register_module("head", nn::Linear(shape.feature_dim, shape.num_classes));
}

torch::Tensor FeatureNetImpl::features(const torch::Tensor& x) {
  DDM_CHECK(x.dim() == 4 && x.size(1) == shape_.in_channels && x.size(2) == shape_.image_size &&
                x.size(3) == shape_.image_size,
            "feature network: expected images [B, " << shape_.in_channels << ", " << shape_.image_size << ", "
                                                    << shape_.image_size << "], got " << x.sizes());
  auto h = torch::relu(b1_(c1_(x)));                     // [B, 32, S, S]
  h = torch::relu(max_pool_2x2(b2_(c2_(h))));            // [B, 32, S/2, S/2] (ReLU after the pool: the same values)
  h = torch::relu(b3_(c3_(h)));                          // [B, 64, S/2, S/2]
  h = torch::relu(max_pool_2x2(b4_(c4_(h))));            // [B, 64, S/4, S/4]
  if (h.size(2) > kMaxPooledSide) h = torch::adaptive_avg_pool2d(h, {kMaxPooledSide, kMaxPooledSide});  // [B, 64, 8, 8]
  return torch::relu(bf_(fc_(h.flatten(1))));            // [B, feature_dim]
}

torch::Tensor FeatureNetImpl::forward(const torch::Tensor& x) {
  return logits(features(x));  // [B, num_classes]
}

torch::Tensor FeatureNetImpl::logits(const torch::Tensor& features) {
  return head_(drop_(features));  // [B, feature_dim] -> [B, num_classes]
}

namespace {

// uint8 images -> float in [-1, 1]; float images are checked for range.
torch::Tensor as_unit_range(const torch::Tensor& images) {
  if (images.scalar_type() == torch::kUInt8) return to_unit_range(images);
  DDM_CHECK(images.is_floating_point(), "feature network: images must be uint8 or float, got " << images.scalar_type());
  return images.to(torch::kFloat32);
}

// Random translation by up to s pixels per image (zero = background -1 padding), from gen.
torch::Tensor random_shift(const torch::Tensor& x, int64_t s, at::Generator& gen) {
  const int64_t B = x.size(0), S = x.size(2);
  auto padded = torch::constant_pad_nd(x, {s, s, s, s}, -1.0);  // [B, C, S + 2s, S + 2s]
  auto offs = torch::randint(0, 2 * s + 1, {B, 2}, gen, torch::kLong);
  auto out = torch::empty_like(x);
  const auto* o = offs.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i)
    out[i].copy_(padded[i].narrow(1, o[2 * i], S).narrow(2, o[2 * i + 1], S));
  return out;
}

}  // namespace

FeatureNet train_classifier(const Dataset& train, const ClassifierTrainConfig& cfg) {
  DDM_CHECK(train.num_classes >= 2, "train-classifier: the training data needs class labels (" << train.description
                                                                                               << ")");
  DDM_CHECK(cfg.epochs >= 1 && cfg.batch_size >= 1 && cfg.lr > 0 && cfg.weight_decay >= 0 && cfg.max_shift >= 0,
            "train-classifier: epochs and batch size must be >= 1, lr > 0, weight decay and shift >= 0");
  const int64_t N = train.images.size(0);
  DDM_INPUT_CHECK(N >= cfg.batch_size, "train-classifier: " << N << " training images is fewer than one batch of "
                                                      << cfg.batch_size << ": give a smaller --batch (at most " << N
                                                      << "), or more images");
  FeatureNetShape shape;
  shape.in_channels = train.images.size(1);
  shape.image_size = train.images.size(2);
  shape.num_classes = train.num_classes;
  torch::manual_seed(derive_seed({cfg.seed, static_cast<uint64_t>(RngPurpose::kInit)}));
  FeatureNet net(shape);
  net->train();
  std::vector<torch::Tensor> decay, no_decay;  // weight decay on conv and linear weights only
  for (auto& p : net->named_parameters()) {
    const bool matrix = p.value().dim() >= 2;
    (matrix ? decay : no_decay).push_back(p.value());
  }
  torch::optim::AdamW opt({torch::optim::OptimizerParamGroup(decay), torch::optim::OptimizerParamGroup(no_decay)},
                          torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay));
  static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[1].options()).weight_decay(0.0);

  const int64_t per_epoch = N / cfg.batch_size, total = per_epoch * cfg.epochs;
  BatchLoader loader(train, cfg.batch_size, cfg.seed, cfg.hflip);
  auto shift_gen = make_generator(derive_seed({cfg.seed, 0x5817f7ULL}));
  Progress progress(0, total, cfg.quiet);
  for (int64_t step = 0; step < total; ++step) {
    const double warm = static_cast<double>(step + 1) / static_cast<double>(per_epoch);
    const double cosine = 0.5 * (1.0 + std::cos(M_PI * static_cast<double>(step) / static_cast<double>(total)));
    const double lr = cfg.lr * std::min(warm, 1.0) * cosine;
    for (auto& group : opt.param_groups()) group.options().set_lr(lr);
    Batch b = loader.next();
    auto x = cfg.max_shift > 0 ? random_shift(b.x, cfg.max_shift, shift_gen) : b.x;  // [B, C, S, S]
    auto loss = torch::cross_entropy_loss(net->forward(x), b.y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    const double l = loss.item<double>();
    DDM_CHECK(std::isfinite(l), "train-classifier: non-finite loss at step " << step << "; lower the learning rate");
    progress.step(step + 1, l, lr, 0.0, cfg.batch_size);
    if (!cfg.quiet && (step + 1) % per_epoch == 0) {  // one plain line per epoch
      std::printf("%sepoch %lld/%lld  loss %.4f  %.0f img/s  ETA %s\n", progress.tty() ? "\n" : "",
                  static_cast<long long>((step + 1) / per_epoch), static_cast<long long>(cfg.epochs),
                  progress.interval_loss(), progress.interval_img_per_s(),
                  format_duration(progress.eta_seconds(step + 1)).c_str());
      std::fflush(stdout);
      progress.reset_interval();
    }
  }
  progress.finish();
  net->eval();
  return net;
}

namespace {
torch::Device device_of(FeatureNet& net) {
  const auto params = net->parameters();
  return params.empty() ? torch::Device(torch::kCPU) : params.front().device();
}
}  // namespace

torch::Tensor extract_features(FeatureNet& net, const torch::Tensor& images, int64_t batch) {
  torch::NoGradGuard ng;
  net->eval();
  const torch::Device dev = device_of(net);  // each batch goes there; the features come back
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < images.size(0); i += batch)
    out.push_back(net->features(as_unit_range(images.narrow(0, i, std::min(batch, images.size(0) - i)).to(dev)))
                      .to(torch::kCPU, torch::kFloat64));
  DDM_CHECK(!out.empty(), "feature network: no images to extract features from");
  return torch::cat(out);  // [N, feature_dim]
}

torch::Tensor predict_classes(FeatureNet& net, const torch::Tensor& images, int64_t batch) {
  torch::NoGradGuard ng;
  net->eval();
  std::vector<torch::Tensor> out;
  const torch::Device dev = device_of(net);
  for (int64_t i = 0; i < images.size(0); i += batch)
    out.push_back(
        net->forward(as_unit_range(images.narrow(0, i, std::min(batch, images.size(0) - i)).to(dev))).argmax(1).cpu());
  DDM_CHECK(!out.empty(), "feature network: no images to classify");
  return torch::cat(out);  // [N]
}

std::string feature_net_warning(const std::string& task, double accuracy, int64_t classes) {
  if (classes < 2) return "";
  const double chance = 1.0 / static_cast<double>(classes);
  if (accuracy >= chance + (1.0 - chance) / 4) return "";
  std::string w = "warning: a held-out accuracy of " + format_number("%.1f", 100 * accuracy) + "% is close to chance (" +
                  format_number("%.1f", 100 * chance) + "% for " + std::to_string(classes) +
                  (task == "rotation" ? " turns" : " classes") +
                  "): the network learned little about these images, and FD, KID and precision/recall in its "
                  "features will barely tell models apart. ";
  if (task == "rotation")
    return w + "Pictures with no up and down (textures, aerial or microscope images, objects at any angle) cannot "
               "teach which way they were turned: label them (a .cls file beside each picture, docs/own-data.md) "
               "and train on the labels instead.";
  return w + "Train longer (--epochs), or check that the labels match the pictures.";
}

int64_t count_correct(FeatureNet& net, const Dataset& data) {
  return predict_classes(net, data.images).eq(data.labels).sum().item<int64_t>();
}

namespace {
const char* kShapeKeys[] = {"in_channels", "image_size", "num_classes", "feature_dim"};
int64_t* shape_field(FeatureNetShape& s, int i) {
  int64_t* f[] = {&s.in_channels, &s.image_size, &s.num_classes, &s.feature_dim};
  return f[i];
}
}  // namespace

std::string save_feature_net(const std::string& path, FeatureNet& net,
                             const std::map<std::string, std::string>& metadata) {
  SafetensorsFile f;
  for (auto& p : net->named_parameters()) f.tensors[p.key()] = p.value().detach();
  for (auto& b : net->named_buffers()) f.tensors[b.key()] = b.value().detach();
  f.metadata = metadata;
  f.metadata["format"] = "ddm-feature-net-1";
  FeatureNetShape shape = net->shape();
  for (int i = 0; i < 4; ++i) f.metadata[kShapeKeys[i]] = std::to_string(*shape_field(shape, i));
  const std::string bytes = safetensors_bytes(f);
  write_file_atomic(path, bytes);
  return sha256_hex(bytes);
}

LoadedFeatureNet load_feature_net(const std::string& path, const std::string& expected_sha256) {
  const std::string bytes = read_file(path);
  LoadedFeatureNet out;
  out.sha256 = sha256_hex(bytes);
  DDM_CHECK(expected_sha256.empty() || out.sha256 == expected_sha256,
            path << ": feature network hash mismatch (sha256 " << out.sha256 << ", expected " << expected_sha256
                 << "); metrics are only comparable with the same network. Restore the file (git checkout) or "
                    "pass the network you mean with --feature-net");
  SafetensorsFile f = parse_safetensors(bytes, path);
  DDM_CHECK(f.metadata.count("format") && f.metadata["format"] == "ddm-feature-net-1",
            path << ": not a ddm feature network (metadata \"format\" is not ddm-feature-net-1)");
  FeatureNetShape shape;
  for (int i = 0; i < 4; ++i) {
    DDM_CHECK(f.metadata.count(kShapeKeys[i]), path << ": metadata lacks \"" << kShapeKeys[i] << "\"");
    try {
      *shape_field(shape, i) = std::stoll(f.metadata[kShapeKeys[i]]);
    } catch (const std::exception&) {
      DDM_FAIL(path << ": metadata \"" << kShapeKeys[i] << "\" is not an integer: " << f.metadata[kShapeKeys[i]]);
    }
  }
  out.net = FeatureNet(shape);
  torch::NoGradGuard ng;
  auto assign = [&](const std::string& name, torch::Tensor& dst) {
    auto it = f.tensors.find(name);
    DDM_CHECK(it != f.tensors.end(), path << ": missing tensor \"" << name << "\"");
    DDM_CHECK(it->second.sizes() == dst.sizes() && it->second.scalar_type() == dst.scalar_type(),
              path << ": tensor \"" << name << "\" is " << it->second.scalar_type() << " " << it->second.sizes()
                   << ", expected " << dst.scalar_type() << " " << dst.sizes());
    dst.copy_(it->second);
  };
  for (auto& p : out.net->named_parameters()) assign(p.key(), p.value());
  for (auto& b : out.net->named_buffers()) assign(b.key(), b.value());
  out.net->eval();
  out.metadata = std::move(f.metadata);
  return out;
}

std::string default_feature_net_path() { return asset_path("feature-net/fmnist-cnn.safetensors"); }

}  // namespace ddm
