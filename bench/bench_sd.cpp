// ddm_bench_sd: Stable Diffusion 2.1's UNet and VAE in ddm (src/sd/), timed as bench/sd_reference.py
// times diffusers' on the same directory and inputs (it writes both): the UNet's forward + backward
// of the seeded loss sum(out * weight), the VAE encoder's forward without gradients, and the VAE's
// whole forward + backward of mean(decoded^2). Prints one JSON line per piece: the first call and the
// best of --repeat further calls, and the largest difference from diffusers' output relative to its
// largest magnitude. Results are reported, never asserted.
//
// usage: ddm_bench_sd DIR [--repeat 3] [--threads 2]   (DIR: unet/, vae/, bench.safetensors)
#include <chrono>
#include <functional>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/safetensors.h"
#include "model/net.h"
#include "sd/autoencoder_kl.h"
#include "sd/unet_2d_condition.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The first call and the best of `repeat` more.
std::pair<double, double> timed(const std::function<void()>& fn, int repeat) {
  auto t0 = std::chrono::steady_clock::now();
  fn();
  const double first = seconds_since(t0);
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, seconds_since(t0));
  }
  return {first, best};
}

double relative(const torch::Tensor& got, const torch::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: ddm_bench_sd DIR [--repeat 3] [--threads 2]\n";
    return 2;
  }
  const std::string dir = argv[1];
  int repeat = 3, threads = 2;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--repeat") repeat = std::stoi(argv[i + 1]);
    else if (flag == "--threads") threads = std::stoi(argv[i + 1]);
  }
  torch::set_num_threads(threads);
  const auto in = ddm::load_safetensors(dir + "/bench.safetensors").tensors;
  auto unet = ddm::sd::load_unet_2d_condition(dir + "/unet");
  auto vae = ddm::sd::load_autoencoder_kl(dir + "/vae");
  const torch::Tensor sample = in.at("sample"), timestep = in.at("timestep"), context = in.at("context");
  const torch::Tensor weight = in.at("weight"), images = in.at("images");
  double diff = 0;
  {
    torch::NoGradGuard no_grad;
    diff = relative(unet->forward(sample, timestep, context), in.at("out"));
  }
  const auto [uf, ub] = timed(
      [&] {
        unet->zero_grad();
        (unet->forward(sample, timestep, context) * weight).sum().backward();
      },
      repeat);
  double vdiff = 0;
  const auto [ef, eb] = timed(
      [&] {
        torch::NoGradGuard no_grad;
        vdiff = relative(vae->encode(images).first, in.at("mean"));
      },
      repeat);
  const auto [vf, vb] = timed(
      [&] {
        vae->zero_grad();
        vae->decode(vae->encode(images).first).square().mean().backward();
      },
      repeat);
  const int64_t batch = sample.size(0), size = sample.size(2);
  for (const auto& [what, first, best, d] :
       {std::tuple<std::string, double, double, double>{"unet forward+backward", uf, ub, diff},
        {"vae encode", ef, eb, vdiff},
        {"vae forward+backward", vf, vb, vdiff}})
    std::cout << nlohmann::json{{"impl", "ddm"},      {"model", "SD 2.1 " + what}, {"unet_params", ddm::count_params(*unet)},
                                {"batch", batch},     {"latent", size},            {"threads", threads},
                                {"first_s", first},   {"best_s", best},            {"max_rel_diff_vs_diffusers", d}}
                     .dump()
              << std::endl;
  return 0;
}
