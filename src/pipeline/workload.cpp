// Profiling a training configuration for the pipeline planner; see workload.h.
#include "pipeline/workload.h"

#include <algorithm>
#include <chrono>

#include <torch/torch.h>

#include "core/device.h"
#include "core/error.h"
#include "core/runtime.h"
#include "data/latent_shards.h"
#include "train/network.h"
#include "train/step.h"

namespace ddm {
namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Batch batch_of(const Dataset& data, int64_t first, int64_t rows) {
  const torch::Tensor x = data.images.slice(0, first, first + rows);  // uint8 images, or latent shards' posteriors
  Batch b{data.latents ? x : to_unit_range(x), data.labels.slice(0, first, first + rows),
          data.clusters.defined() ? data.clusters.slice(0, first, first + rows) : torch::Tensor(), 0,
          torch::arange(first, first + rows, torch::kLong)};
  if (!data.captions.empty()) b.captions.assign(data.captions.begin() + first, data.captions.begin() + first + rows);
  if (data.encoded && !data.encoded->text.encoder.empty()) {  // cached text encodings: their shapes (the values cost alike)
    const auto& t = data.encoded->text;
    b.context = torch::randn({rows, t.tokens, t.dim});        // [rows, T, D]
    b.context_mask = torch::ones({rows, t.tokens}, torch::kLong);  // [rows, T]
    b.pooled = torch::randn({rows, t.pooled_dim});             // [rows, P]
  }
  return b;
}

}  // namespace

PipeProfile profile_workload(const RunConfig& cfg, const Dataset& data, Net net, std::shared_ptr<Objective> objective,
                             const std::vector<int64_t>& rows, int repeats, const std::string& workload) {
  const int64_t n = data.images.size(0);
  DDM_CHECK(!rows.empty() && rows.back() <= n, "profile: the data has " << n << " images, fewer than a micro-batch of "
                                                                        << (rows.empty() ? 0 : rows.back()));
  PipeProfile p;
  const ModelConfig& m = cfg.model;
  const torch::Device device = net->parameters().front().device();  // where the net was put, and the data goes
  p.model = network_name(m) + " " + std::to_string(m.in_channels) + "x" + std::to_string(m.image_size) + "x" +
            std::to_string(m.image_size) + ", " + std::to_string(m.num_classes) + " classes";
  p.workload = workload;
  p.threads = static_cast<int>(cfg.train.threads);
  p.machine = machine_name(device) + ", " + std::to_string(p.threads) + " thread" + (p.threads == 1 ? "" : "s");
  p.self_cond = m.self_cond;
  p.x_bytes_per_row = 4.0 * static_cast<double>(m.in_channels * m.image_size * m.image_size);
  p.units = profile_units(*net, m, rows, repeats, device, cfg.train.precision);

  // The prepare phase, as TrainStep runs it less self-conditioning's pass.
  PipeTaskProfile task;
  task.name = "prepare: " + workload;
  for (int64_t r : rows) {
    std::vector<double> ms;
    for (int rep = 0; rep <= repeats; ++rep) {
      const Batch b = batch_of(data, (rep * r) % (n - r + 1), r).to(device);
      synchronize(device);
      const auto t0 = std::chrono::steady_clock::now();
      torch::NoGradGuard ng;
      Prepared q = objective->prepare(b, rep);
      {
        Autocast autocast(device, cfg.train.precision);
        q.cond = net->precompute(q.xt, q.t, q.cond);
      }
      synchronize(device);
      if (rep > 0) ms.push_back(ms_since(t0));
      if (r == rows.front() && rep == 0) {
        // What it hands the first stage per row: x_t, the target and the per-sample conditioning.
        double bytes = 0;
        for (const torch::Tensor& x : {q.xt, q.t, q.target, q.cond.y, q.cond.control, q.cond.embed, q.cond.context,
                                       q.cond.context_mask, q.cond.pooled})
          if (x.defined()) bytes += static_cast<double>(x.numel() * x.element_size());
        for (const torch::Tensor& x : q.cond.frozen) bytes += static_cast<double>(x.numel() * x.element_size());
        task.output_bytes_per_row = bytes / static_cast<double>(r);
      }
    }
    task.cost.push_back({r, median(ms)});
  }
  p.tasks.push_back(task);

  // AdamW + EMA per million parameters: TrainStep's update phase at the smallest micro-batch.
  RunConfig eager = cfg;
  eager.train.cuda_graphs = false;  // a pipeline's stages update eagerly
  eager.train.loss_scale = 1;       // fp16: a step skipped for an overflow would time no update
  TrainStep step(eager, net, objective);
  std::vector<double> upd;
  for (int rep = 0; rep <= repeats; ++rep) {
    step.run(batch_of(data, 0, rows.front()).to(device), rep);
    synchronize(device);  // (on a GPU the update is queued: its end is when the device is done)
    const StepTimes& t = step.last_times();
    if (rep > 0) upd.push_back(ms_since(t.clipped));
  }
  p.optimizer_ms_per_mparam = median(upd) / (static_cast<double>(count_params(*net)) / 1e6);
  return p;
}

}  // namespace ddm
