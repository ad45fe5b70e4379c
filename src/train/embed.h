// Image-embedding conditioning ("image variations", as Stable Diffusion's image-variation models
// condition on CLIP image embeddings): a model with model.embed set is conditioned on a frozen feature
// network's embedding of a reference image. In training the reference is the image itself, embedded in
// each step's no-grad prepare phase and dropped with the label (label dropout) so that the model
// also learns the null embedding that guidance needs; in sampling it is any image (`ddm sample
// --reference-from test | --reference FILE`).
//
// The embedding is the network's penultimate features (eval/feature_net.h), L2-normalized and scaled
// by sqrt(D) so that its entries are of order 1. The network is pinned, not copied: the resolved config
// names its file and sha256, checked on every load.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <torch/types.h>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "eval/feature_net.h"

namespace ddm {

class ImageEmbedder {
 public:
  // Loads the network of a resolved config (model.embed a file, model.embed_sha256 its hash) onto `device`.
  static std::shared_ptr<const ImageEmbedder> load(const ModelConfig& m, torch::Device device = torch::kCPU);
  // Images [N, C, H, W] (uint8, or float in [-1, 1]) -> embeddings float [N, D], 1000 at a time, no
  // gradients; computed on the network's device, returned on the images'.
  torch::Tensor embed(const torch::Tensor& images) const;
  int64_t dim() const { return dim_; }
  const std::string& path() const { return path_; }

 private:
  mutable FeatureNet net_{nullptr};  // eval mode; forward is not const in LibTorch
  int64_t dim_ = 0;
  std::string path_;
};

// Resolves model.embed against the data before training: "feature-net" becomes the shipped network's
// file, any file its absolute path; embed_sha256 its hash (a value already set must match: the network
// must not have changed) and embed_dim its feature dimension; the network must take the data's images.
// Throws ddm::Error naming the key and the file.
void resolve_embed(ModelConfig& m, const Dataset& data);

// For a resolved model config with model.embed: loads the network and makes `objective` embed every
// batch with it (Objective::set_embedder); returns it. Returns null and changes nothing otherwise.
std::shared_ptr<const ImageEmbedder> attach_embed(Objective& objective, const ModelConfig& m,
                                                  torch::Device device = torch::kCPU);

// The mean cosine similarity of the embeddings of samples and of their references (both [N, C, H, W]):
// how closely samples follow the images they were conditioned on, in the network's feature space.
double embed_similarity(const ImageEmbedder& e, const torch::Tensor& samples, const torch::Tensor& references);

}  // namespace ddm
