// train.cuda_graphs: TrainStep's device work captured once as a CUDA graph and replayed every step,
// so that a step costs the host one launch instead of one per kernel (what holds small models back
// on a GPU: docs/results.md). What the graph holds: every micro-batch's forward + loss and backward,
// the gradient's global norm and clip, AdamW and the EMA (FlatAdamW::clip_and_step_on_device, which
// skip the update on the device when the step is not finite). What stays outside: the prepare phase
// (keyed draws on the host, frozen encoders, self-conditioning's first pass), whose tensors are
// copied into the graph's inputs before each replay, and the learning rate, step count and EMA
// weight, written into the graph's scalars. One read back per step, as the eager step's; given the
// next step's batches, their prepare phase is launched before the host waits for it (step.h).
//
// The order of things: every step runs on the graph's own stream (capture needs one that is not the
// default stream), after what the caller queued on its stream; the first kWarmup steps run eagerly
// there (cuBLAS and the caching allocator set themselves up on that stream), the next one is
// captured and then replayed. A step whose prepared tensors differ in shape or type from the
// captured ones (a short last batch, a changed grad_accum) runs eagerly. A step that cannot be
// captured (an op that reads back to the host) leaves the run eager, saying why.
//
// Numerics: a replay runs the kernels the eager step runs, but for the learning rate, which the
// fused AdamW kernel reads from a float32 tensor instead of a double (within float32 rounding of
// the eager step); runs with graphs repeat bit for bit as eager ones do (train.deterministic).
// fp16 (train/loss_scale.h): the loss's multiplier (1 / micro-batches x the loss scale) and the
// gradient's 1 / loss scale are float32 scalars on the device too, written before each replay from
// the host's LossScale, which the replay's finite flag then updates (a non-finite step already
// skips AdamW and the EMA on the device); with powers of two they multiply as the eager step's do.
#include <chrono>
#include <iostream>

#include "core/cuda_graph.h"
#include "core/cuda_module.h"
#include "core/error.h"
#include "train/step.h"

namespace ddm {

struct StepGraph {
  static constexpr int64_t kWarmup = 2;  // eager steps on the graph's stream before the capture
  explicit StepGraph(torch::Device device) : stream(device) {}
  GraphStream stream;
  CapturedGraph graph;
  std::vector<Prepared> inputs;  // the graph's inputs, one per micro-batch (its own tensors)
  std::string signature;         // their shapes and types
  torch::Tensor lr, step, ema_weight;  // 0-dim float, written before each replay (ema_weight: EMA on)
  torch::Tensor loss_mult, unscale;    // fp16: 0-dim float, the loss's multiplier and 1 / loss scale
  torch::Tensor stats;                 // double [3]: the loss sum, the norm, 1 if finite (the graph's output)
  torch::Tensor host_stats;            // its copy in pinned host memory
  bool ema = true;                     // what the graph was captured with
  int64_t eager = 0;                   // eager steps run so far
  bool failed = false;                 // the capture failed: the run stays eager
  bool told_shapes = false;
  int64_t replays = 0;
};

std::shared_ptr<StepGraph> make_step_graph(torch::Device device) { return std::make_shared<StepGraph>(device); }

namespace {

// Every tensor slot of a prepared micro-batch, in a fixed order.
std::vector<torch::Tensor*> slots(Prepared& p) {
  std::vector<torch::Tensor*> out{&p.xt, &p.t, &p.target, &p.posterior_eps};
  for (torch::Tensor* t : p.cond.slots()) out.push_back(t);
  return out;
}

// What must match for a step to replay the graph: every slot's presence, type, shape and device.
std::string signature(std::vector<Prepared>& ps) {
  std::string s;
  for (Prepared& p : ps) {
    const std::vector<torch::Tensor*> all = slots(p);
    s += std::to_string(p.cond.residuals.size()) + "," + std::to_string(p.cond.frozen.size()) + ":" +
         slots_signature({all.begin(), all.end()}) + "|";
  }
  return s;
}

}  // namespace

int64_t TrainStep::graph_replays() const { return graph_ ? graph_->replays : 0; }

StepResult TrainStep::run_graphed(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) {
  DDM_CHECK(!sync_, "train.cuda_graphs: a step with data parallelism cannot be captured (one process only)");
  StepResult r;
  graph_->stream.run([&] { r = graph_step(micro, step, next); });
  return r;
}

StepResult TrainStep::graph_step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) {
  StepGraph& g = *graph_;
  times_.start = std::chrono::steady_clock::now();
  const double scale = 1.0 / static_cast<double>(micro.size());
  std::vector<Prepared> ps = prepared_for(micro, step, /*lazy=*/false);
  if (g.graph.captured() && g.ema != ema_) g.graph.reset();  // captured with the EMA on and now off, or the reverse
  if (!g.graph.captured() && !g.failed && g.eager >= StepGraph::kWarmup) capture(ps, scale);
  const bool replay = g.graph.captured() && signature(ps) == g.signature;
  if (!replay) {  // warming up, not capturable, or not the captured shapes: the eager step
    if (g.graph.captured() && !g.told_shapes) {
      std::cerr << "train.cuda_graphs: step " << step
                << "'s batch differs in shape from the captured one; steps like it run without the graph\n";
      g.told_shapes = true;
    }
    ++g.eager;
    optim_.zero_grad();
    torch::Tensor loss_sum;
    for (size_t i = 0; i < ps.size(); ++i) {
      const torch::Tensor l = forward_backward(ps[i], scale * optim_.loss_scale().scale());
      loss_sum = i == 0 ? l : loss_sum + l;
    }
    const StepResult r = finish(loss_sum, scale, step);
    if (r.finite || r.overflow) prepare_ahead(next, step + 1);
    return r;
  }
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::vector<torch::Tensor*> to = slots(g.inputs[i]), from = slots(ps[i]);
      for (size_t k = 0; k < to.size(); ++k)
        if (to[k]->defined()) to[k]->copy_(*from[k]);
    }
    ps.clear();  // copied: what the replay reads are the graph's own inputs
    const TrainConfig& tc = cfg_.train;
    const int64_t n = optim_.step_count() + 1;  // the optimizer step this one makes, if finite
    g.lr.fill_(lr_at(tc, step));
    g.step.fill_(static_cast<double>(n));
    if (g.ema_weight.defined()) g.ema_weight.fill_(1.0 - ema_decay_at(tc.ema_decay, n));
    if (g.loss_mult.defined()) {
      g.loss_mult.fill_(scale * optim_.loss_scale().scale());
      g.unscale.fill_(1.0 / optim_.loss_scale().scale());
    }
  }
  times_.backward_start = std::chrono::steady_clock::now();
  g.graph.replay();
  ++g.replays;
  // The one read back: queued after the replay, then the next step's prepare phase is launched
  // while the device computes this one, and only then does the host wait for the results.
  if (!g.host_stats.defined())
    g.host_stats = torch::empty({3}, torch::TensorOptions().dtype(torch::kDouble).pinned_memory(true));
  g.host_stats.copy_(g.stats, /*non_blocking=*/true);
  const std::function<void()> read = cuda_module().mark(-1);  // the current device's stream
  prepare_ahead(next, step + 1);  // on this stream, after the replay's update (self-conditioning reads it)
  read();  // the host waits for the read back
  const torch::Tensor& stats = g.host_stats;
  times_.backward_end = times_.synced = times_.clipped = times_.end = std::chrono::steady_clock::now();
  StepResult r;
  r.lr = lr_at(cfg_.train, step);
  const double* s = stats.data_ptr<double>();
  r.loss = s[0] * scale;
  r.grad_norm = s[1];
  r.finite = s[2] != 0.0;  // the graph skipped AdamW and the EMA otherwise
  if (r.finite) optim_.count_step();
  settle_loss_scale(optim_.loss_scale(), r.finite, r);  // fp16: as finish() does after an eager step
  return r;
}

