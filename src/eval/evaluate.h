// Evaluating a set of generated images against real ones with the feature network: FD, KID,
// precision/recall, and for class-conditional samples the feature network's accuracy per requested
// class and, on request, the classification accuracy score (CAS: the test accuracy of a fresh
// classifier trained only on the samples, Ravuri & Vinyals 2019). The real images are Fashion-MNIST's
// test split (with the shipped network), or any dataset (EvalConfig::reference) with a network
// `ddm train-classifier --config` trained on that data. Reference features are cached on disk, keyed
// by the images' and the network's sha256.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "data/dataset.h"
#include "eval/feature_net.h"
#include "eval/metrics.h"

namespace ddm {

struct EvalConfig {
  std::string feature_net;   // "" = the shipped network (its hash is checked)
  std::string cache_dir;     // "" = $XDG_CACHE_HOME/ddm, else ~/.cache/ddm
  std::string data_root;     // Fashion-MNIST directory ("" = the Debian package's)
  int64_t kid_subsets = 100;
  int64_t kid_subset_size = 1000;
  int64_t pr_k = 3;
  uint64_t seed = 0;         // KID subsets and the CAS classifier
  bool cas = false;          // also train a classifier on the (labelled) samples: slow
  int64_t cas_epochs = 5;
  bool quiet = false;
  // Where the feature network runs. Its features agree across devices within float32 rounding, so
  // the cached reference features serve every device.
  torch::Device device = torch::kCPU;
  // The real images to compare with (uint8 [N, C, H, W], labels if it has classes); null: the
  // Fashion-MNIST test split of data_root.
  std::shared_ptr<const Dataset> reference;
};

// Generated (or real) images to evaluate: uint8 [N, C, H, W], or float in [-1, 1]; labels int64 [N]
// (the requested classes) or undefined.
struct SampleSet {
  torch::Tensor images;
  torch::Tensor labels;
  std::string origin;        // for messages and the report
  std::map<std::string, std::string> info;  // e.g. sampler settings, copied into the report's JSON
};

// Reads a safetensors file with `images` (uint8 NCHW/NHWC as in data/tensor_file.h, or float NCHW
// in [-1, 1]) or `samples` (float NCHW in [-1, 1], as `ddm sample --raw` writes) and optional
// `labels`. Errors name the file and say what is wrong. Samples of a model trained on other data
// than Fashion-MNIST (their "data_source") are refused unless any_source (a reference of their own).
SampleSet load_samples(const std::string& path, bool any_source = false);

// The metrics compare against Fashion-MNIST's test split in the space of a network trained on
// Fashion-MNIST, with its class names: samples of a model trained on other data (an origin,
// data/origin.h, other than "fashion-mnist") would get meaningless scores. Throws ddm::Error naming
// `what` for those.
void check_evaluable_source(const std::string& origin, const std::string& what);

// Reference points for the metrics, drawn with a generator seeded by `seed`:
//   "train": n random images (with labels) of the Fashion-MNIST train split, the floor a perfect
//            generator would reach against the test split;
//   "noise": n images of independent per-pixel Gaussian noise with each pixel's mean and variance
//            over the train split (clamped to [-1, 1]; no labels), a ceiling.
SampleSet anchor_samples(const std::string& kind, int64_t n, uint64_t seed, const std::string& data_root = "");
// The same of `data` (another dataset's images: `ddm eval --anchor --reference-config`).
SampleSet anchor_samples(const std::string& kind, int64_t n, uint64_t seed, const Dataset& data);

struct EvalReport {
  std::string origin, feature_net_sha256, reference;
  std::string feature_net_data;        // what `ddm train-classifier` trained it on ("" for the shipped one)
  bool fmnist = true;                  // against Fashion-MNIST's test split (FD-fmnist), else EvalConfig::reference
  int64_t n = 0, reference_n = 0;
  double fd = 0;
  KidResult kid;
  PrecisionRecall pr;
  std::vector<double> class_accuracy;  // per requested class (empty without labels; -1 = no samples)
  std::vector<std::string> class_names;
  double mean_class_accuracy = -1;     // -1 without labels
  double cas = -1;                     // -1 when not computed
  double seconds = 0;                  // features + statistics
  std::map<std::string, std::string> info;
  std::string json() const;            // one JSON object
  std::string table() const;           // human-readable
};

// Validates the images (shape, dtype, range), extracts features and computes every metric.
EvalReport evaluate_samples(const SampleSet& samples, const EvalConfig& cfg);

// The loaded feature network of cfg (shipped one by default, hash-checked).
LoadedFeatureNet load_eval_feature_net(const EvalConfig& cfg);

// What evaluate_samples will refuse, checked before the samples are made (sampling 10000 images takes
// hours): the feature network (present, readable, taking channels x image_size images), a reference
// that needs one, and enough samples (n) and reference images for FD. `what` names the samples.
void check_eval_inputs(const EvalConfig& cfg, int64_t channels, int64_t image_size, int64_t n, const std::string& what);

}  // namespace ddm
