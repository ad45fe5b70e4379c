// How well a trained router predicts the cluster of a noisy sample, per noise level: accuracy (with
// the class label and with the null label), mean confidence, expected calibration error and
// negative log-likelihood in buckets of t, on images with fresh noise from the router's own
// forward process. Held-out images are the default (ddm train-router withholds data.holdout).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "core/config.h"
#include "model/net.h"

namespace ddm {

struct RouterBucket {
  double t_lo = 0, t_hi = 0;
  int64_t n = 0;
  double accuracy = 0;       // argmax == cluster, router given the class label
  double accuracy_null = 0;  // the same with the null label and prompt (what an unconditional query sees)
  double confidence = 0;     // mean max probability (label given)
  double ece = 0;            // expected calibration error, 15 equal-width confidence bins
  double nll = 0;            // mean -log p(true cluster)
};

struct RouterReport {
  int64_t k = 0;
  int64_t images = 0;
  double prior_accuracy = 0;  // always guessing the largest cluster
  std::string images_note;    // which images were used ("held-out ..." or "training ...")
  std::vector<RouterBucket> buckets;
  std::string table() const;
  nlohmann::json json() const;
};

// router: a trained router net (eval mode); cfg: its run config (diffusion path, time distribution,
// classes); x0 float [N, C, H, W] in [-1, 1]; labels int64 [N]; clusters int64 [N]. t is drawn
// uniformly inside each of `buckets` equal-width buckets of [0, 1]; all noise comes from seed.
// A text router: `pooled` float [N, P], each image's caption's pooled embedding, and `null_pooled`
// [1, P], the empty prompt's (what the null column measures with the null label).
RouterReport evaluate_router(const Net& router, const RunConfig& cfg, const torch::Tensor& x0,
                             const torch::Tensor& labels, const torch::Tensor& clusters, int64_t buckets,
                             uint64_t seed, const std::string& images_note, const torch::Tensor& pooled = {},
                             const torch::Tensor& null_pooled = {});

}  // namespace ddm
