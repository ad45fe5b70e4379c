// ddm_bench_sd: Stable Diffusion 2.1's UNet and VAE in ddm (src/sd/), timed as bench/sd_reference.py
// times diffusers' on the same directory and inputs (it writes both): the UNet's forward + backward
// of the seeded loss sum(out * weight), the VAE encoder's forward without gradients, and the VAE's
// whole forward + backward of mean(decoded^2). Prints one JSON line per piece: the first call and the
// best of --repeat further calls, and the largest difference from diffusers' output relative to its
// largest magnitude. Then the UNet's forward + backward with activation checkpointing (model/recompute.h,
// train.checkpoint_activations) beside the plain one: the time and the bytes each holds between
// forward and backward (the host allocator's count before and after the forward). Results are
// reported, never asserted.
//
// usage: ddm_bench_sd DIR [--repeat 3] [--threads 2] [--device cpu|cuda] [--precision fp32|bf16]
//        (DIR: unet/, vae/, bench.safetensors; on a GPU the forwards run under autocast in --precision
//        and each timed call ends with a synchronization, as sd_reference.py's DEVICE and PRECISION)
//
// Memory mode: a UNet built from CONFIG (a diffusers unet config.json; random weights) trains on
// random latents as a run does (forward + backward under --precision, the global norm, AdamW + EMA
// on FlatAdamW's flat buffers), without and with activation checkpointing. One JSON line each: the
// best step time of --repeat and the peak memory of the step (on a GPU the caching allocator's peak
// of tensors, reset before; on the CPU the bytes held between forward and backward, and the
// process's peak resident set).
//   ddm_bench_sd --memory CONFIG [--batch 1] [--latent 64] [--tokens 77] [--device cpu|cuda]
//                [--precision fp32|bf16] [--repeat 2] [--threads 2] [--checkpoint both|on|off]
//                [--controlnet off|on]
// With --controlnet on the step trains a ControlNet (v1.0's: diffusers' from_unet, its encoder copied
// from the UNet, an RGB control image of 8x the latents) on that UNet, locked, as `ddm train` trains
// one (sd/controlnet_net.h: the locked encoder in the no-grad prepare phase, then the ControlNet and
// the locked decoder forward and backward, AdamW + EMA on the ControlNet's parameters alone);
// bench/sd_reference.py --controlnet-step is the same step in diffusers.
#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>

