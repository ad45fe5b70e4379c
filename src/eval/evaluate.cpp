// Sample evaluation against real images (see evaluate.h).
#include "eval/evaluate.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "data/dataset.h"
#include "data/tensor_file.h"

namespace fs = std::filesystem;

namespace ddm {

namespace {

// Checks images (shape, dtype, range) and labels against the feature network's input.
void check_images(const SampleSet& s, const FeatureNetShape& shape) {
  const auto& x = s.images;
  DDM_CHECK(x.defined() && x.dim() == 4, s.origin << ": images must be a rank-4 tensor [N, C, H, W], got "
                                                  << (x.defined() ? x.sizes() : at::IntArrayRef{}));
  DDM_CHECK(x.size(1) == shape.in_channels && x.size(2) == shape.image_size && x.size(3) == shape.image_size,
            s.origin << ": images are " << x.sizes() << " but the feature network takes [N, " << shape.in_channels
                     << ", " << shape.image_size << ", " << shape.image_size << "]: give the network trained on this "
                     << "data (--feature-net; `ddm train-classifier --config` makes one)");
  DDM_CHECK(x.size(0) > 0, s.origin << ": no images");
  const auto t = x.scalar_type();
  DDM_CHECK(t == torch::kUInt8 || t == torch::kFloat32 || t == torch::kFloat64,
            s.origin << ": images must be uint8 (0..255) or float32/float64 in [-1, 1], got " << t);
  if (t != torch::kUInt8) {
    DDM_CHECK(torch::isfinite(x).all().item<bool>(), s.origin << ": images contain NaN or infinity");
    const double lo = x.min().item<double>(), hi = x.max().item<double>();
    DDM_CHECK(lo >= -1.001 && hi <= 1.001, s.origin << ": float images must lie in [-1, 1], got values in [" << lo
                                                    << ", " << hi << "]; scale them (x / 127.5 - 1 for 0..255 "
                                                                     "pixels) or store them as uint8");
  }
  if (s.labels.defined()) {
    DDM_CHECK(s.labels.dim() == 1 && s.labels.size(0) == x.size(0),
              s.origin << ": labels must be [N] with N = " << x.size(0) << ", got " << s.labels.sizes());
    const auto lmin = s.labels.min().item<int64_t>(), lmax = s.labels.max().item<int64_t>();
    DDM_CHECK(lmin >= 0 && lmax < shape.num_classes, s.origin << ": labels must be classes 0.." << shape.num_classes - 1
                                                              << " of the feature network, got " << lmin << ".."
                                                              << lmax);
  }
}

struct Reference {
  torch::Tensor features;  // float64 [N, D]
  std::string description;
  std::vector<std::string> class_names;
  bool labelled = false;
};

// The real images: EvalConfig::reference, else Fashion-MNIST's test split.
Dataset reference_images(const EvalConfig& cfg) {
  if (cfg.reference) return *cfg.reference;
  DataConfig dc;
  dc.root = cfg.data_root;
  dc.split = "test";
  return load_dataset(dc);
}

// Features of the real images, from the cache or computed and cached.
Reference reference_features(FeatureNet& net, const std::string& net_sha, const EvalConfig& cfg) {
  const Dataset test = reference_images(cfg);
  DDM_CHECK(test.images.scalar_type() == torch::kUInt8 && test.images.dim() == 4 &&
                test.images.size(1) == net->shape().in_channels && test.images.size(2) == net->shape().image_size &&
                test.images.size(3) == net->shape().image_size,
            "the reference images (" << test.description << ") are " << test.images.scalar_type() << " "
                                     << test.images.sizes() << ", but the feature network takes uint8 [N, "
                                     << net->shape().in_channels << ", " << net->shape().image_size << ", "
                                     << net->shape().image_size << "]: give the network trained on this data");
  const torch::Tensor flat = test.images.contiguous();
  const std::string data_sha = sha256_hex(std::string(static_cast<const char*>(flat.data_ptr()),
                                                      static_cast<size_t>(flat.numel())));
  const fs::path dir = cfg.cache_dir.empty() ? default_cache_dir() : cfg.cache_dir;
  const fs::path path = dir / ((cfg.reference ? "reference-" : "fmnist-test-") + data_sha.substr(0, 12) + "-net-" +
                               net_sha.substr(0, 12) + ".safetensors");
  Reference ref;
  ref.description = test.description;
  ref.class_names = test.class_names;
  ref.labelled = test.num_classes > 0;
  if (fs::exists(path)) {
    SafetensorsFile f = load_safetensors(path.string());
    const std::string got = f.metadata.count("feature_net_sha256") ? f.metadata["feature_net_sha256"] : "";
    DDM_CHECK(got == net_sha, path.string() << ": this reference cache was computed with feature network "
                                            << (got.empty() ? "(unknown)" : got) << ", not " << net_sha
                                            << "; delete the file (it is recomputed in seconds)");
    DDM_CHECK(f.metadata.count("data_sha256") && f.metadata["data_sha256"] == data_sha,
              path.string() << ": this reference cache belongs to other test images; delete the file");
    DDM_CHECK(f.tensors.count("features") && f.tensors["features"].dim() == 2 &&
                  f.tensors["features"].size(0) == test.images.size(0),
              path.string() << ": malformed reference cache (no features [" << test.images.size(0)
                            << ", D]); delete the file");
    ref.features = f.tensors["features"].to(torch::kFloat64);
    return ref;
  }
  if (!cfg.quiet)
    std::cout << "computing reference features of " << test.description << " (cached in " << path.string() << ")"
              << std::endl;
  ref.features = extract_features(net, test.images);
  SafetensorsFile f;
  f.tensors["features"] = ref.features;
  f.metadata["feature_net_sha256"] = net_sha;
  f.metadata["data_sha256"] = data_sha;
  f.metadata["data"] = test.description;
  fs::create_directories(dir);
  save_safetensors(path.string(), f);
  return ref;
}

}  // namespace

void check_evaluable_source(const std::string& origin, const std::string& what) {
  const std::string unknown =
      origin == "shards"    ? " (tar shards without the record `ddm shards write` leaves beside them, PREFIX.shards.json, "
                              "so ddm cannot tell what they hold)"
      : origin == "latents" ? " (latent shards whose encode.json records no origin)"
                            : "";
  DDM_CHECK(origin == "fashion-mnist",
            what << " was trained on data from \"" << origin << "\"" << unknown << ", not Fashion-MNIST. ddm eval scores "
                 "samples against Fashion-MNIST's test split with a feature network trained on Fashion-MNIST (and "
                 "names its classes), so for other data its FD, KID, precision/recall and class accuracy would be "
                 "meaningless: give --reference-config (that data's config) and a --feature-net trained on that "
                 "data (`ddm train-classifier --config` makes one)");
}

SampleSet load_samples(const std::string& path, bool any_source) {
  DDM_CHECK(fs::exists(path), path << ": no such samples file (write one with `ddm sample --raw FILE`)");
  SafetensorsFile f = load_safetensors(path);
  if (f.metadata.count("data_source") && !any_source) check_evaluable_source(f.metadata["data_source"], path + " (its model)");
  SampleSet s;
  s.origin = path;
  auto labels = f.tensors.find("labels");
  if (f.tensors.count("samples") && !f.tensors.count("images")) {
    s.images = f.tensors["samples"];
    DDM_CHECK(s.images.is_floating_point(), path << ": tensor \"samples\" must be float in [-1, 1], got "
                                                 << s.images.scalar_type());
  } else {
    DDM_CHECK(f.tensors.count("images"), path << ": no tensor named \"images\" (uint8 NCHW/NHWC, or float in "
                                                 "[-1, 1]) or \"samples\" (float NCHW in [-1, 1])");
    if (f.tensors["images"].scalar_type() == torch::kUInt8) {
      Dataset d = load_tensor_file(path, /*every_class=*/false);  // uint8 layout rules and label checks
      s.images = d.images;
      if (labels != f.tensors.end()) s.labels = d.labels;
      return s;
    }
    s.images = f.tensors["images"];
  }
  if (labels != f.tensors.end()) {
    const auto t = labels->second.scalar_type();
    DDM_CHECK(t == torch::kInt64 || t == torch::kInt32 || t == torch::kUInt8 || t == torch::kInt16 || t == torch::kInt8,
              path << ": tensor \"labels\" must be integer, got " << t);
    s.labels = labels->second.to(torch::kInt64);
  }
  return s;
}

SampleSet anchor_samples(const std::string& kind, int64_t n, uint64_t seed, const std::string& data_root) {
  DataConfig dc;
  dc.root = data_root;
  return anchor_samples(kind, n, seed, load_dataset(dc));
}

SampleSet anchor_samples(const std::string& kind, int64_t n, uint64_t seed, const Dataset& train) {
  DDM_CHECK(kind == "train" || kind == "noise", "unknown anchor '" << kind << "' (train | noise)");
  DDM_INPUT_CHECK(n >= 1 && n <= train.images.size(0),
                  "anchor " << kind << ": --n must be in 1.." << train.images.size(0) << " (the images of "
                            << train.description << "), got " << n);
  const bool fmnist = train.description.rfind("fashion-mnist", 0) == 0;
  auto gen = make_generator(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kSample), 0xa7c4ULL}));
  SampleSet s;
  if (kind == "train") {
    const auto idx = torch::randperm(train.images.size(0), gen, torch::kLong).narrow(0, 0, n);
    s.images = train.images.index_select(0, idx);
    s.labels = train.labels.index_select(0, idx);
    s.origin = "anchor: " + std::to_string(n) + " random " + (fmnist ? "train images" : "images of " + train.description);
  } else {
    // Each pixel's mean and (unbiased) standard deviation in float64, two passes over chunks of the
    // images: the whole data in float64 is 8 bytes a pixel (9.8 GB for 100000 RGB images of 64x64).
    const torch::Tensor& all = train.images;  // uint8 [N, C, H, W]
    const int64_t count = all.size(0), chunk = 1024;
    const auto unit = [&](int64_t at) {       // float64 [<= chunk, C, H, W] in [-1, 1]
      return to_unit_range(all.narrow(0, at, std::min(chunk, count - at))).to(torch::kFloat64);
    };
    auto mean = torch::zeros({all.size(1), all.size(2), all.size(3)}, torch::kFloat64);  // [C, H, W]
    for (int64_t at = 0; at < count; at += chunk) mean += unit(at).sum(0);
    mean /= static_cast<double>(count);
    auto squares = torch::zeros_like(mean);  // [C, H, W]: sum of squared deviations
    for (int64_t at = 0; at < count; at += chunk) squares += (unit(at) - mean).square().sum(0);
    const auto std = count > 1 ? (squares / static_cast<double>(count - 1)).sqrt() : torch::zeros_like(mean);
    auto noise = torch::randn({n, all.size(1), all.size(2), all.size(3)}, gen, torch::kFloat64);
    s.images = (mean + std * noise).clamp(-1, 1).to(torch::kFloat32);
    s.origin = "anchor: per-pixel Gaussian noise with each pixel's mean and variance over " +
               (fmnist ? std::string("the train split") : train.description);
  }
  return s;
}

