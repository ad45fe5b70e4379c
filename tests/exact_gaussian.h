// The exact network for data x0 ~ N(mu, var) per dimension (independent), for any path and
// prediction: E[x0 | x_t] = mu + a var / (a^2 var + s^2) (x - a mu). Used to check samplers and
// ensembles against closed forms.
#pragma once
#include <torch/torch.h>

#include "diffusion/denoiser.h"
#include "diffusion/path.h"
#include "model/net.h"

namespace ddm::test {

class ExactGaussianNet : public NetImpl {
 public:
  ExactGaussianNet(NoisePath path, Prediction pred, torch::Tensor mu, torch::Tensor var)
      : path_(path), pred_(pred), mu_(mu), var_(var) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond&) override {
    auto a = path_.alpha(t).view({-1, 1, 1, 1}), s = path_.sigma(t).view({-1, 1, 1, 1});
    auto x0 = mu_ + a * var_ / (a * a * var_ + s * s) * (x - a * mu_);  // [B,C,H,W]
    auto eps = (x - a * x0) / s;                                          // [B,C,H,W]
    return training_target(path_, pred_, x0, eps, t);
  }

 private:
  NoisePath path_;
  Prediction pred_;
  torch::Tensor mu_, var_;
};

}  // namespace ddm::test