#include <ATen/DeviceAccelerator.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/cuda_load.h"
#include "core/device.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "model/net.h"
#include "model/recompute.h"
#include "sd/autoencoder_kl.h"
#include "sd/controlnet_model.h"
#include "sd/controlnet_net.h"
#include "sd/unet_2d_condition.h"
#include "sd/unet_net.h"
#include "train/optimizer.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --precision: fp32 or bf16, the precisions of the diffusers comparisons (bench/sd_reference.py);
// another name refused.
ddm::Precision training_precision(const std::string& name) {
  if (name != "fp32" && name != "bf16") throw std::runtime_error("--precision must be fp32 or bf16, got " + name);
  return ddm::precision_named(name);
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

// The memory mode (see the top of this file).
int memory_mode(int argc, char** argv) {
  const std::string config = argv[2];
  int64_t batch = 1, latent = 64, tokens = 77;
  int repeat = 2, threads = 2;
  std::string device_name = "cpu", precision_name = "fp32", which = "both", controlnet = "off";
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], v = argv[i + 1];
    if (flag == "--batch") batch = std::stoll(v);
    else if (flag == "--latent") latent = std::stoll(v);
    else if (flag == "--tokens") tokens = std::stoll(v);
    else if (flag == "--device") device_name = v;
    else if (flag == "--precision") precision_name = v;
    else if (flag == "--repeat") repeat = std::stoi(v);
    else if (flag == "--threads") threads = std::stoi(v);
    else if (flag == "--checkpoint") which = v;
    else if (flag == "--controlnet") controlnet = v;
    else throw std::runtime_error("unknown flag " + flag);
  }
  if (controlnet != "on" && controlnet != "off") throw std::runtime_error("--controlnet must be on or off, got " + controlnet);
  torch::set_num_threads(threads);
  const torch::Device device(device_name);
  const ddm::Precision precision = training_precision(precision_name);
  ddm::configure_math(device, false);
  std::ifstream in(config);
  if (!in) throw std::runtime_error(config + ": cannot read it");
  const auto cfg = ddm::sd::parse_unet_2d_condition_config(nlohmann::json::parse(in), config);
  torch::manual_seed(0);
  ddm::Net net;
  std::string model = "sd-unet step";
  ddm::sd::UNet2DConditionModel unet(cfg);
  if (controlnet == "on") {  // the UNet locked, a ControlNet made from it trained
    for (auto& p : unet->parameters()) p.requires_grad_(false);
    ddm::sd::ControlNetModel cn(ddm::sd::controlnet_config_from_unet(cfg, 3));
    cn->copy_encoder_from(*unet);
    auto cnet = std::make_shared<ddm::sd::SdControlNetNetImpl>(unet, cn, 1000);
    cnet->set_unet_loaded();
    net = cnet;
    model = "sd-controlnet step";
  } else {
    net = std::make_shared<ddm::sd::SdUNetNetImpl>(unet, 1000);
  }
  net->to(device);
  ddm::FlatAdamW opt(*net, ddm::AdamWOptions{});
  const auto f32 = torch::TensorOptions().device(device);
  const torch::Tensor x = torch::randn({batch, cfg.in_channels, latent, latent}, f32);
  const torch::Tensor t = torch::rand({batch}, f32), target = torch::randn_like(x);
  ddm::Cond c;
  c.context = torch::randn({batch, tokens, cfg.cross_attention_dim}, f32);
  if (controlnet == "on") c.control = torch::rand({batch, 3, 8 * latent, 8 * latent}, f32) * 2 - 1;  // [B, 3, 8 h, 8 w] in [-1, 1]
  for (const bool checkpointed : {false, true}) {
    if ((which == "on" && !checkpointed) || (which == "off" && checkpointed)) continue;
    double held = 0, best = 1e30;
    bool out_of_memory = false;
    if (device.is_cuda()) at::accelerator::resetPeakStats(device.index() < 0 ? 0 : device.index());
    for (int r = 0; r <= repeat && !out_of_memory; ++r) {
      try {
        ddm::synchronize(device);
        const auto t0 = std::chrono::steady_clock::now();
        opt.zero_grad();
        torch::Tensor loss;
        const double before = ddm::allocated_bytes_on(device);
        {
          ddm::Autocast autocast(device, precision);
          ddm::Cond pc;  // the network's frozen part (a ControlNet's locked encoder), as TrainStep::prepare runs it
          {
            torch::NoGradGuard no_grad;
            pc = net->precompute(x, t, c);
          }
          const torch::Tensor out = checkpointed ? ddm::forward_recomputed(*net, x, t, pc) : net->forward(x, t, pc);
          held = ddm::allocated_bytes_on(device) - before;
          loss = torch::mse_loss(out.to(torch::kFloat), target);
        }
        loss.backward();
        opt.clip_grad_norm(1.0);
        opt.step(1e-5, 0.9999);
        ddm::synchronize(device);
        if (r > 0) best = std::min(best, seconds_since(t0));  // the first call warms up
      } catch (const c10::OutOfMemoryError&) {
        out_of_memory = true;
      }
    }
    nlohmann::json j{{"impl", "ddm"},
                     {"model", model + (checkpointed ? ", checkpointed" : "")},
                     {"config", config},
                     {"params", ddm::count_params(*net)},
                     {"batch", batch},
                     {"latent", latent},
                     {"device", device.str()},
                     {"precision", precision_name},
                     {"threads", threads},
                     {"out_of_memory", out_of_memory},
                     {"held_after_forward_gib", held / (1 << 30)},
                     {"peak_gib", ddm::peak_memory_bytes_on(device) / (1 << 30)}};
    if (!out_of_memory) j["best_s"] = best;
    std::cout << j.dump() << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  ddm::load_cuda();  // before anything asks LibTorch about CUDA (core/cuda_load.h)
  if (argc >= 3 && std::string(argv[1]) == "--memory") return memory_mode(argc, argv);
  if (argc < 2) {
    std::cerr << "usage: ddm_bench_sd DIR [--repeat 3] [--threads 2]\n";
    return 2;
  }
  const std::string dir = argv[1];
  int repeat = 3, threads = 2;
  std::string device_name = "cpu", precision_name = "fp32";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--repeat") repeat = std::stoi(argv[i + 1]);
    else if (flag == "--threads") threads = std::stoi(argv[i + 1]);
    else if (flag == "--device") device_name = argv[i + 1];
    else if (flag == "--precision") precision_name = argv[i + 1];
    else throw std::runtime_error("unknown flag " + flag);
  }
  torch::set_num_threads(threads);
  const torch::Device device(device_name);
  const ddm::Precision precision = training_precision(precision_name);
  ddm::configure_math(device, false);
  const auto in = ddm::load_safetensors(dir + "/bench.safetensors").tensors;
  auto unet = ddm::sd::load_unet_2d_condition(dir + "/unet");
  auto vae = ddm::sd::load_autoencoder_kl(dir + "/vae");
  unet->to(device);
  vae->to(device);
  const auto on = [&](const char* name) { return in.at(name).to(device); };
  const torch::Tensor sample = on("sample"), timestep = on("timestep"), context = on("context");
  const torch::Tensor weight = on("weight"), images = on("images");
  // diffusers' outputs were computed in float32 on the CPU.
  const auto off = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kFloat); };
  double diff = 0;
  {
    torch::NoGradGuard no_grad;
    ddm::Autocast autocast(device, precision);
    diff = relative(off(unet->forward(sample, timestep, context)), in.at("out"));
  }
  const auto [uf, ub] = timed(
      [&] {
        unet->zero_grad();
        torch::Tensor out;
        {
          ddm::Autocast autocast(device, precision);
          out = unet->forward(sample, timestep, context);
        }
        (out.to(torch::kFloat) * weight).sum().backward();
        ddm::synchronize(device);
      },
      repeat);
  double vdiff = 0;
  const auto [ef, eb] = timed(
      [&] {
        torch::NoGradGuard no_grad;
        ddm::Autocast autocast(device, precision);
        vdiff = relative(off(vae->encode(images).first), in.at("mean"));
      },
      repeat);
  const auto [vf, vb] = timed(
      [&] {
        vae->zero_grad();
        torch::Tensor decoded;
        {
          ddm::Autocast autocast(device, precision);
          decoded = vae->decode(vae->encode(images).first);
        }
        decoded.to(torch::kFloat).square().mean().backward();
        ddm::synchronize(device);
      },
      repeat);
  const int64_t batch = sample.size(0), size = sample.size(2);
  for (const auto& [what, first, best, d] :
       {std::tuple<std::string, double, double, double>{"unet forward+backward", uf, ub, diff},
        {"vae encode", ef, eb, vdiff},
        {"vae forward+backward", vf, vb, vdiff}})
    std::cout << nlohmann::json{{"impl", "ddm"},
                                {"model", "SD 2.1 " + what},
                                {"unet_params", ddm::count_params(*unet)},
                                {"batch", batch},
                                {"latent", size},
                                {"threads", threads},
                                {"device", device.str()},
                                {"precision", precision_name},
                                {"first_s", first},
                                {"best_s", best},
                                {"max_rel_diff_vs_diffusers", d}}
                     .dump()
              << std::endl;
  if (device.is_cuda()) return 0;  // the checkpointing comparison below counts the CPU allocator's bytes
  // Activation checkpointing: the UNet as a ddm network (diffusers' timestep k is ddm's t = (k + 1) / 1000).
  auto net = std::make_shared<ddm::sd::SdUNetNetImpl>(unet, 1000);
  const torch::Tensor t = (timestep + 1) / 1000;
  ddm::Cond c;
  c.context = context;
  for (const bool checkpointed : {false, true}) {
    double held = 0;
    const auto [first, best] = timed(
        [&] {
          net->zero_grad();
          const double before = ddm::allocated_bytes();
          const torch::Tensor out = checkpointed ? ddm::forward_recomputed(*net, sample, t, c) : net->forward(sample, t, c);
          held = ddm::allocated_bytes() - before;
          (out * weight).sum().backward();
        },
        repeat);
    std::cout << nlohmann::json{{"impl", "ddm"},
                                {"model", std::string("SD 2.1 unet forward+backward") + (checkpointed ? ", checkpointed" : ", as a net")},
                                {"batch", batch},
                                {"latent", size},
                                {"threads", threads},
                                {"first_s", first},
                                {"best_s", best},
                                {"held_after_forward_mib", held / (1 << 20)}}
                     .dump()
              << std::endl;
  }
  return 0;
} catch (const std::exception& e) {  // a bad flag, a missing file: named, exit 1
  std::cerr << "ddm_bench_sd: " << e.what() << "\n";
  return 1;
}
