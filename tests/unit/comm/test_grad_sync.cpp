// GradSync on a small real model (a conv, linears, one layer used twice, one unused layer) with ranks
// as threads: bucket layout, hooks counting each parameter once, in-order launches, averaged
// gradients against a serial reference, no-sync micro-batches, the float16 wire, a rank whose
// backward touches nothing, world 1, and a timeout surfacing from backward as ddm::Error.
//
// Tolerances: ranks agree bit for bit. With two ranks the result is normally exact: each rank halves
// its gradient (exact) and the sum of two floats is the same in either order, so it equals g0/2 + g1/2
// computed serially; it is checked within 1e-4 of it (mean_of below says why). With three
// ranks Gloo may add in any order: |result - mean| <= 4u * sum_k |g_k| / 3 (one rounding for each
// division, two for the sum; u = 2^-24). The float16 wire: each input rounded to half (u16 = 2^-11),
// the half sum rounded once more: 3 u16 (|g0| + |g1|) / 2, plus 2^-24 for half's subnormal spacing.
#include <gtest/gtest.h>

#include <future>
#include <sstream>

#include "comm/grad_sync.h"
#include "core/error.h"
#include "float_tolerance.h"
#include "unit/test_dist_util.h"
#include "test_util.h"
#include "train/optimizer.h"

using namespace ddm;
using ddm::test::error_message;
using ddm::test::has;
using ddm::test::shown;
using ddm::test::run_ranks;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    unused = register_module("unused", torch::nn::Linear(3, 3));  // first: lands in the last bucket
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)));
    lin = register_module("lin", torch::nn::Linear(64, 16));
    shared = register_module("shared", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // x: [B, 2, 4, 4]
    auto h = torch::relu(conv(x));                 // [B, 4, 4, 4]
    h = torch::tanh(lin(h.flatten(1)));            // [B, 16]
    h = torch::tanh(shared(h));                    // [B, 16]
    h = shared(h);                                 // [B, 16]: the same parameters a second time
    return head(h);                                // [B, 3]
  }
  torch::nn::Linear unused{nullptr}, lin{nullptr}, shared{nullptr}, head{nullptr};
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Net);

// numels in registration order: unused 9 + 3, conv 72 + 4, lin 1024 + 16, shared 256 + 16, head 48 + 3.
constexpr int64_t kParams = 1451;

// A model with FlatAdamW's flat layout; every Replica is built with the same seed, so identical.
struct Replica {
  Replica() {
    torch::manual_seed(0);
    net = Net();
    opt = std::make_unique<FlatAdamW>(*net, AdamWOptions{});
    for (auto& p : net->parameters())
      if (p.requires_grad()) params.push_back(p);
    flat = params[0].grad()._base();  // FlatAdamW's gradient buffer: every .grad is a view of it
  }
  void backward(const torch::Tensor& x, const torch::Tensor& y) { torch::mse_loss(net->forward(x), y).backward(); }
  Net net{nullptr};
  std::unique_ptr<FlatAdamW> opt;
  std::vector<torch::Tensor> params;
  torch::Tensor flat;
};

// Small buckets, so that the model has four: {head.bias, head.weight}, {shared.bias, shared.weight,
// lin.bias}, {lin.weight}, {conv.bias, conv.weight, unused.bias, unused.weight}.
GradSyncOptions small_buckets() {
  GradSyncOptions o;
  o.first_bucket_bytes = 256;
  o.bucket_cap_bytes = 2048;
  return o;
}

struct Data {
  explicit Data(int n) {
    torch::manual_seed(100);
    for (int i = 0; i < n; ++i) {
      x.push_back(torch::randn({4, 2, 4, 4}));
      y.push_back(torch::randn({4, 3}));
    }
  }
  std::vector<torch::Tensor> x, y;
};

// A re-entrant backward, as re-entrant activation checkpointing does it: its backward runs another
// backward over a parameter w (accumulating d(sum w)/dw = 1 into w's gradient a second time).
struct Reentrant : torch::autograd::Function<Reentrant> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& z, const torch::Tensor& w) {
    ctx->saved_data["w"] = w;
    return z.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    torch::AutoGradMode enable(true);
    ctx->saved_data["w"].toTensor().sum().backward();
    return {g[0], torch::Tensor()};
  }
};

std::shared_ptr<Comm> borrow(Comm& c) { return std::shared_ptr<Comm>(&c, [](Comm*) {}); }