LoadedFeatureNet load_eval_feature_net(const EvalConfig& cfg) {
  LoadedFeatureNet f;
  if (cfg.feature_net.empty()) {
    const std::string path = default_feature_net_path();
    DDM_CHECK(fs::exists(path), path << ": the shipped feature network is missing; restore it from the repository "
                                        "(git checkout assets/) or pass one with --feature-net");
    f = load_feature_net(path, kDefaultFeatureNetSha256);
  } else {
    f = load_feature_net(cfg.feature_net);
  }
  f.net->to(cfg.device);
  return f;
}

namespace {

// What the network was trained on, as `ddm train-classifier` recorded it.
std::string feature_net_data(const LoadedFeatureNet& f) {
  const auto it = f.metadata.find("train_data");
  return it == f.metadata.end() ? "data it does not record" : it->second;
}

// Why the network's classes are not the reference's ("" when they are, or either set is unnamed):
// another number of classes, or other names where both name theirs ("class 3" names nothing).
// Its features still serve FD, KID and precision/recall, as Inception's do for any data; its class
// accuracies and CAS would score other classes.
std::string other_classes(const LoadedFeatureNet& f, const std::vector<std::string>& ref_names, bool ref_labelled) {
  const bool classes = f.metadata.count("task") == 0 || f.metadata.at("task") == "classes";
  if (!classes || !ref_labelled) return "";
  const int64_t k = f.net->shape().num_classes;
  std::ostringstream why;
  if (k != static_cast<int64_t>(ref_names.size())) {
    why << "the feature network classifies " << k << " classes, the reference has " << ref_names.size();
    return why.str();
  }
  std::vector<std::string> names;
  if (auto it = f.metadata.find("class_names"); it != f.metadata.end()) {
    const nlohmann::json j = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
    if (j.is_array() && std::all_of(j.begin(), j.end(), [](const nlohmann::json& x) { return x.is_string(); }))
      names = j.get<std::vector<std::string>>();
  }
  const auto generic = [](const std::vector<std::string>& v) {
    return v.empty() || std::all_of(v.begin(), v.end(), [](const std::string& n) { return n.rfind("class ", 0) == 0; });
  };
  if (generic(names) || generic(ref_names) || names.size() != ref_names.size() || names == ref_names) return "";
  for (size_t c = 0; c < names.size(); ++c)
    if (names[c] != ref_names[c]) {
      why << "the feature network's class " << c << " is '" << names[c] << "', the reference's '" << ref_names[c] << "'";
      break;
    }
  return why.str();
}

void check_reference_has_a_network(const EvalConfig& cfg) {
  DDM_CHECK(!cfg.reference || !cfg.feature_net.empty(),
            "evaluating against " << cfg.reference->description << " needs a feature network trained on that data "
                                  "(--feature-net FILE; `ddm train-classifier --config` makes one): the shipped one "
                                  "knows Fashion-MNIST only");
}

// FD fits a Gaussian to each set's features: each needs more images than the features have dimensions.
void check_count(int64_t n, int64_t dim, const std::string& what, const std::string& fix) {
  DDM_CHECK(n > dim, what << ": " << n << " images, but FD needs more than the feature network's " << dim
                          << " feature dimensions; " << fix);
}

}  // namespace

