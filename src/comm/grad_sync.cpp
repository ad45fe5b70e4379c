// GradSync (see grad_sync.h): bucket layout, the accumulator post-hooks, in-order launching, the
// end-of-backward callback and the averaging.
//
// Averaging: each bucket is divided by the world size before the sum all-reduce (Gloo has no AVG),
// as DDP does; that also keeps float16 sums from overflowing. Every rank receives the same reduced
// bytes and does nothing after it but an exact fp16 -> fp32 copy, so results are bit-identical
// across ranks. With two ranks fl(a/2 + b/2) == fl(a + b) / 2 exactly (halving is exact), so the
// result equals a serial (g0 + g1) / 2.
//
// A hook firing again for a parameter already marked ready happens only with re-entrant backward
// passes (a custom Function whose backward runs another backward over the same parameters, as
// re-entrant activation checkpointing does): within one backward the engine sums every use of a
// parameter before its accumulator runs once. Before the parameter's bucket is launched the extra
// accumulation already sits in the buffer and is simply included: the firing is ignored. After the
// launch, the accumulation raced with the all-reduce reading and writing the same memory, so the
// step's gradients are wrong and differ between ranks: the end of backward waits for every bucket
// and then throws ddm::Error saying so. (Such models should accumulate with set_enabled(false) and
// call sync_now().) Re-entrant passes in which the *first* gradient of the step arrives in the inner
// pass are not supported: the end-of-backward callback then belongs to the inner pass.
#include "comm/grad_sync.h"

#include <atomic>
#include <chrono>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "core/error.h"

namespace ddm {

using Clock = std::chrono::steady_clock;

std::vector<GradBucket> make_grad_buckets(const std::vector<int64_t>& numels, const GradSyncOptions& options) {
  DDM_CHECK(options.first_bucket_bytes > 0 && options.bucket_cap_bytes > 0,
            "gradient buckets: first_bucket_bytes (" << options.first_bucket_bytes << ") and bucket_cap_bytes ("
                                                     << options.bucket_cap_bytes << ") must be > 0");
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) offsets[i + 1] = offsets[i] + numels[i];
  std::vector<GradBucket> out;
  GradBucket cur;
  int64_t bytes = 0;
  for (int i = static_cast<int>(numels.size()) - 1; i >= 0; --i) {
    const int64_t b = numels[i] * static_cast<int64_t>(sizeof(float));
    const int64_t limit = out.empty() ? options.first_bucket_bytes : options.bucket_cap_bytes;
    if (!cur.params.empty() && bytes + b > limit) {
      out.push_back(cur);
      cur = GradBucket();
      bytes = 0;
    }
    if (cur.params.empty()) cur.end = offsets[i + 1];
    cur.begin = offsets[i];
    cur.params.push_back(i);
    bytes += b;
  }
  if (!cur.params.empty()) out.push_back(cur);
  return out;
}

struct GradSync::State : std::enable_shared_from_this<GradSync::State> {
  enum class Phase { kIdle, kBackward, kReduced };

  std::shared_ptr<Comm> comm;
  std::vector<torch::Tensor> params;
  torch::Tensor flat;  // float32 [P]
  GradSyncOptions opt;
  std::vector<GradBucket> buckets;
  std::vector<int> bucket_of;                                      // parameter -> bucket
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive: they hold the hooks
  std::vector<torch::Tensor> wire;                                 // per bucket: float16 [numel] or undefined
  bool enabled = true;
  Phase phase = Phase::kIdle;
  int64_t synced_version = -1;  // flat's version counter right after the last synchronization

  // The step in progress.
  std::vector<char> ready, launched;
  std::vector<int> pending;  // per bucket: parameters not yet ready
  int next_launch = 0;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  Clock::time_point t0;
  std::atomic<int64_t> generation{0};
  std::unique_ptr<std::atomic<int64_t>[]> done_ns;  // written by Gloo's threads (future callbacks)
  GradSyncStats stats, last;
  std::string late_error;

  double ms_since_t0(Clock::time_point t) const {
    return std::chrono::duration<double, std::milli>(t - t0).count();
  }

