// ddm_bench: training-step throughput per preset (the exact step `ddm train` runs), achieved FLOP/s
// against the machine's measured matmul peak, and sampling throughput. One JSON line per result;
// bench/compare_python.sh runs it side by side with bench/reference.py. Results are reported, never
// asserted.
//
// usage: ddm_bench train PRESET [--batch 128] [--threads 2] [--steps 20] [--warmup 3] [--device cpu|cuda]
//          [--precision fp32|bf16|fp16] [--peak TFLOPS] [--cuda-graphs on|off] (on: train.cuda_graphs, the step
//          captured after 2 eager steps, so keep --warmup >= 3)
//          (PRESET: any model preset, on 28x28x1 with 10 classes, or dit-b: DiT-B/2 on 32x32x4 latents
//           with 1000 classes, as bench/reference.py's; on a GPU the step is timed to its end (a device
//           synchronization) and --peak, the card's dense bf16 TFLOP/s, gives the MFU)
//        ddm_bench forward PRESET --out FILE.safetensors [--batch 4] [--text T:D]
//          (the preset's network with random weights, one float32 forward on the CPU, written with its
//           weights and inputs; bench/reference.py PRESET --check FILE compares its model's forward)
//        ddm_bench peak [--threads 2]
//        ddm_bench sample PRESET [--n 256] [--nfe 50] [--threads 2] [--steps 20] [--warmup 3]
//          [--device cpu|cuda] [--precision fp32|bf16|fp16] [--cuda-graphs on|off] (on: the network's forward
//          replayed from a CUDA graph, as `ddm sample --cuda-graphs`) [--experts K]
//          (n images from noise with the Euler sampler in one batch, no guidance; the best of --steps
//           timed runs after --warmup untimed ones; bench/reference.py --sample is the same in PyTorch.
//           --experts K: a routed top-1 ensemble of K experts of PRESET (random weights, seeds 0..K-1)
//           and an untrained router-conv-tiny whose probabilities a fixed random projection of x_t
//           tilts, so that samples spread over the experts (expert_share says how); with --cuda-graphs on, as `ddm sample --ensemble --cuda-graphs`:
//           every expert and the router from graphs, groups padded to multiples of n / 4K for K experts;
//           [--side-by-side on|off] (on, the default: the experts each on a CUDA stream of their own, as
//           `ddm sample --ensemble` on a GPU; off: one after another, Ensemble::set_side_by_side))
//        ddm_bench ops PRESET [--batch 128] [--threads 2] [--steps 20] [--warmup 3]
//          (attention, and adaLN + proj + gated residual of one DiT block, forward +
//           backward: the fused CPU kernels against LibTorch's ops; attention also against
//           LibTorch's fused scaled_dot_product_attention)
//        ddm_bench optim PRESET [--threads 2] [--steps 20] [--warmup 3]
//          (AdamW + EMA over the preset's parameters: FlatAdamW against LibTorch's fused AdamW on
//           the same flat buffers, and against torch::optim::AdamW per tensor)
//        ddm_bench dp PRESET [--batch 128] [--threads 1] [--steps 5] [--warmup 2] [--bucket-mb 25]
//          [--first-bucket-mb 1] [--wire float32|float16] [--gloo-threads 1] [--sync on|off]
//          [--timeline PREFIX]
//          (data parallel: --batch is the GLOBAL batch, split over the ranks of the launcher's
//           environment (one process without one), gradients synchronized by GradSync exactly as
//           `ddm train` wires it; run it under `ddm launch --nproc N --no-ddm -- ddm_bench dp ...`.
//           Rank 0 prints one JSON line; --timeline writes PREFIX.rankR.json per rank, which
//           `ddm_bench timeline` draws. --sync off: no gradient all-reduce (a diagnostic only:
//           the ranks then train different models))
//        ddm_bench timeline OUT.png RANK0.json [RANK1.json ...] [--step K] [--title TEXT] [--window FROM TO]
//          (one step per rank: compute and communication rows, in ms; the step of median duration
//           on rank 0 unless --step is given; --window: only FROM..TO ms after the step's start)
//        ddm_bench loader SHARDS [--resolution 64] [--batch 256] [--threads 2] [--steps 20] [--warmup 3]
//          (the shard loader alone: batches of RGB images from JPEG/PNG/WebP shards, decoded on
//           --threads threads; bench/loader.sh runs it beside bench/loader_reference.py)
//        ddm_bench phases CONFIG [--set section.key=value ...] [--batch 128] [--threads 2] [--steps 20]
//          [--warmup 3]
//          (the step of a real training config on its real data, model.latent and all, split into its
//           phases: prepare (no-grad work: the frozen encoder, a teacher), the trainable forward,
//           backward and the update, medians in ms; experts (data.partition) and distillation
//           (train.teacher) are prepared as `ddm train` prepares them; frozen_share = prepare / (forward + backward), the
//           DiffusionPipe paper's "44% of the backbone's forward+backward" measure; a ControlNet
//           (model.controlnet) also reports locked_decoder_ms, its frozen decoder's forward and
//           input-gradients timed alone on the same batch, and frozen_grad_path_share = that / (forward + backward))
// DDM_BENCH_TRACE=FILE with `train` writes a LibTorch profiler trace (Chrome JSON) of 3 steps, with
// `sample` of one sampling run (bench/op_profile.py sums either per op).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <time.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "comm/comm.h"
#include "comm/env.h"
#include "comm/grad_sync.h"
#include "core/config.h"
#include "core/cuda_load.h"
#include "core/device.h"
#include "core/error.h"
#include "core/presets.h"
#include "core/rng.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "data/shard_loader.h"
#include "decentral/ensemble.h"
#include "decentral/train_run.h"
#include "diffusion/generate.h"
#include "model/controlnet.h"
#include "model/dit.h"
#include "model/fused_cpu.h"
#include "model/fused_gpu.h"
#include "model/graphed_net.h"
#include "model/layers.h"
#include "model/net.h"
#include "model/ops.h"
#include "run/trainer.h"
#include "sd/controlnet_net.h"
#include "train/controlnet.h"
#include "train/embed.h"
#include "train/latent.h"
#include "train/network.h"
#include "train/optimizer.h"
#include "train/step.h"
#include "train/text.h"

using namespace ddm;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string mode, preset;
  int64_t batch = 128, threads = 2, steps = 20, warmup = 3, n = 256, nfe = 50;
  // dp
  double bucket_mb = 25, first_bucket_mb = 1;
  std::string wire = "float32", sync = "on", timeline;
  std::vector<std::string> sets;  // phases: config overrides
  int64_t gloo_threads = 1;
  std::string device = "cpu", precision = "fp32", cuda_graphs = "off";  // train
  std::string side_by_side = "on";                                     // sample --experts
  std::string out;                                                     // forward: the file written
  double peak_tflops = 0;
  int64_t resolution = 64;  // loader
  int64_t experts = 0;      // sample: a routed ensemble of this many experts (0: one model)
  int64_t text_tokens = 0, text_dim = 0;  // train, sample, forward: --text T:D (0: a class-conditional preset)
  bool batch_set = false, threads_set = false, steps_set = false, warmup_set = false;
};