void check_eval_inputs(const EvalConfig& cfg, int64_t channels, int64_t image_size, int64_t n, const std::string& what) {
  check_reference_has_a_network(cfg);
  DDM_CHECK(cfg.feature_net.empty() || fs::is_regular_file(cfg.feature_net),
            "--feature-net " << cfg.feature_net << ": no such file (`ddm train-classifier --config C --out F.safetensors` "
                                                   "makes one)");
  const LoadedFeatureNet fnet = load_eval_feature_net(cfg);  // a damaged file, or not a feature network, fails here
  if (cfg.cas) {
    const Dataset* ref = cfg.reference.get();
    const std::string why = ref ? other_classes(fnet, ref->class_names, ref->num_classes > 0) : "";
    DDM_INPUT_CHECK(why.empty(), "--cas: " << why << ": it was trained on other data (" << feature_net_data(fnet)
                                     << "); train one on the reference's (`ddm train-classifier --config`)");
  }
  SampleSet probe;
  probe.origin = what;
  probe.images = torch::zeros({1, channels, image_size, image_size}, torch::kUInt8);
  check_images(probe, fnet.net->shape());
  if (cfg.reference) {  // the samples fit the network: a reference that does not is at another size
    const torch::Tensor& r = cfg.reference->images;  // [N, C, H, W]
    DDM_INPUT_CHECK(r.dim() == 4 && r.size(1) == channels && r.size(2) == image_size && r.size(3) == image_size,
                    "the reference (" << cfg.reference->description << ") holds images of " << r.sizes().slice(1)
                                      << ", but the samples of " << what << " and the feature network are ["
                                      << channels << ", " << image_size << ", " << image_size
                                      << "]: compare them at one size ("
                                      << (cfg.reference->shards  // shards are cropped and resized as data.* says
                                              ? "--reference-set data.resolution=" + std::to_string(image_size) +
                                                    (r.size(1) != channels
                                                         ? " --reference-set data.channels=" + std::to_string(channels)
                                                         : std::string())
                                              : "reference images of the samples' size")
                                      << "; nothing was sampled)");
  }
  const int64_t dim = fnet.net->shape().feature_dim;
  check_count(n, dim, what, "give a larger --n (at least " + std::to_string(dim + 1) + "; 10000 is the default)");
  if (cfg.reference)
    check_count(cfg.reference->images.size(0), dim, "the reference (" + cfg.reference->description + ")",
                "give it more images (--reference-set)");
}