  void begin_step(bool from_hooks) {
    phase = Phase::kBackward;
    ++generation;
    const size_t nb = buckets.size();
    std::fill(ready.begin(), ready.end(), 0);
    launched.assign(nb, 0);
    pending.resize(nb);
    for (size_t b = 0; b < nb; ++b) pending[b] = static_cast<int>(buckets[b].params.size());
    next_launch = 0;
    works.assign(nb, {});
    for (size_t b = 0; b < nb; ++b) done_ns[b] = -1;
    stats = GradSyncStats();
    stats.launch_ms.assign(nb, -1.0);
    stats.done_ms.assign(nb, -1.0);
    stats.from_hooks = from_hooks;
    late_error.clear();
    t0 = Clock::now();
    stats.origin = t0;
  }

  void launch(int b) {
    torch::NoGradGuard no_grad;
    const auto& bk = buckets[b];
    auto slice = flat.narrow(0, bk.begin, bk.numel());
    slice.div_(comm->world_size());
    std::vector<at::Tensor> tensors{slice};
    if (opt.fp16_wire) {
      wire[b].copy_(slice);
      tensors = {wire[b]};
    }
    launched[b] = 1;
    works[b] = comm->allreduce_async(tensors);
    stats.launch_ms[b] = ms_since_t0(Clock::now());
    stats.launch_order.push_back(b);
    stats.bytes += tensors[0].numel() * static_cast<int64_t>(tensors[0].element_size());
    // Completion time, recorded in Gloo's thread; never throws there. (Over NCCL the future completes
    // as the work is queued on the GPU: done_ms then says when it was queued, not finished.)
    std::weak_ptr<State> weak = weak_from_this();
    const int64_t gen = generation.load();
    try {
      works[b]->getFuture()->addCallback([weak, b, gen](c10::ivalue::Future&) noexcept {
        if (auto s = weak.lock()) {
          int64_t unset = -1;
          const int64_t now = Clock::now().time_since_epoch().count();
          if (s->generation.load() == gen) s->done_ns[b].compare_exchange_strong(unset, now);
        }
      });
    } catch (const std::exception&) {
      // A backend without futures: complete() records the time it saw the bucket done instead.
    }
  }

  // A post-hook: parameter i's gradient has been accumulated into the flat buffer.
  void on_ready(int i) {
    if (!enabled) return;
    if (phase != Phase::kBackward) {
      begin_step(/*from_hooks=*/true);
      std::weak_ptr<State> weak = weak_from_this();
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto s = weak.lock())
          if (s->phase == Phase::kBackward) s->complete();
      });
    }
    const int b = bucket_of[i];
    if (ready[i]) {
      ++stats.repeated_hooks;
      if (launched[b] && late_error.empty())
        late_error = "rank " + std::to_string(comm->rank()) + ": gradient sync: the gradient of parameter #" +
                     std::to_string(i) +
                     " was accumulated again after its bucket's all-reduce had started (a re-entrant backward, "
                     "e.g. activation checkpointing, over shared parameters); this step's gradients are wrong. "
                     "Run such backward passes with GradSync disabled (set_enabled(false)) and call sync_now() after them";
      return;
    }
    ready[i] = 1;
    ++stats.ready_params;
    --pending[b];
    // Strictly in bucket order: a later bucket that is ready waits for the earlier ones.
    while (next_launch < static_cast<int>(buckets.size()) && pending[next_launch] == 0) {
      launch(next_launch++);
      ++stats.launched_early;
    }
  }

  // Launches what is left (parameters unused in this forward keep their gradient, usually zero), waits
  // for every bucket, copies float16 results back.
  void complete() {
    while (next_launch < static_cast<int>(buckets.size())) launch(next_launch++);
    const auto wait_start = Clock::now();
    const int nb = static_cast<int>(buckets.size());
    for (int b = 0; b < nb; ++b) {
      try {
        comm->wait(works[b], "the gradient all-reduce (bucket " + std::to_string(b + 1) + " of " +
                                 std::to_string(nb) + ")");
      } catch (...) {
        works.clear();
        phase = Phase::kIdle;
        throw;
      }
      int64_t unset = -1;
      done_ns[b].compare_exchange_strong(unset, Clock::now().time_since_epoch().count());
      if (opt.fp16_wire) {
        torch::NoGradGuard no_grad;
        flat.narrow(0, buckets[b].begin, buckets[b].numel()).copy_(wire[b]);
      }
    }
    stats.wait_ms = ms_since_t0(Clock::now()) - ms_since_t0(wait_start);
    for (int b = 0; b < nb; ++b)
      stats.done_ms[b] = ms_since_t0(Clock::time_point(Clock::duration(done_ns[b].load())));
    works.clear();
    phase = Phase::kReduced;
    synced_version = static_cast<int64_t>(flat._version());
    last = stats;
    if (!late_error.empty()) throw Error(late_error);
  }
};