Args parse(int argc, char** argv) {
  Args a;
  DDM_CHECK(argc >= 2, "usage: ddm_bench train|peak|sample|ops|dp|phases|timeline|loader [PRESET|CONFIG|SHARDS] [--batch N] "
                       "[--threads N] [--steps N]");
  a.mode = argv[1];
  int i = 2;
  if (a.mode != "peak") {
    DDM_CHECK(argc >= 3, "ddm_bench " << a.mode << " needs a "
                                      << (a.mode == "phases" ? "config file" : a.mode == "loader" ? "shard pattern" : "preset"));
    a.preset = argv[i++];
  }
  for (; i < argc; i += 2) {
    const std::string k = argv[i];
    DDM_CHECK(i + 1 < argc, "ddm_bench: " << k << " needs a value");
    const std::string s = argv[i + 1];
    const int64_t v = std::atoll(s.c_str());
    if (k == "--batch") a.batch = v, a.batch_set = true;
    else if (k == "--threads") a.threads = v, a.threads_set = true;
    else if (k == "--steps") a.steps = v, a.steps_set = true;
    else if (k == "--warmup") a.warmup = v, a.warmup_set = true;
    else if (k == "--n") a.n = v;
    else if (k == "--nfe") a.nfe = v;
    else if (k == "--bucket-mb") a.bucket_mb = std::atof(s.c_str());
    else if (k == "--first-bucket-mb") a.first_bucket_mb = std::atof(s.c_str());
    else if (k == "--wire") a.wire = s;
    else if (k == "--gloo-threads") a.gloo_threads = v;
    else if (k == "--sync") a.sync = s;
    else if (k == "--timeline") a.timeline = s;
    else if (k == "--set") a.sets.push_back(s);
    else if (k == "--device") a.device = s;
    else if (k == "--precision") a.precision = s;
    else if (k == "--cuda-graphs") a.cuda_graphs = s;
    else if (k == "--side-by-side") a.side_by_side = s;
    else if (k == "--peak") a.peak_tflops = std::atof(s.c_str());
    else if (k == "--resolution") a.resolution = v;
    else if (k == "--experts") a.experts = v;
    else if (k == "--out") a.out = s;
    else if (k == "--text") {
      const auto colon = s.find(':');
      DDM_CHECK(colon != std::string::npos, "--text takes TOKENS:WIDTH (e.g. 77:1024), got " << s);
      a.text_tokens = std::atoll(s.substr(0, colon).c_str());
      a.text_dim = std::atoll(s.substr(colon + 1).c_str());
      DDM_CHECK(a.text_tokens >= 2 && a.text_dim >= 1, "--text: TOKENS must be >= 2 and WIDTH >= 1, got " << s);
    }
    else DDM_FAIL("unknown flag " << k);
  }
  if (a.mode == "forward" && !a.batch_set) a.batch = 4;  // a file to compare, not a speed
  if (a.mode == "dp") {  // defaults of the data-parallel mode: one thread per rank, few (slow) steps
    if (!a.threads_set) a.threads = 1;
    if (!a.steps_set) a.steps = 5;
    if (!a.warmup_set) a.warmup = 2;
  }
  DDM_CHECK(a.wire == "float32" || a.wire == "float16", "--wire must be float32 or float16, got " << a.wire);
  DDM_CHECK(a.precision == "fp32" || a.precision == "bf16" ||
                (a.precision == "fp16" && (a.mode == "sample" || a.mode == "train")),
            "--precision must be fp32, bf16 or fp16 (train and sample), got " << a.precision);
  check_device_spec(a.device, "--device");
  DDM_CHECK(a.sync == "on" || a.sync == "off", "--sync must be on or off, got " << a.sync);
  DDM_CHECK(a.cuda_graphs == "on" || a.cuda_graphs == "off", "--cuda-graphs must be on or off, got " << a.cuda_graphs);
  DDM_CHECK(a.side_by_side == "on" || a.side_by_side == "off", "--side-by-side must be on or off, got " << a.side_by_side);
  DDM_CHECK(a.bucket_mb > 0 && a.first_bucket_mb > 0 && a.gloo_threads >= 1,
            "--bucket-mb and --first-bucket-mb must be > 0, --gloo-threads >= 1");
  DDM_CHECK(a.batch >= 1 && a.threads >= 1 && a.steps >= 1 && a.warmup >= 0 && a.n >= 1 && a.nfe >= 1,
            "ddm_bench: --batch, --threads, --steps, --n and --nfe must be >= 1 and --warmup >= 0");
  DDM_CHECK(a.experts == 0 || (a.experts >= 2 && a.mode == "sample"), "--experts K (K >= 2) applies to ddm_bench sample");
  DDM_CHECK(a.text_tokens == 0 || ((a.mode == "train" || a.mode == "sample" || a.mode == "forward") && a.experts == 0),
            "--text applies to ddm_bench train, sample and forward, without --experts");
  DDM_CHECK(a.mode != "forward" || !a.out.empty(), "ddm_bench forward needs --out FILE.safetensors");
  return a;
}

RunConfig preset_config(const std::string& preset, int64_t batch) {
  if (preset == "dit-b")  // DiT-B/2 on ImageNet-256's 32x32x4 latents: the GPU benchmark's model
    return parse_config("", "bench",
                        {"model.arch=dit", "model.patch=2", "model.width=768", "model.depth=12", "model.heads=12",
                         "model.mlp_ratio=4.0", "model.in_channels=4", "model.image_size=32", "model.num_classes=1000",
                         "train.batch_size=" + std::to_string(batch)});
  RunConfig cfg = parse_config("", "bench", {"model.preset=" + preset, "train.batch_size=" + std::to_string(batch)});
  cfg.model.in_channels = 1;
  cfg.model.image_size = 28;
  cfg.model.num_classes = 10;
  return cfg;
}

// --text T:D: the preset conditioned on text instead of classes, with what ddm trains text models
// with (model.text_dim, train.caption_dropout's default 0.1): cross-attention after every DiT block's
// self-attention (PixArt-alpha's), SD's spatial transformer at a U-Net's attention levels. No text
// encoder runs: the token states are given, as latent shards with cached encodings give them.
void apply_bench_text(RunConfig& cfg, const Args& a) {
  if (a.text_tokens == 0) return;
  DDM_CHECK(cfg.model.arch == "dit" || !cfg.model.attn_levels.empty(),
            "--text: " << a.preset << " has no attention level to attend to the text from");
  cfg.model.text_dim = a.text_dim;
  cfg.model.text_tokens = a.text_tokens;
  cfg.model.num_classes = 0;
}

