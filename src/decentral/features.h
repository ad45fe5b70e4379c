// Feature sources for partitioning a dataset into clusters: one float32 row per image, in dataset
// order. Specs (the `--features` flag of `ddm partition`):
//   pixels[:D]         the images' pixels projected on their top D principal components (default 64)
//   feature-net[:FILE] the 128-d penultimate layer of the evaluation feature network (default: the
//                      shipped one; note it was trained with labels, so its clusters follow classes)
//   autoencoder[:D]    the D-d bottleneck (default 32) of a conv autoencoder trained here on the images
//                      alone, without labels (deterministic from the seed)
//   latent:RUN         the normalized posterior means of a `ddm train-autoencoder` run's frozen encoder
//                      (the space latent experts train in), projected on their top 64 principal components
//   latent             the same for latent shards (`ddm encode`): their own posterior means, no encoder
//   file:PATH          rows computed elsewhere (DINOv2, CLIP, ...): a .npy, .npz or .safetensors file
//                      (decentral/features_file.h); in memory, one row per image in dataset order
//   text:ENCODER       the captions' pooled embeddings by a frozen text encoder's directory (CLIP, BERT,
//                      a diffusers pipeline: text/encoder.h): clusters of what the captions say; `text`
//                      alone takes the config's model.text_encoder (the CLI fills it in)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "data/dataset.h"

namespace ddm {

struct FeatureSource {
  std::string kind;  // pixels | feature-net | autoencoder | latent | file | text
  int64_t dim = 0;   // pixels / autoencoder / latent (PCA)
  // feature-net (optional) / latent (the autoencoder run; empty: latent shards' own) / file / text (the
  // encoder; empty: the config's)
  std::string path;
  std::string spec() const;  // back to the flag's form
};

// Parses a spec as above; throws ddm::Error naming the spec and listing the valid forms.
FeatureSource parse_feature_source(const std::string& spec);

struct Features {
  torch::Tensor rows;        // float32 [N, D]
  std::string description;   // e.g. "pixels PCA 64 of 784 (86.1% of the variance)"
};

// Computes or loads the features of every image of `data` (rows must match it). Progress goes to
// stdout unless quiet. A feature network or a latent model's encoder runs on `device` (the rows
// come back to the host); PCA, the autoencoder trained here and k-means run on the CPU.
Features compute_features(const Dataset& data, const FeatureSource& src, uint64_t seed, bool quiet,
                          torch::Device device = torch::kCPU);

// The pooled embeddings, float32 [N, P], of `captions` by the text encoder in `encoder` (on `device`,
// batches of 256, a line of progress every 10 s unless quiet); `what(i)` names caption i in errors.
// `description` gets e.g. "captions' pooled embeddings by <the encoder> (384-d)".
torch::Tensor caption_rows(const std::string& encoder, const std::vector<std::string>& captions,
                           const std::function<std::string(size_t)>& what, bool quiet, torch::Device device,
                           std::string* description);

// Projection of x [N, F] on its top `dim` principal components (centred, covariance in float64,
// each component's sign fixed so its largest entry is positive): float32 [N, dim]. explained gets
// the fraction of the variance kept. StreamingPca over blocks of x.
torch::Tensor pca_project(const torch::Tensor& x, int64_t dim, double* explained = nullptr);

// PCA over rows that arrive in blocks, so that they need not all be in memory at once: every block
// once to add_mean, then every block again to add_covariance, then finish, then project any rows.
// Blocks of kBlock rows (the last shorter) give bit for bit what pca_project gives on all of them.
class StreamingPca {
 public:
  static constexpr int64_t kBlock = 4096;
  explicit StreamingPca(int64_t features);
  void add_mean(const torch::Tensor& block);        // float [n, F]
  void add_covariance(const torch::Tensor& block);  // float [n, F], the same blocks again
  void finish(int64_t dim);                         // keeps the top `dim` components
  torch::Tensor project(const torch::Tensor& rows) const;  // float [n, F] -> float32 [n, dim]
  double explained() const { return explained_; }   // the fraction of the variance kept
  int64_t features() const { return f_; }

 private:
  int64_t f_ = 0, n_mean_ = 0, n_cov_ = 0;
  torch::Tensor sum_, mean32_, cov_, top_;
  double explained_ = 0;
};

}  // namespace ddm
