// ddm_bench_text_encoder: a frozen CLIP text encoder's forward, timed as
// bench/text_encoder_reference.py times transformers' on the same directory and ids (it writes
// both). Prints one JSON line: the first call and the best of --repeat further calls, and the largest
// difference from transformers' last hidden state relative to its largest magnitude. Results are
// reported, never asserted.
//
// usage: ddm_bench_text_encoder DIR [--repeat 3] [--threads 2]   (DIR/bench.safetensors: ids, last)
#include <chrono>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/cuda_load.h"
#include "core/safetensors.h"
#include "text/clip_text_encoder.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  ddm::load_cuda();  // before anything asks LibTorch about CUDA (core/cuda_load.h)
  if (argc < 2) {
    std::cerr << "usage: ddm_bench_text_encoder DIR [--repeat 3] [--threads 2]\n";
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
  const auto ref = ddm::load_safetensors(dir + "/bench.safetensors").tensors;
  const torch::Tensor ids = ref.at("ids"), want = ref.at("last");  // [B, T], [B, T, W]
  auto t0 = std::chrono::steady_clock::now();
  const auto enc = ddm::text::ClipTextEncoder::load(dir);
  const double load_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  const auto out = enc.encode(ids, 0);
  const double first = seconds_since(t0);
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    t0 = std::chrono::steady_clock::now();
    enc.encode(ids, 0);
    best = std::min(best, seconds_since(t0));
  }
  const double diff = (out.states - want).abs().max().item<double>() / want.abs().max().item<double>();
  std::cout << nlohmann::json{{"impl", "ddm"},           {"batch", ids.size(0)},      {"tokens", ids.size(1)},
                              {"threads", threads},      {"load_s", load_s},          {"first_s", first},
                              {"best_s", best},          {"texts_per_s", ids.size(0) / best},
                              {"max_rel_diff_vs_transformers", diff}}
                   .dump()
            << std::endl;
  return 0;
}