void TrainStep::capture(const std::vector<Prepared>& prepared, double scale) {
  StepGraph& g = *graph_;
  const torch::Device device = optim_.flat_params().device();
  g.inputs.clear();
  for (Prepared p : prepared) {  // the graph's own copies: a replay reads them where capture saw them
    for (torch::Tensor* t : slots(p))
      if (t->defined()) *t = t->clone();
    g.inputs.push_back(std::move(p));
  }
  g.signature = signature(g.inputs);
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  g.lr = torch::zeros({}, f32);
  g.step = torch::ones({}, f32);
  g.ema = ema_;
  g.ema_weight = ema_ ? torch::zeros({}, f32) : torch::Tensor();
  const bool scaled = optim_.loss_scale().on();
  g.loss_mult = scaled ? torch::full({}, scale * optim_.loss_scale().scale(), f32) : torch::Tensor();
  g.unscale = scaled ? torch::full({}, 1.0 / optim_.loss_scale().scale(), f32) : torch::Tensor();
  const std::string why = g.graph.capture([&] {
    optim_.zero_grad();
    torch::Tensor loss_sum;
    for (size_t i = 0; i < g.inputs.size(); ++i) {
      const torch::Tensor l = forward_backward(g.inputs[i], scale, g.loss_mult);
      loss_sum = i == 0 ? l : loss_sum + l;
    }
    if (scaled) optim_.flat_grad().mul_(g.unscale);  // fp16: the gradient of the loss itself
    const torch::Tensor tail =
        optim_.clip_and_step_on_device(loss_sum, cfg_.train.grad_clip, g.lr, g.step, g.ema_weight);  // [2]
    g.stats = torch::cat({loss_sum.view({1}), tail});  // double [3]
  });
  if (why.empty()) {
    std::cerr << "train.cuda_graphs: the step is captured (" << g.inputs.size() << " micro-batch"
              << (g.inputs.size() == 1 ? "" : "es") << "); later steps replay it\n";
    // The eager warm-up's blocks are cached in the default pool; the graph has its own from now on.
    cuda_module().empty_cache();
  } else {
    g.failed = true;
    g.inputs.clear();
    std::cerr << "train.cuda_graphs: the step could not be captured as a CUDA graph (" << why
              << "); the run goes on without graphs\n";
  }
}

}  // namespace ddm