// "" when a and b are bit-identical; otherwise how many elements differ and the first one (its flat index
// and bucket in small_buckets()'s layout: bucket 0 starts at the end), to tell a wrong local gradient
// from a wrong reduction when a run fails.
// Whether the averaged gradient `got` is the serial mean of a and b: with two ranks it is normally
// bit-identical (see the top of this file), but in CI (ranks as threads, another test beside) the
// reference replicas' gradients came out off by up to 1e-5 relative in nearly every element while
// both ranks agreed bit for bit, three times in four runs (not reproduced here in 1,800 repeats, under
// load too; the cause is open, in issue 54's notes). So ranks are compared bit for bit, and the
// reference within 1e-4 of |a| + |b| (a wrong reduction, a sum or a lost rank, is off by half the
// value); `differences` says where a bitwise difference was.
::testing::AssertionResult mean_of(const torch::Tensor& got, const torch::Tensor& a, const torch::Tensor& b);

std::string differences(const torch::Tensor& a, const torch::Tensor& b) {
  if (torch::equal(a, b)) return "";
  const auto ne = (a != b).nonzero();
  const int64_t i = ne.numel() ? ne[0][0].item<int64_t>() : -1;
  std::ostringstream o;
  o << ne.size(0) << " of " << a.numel() << " elements differ; the first at " << i << " ("
    << (i >= 1400 ? "bucket 1, head" : i >= 1112 ? "bucket 2, shared + lin.bias" : i >= 88 ? "bucket 3, lin.weight"
                                                                                    : "bucket 4, conv + unused")
    << "): " << (i >= 0 ? a[i].item<float>() : 0.f) << " vs " << (i >= 0 ? b[i].item<float>() : 0.f);
  return o.str();
}

::testing::AssertionResult mean_of(const torch::Tensor& got, const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor want = a / 2 + b / 2;
  if (torch::equal(got, want)) return ::testing::AssertionSuccess();
  const auto tol = 1e-4 * (a.abs() + b.abs()).to(torch::kDouble) + 1e-30;
  const double r = ddm::test::tolerance_ratio(got, want.to(torch::kDouble), tol);
  ::testing::Test::RecordProperty("not_bitwise", differences(got, want));
  if (r <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not the mean within 1e-4 (ratio " << r << "): "
                                       << differences(got, want);
}

}  // namespace

TEST(DistGradSync, BucketLayout) {
  // Reverse order, a small first bucket, the rest up to the cap, no parameter split.
  GradSyncOptions o;
  o.first_bucket_bytes = 100;  // 25 floats
  o.bucket_cap_bytes = 1200;   // 300 floats
  const auto b = make_grad_buckets({10, 300, 5, 40, 1000, 7}, o);
  ASSERT_EQ(b.size(), 5u);
  EXPECT_EQ(b[0].params, std::vector<int>{5});     // 7 + 1000 floats would exceed the first bucket
  EXPECT_EQ(b[1].params, std::vector<int>{4});     // larger than the cap: alone
  EXPECT_EQ(b[2].params, (std::vector<int>{3, 2}));
  EXPECT_EQ(b[3].params, std::vector<int>{1});     // exactly the cap
  EXPECT_EQ(b[4].params, std::vector<int>{0});
  EXPECT_EQ(b[0].begin, 1355);
  EXPECT_EQ(b[0].end, 1362);
  EXPECT_EQ(b[2].begin, 310);
  EXPECT_EQ(b[2].end, 355);
  // Properties on random sizes: contiguous ranges covering everything from the back, within limits
  // unless alone, and closed only when the next parameter would not fit.
  torch::manual_seed(1);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 1 + trial % 17;
    const auto sizes = torch::randint(1, 400, {n}, torch::kInt64);
    std::vector<int64_t> numels(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + n);
    int64_t total = 0;
    for (auto v : numels) total += v;
    const auto bs = make_grad_buckets(numels, o);
    int64_t end = total;
    int next = n - 1;
    for (size_t k = 0; k < bs.size(); ++k) {
      const int64_t limit = (k == 0 ? o.first_bucket_bytes : o.bucket_cap_bytes) / 4;
      EXPECT_EQ(bs[k].end, end);
      for (int p : bs[k].params) EXPECT_EQ(p, next--);
      EXPECT_TRUE(bs[k].numel() <= limit || bs[k].params.size() == 1);
      if (k + 1 < bs.size()) {
        EXPECT_GT(bs[k].numel() + numels[bs[k + 1].params[0]], limit);
      }
      end = bs[k].begin;
    }
    EXPECT_EQ(end, 0);
    EXPECT_EQ(next, -1);
  }
}

