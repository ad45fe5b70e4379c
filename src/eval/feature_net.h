// The feature network behind ddm's sample-quality metrics: a small CNN classifier trained on
// Fashion-MNIST by ddm itself (no pretrained Inception weights exist on these machines; the FID
// authors recommend a domain classifier for MNIST-like data). Its penultimate layer (128 dims) is
// the feature space of FD-fmnist, KID and precision/recall; its logits give the per-class accuracy
// of class-conditional samples. A trained network is identified everywhere by the sha256 of its
// safetensors file.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "data/dataset.h"

namespace ddm {

struct FeatureNetShape {
  int64_t in_channels = 1;
  int64_t image_size = 28;  // must be divisible by 4 (two 2x2 poolings)
  int64_t num_classes = 10;
  int64_t feature_dim = 128;
};

// conv(32) conv(32) pool conv(64) conv(64) pool -> linear(feature_dim) -> linear(num_classes);
// 3x3 convolutions with BatchNorm and ReLU; dropout before the last linear while training. Images
// larger than 32 px are average-pooled to 8x8 before the linear layer, so that it stays small
// (64 px: 4096 inputs instead of 16384; the 28 px Fashion-MNIST network is unchanged).
inline constexpr int64_t kMaxPooledSide = 8;
int64_t pooled_side(int64_t image_size);
class FeatureNetImpl : public torch::nn::Module {
 public:
  explicit FeatureNetImpl(const FeatureNetShape& shape);
  // x: float [B, C, S, S] in [-1, 1] -> features [B, feature_dim] (after BatchNorm and ReLU).
  torch::Tensor features(const torch::Tensor& x);
  // x -> logits [B, num_classes].
  torch::Tensor forward(const torch::Tensor& x);
  // features [B, feature_dim] (float32) -> logits [B, num_classes]: the head alone, so a caller
  // that already has features does not run the convolutions twice.
  torch::Tensor logits(const torch::Tensor& features);
  const FeatureNetShape& shape() const { return shape_; }

 private:
  FeatureNetShape shape_;
  torch::nn::Conv2d c1_{nullptr}, c2_{nullptr}, c3_{nullptr}, c4_{nullptr};
  torch::nn::BatchNorm2d b1_{nullptr}, b2_{nullptr}, b3_{nullptr}, b4_{nullptr};
  torch::nn::Linear fc_{nullptr}, head_{nullptr};
  torch::nn::BatchNorm1d bf_{nullptr};
  torch::nn::Dropout drop_{nullptr};
};
TORCH_MODULE(FeatureNet);

struct ClassifierTrainConfig {
  int64_t epochs = 12;
  int64_t batch_size = 128;
  double lr = 2e-3;            // AdamW peak: linear warm-up over the first epoch, then cosine to 0
  double weight_decay = 5e-4;
  int64_t max_shift = 2;       // random translation by up to this many pixels (0 = off)
  bool hflip = true;           // random horizontal flip
  uint64_t seed = 0;
  bool quiet = false;          // no progress output
};

// The self-supervised task for unlabelled data (Gidaris et al., ICLR 2018): every image four times,
// turned by 0, 90, 180 and 270 degrees, labelled by the turn. A classifier of the turn learns features
// of what the images show (which way is up needs the objects), so its penultimate layer serves the
// metrics where no classes exist.
Dataset rotation_dataset(const Dataset& d);

// Trains a classifier on `train` (labels required), deterministically from cfg.seed for a given
// thread count. Progress goes to stdout unless cfg.quiet.
FeatureNet train_classifier(const Dataset& train, const ClassifierTrainConfig& cfg);

// Features [N, feature_dim] (float64) or predicted classes [N] of uint8 images [N, C, S, S] or
// float images in [-1, 1], in eval mode, in batches, computed on the network's device (the images
// may be anywhere; the results are on the host).
torch::Tensor extract_features(FeatureNet& net, const torch::Tensor& images, int64_t batch = 250);
torch::Tensor predict_classes(FeatureNet& net, const torch::Tensor& images, int64_t batch = 250);

// Number of images of `data` classified correctly.
int64_t count_correct(FeatureNet& net, const Dataset& data);

// A warning for a network whose held-out accuracy closed less than a quarter of the way from chance
// (1 / classes) to 100%: its features say little about the images, so metrics in them barely tell
// models apart. Says why for the rotation task (pictures with no up cannot teach it) and what to do.
// "" when the accuracy is clear of that.
std::string feature_net_warning(const std::string& task, double accuracy, int64_t classes);

// A trained network with its file's hash and the metadata written with it.
struct LoadedFeatureNet {
  FeatureNet net{nullptr};
  std::string sha256;                         // of the safetensors file
  std::map<std::string, std::string> metadata;
};

// Saves weights and buffers as safetensors (atomically) with the shape and `metadata`; returns the
// file's sha256.
std::string save_feature_net(const std::string& path, FeatureNet& net,
                             const std::map<std::string, std::string>& metadata);

// Loads a network. If expected_sha256 is non-empty, the file's hash must match it.
LoadedFeatureNet load_feature_net(const std::string& path, const std::string& expected_sha256 = "");

// The feature network shipped in the repository (assets/feature-net/) and its hash.
std::string default_feature_net_path();
inline constexpr const char* kDefaultFeatureNetSha256 =
    "61e01b19145026eeb897f19bb69f40b46ecf18381471997799ac9f8085bf62ee";

}  // namespace ddm