EvalReport evaluate_samples(const SampleSet& samples, const EvalConfig& cfg) {
  DDM_INPUT_CHECK(!cfg.cas || samples.labels.defined(), samples.origin << ": CAS needs labelled samples (class-conditional)");
  check_reference_has_a_network(cfg);
  LoadedFeatureNet fnet = load_eval_feature_net(cfg);
  check_images(samples, fnet.net->shape());
  check_count(samples.images.size(0), fnet.net->shape().feature_dim, samples.origin, "give more samples (--n)");
  const Reference ref = reference_features(fnet.net, fnet.sha256, cfg);
  check_count(ref.features.size(0), fnet.net->shape().feature_dim, "the reference (" + ref.description + ")",
              "give it more images");
  // The network's classes are the data's (not the turns of an unlabelled set's network): then it
  // judges the requested classes.
  bool classes = fnet.metadata.count("task") == 0 || fnet.metadata.at("task") == "classes";
  DDM_INPUT_CHECK(!cfg.cas || (classes && ref.labelled),
            samples.origin << ": CAS measures a classifier of the samples on the reference's classes, and "
                           << ref.description << " has none");
  const std::string other = other_classes(fnet, ref.class_names, ref.labelled);
  DDM_INPUT_CHECK(!cfg.cas || other.empty(), "--cas: " << other << ": it was trained on other data (" << feature_net_data(fnet)
                                                 << "); train one on the reference's (`ddm train-classifier --config`)");
  if (!other.empty()) {
    if (!cfg.quiet && samples.labels.defined())
      std::cout << "note: no class accuracies: " << other << " (it was trained on " << feature_net_data(fnet)
                << "); FD, KID, precision and recall use its features only" << std::endl;
    classes = false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  EvalReport r;
  r.origin = samples.origin;
  r.info = samples.info;
  r.feature_net_sha256 = fnet.sha256;
  if (fnet.metadata.count("train_data")) r.feature_net_data = fnet.metadata.at("train_data");
  r.fmnist = !cfg.reference;
  r.reference = ref.description;
  r.n = samples.images.size(0);
  r.reference_n = ref.features.size(0);
  if (classes) r.class_names = ref.class_names;
  const auto feats = extract_features(fnet.net, samples.images);  // [N, D] float64
  r.fd = frechet_distance(gaussian_stats(feats), gaussian_stats(ref.features));
  r.kid = kernel_inception_distance(feats, ref.features, cfg.kid_subsets, cfg.kid_subset_size, cfg.seed);
  r.pr = precision_recall(ref.features, feats, cfg.pr_k);
  if (samples.labels.defined() && classes && ref.labelled) {
    torch::Tensor pred;  // [N]: the head on the features above (float64 holds float32 exactly)
    {
      torch::NoGradGuard ng;
      pred = fnet.net->logits(feats.to(cfg.device, torch::kFloat32)).argmax(1).cpu();
    }
    double sum = 0;
    int64_t present = 0;
    for (int64_t c = 0; c < fnet.net->shape().num_classes; ++c) {
      const auto mask = samples.labels.eq(c);
      const int64_t n = mask.sum().item<int64_t>();
      const double acc = n ? pred.masked_select(mask).eq(c).sum().item<double>() / static_cast<double>(n) : -1.0;
      r.class_accuracy.push_back(acc);
      if (n) sum += acc, ++present;
    }
    r.mean_class_accuracy = present ? sum / static_cast<double>(present) : -1.0;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (cfg.cas) {
    Dataset gen;
    gen.images = samples.images.scalar_type() == torch::kUInt8 ? samples.images : to_uint8(samples.images);
    gen.labels = samples.labels;
    gen.num_classes = fnet.net->shape().num_classes;
    gen.class_names = ref.class_names;
    gen.description = samples.origin;
    DDM_CHECK(gen.images.size(0) >= 128, samples.origin << ": CAS needs at least 128 samples, got "
                                                        << gen.images.size(0));
    ClassifierTrainConfig tc;
    tc.epochs = cfg.cas_epochs;
    tc.seed = cfg.seed;
    tc.quiet = cfg.quiet;
    if (!cfg.quiet)
      std::cout << "CAS: training a classifier on the samples for " << tc.epochs << " epochs" << std::endl;
    FeatureNet cas_net = train_classifier(gen, tc);
    const Dataset test = reference_images(cfg);
    r.cas = static_cast<double>(count_correct(cas_net, test)) / static_cast<double>(test.images.size(0));
  }
  return r;
}

namespace {

// An info value as JSON: the numeric ones as numbers ("2.000000" -> 2; a seed as the exact integer),
// an ensemble's expert_sample_steps as a list of integers, the rest (paths, names) as text.
nlohmann::json info_value(const std::string& key, const std::string& text) {
  static const std::set<std::string> numeric = {"steps", "cfg", "nfe", "seed", "sampling_seconds", "gflop_per_image",
                                                "router_gflop_per_image", "control_mse", "embed_similarity",
                                                "expert_sample_steps"};
  if (!numeric.count(key)) return text;  // paths and names stay text, whatever they look like
  const auto integer = [](const std::string& t, int64_t& v) {
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    return !t.empty() && ec == std::errc() && end == t.data() + t.size();
  };
  int64_t i = 0;
  if (integer(text, i)) return i;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (!text.empty() && end == text.c_str() + text.size() && std::isfinite(v)) return v == std::floor(v) && std::abs(v) < 1e15 ? nlohmann::json(static_cast<int64_t>(v)) : nlohmann::json(v);
  nlohmann::json list = nlohmann::json::array();  // a list of integers separated by spaces
  std::istringstream in(text);
  for (std::string part; in >> part;) {
    if (!integer(part, i)) return text;
    list.push_back(i);
  }
  return list.empty() ? nlohmann::json(text) : list;
}

}  // namespace

std::string EvalReport::json() const {
  nlohmann::json typed_info = nlohmann::json::object();
  for (const auto& [key, value] : info) typed_info[key] = info_value(key, value);
  nlohmann::json j = {{"origin", origin},
                      {"n", n},
                      {"feature_net_sha256", feature_net_sha256},
                      {"feature_net_data", feature_net_data},
                      {"reference", reference},
                      {"reference_n", reference_n},
                      {fmnist ? "fd_fmnist" : "fd", fd},
                      {"kid_mean", kid.mean},
                      {"kid_std", kid.std},
                      {"kid_subsets", kid.subsets},
                      {"kid_subset_size", kid.subset_size},
                      {"precision", pr.precision},
                      {"recall", pr.recall},
                      {"pr_k", pr.k},
                      {"seconds", seconds},
                      {"info", typed_info}};
  if (cas >= 0) j["cas"] = cas;
  if (mean_class_accuracy >= 0) {
    j["class_accuracy"] = class_accuracy;  // -1 for classes without samples
    j["class_names"] = class_names;
    j["mean_class_accuracy"] = mean_class_accuracy;
  }
  return j.dump(2);
}

std::string EvalReport::table() const {
  std::ostringstream o;
  char buf[160];
  o << "samples          " << n << " from " << origin << "\n";
  o << "reference        " << reference << "\n";
  o << "feature network  sha256 " << feature_net_sha256.substr(0, 16) << "..."
    << (feature_net_data.empty() ? "" : ", trained on " + feature_net_data) << "\n";
  std::snprintf(buf, sizeof buf, "%-16s %.3f%s\n", fmnist ? "FD-fmnist" : "FD", fd,
                fmnist ? "" : " (in the feature network's space: not Inception FID, docs/evaluation.md)");
  o << buf;
  std::snprintf(buf, sizeof buf, "KID              %.5f +- %.5f (%lld subsets of %lld)\n", kid.mean, kid.std,
                static_cast<long long>(kid.subsets), static_cast<long long>(kid.subset_size));
  o << buf;
  std::snprintf(buf, sizeof buf, "precision        %.4f (k = %lld)\nrecall           %.4f\n", pr.precision,
                static_cast<long long>(pr.k), pr.recall);
  o << buf;
  if (mean_class_accuracy >= 0) {
    std::snprintf(buf, sizeof buf, "class accuracy   %.4f (feature network's accuracy on the requested class)\n",
                  mean_class_accuracy);
    o << buf;
    for (size_t c = 0; c < class_accuracy.size(); ++c) {
      if (class_accuracy[c] < 0) continue;
      std::snprintf(buf, sizeof buf, "  %-14s %.3f\n", c < class_names.size() ? class_names[c].c_str() : "?",
                    class_accuracy[c]);
      o << buf;
    }
  }
  if (cas >= 0) {
    std::snprintf(buf, sizeof buf, "CAS              %.4f (test accuracy of a classifier trained on the samples)\n",
                  cas);
    o << buf;
  }
  return o.str();
}

}  // namespace ddm
