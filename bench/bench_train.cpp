// ddm_bench: training-step throughput per preset (the exact step `ddm train` runs), achieved FLOP/s
// against the machine's measured matmul peak, and sampling throughput. One JSON line per result;
// bench/compare_python.sh runs it side by side with bench/reference.py. Results are reported, never
// asserted.
//
// usage: ddm_bench train PRESET [--batch 128] [--threads 2] [--steps 20] [--warmup 3]
//        ddm_bench peak [--threads 2]
//        ddm_bench sample PRESET [--n 256] [--nfe 50] [--threads 2]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <torch/torch.h>

#include "core/config.h"
#include "core/error.h"
#include "core/runtime.h"
#include "diffusion/generate.h"
#include "model/net.h"
#include "model/presets.h"
#include "train/step.h"
#include "train/trainer.h"

using namespace ddm;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string mode, preset;
  int64_t batch = 128, threads = 2, steps = 20, warmup = 3, n = 256, nfe = 50;
};

Args parse(int argc, char** argv) {
  Args a;
  DDM_CHECK(argc >= 2, "usage: ddm_bench train|peak|sample [PRESET] [--batch N] [--threads N] [--steps N]");
  a.mode = argv[1];
  int i = 2;
  if (a.mode != "peak") {
    DDM_CHECK(argc >= 3, "ddm_bench " << a.mode << " needs a preset");
    a.preset = argv[i++];
  }
  for (; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (k == "--batch") a.batch = v;
    else if (k == "--threads") a.threads = v;
    else if (k == "--steps") a.steps = v;
    else if (k == "--warmup") a.warmup = v;
    else if (k == "--n") a.n = v;
    else if (k == "--nfe") a.nfe = v;
    else DDM_FAIL("unknown flag " << k);
  }
  return a;
}

RunConfig preset_config(const std::string& preset, int64_t batch) {
  RunConfig cfg = parse_config("", "bench", {"model.preset=" + preset, "train.batch_size=" + std::to_string(batch)});
  cfg.model.in_channels = 1;
  cfg.model.image_size = 28;
  cfg.model.num_classes = 10;
  return cfg;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double matmul_peak(int64_t threads) {
  torch::set_num_threads(static_cast<int>(threads));
  const int64_t n = 1024;
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto c = torch::mm(a, b);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    for (int i = 0; i < 4; ++i) torch::mm_out(c, a, b);
    best = std::max(best, 4 * 2.0 * n * n * n / seconds_since(t0));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  if (!std::getenv("DDM_DEFAULT_MALLOC")) configure_allocator();
  if (a.mode == "peak") {
    std::printf("{\"impl\": \"cpp\", \"mode\": \"peak\", \"threads\": %lld, \"matmul_gflops\": %.2f}\n",
                static_cast<long long>(a.threads), matmul_peak(a.threads) / 1e9);
    return 0;
  }
  torch::set_num_threads(static_cast<int>(a.threads));
  RunConfig cfg = preset_config(a.preset, a.batch);
  torch::manual_seed(0);
  Net net = make_net(cfg.model);
  const double fwd_flops = forward_flops_per_image(cfg.model);
  if (a.mode == "train") {
    DiffusionStep stepper(cfg, net);
    Batch batch{torch::rand({a.batch, 1, 28, 28}) * 2 - 1, torch::randint(0, 10, {a.batch})};
    for (int64_t i = 0; i < a.warmup; ++i) stepper.run(batch, i);
    auto t0 = Clock::now();
    for (int64_t i = 0; i < a.steps; ++i) stepper.run(batch, a.warmup + i);
    const double step_s = seconds_since(t0) / a.steps;
    // Training FLOPs: forward + backward ~ 3x forward.
    const double gflops = 3.0 * fwd_flops * a.batch / step_s / 1e9;
    std::printf("{\"impl\": \"cpp\", \"mode\": \"train\", \"preset\": \"%s\", \"batch\": %lld, \"threads\": %lld, "
                "\"params\": %lld, \"step_s\": %.5f, \"img_per_s\": %.2f, \"train_gflops\": %.2f}\n",
                a.preset.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.threads),
                static_cast<long long>(count_params(*net)), step_s, a.batch / step_s, gflops);
    return 0;
  }
  if (a.mode == "sample") {
    net->eval();
    Denoiser den(net, make_path(cfg.diffusion), prediction_for(cfg.diffusion), 10);
    GenerateOptions g;
    g.n = a.n;
    g.sample.steps = a.nfe;
    g.sample.cfg = 1.0;
    g.batch_size = a.n;
    auto out = generate(den, 1, 28, g);
    std::printf("{\"impl\": \"cpp\", \"mode\": \"sample\", \"preset\": \"%s\", \"n\": %lld, \"nfe\": %lld, "
                "\"threads\": %lld, \"seconds\": %.3f, \"img_per_s\": %.2f}\n",
                a.preset.c_str(), static_cast<long long>(a.n), static_cast<long long>(out.nfe),
                static_cast<long long>(a.threads), out.seconds, a.n / out.seconds);
    return 0;
  }
  DDM_FAIL("unknown mode " << a.mode << " (train | peak | sample)");
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