TEST(DistGradSync, AveragesGradientsLikeOneProcess) {
  torch::set_num_threads(1);
  for (int world : {2, 3}) {
    const Data data(world);
    std::vector<Replica> live(world), ref(world);
    std::vector<torch::Tensor> g(world), out(world);
    std::vector<GradSyncStats> stats(world);
    const auto errors = run_ranks(world, ddm::test::short_timeouts(), [&](Comm& c) {
      const int r = c.rank();
      ref[r].backward(data.x[r], data.y[r]);  // this rank's own gradient, computed on this thread
      g[r] = ref[r].flat.clone();
      GradSync gs(borrow(c), live[r].params, live[r].flat, small_buckets());
      ASSERT_EQ(gs.buckets().size(), 4u);
      EXPECT_EQ(gs.buckets()[2].params, std::vector<int>{4});  // lin.weight
      live[r].backward(data.x[r], data.y[r]);
      out[r] = live[r].flat.clone();
      stats[r] = gs.last_stats();
      gs.finish();  // already synchronized: nothing more happens
      EXPECT_TRUE(torch::equal(live[r].flat, out[r]));
    });
    for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << r;
    for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(out[r], out[0])) << "ranks differ, world " << world;
    EXPECT_TRUE(torch::equal(out[0].narrow(0, 0, 12), torch::zeros({12})));  // the unused layer
    if (world == 2) {
      EXPECT_TRUE(mean_of(out[0], g[0], g[1]));
    } else {
      auto sum = torch::zeros({kParams}, torch::kDouble), abs = torch::zeros({kParams}, torch::kDouble);
      for (auto& gr : g) sum += gr.to(torch::kDouble), abs += gr.to(torch::kDouble).abs();
      const auto tol = 4 * ddm::test::kFloat32Roundoff * abs / 3;
      EXPECT_LE(ddm::test::tolerance_ratio(out[0], sum / 3, tol), 1.0);
      EXPECT_GT(ddm::test::tolerance_ratio(out[0] * 3, sum / 3, tol), 1.0);  // a sum, not a mean, is caught
    }
    for (int r = 0; r < world; ++r) {
      const auto& s = stats[r];
      EXPECT_EQ(s.launch_order, (std::vector<int>{0, 1, 2, 3})) << r;
      EXPECT_EQ(s.launched_early, 3) << r;  // the last bucket holds the unused layer: launched at the end
      EXPECT_EQ(s.ready_params, 8) << r;    // each used parameter once, the shared layer too
      EXPECT_EQ(s.repeated_hooks, 0) << r;
      EXPECT_EQ(s.bytes, kParams * 4) << r;
      EXPECT_TRUE(s.from_hooks);
      for (int b = 0; b < 4; ++b) {
        EXPECT_GE(s.launch_ms[b], 0.0);
        EXPECT_GE(s.done_ms[b], s.launch_ms[b]);
        if (b) {
          EXPECT_GE(s.launch_ms[b], s.launch_ms[b - 1]);
        }
      }
      EXPECT_GE(s.wait_ms, 0.0);
    }
  }
}