// The bench's text conditions, the same as bench/reference.py's: n samples' token states, float
// [n, T, D] standard normal (seeded), and their masks, int64 [n, T]: sample i attends to its first
// min(T, 8 + 13 i mod 24) tokens (captions of 8 to 31 tokens), as a text encoder with a padding mask
// gives them (BERT's; CLIP's attends to all T). null: the empty prompt's, [1, T, D]
// with its first 2 tokens (start and end) attended to.
Cond bench_text_cond(int64_t n, const Args& a, bool null) {
  const int64_t T = a.text_tokens;
  Cond c;
  c.context = torch::randn({n, T, a.text_dim}, make_generator(null ? 2 : 1));  // [n, T, D]
  const auto len = null ? torch::full({n, 1}, 2, torch::kLong)
                        : (8 + (13 * torch::arange(n, torch::kLong)).remainder(24)).clamp_max(T).view({n, 1});  // [n, 1]
  c.context_mask = torch::arange(T, torch::kLong).view({1, T}).lt(len).to(torch::kLong);  // [n, T]
  c.pooled = torch::zeros({n, 0});  // [n, 0]: no pooled embedding (model.text_pooled_dim = 0), as cached encodings hold it
  return c;
}

// The preset as the JSON lines name it: "dit-b" or, with --text 77:1024, "dit-b+text77x1024" (as bench/reference.py's).
std::string bench_name(const Args& a) {
  if (a.text_tokens == 0) return a.preset;
  return a.preset + "+text" + std::to_string(a.text_tokens) + "x" + std::to_string(a.text_dim);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// DDM_BENCH_TRACE: `run` under LibTorch's profiler, its Chrome trace written to `path`. On a GPU with
// Kineto, so that the GPU's kernels are in it (the "kernel" events bench/op_profile.py --gpu sums), as
// reference.py --trace records them with torch.profiler; on the CPU the CPU ops alone.
void profiled(const char* path, torch::Device device, const std::function<void()>& run) {
  if (device.is_cuda()) {
    namespace prof = torch::profiler::impl;
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
    const std::set<prof::ActivityType> activities{prof::ActivityType::CPU, prof::ActivityType::CUDA};
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    run();
    torch::autograd::profiler::disableProfiler()->save(path);
  } else {
    torch::autograd::profiler::RecordProfile guard(path);
    run();
  }
}

// The fastest of `steps` runs of `once`, in seconds, after `warmup` untimed runs.
double best_seconds(const std::function<void()>& once, int64_t warmup, int64_t steps) {
  for (int64_t i = 0; i < warmup; ++i) once();
  double best = 1e30;
  for (int64_t i = 0; i < steps; ++i) {
    auto t0 = Clock::now();
    once();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

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

double ms_between(StepTimes::TimePoint a, StepTimes::TimePoint b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
int64_t ns_of(StepTimes::TimePoint t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// CPU time (ms) of the whole process (every thread: compute, Gloo's, the store's) and of the calling
// thread (the one that runs forward, backward and the optimizer; with one intra-op thread, all of the
// compute). Their difference with one intra-op thread is what Gloo's threads used.
double cpu_ms(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// The 1-minute load average: how busy the machine was (other processes included) when a run began.
double load_average() {
  double l = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = -1;
    std::fclose(f);
  }
  return l;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// How long at least one bucket's all-reduce was in flight: the union of the [launch, done]
// intervals (ms). Buckets are queued behind each other in Gloo's thread(s), so the sum of
// (done - launch) would count the queueing of later buckets again; the union does not. This is the
// denominator of the exposed fraction: exposed = wait after backward / union.
double allreduce_busy_ms(const GradSyncStats& st) {
  std::vector<std::pair<double, double>> iv;
  for (size_t b = 0; b < st.launch_ms.size(); ++b)
    if (st.launch_ms[b] >= 0 && st.done_ms[b] >= 0) iv.emplace_back(st.launch_ms[b], st.done_ms[b]);
  std::sort(iv.begin(), iv.end());
  double total = 0, lo = 0, hi = -1;
  for (const auto& [a, b] : iv) {
    if (a > hi) {
      if (hi > lo) total += hi - lo;
      lo = a;
      hi = b;
    } else {
      hi = std::max(hi, b);
    }
  }
  if (hi > lo) total += hi - lo;
  return total;
}

// `ddm_bench dp`: the training step with data parallelism, wired as train() wires it (Comm from the
// launcher's environment, this rank's shard of the global batch, GradSync on the optimizer's flat
// gradient buffer). Phases are read from TrainStep::last_times() and GradSync::last_stats(), so the
// timed code is exactly the library's.
int run_dp(const Args& a, const RunConfig& cfg, Net net) {
  const DistEnv env = detect_dist_env();
  CommOptions co;
  co.gloo_threads = static_cast<int>(a.gloo_threads);
  auto comm = Comm::create(env, co);
  const int rank = comm->rank(), world = comm->world_size();
  DDM_CHECK(a.batch % world == 0, "ddm_bench dp: --batch " << a.batch << " (global) does not split into " << world << " ranks");
  const int64_t local = a.batch / world;
  TrainStep stepper(cfg, net, make_objective(cfg));
  std::shared_ptr<GradSync> sync;
  if (comm->distributed()) {
    GradSyncOptions so;
    so.first_bucket_bytes = static_cast<int64_t>(a.first_bucket_mb * (1 << 20));
    so.bucket_cap_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
    so.fp16_wire = a.wire == "float16";
    if (a.sync == "on") sync = std::make_shared<GradSync>(comm, stepper.optim().params(), stepper.optim().flat_grad(), so);
    stepper.set_data_parallel(comm, sync);  // without sync: only the loss is all-reduced (--sync off)
  }
  torch::manual_seed(1000 + rank);  // this rank's shard: different samples on every rank
  Batch batch{torch::rand({local, 1, 28, 28}) * 2 - 1, torch::randint(0, 10, {local}), torch::Tensor(), rank * local};
  for (int64_t i = 0; i < a.warmup; ++i) stepper.run(batch, i);
  comm->barrier();
  const double load = load_average();

  nlohmann::json steps = nlohmann::json::array();
  std::vector<double> step_ms, fwd_ms, bwd_ms, bwd_compute_ms, wait_ms, busy_ms, loss_sync_ms, clip_ms, update_ms;
  std::vector<double> proc_cpu_ms, main_cpu_ms;
  std::vector<int64_t> compute_end_ns;  // backward compute ended: backward() returned, minus its wait
  int64_t bytes = 0;
  int buckets_early = 0;
  for (int64_t i = 0; i < a.steps; ++i) {
    const double p0 = cpu_ms(CLOCK_PROCESS_CPUTIME_ID), m0 = cpu_ms(CLOCK_THREAD_CPUTIME_ID);
    stepper.run(batch, a.warmup + i);
    proc_cpu_ms.push_back(cpu_ms(CLOCK_PROCESS_CPUTIME_ID) - p0);
    main_cpu_ms.push_back(cpu_ms(CLOCK_THREAD_CPUTIME_ID) - m0);
    const StepTimes& t = stepper.last_times();
    GradSyncStats st;
    if (sync) st = sync->last_stats();
    const double bwd = ms_between(t.backward_start, t.backward_end);
    const double busy = allreduce_busy_ms(st);
    step_ms.push_back(ms_between(t.start, t.end));
    fwd_ms.push_back(ms_between(t.start, t.backward_start));
    bwd_ms.push_back(bwd);
    bwd_compute_ms.push_back(bwd - st.wait_ms);
    wait_ms.push_back(st.wait_ms);
    busy_ms.push_back(busy);
    loss_sync_ms.push_back(ms_between(t.backward_end, t.synced));
    clip_ms.push_back(ms_between(t.synced, t.clipped));
    update_ms.push_back(ms_between(t.clipped, t.end));
    compute_end_ns.push_back(ns_of(t.backward_end) - static_cast<int64_t>(st.wait_ms * 1e6));
    bytes = st.bytes;
    buckets_early = st.launched_early;
    if (!a.timeline.empty()) {
      nlohmann::json rec = {{"start_ns", ns_of(t.start)},          {"backward_start_ns", ns_of(t.backward_start)},
                            {"backward_end_ns", ns_of(t.backward_end)}, {"synced_ns", ns_of(t.synced)},
                            {"clipped_ns", ns_of(t.clipped)},       {"end_ns", ns_of(t.end)},
                            {"wait_ms", st.wait_ms},                {"bytes", st.bytes}};
      nlohmann::json bk = nlohmann::json::array();
      if (sync) {
        rec["origin_ns"] = ns_of(st.origin);
        const int64_t elem = a.wire == "float16" ? 2 : 4;
        for (size_t b = 0; b < st.launch_ms.size(); ++b)
          bk.push_back({{"index", b},
                        {"bytes", sync->buckets()[b].numel() * elem},
                        {"launch_ms", st.launch_ms[b]},
                        {"done_ms", st.done_ms[b]}});
      }
      rec["buckets"] = bk;
      steps.push_back(rec);
    }
  }
  if (!a.timeline.empty()) {
    nlohmann::json doc = {{"preset", a.preset}, {"rank", rank},         {"world", world},
                          {"threads", a.threads}, {"global_batch", a.batch}, {"bucket_mb", a.bucket_mb},
                          {"first_bucket_mb", a.first_bucket_mb}, {"wire", a.wire}, {"sync", a.sync},
                          {"steps", steps}};
    const std::string path = a.timeline + ".rank" + std::to_string(rank) + ".json";
    std::ofstream f(path);
    f << doc.dump(1) << "\n";
    DDM_CHECK(f.good(), "ddm_bench dp: cannot write the timeline " << path << " (does its directory exist?)");
  }
  // Per step, every rank's backward-compute end (absolute, one steady clock for the whole machine),
  // wait and all-reduce busy time go to rank 0. The rank whose backward compute ended LAST in a step
  // is the critical one: its wait after backward is communication that backward did not hide (the
  // "exposed" time of the target), and its union of bucket intervals is the all-reduce time. A rank
  // that finished earlier also waits for its slower peer (skew: other processes on the machine,
  // uneven cores); that is reported separately as skew_ms, the spread of compute ends.
  nlohmann::json mine = {{"compute_end_ns", compute_end_ns}, {"wait_ms", wait_ms}, {"busy_ms", busy_ms},
                         {"bwd_compute_ms", median(bwd_compute_ms)}, {"fwd_ms", median(fwd_ms)},
                         {"cpu_ms", median(proc_cpu_ms)}, {"main_cpu_ms", median(main_cpu_ms)},
                         {"step_ms", median(step_ms)}};
  const auto all = comm->all_gather_strings(mine.dump());
  if (rank != 0) return 0;
  std::vector<nlohmann::json> rj;
  for (const auto& s : all) rj.push_back(nlohmann::json::parse(s));
  std::vector<double> exposed, busy_crit, skew, worst_wait;
  double exposed_sum = 0, busy_sum = 0;
  for (int64_t k = 0; k < a.steps; ++k) {
    int crit = 0;
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    double ww = 0;
    for (int r = 0; r < world; ++r) {
      const int64_t e = rj[r]["compute_end_ns"][k].get<int64_t>();
      if (e > hi) hi = e, crit = r;
      lo = std::min(lo, e);
      ww = std::max(ww, rj[r]["wait_ms"][k].get<double>());
    }
    const double w = rj[crit]["wait_ms"][k].get<double>(), b = rj[crit]["busy_ms"][k].get<double>();
    exposed.push_back(w);
    busy_crit.push_back(b);
    skew.push_back((hi - lo) / 1e6);
    worst_wait.push_back(ww);
    exposed_sum += w;
    busy_sum += b;
  }
  nlohmann::json per_rank = nlohmann::json::array();
  double cpu_sum = 0, other_sum = 0, main_share_min = 1e9;
  for (const auto& j : rj) {
    const double cpu = j["cpu_ms"], main = j["main_cpu_ms"], wall = j["step_ms"];
    cpu_sum += cpu;
    other_sum += cpu - main;
    main_share_min = std::min(main_share_min, main / wall);
    per_rank.push_back({{"fwd_ms", j["fwd_ms"]}, {"bwd_compute_ms", j["bwd_compute_ms"]},
                        {"wait_ms", median(j["wait_ms"].get<std::vector<double>>())}, {"cpu_ms", cpu},
                        {"main_thread_cpu_ms", main}, {"step_ms", wall}});
  }
  const double step_s = median(step_ms) / 1e3;
  nlohmann::json out = {{"impl", "cpp"},
                        {"mode", "dp"},
                        {"preset", a.preset},
                        {"global_batch", a.batch},
                        {"ranks", world},
                        {"threads", a.threads},
                        {"gloo_threads", a.gloo_threads},
                        {"bucket_mb", a.bucket_mb},
                        {"first_bucket_mb", a.first_bucket_mb},
                        {"wire", a.wire},
                        {"sync", a.sync},
                        {"buckets", sync ? static_cast<int64_t>(sync->buckets().size()) : 0},
                        {"buckets_launched_early", buckets_early},
                        {"params", count_params(*net)},
                        {"steps", a.steps},
                        {"step_s", step_s},
                        {"img_per_s", a.batch / step_s},
                        {"allreduce_bytes_per_rank", bytes},
                        {"fwd_ms", median(fwd_ms)},
                        {"bwd_ms", median(bwd_ms)},
                        {"bwd_compute_ms", median(bwd_compute_ms)},
                        {"exposed_wait_ms", median(exposed)},
                        {"allreduce_busy_ms", median(busy_crit)},
                        {"exposed_frac", busy_sum > 0 ? exposed_sum / busy_sum : 0.0},
                        {"skew_ms", median(skew)},
                        {"max_wait_ms", median(worst_wait)},
                        {"loss_sync_ms", median(loss_sync_ms)},
                        {"clip_ms", median(clip_ms)},
                        {"update_ms", median(update_ms)},
                        // CPU time per step, all ranks together: how many cores the run got
                        // (other processes on the machine take the rest), images per CPU-second
                        // (the work itself, whatever the contention), and what threads other than
                        // the compute thread used (Gloo's; with --threads 2 also OpenMP's worker).
                        {"cpu_ms", cpu_sum},
                        {"cores_used", cpu_sum / median(step_ms)},
                        {"img_per_cpu_s", a.batch / (cpu_sum / 1e3)},
                        {"other_threads_cpu_ms", other_sum},
                        {"main_thread_share_min", main_share_min},
                        {"load_before", load},
                        {"per_rank", per_rank}};
  std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

// `ddm_bench phases`: a real config's step, phase by phase, read from TrainStep::last_times().
int run_phases(const Args& a) {
  std::vector<std::string> sets = a.sets;
  sets.push_back("train.batch_size=" + std::to_string(a.batch));
  sets.push_back("train.threads=" + std::to_string(a.threads));
  // As `ddm train` prepares it: data loaded, model (and latent) resolved, an expert's cluster or a
  // distillation teacher (train.teacher) set up.
  TrainJob job = prepare_train_job(load_config(a.preset, sets));
  const RunConfig& cfg = job.cfg;
  torch::manual_seed(0);
  Net net = make_network(cfg);  // ddm's networks and diffusers' UNet (model.arch = sd-unet)
  attach_controlnet(*net, cfg.model);
  auto objective = job.objective ? job.objective : make_objective(cfg);
  const auto latent = attach_latent(*objective, cfg.model, torch::kCPU, cfg.train.cache_latents ? &job.data : nullptr);
  const auto embedder = attach_embed(*objective, cfg.model);
  const auto text = attach_text(*objective, cfg.model, job.data, torch::kCPU);  // the frozen text encoder
  TrainStep stepper(cfg, net, objective);
  auto* controlnet = dynamic_cast<ControlNetImpl*>(net.get());
  auto* sd_controlnet = dynamic_cast<sd::SdControlNetNetImpl*>(net.get());  // on Stable Diffusion's UNet
  std::vector<double> locked;  // a ControlNet's locked decoder: forward + input-gradients
  const int64_t n = job.data.images.size(0);
  DDM_CHECK(n >= a.batch, a.preset << ": the data has " << n << " images, fewer than --batch " << a.batch);
  std::vector<double> prep, fwd, bwd, upd, step;
  for (int64_t i = 0; i < a.warmup + a.steps; ++i) {
    const int64_t first = (i * a.batch) % (n - a.batch + 1);
    Batch b{to_unit_range(job.data.images.slice(0, first, first + a.batch)),
            job.data.labels.slice(0, first, first + a.batch),
            job.data.clusters.defined() ? job.data.clusters.slice(0, first, first + a.batch) : torch::Tensor(), 0,
            torch::arange(first, first + a.batch, torch::kLong)};
    if (!job.data.captions.empty())
      b.captions.assign(job.data.captions.begin() + first, job.data.captions.begin() + first + a.batch);
    stepper.run(b, i);
    if (i < a.warmup) continue;
    const StepTimes& t = stepper.last_times();
    prep.push_back(ms_between(t.start, t.prepared));
    fwd.push_back(ms_between(t.prepared, t.backward_start));
    bwd.push_back(ms_between(t.backward_start, t.backward_end));
    upd.push_back(ms_between(t.backward_end, t.end));
    step.push_back(ms_between(t.start, t.end));
    if (controlnet) {
      // The frozen work on the gradient path, alone: the locked decoder on this batch's features
      // with residuals that need gradients, forward and backward (no parameter gradient: all frozen).
      Prepared p;
      {
        torch::NoGradGuard ng;
        p = objective->prepare(b, i);
        p.cond = controlnet->precompute(p.xt, p.t, p.cond);
      }
      UNetImpl::Features f{p.cond.frozen[0], {p.cond.frozen.begin() + 2, p.cond.frozen.end()}, p.cond.frozen[1]};
      std::vector<torch::Tensor> res;
      for (const auto& s : f.skips) res.push_back(torch::zeros_like(s).requires_grad_());
      res.push_back(torch::zeros_like(f.h).requires_grad_());
      const auto t0 = std::chrono::steady_clock::now();
      controlnet->base().decode(f, res).pow(2).mean().backward();
      locked.push_back(ms_between(t0, std::chrono::steady_clock::now()));
    }
    if (sd_controlnet) {  // the same for the locked UNet's decoder (its up blocks and output)
      Prepared p;
      {
        torch::NoGradGuard ng;
        p = objective->prepare(b, i);
        p.cond = sd_controlnet->precompute(p.xt, p.t, p.cond);
      }
      NetCarry k{p.cond.frozen[1], p.cond.frozen[0], {p.cond.frozen.begin() + 2, p.cond.frozen.end()}};
      sd::UNetResiduals res;
      for (const auto& s : k.skips) res.down.push_back(torch::zeros_like(s).requires_grad_());
      res.mid = torch::zeros_like(k.h).requires_grad_();
      const auto t0 = std::chrono::steady_clock::now();
      sd_controlnet->unet()->decode(k, p.cond.context, &res).pow(2).mean().backward();
      locked.push_back(ms_between(t0, std::chrono::steady_clock::now()));
    }
  }
  const std::string cn_frozen = controlnet || sd_controlnet ? cfg.model.control + " maps and the locked " +
                                                                  (sd_controlnet ? "UNet's encoder" : "encoder of " + cfg.model.controlnet)
                                                            : "";
  nlohmann::json j = {{"mode", "phases"},
                      {"config", a.preset},
                      {"set", a.sets},
                      {"model", network_name(cfg.model)},
                      {"params", count_params(*net)},
                      {"input", std::to_string(cfg.model.in_channels) + "x" + std::to_string(cfg.model.image_size) +
                                    "x" + std::to_string(cfg.model.image_size)},
                      {"frozen", (text ? "text encoder " + cfg.model.text_encoder + (latent ? " and " : "") : std::string()) +
                                     (latent ? (cfg.train.cache_latents ? "cached latents of " : "encoder of ") + latent->checkpoint()
                                        : !cfg.train.teacher.empty() ? "teacher ensemble " + cfg.train.teacher
                                        : embedder ? "embedding network " + embedder->path()
                                        : text || !cn_frozen.empty() ? "" : "none") +
                                     (cn_frozen.empty() ? "" : (text || latent ? ", " : "") + cn_frozen)},
                      {"batch", a.batch},
                      {"threads", a.threads},
                      {"steps", a.steps},
                      {"load_before", load_average()},
                      {"prepare_ms", median(prep)},
                      {"forward_ms", median(fwd)},
                      {"backward_ms", median(bwd)},
                      {"update_ms", median(upd)},
                      {"step_ms", median(step)},
                      {"img_per_s", a.batch / (median(step) / 1e3)},
                      {"frozen_share", median(prep) / (median(fwd) + median(bwd))}};
  if (controlnet || sd_controlnet) {  // the locked decoder runs inside forward + backward: how much of it
    j["locked_decoder_ms"] = median(locked);
    j["frozen_grad_path_share"] = median(locked) / (median(fwd) + median(bwd));
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

// Loader throughput: batches of decoded, centre-cropped, resized, flipped RGB images (float in
// [-1, 1], as the trainer takes them) from the shards a.preset names, decoded on a.threads threads,
// a shuffle buffer of 1000; images per second over a.steps batches after a.warmup. The intra-op
// pool gets one thread, as a PyTorch DataLoader worker's does (bench/loader_reference.py).
int run_loader(const Args& a) {
  torch::set_num_threads(1);
  DataConfig dc;
  dc.source = "shards";
  dc.root = a.preset;
  dc.resolution = a.resolution;
  dc.channels = 3;
  dc.hflip = true;
  dc.decode_threads = a.threads;
  const Dataset d = open_shards(dc, static_cast<int>(a.threads), /*quiet=*/true);
  ShardOrder order;
  order.shuffle_buffer = 1000;
  ShardLoader loader(d.shards, order, shard_loader_options(dc, d, a.batch, 1));
  for (int64_t i = 0; i < a.warmup; ++i) loader.next();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < a.steps; ++i) {
    const Batch b = loader.next();
    DDM_CHECK(b.x.size(0) == a.batch && b.x.size(2) == a.resolution, "ddm_bench loader: a batch of " << b.x.sizes());
  }
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  const nlohmann::json j = {{"impl", "cpp"}, {"mode", "loader"}, {"resolution", a.resolution}, {"workers", a.threads},
                            {"batch", a.batch}, {"steps", a.steps}, {"img_per_s", static_cast<double>(a.steps * a.batch) / dt}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

int timeline_main(int argc, char** argv);  // bench/timeline.cpp

int main(int argc, char** argv) try {
  ddm::load_cuda();  // before anything asks LibTorch about CUDA (core/cuda_load.h)
  if (argc >= 2 && std::string(argv[1]) == "timeline") return timeline_main(argc, argv);
  const Args a = parse(argc, argv);
  if (!std::getenv("DDM_DEFAULT_MALLOC")) configure_allocator();
  if (a.mode == "peak") {
    std::printf("{\"impl\": \"cpp\", \"mode\": \"peak\", \"threads\": %lld, \"matmul_gflops\": %.2f}\n",
                static_cast<long long>(a.threads), matmul_peak(a.threads) / 1e9);
    return 0;
  }
  if (a.mode == "loader") return run_loader(a);
  torch::set_num_threads(static_cast<int>(a.threads));
  if (a.mode == "phases") return run_phases(a);
  RunConfig cfg = preset_config(a.preset, a.batch);
  apply_bench_text(cfg, a);
  torch::manual_seed(0);
  Net net = make_net(cfg.model);
  const double fwd_flops = forward_flops_per_image(cfg.model);
  if (a.mode == "dp") return run_dp(a, cfg, net);
  if (a.mode == "forward") {
    // The preset's network with every parameter drawn at random (the zero-initialised output layers
    // too, so that every path counts), one forward of --batch samples in float32 on the CPU, written
    // with its inputs: bench/reference.py --check FILE loads the weights into its model and compares
    // (tests/integration/test_bench_reference.cpp): the PyTorch model ddm is measured against is ddm's.
    torch::NoGradGuard no_grad;
    torch::manual_seed(3);
    SafetensorsFile f;
    for (const auto& p : net->named_parameters()) {
      const double fan_in = p.value().dim() >= 2 ? static_cast<double>(p.value()[0].numel()) : 16.0;
      p.value().normal_(0.0, 1.0 / std::sqrt(fan_in));
      f.tensors["param/" + p.key()] = p.value().clone();
    }
    const int64_t B = a.batch, c = cfg.model.in_channels, s = cfg.model.image_size;
    const torch::Tensor x = torch::randn({B, c, s, s}), t = torch::rand({B});  // [B, C, S, S], [B]
    Cond cond(torch::randint(0, std::max<int64_t>(1, cfg.model.num_classes), {B}));  // [B]
    if (a.text_tokens > 0) {
      const Cond text = bench_text_cond(B, a, false);
      cond.context = text.context, cond.context_mask = text.context_mask;  // [B, T, D], [B, T]
      f.tensors["context"] = text.context, f.tensors["mask"] = text.context_mask;
    }
    net->eval();
    f.tensors["x"] = x, f.tensors["t"] = t, f.tensors["y"] = cond.y;
    f.tensors["out"] = net->forward(x, t, cond);  // [B, C, S, S]
    f.metadata["preset"] = bench_name(a);
    save_safetensors(a.out, f);
    std::printf("{\"impl\": \"cpp\", \"mode\": \"forward\", \"preset\": \"%s\", \"params\": %lld, \"out\": \"%s\"}\n",
                bench_name(a).c_str(), static_cast<long long>(count_params(*net)), a.out.c_str());
    return 0;
  }
  const torch::Device device = resolve_device(a.device, 0, "--device");
  configure_math(device, false);
  auto sync = [&] {  // a GPU step is over when the device is done
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  if (a.mode == "train") {
    cfg.train.precision = precision_named(a.precision);  // fp16: with its loss scale (train/loss_scale.h)
    cfg.train.cuda_graphs = a.cuda_graphs == "on";  // train/step_graph.cpp: captured after 2 eager steps
    net->to(device);
    const auto objective = make_objective(cfg);
    const int64_t c = cfg.model.in_channels, s = cfg.model.image_size;
    Batch batch{torch::rand({a.batch, c, s, s}) * 2 - 1, torch::randint(0, std::max<int64_t>(1, cfg.model.num_classes), {a.batch}),
                torch::Tensor(), 0};
    if (a.text_tokens > 0) {  // the batch's caption encodings, and the empty prompt's for caption dropout
      const Cond text = bench_text_cond(a.batch, a, false);
      batch.context = text.context, batch.context_mask = text.context_mask, batch.pooled = text.pooled;
      objective->set_cached_text(bench_text_cond(1, a, true));
    }
    TrainStep stepper(cfg, net, objective);
    batch = batch.to(device);  // (the data's copy to the device is not part of the step timed here)
    // As the training loop steps: each step prepares the next one at its end (train/step.h), here
    // the same batch at the next step's draws.
    const std::vector<Batch> micro{batch};
    auto step = [&](int64_t i) { stepper.run(micro, i, micro); };
    for (int64_t i = 0; i < a.warmup; ++i) step(i);
    sync();
    if (const char* trace = std::getenv("DDM_BENCH_TRACE"))  // LibTorch profiler trace of 3 steps
      profiled(trace, device, [&] {
        for (int64_t i = 0; i < 3; ++i) step(a.warmup + i);
        sync();
      });
    // Median step time: robust to bursts from other processes on a shared machine. reference.py
    // reports the same statistic.
    std::vector<double> times;
    for (int64_t i = 0; i < a.steps; ++i) {
      auto t0 = Clock::now();
      step(a.warmup + i);
      sync();
      times.push_back(seconds_since(t0));
    }
    std::sort(times.begin(), times.end());
    const double step_s = times[times.size() / 2];
    // The step's prepare phase alone (the keyed draws on the CPU, their copy, x_t and the target),
    // median: on a GPU the device waits for it.
    std::vector<double> prep;
    for (int64_t i = 0; i < a.steps; ++i) {
      torch::NoGradGuard no_grad;
      auto t0 = Clock::now();
      const Prepared p = stepper.objective().prepare(batch, a.warmup + i);
      sync();
      prep.push_back(seconds_since(t0));
    }
    std::sort(prep.begin(), prep.end());
    // Training FLOPs: forward + backward ~ 3x forward.
    const double gflops = 3.0 * fwd_flops * a.batch / step_s / 1e9;
    nlohmann::json j = {{"impl", "cpp"},        {"mode", "train"},        {"preset", bench_name(a)},
                        {"batch", a.batch},     {"threads", a.threads},   {"device", device.str()},
                        {"precision", a.precision}, {"params", count_params(*net)}, {"step_s", step_s},
                        {"img_per_s", a.batch / step_s}, {"train_gflops", gflops},
                        {"prepare_ms", prep[prep.size() / 2] * 1e3}};
    if (device.is_cuda()) j["fused_cuda"] = fused_cuda_enabled();  // DDM_FUSED_CUDA (model/fused_gpu.h)
    if (device.is_cuda()) j["fused_group_norm"] = fused_group_norm_enabled();  // DDM_FUSED_GROUPNORM
    if (cfg.model.arch == "unet") j["channels_last"] = channels_last_enabled(device);  // DDM_CHANNELS_LAST (model/ops.h)
    if (device.is_cuda()) j["cuda_graphs"] = cfg.train.cuda_graphs;
    if (a.peak_tflops > 0) j["mfu"] = gflops / 1e3 / a.peak_tflops;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  if (a.mode == "optim") {
    // The optimizer update of the preset's parameters (AdamW + EMA, as `ddm train` runs it), best of
    // --steps: FlatAdamW's one pass over the flat buffers against LibTorch's fused AdamW kernel
    // (at::_fused_adamw_, what torch.optim.AdamW(fused=True) runs) on the same flat buffers followed
    // by the EMA as one lerp_, and against LibTorch C++'s torch::optim::AdamW over the parameter
    // tensors (+ the same EMA per tensor).
    auto best_of = [&](const std::function<void()>& once) { return best_seconds(once, a.warmup, a.steps); };
    FlatAdamW flat(*net, AdamWOptions{});
    flat.flat_grad().copy_(torch::randn_like(flat.flat_grad()) * 1e-3);
    const double t_flat = best_of([&] { flat.step(1e-4, 0.999); });
    torch::Tensor p = flat.flat_params().clone(), g = flat.flat_grad().clone(), m = torch::zeros_like(p),
                  v = torch::zeros_like(p), e = p.clone(), st = torch::zeros({}, torch::kFloat);
    const double t_fused = best_of([&] {
      torch::NoGradGuard no_grad;
      st.add_(1);
      at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {st}, 1e-4, 0.9, 0.999, 0.0, 1e-8, false, false);
      e.lerp_(p, 1 - 0.999);
    });
    std::vector<torch::Tensor> params, emas;
    for (const auto& q : net->parameters()) {
      params.push_back(q.detach().clone().requires_grad_(true));
      params.back().mutable_grad() = torch::randn_like(q) * 1e-3;
      emas.push_back(q.detach().clone());
    }
    torch::optim::AdamW per_tensor(params, torch::optim::AdamWOptions(1e-4).weight_decay(0));
    const double t_torch = best_of([&] {
      per_tensor.step();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) emas[i].lerp_(params[i], 1 - 0.999);
    });
    std::printf("{\"impl\": \"cpp\", \"mode\": \"optim\", \"preset\": \"%s\", \"threads\": %lld, \"params\": %lld, "
                "\"flat_adamw_ms\": %.3f, \"fused_adamw_flat_ms\": %.3f, \"torch_optim_adamw_ms\": %.3f, "
                "\"flat_over_fused\": %.2f, \"flat_over_torch_optim\": %.2f}\n",
                a.preset.c_str(), static_cast<long long>(a.threads), static_cast<long long>(flat.numel()), t_flat * 1e3,
                t_fused * 1e3, t_torch * 1e3, t_fused / t_flat, t_torch / t_flat);
    return 0;
  }
  if (a.mode == "ops") {
    // The hand-written kernels against LibTorch's own ops, forward + backward, on the shapes of
    // one block of the preset: best of --steps runs each.
    DDM_CHECK(cfg.model.arch == "dit", "ddm_bench ops: needs a DiT preset");
    DDM_CHECK(fused_attention_cpu_supported(torch::zeros({1, 3, 1, 1, 1})), "ddm_bench ops: needs an AVX2 + FMA CPU");
    const int64_t N = (28 / cfg.model.patch) * (28 / cfg.model.patch), H = cfg.model.heads;
    const int64_t d = cfg.model.width / H;
    auto best_of = [&](const std::function<void()>& once) { return best_seconds(once, a.warmup, a.steps); };
    auto qkv_store = torch::randn({a.batch, N, 3, H, d}, torch::requires_grad());
    auto attn_grad = torch::randn({a.batch, H, N, d});
    auto attention_once = [&](int how) {  // 0: three ops, 1: the fused CPU kernel, 2: LibTorch's SDPA
      auto qkv = qkv_store.permute({0, 2, 3, 1, 4});  // [B, 3, H, N, d], as the DiT block makes it
      auto u = qkv.unbind(1);
      auto out = how == 1   ? fused_attention_cpu(qkv)
                 : how == 2 ? at::scaled_dot_product_attention(u[0], u[1], u[2])
                            : attention_reference(u[0], u[1], u[2]);
      out.backward(attn_grad);
      qkv_store.mutable_grad() = torch::Tensor();
    };
    const int64_t W = cfg.model.width;
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
    const double att3 = best_of([&] { attention_once(0); }), attf = best_of([&] { attention_once(1); });
    const double atts = best_of([&] { attention_once(2); });
    const double res0 = best_of([&] { residual_once(false); }), resf = best_of([&] { residual_once(true); });
    std::printf("{\"impl\": \"cpp\", \"mode\": \"ops\", \"preset\": \"%s\", \"batch\": %lld, \"threads\": %lld, "
                "\"attention_three_op_ms\": %.3f, \"attention_fused_ms\": %.3f, \"attention_speedup\": %.2f, "
                "\"attention_sdpa_ms\": %.3f, \"attention_fused_over_sdpa\": %.2f, "
                "\"adaln_proj_residual_aten_ms\": %.3f, \"adaln_proj_residual_fused_ms\": %.3f, "
                "\"adaln_proj_residual_speedup\": %.2f}\n",
                a.preset.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.threads), att3 * 1e3,
                attf * 1e3, att3 / attf, atts * 1e3, atts / attf, res0 * 1e3, resf * 1e3, res0 / resf);
    return 0;
  }
  if (a.mode == "sample") {
    const bool graphs = a.cuda_graphs == "on";
    DDM_CHECK(!graphs || device.is_cuda(), "ddm_bench sample: --cuda-graphs on needs --device cuda");
    const Precision precision = precision_named(a.precision);
    auto ready = [&](Net n, int64_t max_graphs) -> Net {  // eval mode on the device, from graphs if asked
      n->eval();
      n->to(device);
      if (graphs) n = std::make_shared<GraphedNetImpl>(n, max_graphs);  // model/graphed_net.h
      return n;
    };
    std::unique_ptr<Ensemble> ensemble;
    std::optional<Denoiser> den;
    if (a.experts == 0) {
      den.emplace(ready(net, 4), make_path(cfg.diffusion), prediction_for(cfg.diffusion), cfg.model.num_classes);
      den->set_precision(precision);
    } else {
      std::vector<std::optional<Denoiser>> experts;
      for (int64_t e = 0; e < a.experts; ++e) {
        torch::manual_seed(static_cast<uint64_t>(e));
        experts.emplace_back(Denoiser(ready(make_net(cfg.model), graphed_expert_graphs(a.experts)),
                                      make_path(cfg.diffusion), prediction_for(cfg.diffusion), cfg.model.num_classes));
        experts.back()->set_precision(precision);
      }
      ModelConfig rm;
      apply_preset("router-conv-tiny", rm);
      rm.in_channels = cfg.model.in_channels, rm.image_size = cfg.model.image_size;
      rm.num_classes = cfg.model.num_classes, rm.num_experts = a.experts;
      torch::manual_seed(100);
      Net router = make_net(rm);  // untrained: its output layer is zero, its probabilities uniform
      // A trained router spreads the samples over its clusters; an untrained one would send them all
      // to one expert. So its probabilities are tilted by a fixed random projection of x_t, which
      // spreads Gaussian noise evenly over the experts; router-conv-tiny's forward is what it costs.
      const torch::Tensor proj =
          torch::randn({cfg.model.in_channels * cfg.model.image_size * cfg.model.image_size, a.experts}).to(device);
      const NoisePath path = make_path(cfg.diffusion);
      RouterFn route = net_router(ready(router, 4), path, path);
      RouterFn routed = [route, precision, proj](const torch::Tensor& x, const torch::Tensor& t, const Cond& y) {
        torch::Tensor p;
        {
          Autocast autocast(x.device(), precision);
          p = route(x, t, y);  // [B, K]
        }
        return torch::softmax(torch::log(p.to(torch::kFloat)) + torch::mm(x.flatten(1).to(torch::kFloat), proj), 1);
      };
      ensemble = std::make_unique<Ensemble>(std::move(experts), std::vector<double>(a.experts, fwd_flops), routed,
                                            network_flops_per_image(rm), path, cfg.model.num_classes,
                                            parse_routing("top1"), 0, device);
      if (graphs) ensemble->set_group_quantum(graphed_group_quantum(a.n, a.experts));
      ensemble->set_side_by_side(a.side_by_side == "on");
      den.emplace(ensemble->denoiser());
    }
    GenerateOptions g;
    g.n = a.n;
    g.sample.steps = a.nfe;
    g.sample.cfg = 1.0;
    g.batch_size = a.n;
    if (a.text_tokens > 0) g.text = bench_text_cond(a.n, a, false);
    int64_t nfe = 0;
    const int64_t c = cfg.model.in_channels, s = cfg.model.image_size;
    const double best = best_seconds([&] { nfe = generate(*den, c, s, g).nfe; }, a.warmup, a.steps);
    if (const char* trace = std::getenv("DDM_BENCH_TRACE"))  // LibTorch profiler trace of one run
      profiled(trace, device, [&] {
        generate(*den, c, s, g);
        sync();
      });
    nlohmann::json j = {{"impl", "cpp"}, {"mode", "sample"}, {"preset", bench_name(a)}, {"n", a.n}, {"nfe", nfe},
                        {"threads", a.threads}, {"device", device.str()}, {"precision", a.precision},
                        {"seconds", best}, {"img_per_s", a.n / best}, {"cuda_graphs", graphs}};
    if (device.is_cuda()) j["fused_group_norm"] = fused_group_norm_enabled();  // DDM_FUSED_GROUPNORM
    if (channels_last_enabled(device)) j["channels_last"] = true;              // DDM_CHANNELS_LAST (model/ops.h)
    if (ensemble) {  // how the routing spread the samples, over every run
      const EnsembleUsage& u = ensemble->usage();
      nlohmann::json share = nlohmann::json::array();
      for (int64_t e : u.expert_evals) share.push_back(static_cast<double>(e) / std::max<int64_t>(1, u.sample_evals));
      j["experts"] = a.experts;
      j["routing"] = "top1";
      j["expert_share"] = share;
      j["padding_rows_share"] = static_cast<double>(u.padding_evals) / std::max<int64_t>(1, u.sample_evals);
      j["side_by_side"] = a.side_by_side == "on" && device.is_cuda();
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  DDM_FAIL("unknown mode " << a.mode << " (train | peak | sample | forward | ops | optim | dp | timeline | loader | phases)");
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