GradSyncOptions grad_sync_options(const ParallelConfig& p) {
  GradSyncOptions so;
  so.first_bucket_bytes = static_cast<int64_t>(p.first_bucket_mb * (1 << 20));
  so.bucket_cap_bytes = static_cast<int64_t>(p.bucket_mb * (1 << 20));
  so.fp16_wire = p.wire == WireFormat::kFloat16;
  return so;
}

GradSync::GradSync(std::shared_ptr<Comm> comm, std::vector<torch::Tensor> params, torch::Tensor flat_grad,
                   GradSyncOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  DDM_CHECK(comm, "GradSync needs a Comm");
  DDM_CHECK(flat_grad.defined() && flat_grad.dim() == 1 && flat_grad.scalar_type() == torch::kFloat &&
                flat_grad.is_contiguous(),
            "GradSync: the flat gradient buffer must be a contiguous float32 [P] tensor");
  s.comm = std::move(comm);
  s.params = std::move(params);
  s.flat = flat_grad;
  s.opt = options;
  // Check the layout: parameter i's .grad is flat[offset_i : offset_i + numel_i], offsets consecutive.
  std::vector<int64_t> numels;
  int64_t offset = 0;
  const float* base = flat_grad.data_ptr<float>();
  for (size_t i = 0; i < s.params.size(); ++i) {
    const auto& p = s.params[i];
    DDM_CHECK(p.requires_grad() && p.is_leaf(),
              "GradSync: parameter #" << i << " is frozen or not a leaf; pass only trainable parameters");
    const auto& g = p.grad();
    DDM_CHECK(g.defined() && g.scalar_type() == torch::kFloat && g.is_contiguous() &&
                  g.data_ptr<float>() == base + offset,
              "GradSync: the gradient of parameter #" << i << " is not the flat buffer's slice at offset " << offset
                                                      << "; pass the parameters in flat-buffer (registration) "
                                                         "order, after the optimizer has laid them out");
    numels.push_back(p.numel());
    offset += p.numel();
  }
  DDM_CHECK(offset == flat_grad.numel(), "GradSync: the parameters cover " << offset << " of the flat buffer's "
                                                                           << flat_grad.numel() << " elements");
  s.buckets = make_grad_buckets(numels, options);
  s.bucket_of.assign(s.params.size(), 0);
  for (size_t b = 0; b < s.buckets.size(); ++b)
    for (int i : s.buckets[b].params) s.bucket_of[i] = static_cast<int>(b);
  s.ready.assign(s.params.size(), 0);
  s.done_ns.reset(new std::atomic<int64_t>[s.buckets.size()]);
  s.wire.resize(s.buckets.size());
  if (!s.comm->distributed()) return;  // one process: nothing to synchronize, no hooks
  if (options.fp16_wire)
    for (size_t b = 0; b < s.buckets.size(); ++b) s.wire[b] = torch::empty({s.buckets[b].numel()}, flat_grad.options().dtype(torch::kHalf));
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    const int idx = static_cast<int>(i);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, idx](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto st = weak.lock()) st->on_ready(idx);
          return outputs;
        }));
    s.accumulators.push_back(std::move(acc));
  }
}

GradSync::~GradSync() {
  // Never leave Gloo writing into buffers nobody waits for; errors no longer matter here.
  for (auto& w : state_->works) {
    try {
      if (w) w->wait();
    } catch (...) {
    }
  }
}

void GradSync::set_enabled(bool enabled) { state_->enabled = enabled; }
bool GradSync::enabled() const { return state_->enabled; }
const std::vector<GradBucket>& GradSync::buckets() const { return state_->buckets; }
const GradSyncStats& GradSync::last_stats() const { return state_->last; }

void GradSync::finish() {
  auto& s = *state_;
  if (!s.comm->distributed() || !s.enabled) return;
  if (s.phase == State::Phase::kBackward) return s.complete();  // backward ended early (an error)
  if (static_cast<int64_t>(s.flat._version()) == s.synced_version) return;
  sync_now();
}

void GradSync::sync_now() {
  auto& s = *state_;
  if (!s.comm->distributed()) return;
  if (s.phase == State::Phase::kBackward) return s.complete();
  s.begin_step(/*from_hooks=*/false);
  s.complete();
}

}  // namespace ddm