TEST(DistGradSync, NoSyncMicroBatchesThenOneSyncedBackward) {
  torch::set_num_threads(1);
  const Data data(6);  // rank r uses micro-batches 3r .. 3r+2
  std::vector<Replica> live(2), ref(2);
  std::vector<torch::Tensor> sums(2), out(2);
  const auto errors = run_ranks(2, ddm::test::short_timeouts(), [&](Comm& c) {
    const int r = c.rank();
    for (int m = 0; m < 3; ++m) ref[r].backward(data.x[3 * r + m], data.y[3 * r + m]);
    sums[r] = ref[r].flat.clone();
    GradSync gs(borrow(c), live[r].params, live[r].flat, small_buckets());
    gs.set_enabled(false);
    live[r].backward(data.x[3 * r], data.y[3 * r]);
    live[r].backward(data.x[3 * r + 1], data.y[3 * r + 1]);
    gs.finish();  // disabled: a no-op
    EXPECT_TRUE(gs.last_stats().launch_order.empty());
    gs.set_enabled(true);
    live[r].backward(data.x[3 * r + 2], data.y[3 * r + 2]);
    out[r] = live[r].flat.clone();
    EXPECT_EQ(gs.last_stats().launch_order.size(), 4u);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_TRUE(mean_of(out[0], sums[0], sums[1]));
  EXPECT_FALSE(mean_of(out[0] * 2, sums[0], sums[1]));  // a sum, not a mean, is caught
  EXPECT_EQ(differences(out[1], out[0]), "");
}

TEST(DistGradSync, Fp16WireWithinHalfPrecision) {
  torch::set_num_threads(1);
  const Data data(2);
  std::vector<Replica> live(2), ref(2);
  std::vector<torch::Tensor> g(2), out(2);
  std::vector<int64_t> bytes(2);
  const auto errors = run_ranks(2, ddm::test::short_timeouts(), [&](Comm& c) {
    const int r = c.rank();
    ref[r].backward(data.x[r], data.y[r]);
    g[r] = ref[r].flat.clone();
    auto o = small_buckets();
    o.fp16_wire = true;
    GradSync gs(borrow(c), live[r].params, live[r].flat, o);
    live[r].backward(data.x[r], data.y[r]);
    out[r] = live[r].flat.clone();
    bytes[r] = gs.last_stats().bytes;
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_TRUE(torch::equal(out[0], out[1]));
  EXPECT_EQ(bytes[0], kParams * 2);
  const auto g0 = g[0].to(torch::kDouble), g1 = g[1].to(torch::kDouble);
  const auto tol = 3 * std::ldexp(1.0, -11) * (g0.abs() + g1.abs()) / 2 + std::ldexp(1.0, -24);
  EXPECT_LE(ddm::test::tolerance_ratio(out[0], (g0 + g1) / 2, tol), 1.0);
  EXPECT_FALSE(torch::equal(out[0], g[0] / 2 + g[1] / 2));  // the half wire was really used
}

TEST(DistGradSync, FinishSyncsARankWhoseBackwardTouchedNothing) {
  torch::set_num_threads(1);
  const Data data(2);
  std::vector<Replica> live(2), ref(2);
  std::vector<torch::Tensor> g(2), first(2), second(2);
  const auto errors = run_ranks(2, ddm::test::short_timeouts(), [&](Comm& c) {
    const int r = c.rank();
    ref[r].backward(data.x[r], data.y[r]);
    g[r] = ref[r].flat.clone();
    GradSync gs(borrow(c), live[r].params, live[r].flat, small_buckets());
    // Step 1: rank 1's loss does not depend on any trainable parameter (no hook fires there).
    live[r].opt->zero_grad();
    if (r == 0) live[r].backward(data.x[r], data.y[r]);
    gs.finish();
    gs.finish();  // idempotent on both ranks
    first[r] = live[r].flat.clone();
    EXPECT_EQ(gs.last_stats().from_hooks, r == 0);
    // Step 2: both ranks as usual; the collectives still match.
    live[r].opt->zero_grad();
    live[r].backward(data.x[r], data.y[r]);
    gs.finish();
    second[r] = live[r].flat.clone();
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_TRUE(mean_of(first[0], g[0], torch::zeros_like(g[0])));
  EXPECT_EQ(differences(first[1], first[0]), "");
  EXPECT_TRUE(mean_of(second[0], g[0], g[1]));
  EXPECT_EQ(differences(second[1], second[0]), "");
}

TEST(DistGradSync, WorldOneIsANoOp) {
  const Data data(1);
  Replica live, ref;
  ref.backward(data.x[0], data.y[0]);
  auto comm = Comm::create(DistEnv{});
  GradSync gs(comm, live.params, live.flat, small_buckets());
  live.backward(data.x[0], data.y[0]);
  gs.finish();
  gs.sync_now();
  EXPECT_TRUE(torch::equal(live.flat, ref.flat));
  EXPECT_TRUE(gs.last_stats().launch_order.empty());
  EXPECT_EQ(gs.buckets().size(), 4u);
}

TEST(DistGradSync, PeerThatNeverSyncsFailsBackwardWithTheTimeout) {
  const Data data(2);
  std::vector<Replica> live(2);
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future().share();
  const auto errors = run_ranks(2, ddm::test::short_timeouts(1000), [&](Comm& c) {
    GradSync gs(borrow(c), live[c.rank()].params, live[c.rank()].flat, small_buckets());
    if (c.rank() == 1) {
      done.wait();
      return;
    }
    const auto msg = shown(error_message([&] { live[0].backward(data.x[0], data.y[0]); }));
    rank0_done.set_value();
    EXPECT_TRUE(has(msg, "rank 0: the gradient all-reduce (bucket 1 of 4) timed out after 1s")) << msg;
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(DistGradSync, SecondAccumulationAfterLaunchIsAnError) {
  torch::set_num_threads(1);
  const Data data(2);
  std::vector<Replica> live(2);
  const auto errors = run_ranks(2, ddm::test::short_timeouts(), [&](Comm& c) {
    const int r = c.rank();
    GradSync gs(borrow(c), live[r].params, live[r].flat, small_buckets());
    // Applied first, so its backward runs last: after head.weight's bucket (bucket 0) was launched.
    auto z = torch::ones({2}, torch::requires_grad());
    auto extra = Reentrant::apply(z, live[r].net->head->weight).sum();
    auto loss = torch::mse_loss(live[r].net->forward(data.x[r]), data.y[r]) + extra;
    const auto msg = shown(error_message([&] { loss.backward(); }));
    EXPECT_TRUE(has(msg, "the gradient of parameter #8 was accumulated again after its bucket's all-reduce had "
                         "started"))
        << msg;
    EXPECT_EQ(gs.last_stats().repeated_hooks, 1);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}
