// ddm_bench: training-step throughput per preset (the exact step `ddm train` runs), achieved FLOP/s
// against the machine's measured matmul peak, and sampling throughput. One JSON line per result;
// bench/compare_python.sh runs it side by side with bench/reference.py. Results are reported, never
// asserted.
//
// usage: ddm_bench train PRESET [--batch 128] [--threads 2] [--steps 20] [--warmup 3]
//        ddm_bench peak [--threads 2]
//        ddm_bench sample PRESET [--n 256] [--nfe 50] [--threads 2]
//        ddm_bench ops PRESET [--batch 128] [--threads 2] [--steps 20] [--warmup 3]
//          (attention, fc1 + GELU, and adaLN + proj + gated residual of one DiT block, forward +
//           backward: the fused CPU kernels against LibTorch's ops)
// DDM_BENCH_TRACE=FILE with `train` writes a LibTorch profiler trace (Chrome JSON) of 3 steps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/config.h"
#include "core/error.h"
#include "core/runtime.h"
#include "diffusion/generate.h"
#include "model/fused_cpu.h"
#include "model/ops.h"
#include "model/dit.h"
#include "model/layers.h"
#include "model/net.h"
#include "core/presets.h"
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
  DDM_CHECK(argc >= 2, "usage: ddm_bench train|peak|sample|ops [PRESET] [--batch N] [--threads N] [--steps N]");
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
  DDM_CHECK(a.batch >= 1 && a.threads >= 1 && a.steps >= 1 && a.warmup >= 0 && a.n >= 1 && a.nfe >= 1,
            "ddm_bench: --batch, --threads, --steps, --n and --nfe must be >= 1 and --warmup >= 0");
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
    TrainStep stepper(cfg, net, make_objective(cfg));
    Batch batch{torch::rand({a.batch, 1, 28, 28}) * 2 - 1, torch::randint(0, 10, {a.batch}), torch::Tensor(), 0};
    for (int64_t i = 0; i < a.warmup; ++i) stepper.run(batch, i);
    if (const char* trace = std::getenv("DDM_BENCH_TRACE")) {  // LibTorch profiler trace of 3 steps
      torch::autograd::profiler::RecordProfile guard(trace);
      for (int64_t i = 0; i < 3; ++i) stepper.run(batch, a.warmup + i);
    }
    // Median step time: robust to bursts from other processes on a shared machine. reference.py
    // reports the same statistic.
    std::vector<double> times;
    for (int64_t i = 0; i < a.steps; ++i) {
      auto t0 = Clock::now();
      stepper.run(batch, a.warmup + i);
      times.push_back(seconds_since(t0));
    }
    std::sort(times.begin(), times.end());
    const double step_s = times[times.size() / 2];
    // Training FLOPs: forward + backward ~ 3x forward.
    const double gflops = 3.0 * fwd_flops * a.batch / step_s / 1e9;
    std::printf("{\"impl\": \"cpp\", \"mode\": \"train\", \"preset\": \"%s\", \"batch\": %lld, \"threads\": %lld, "
                "\"params\": %lld, \"step_s\": %.5f, \"img_per_s\": %.2f, \"train_gflops\": %.2f}\n",
                a.preset.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.threads),
                static_cast<long long>(count_params(*net)), step_s, a.batch / step_s, gflops);
    return 0;
  }
  if (a.mode == "ops") {
    // The hand-written kernels against LibTorch's own ops, forward + backward, on the shapes of
    // one block of the preset: best of --steps runs each.
    DDM_CHECK(cfg.model.arch == "dit", "ddm_bench ops: needs a DiT preset");
    DDM_CHECK(fused_attention_cpu_supported(torch::zeros({1, 3, 1, 1, 1})), "ddm_bench ops: needs an AVX2 + FMA CPU");
    const int64_t N = (28 / cfg.model.patch) * (28 / cfg.model.patch), H = cfg.model.heads;
    const int64_t d = cfg.model.width / H, hidden = dit_mlp_hidden(cfg.model);
    auto best_of = [&](const std::function<void()>& once) {
      for (int64_t i = 0; i < a.warmup; ++i) once();
      double best = 1e30;
      for (int64_t i = 0; i < a.steps; ++i) {
        auto t0 = Clock::now();
        once();
        best = std::min(best, seconds_since(t0));
      }
      return best;
    };
    auto qkv_store = torch::randn({a.batch, N, 3, H, d}, torch::requires_grad());
    auto attn_grad = torch::randn({a.batch, H, N, d});
    auto attention_once = [&](bool fused) {
      auto qkv = qkv_store.permute({0, 2, 3, 1, 4});  // [B, 3, H, N, d], as the DiT block makes it
      auto u = qkv.unbind(1);
      auto out = fused ? fused_attention_cpu(qkv) : attention_reference(u[0], u[1], u[2]);
      out.backward(attn_grad);
      qkv_store.mutable_grad() = torch::Tensor();
    };
    const int64_t W = cfg.model.width;
    auto x = torch::randn({a.batch * N, W}, torch::requires_grad());
    auto fc1 = torch::nn::Linear(W, hidden);
    auto mlp_grad = torch::randn({a.batch * N, hidden});
    auto mlp_once = [&](bool fused) {
      (fused ? linear_gelu_cpu(x, fc1->weight, fc1->bias) : torch::gelu(fc1(x))).backward(mlp_grad);
      x.mutable_grad() = torch::Tensor();
      fc1->zero_grad();
    };
    // LayerNorm + modulation, then the proj linear and the gated residual (one half of a block
    // without its attention or MLP).
    auto xr = torch::randn({a.batch, N, W}, torch::requires_grad());
    auto mod = torch::randn({a.batch, 3 * W}, torch::requires_grad());
    auto proj = torch::nn::Linear(W, W);
    auto res_grad = torch::randn({a.batch, N, W});
    auto residual_once = [&](bool fused) {
      auto m = mod.chunk(3, -1);  // shift, scale, gate: 3 x [B, W]
      torch::Tensor out;
      if (fused) {
        auto h = adaln_modulate_cpu(xr, m[0], m[1], kDiTNormEps).view({-1, W});
        out = gated_residual_cpu(xr, m[2], torch::mm(h, proj->weight.t()).view({a.batch, N, W}), proj->bias);
      } else {
        auto h = torch::addcmul(m[0].unsqueeze(1), torch::layer_norm(xr, {W}, {}, {}, kDiTNormEps),
                                m[1].unsqueeze(1) + 1.0);
        out = torch::addcmul(xr, m[2].unsqueeze(1), proj(h.view({-1, W})).view({a.batch, N, W}));
      }
      out.backward(res_grad);
      xr.mutable_grad() = torch::Tensor();
      mod.mutable_grad() = torch::Tensor();
      proj->zero_grad();
    };
    const double att3 = best_of([&] { attention_once(false); }), attf = best_of([&] { attention_once(true); });
    const double gel0 = best_of([&] { mlp_once(false); }), gelf = best_of([&] { mlp_once(true); });
    const double res0 = best_of([&] { residual_once(false); }), resf = best_of([&] { residual_once(true); });
    std::printf("{\"impl\": \"cpp\", \"mode\": \"ops\", \"preset\": \"%s\", \"batch\": %lld, \"threads\": %lld, "
                "\"attention_three_op_ms\": %.3f, \"attention_fused_ms\": %.3f, \"attention_speedup\": %.2f, "
                "\"linear_gelu_aten_ms\": %.3f, \"linear_gelu_fused_ms\": %.3f, \"linear_gelu_speedup\": %.2f, "
                "\"adaln_proj_residual_aten_ms\": %.3f, \"adaln_proj_residual_fused_ms\": %.3f, "
                "\"adaln_proj_residual_speedup\": %.2f}\n",
                a.preset.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.threads), att3 * 1e3,
                attf * 1e3, att3 / attf, gel0 * 1e3, gelf * 1e3, gel0 / gelf, res0 * 1e3, resf * 1e3, res0 / resf);
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
  DDM_FAIL("unknown mode " << a.mode << " (train | peak | sample | ops)");
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
