// FlatAdamW against LibTorch's AdamW, gradient clipping, EMA and its warm-up, module state loading with shape
// checks, overfitting one batch, and checkpoint write / read / prune / corruption detection.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <tuple>
#include <cmath>

#include <filesystem>
#include <fstream>

#include "core/config.h"
#include "core/error.h"
#include "diffusion/denoiser.h"
#include "model/net.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"

namespace fs = std::filesystem;
using namespace ddm;
using ddm::test::error_message;

namespace {
torch::nn::Sequential small_mlp(int64_t hidden) {
  return torch::nn::Sequential(torch::nn::Linear(4, hidden), torch::nn::SiLU(), torch::nn::Linear(hidden, 3));
}

}  // namespace

TEST(FlatAdamW, MatchesLibTorchAdamW) {
  torch::manual_seed(0);
  auto a = small_mlp(8), b = small_mlp(8);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  const double lr = 1e-2, wd = 0.1;
  FlatAdamW flat(*a, {0.9, 0.99, 1e-8, wd});
  torch::optim::AdamW ref(b->parameters(), torch::optim::AdamWOptions(lr).betas({0.9, 0.99}).eps(1e-8).weight_decay(wd));
  auto x = torch::randn({16, 4}), y = torch::randn({16, 3});
  for (int step = 0; step < 20; ++step) {
    flat.zero_grad();
    torch::mse_loss(a->forward(x), y).backward();
    flat.step(lr);
    ref.zero_grad();
    torch::mse_loss(b->forward(x), y).backward();
    ref.step();
  }
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(torch::allclose(a->parameters()[i], b->parameters()[i], 1e-5, 1e-6)) << i;
}

TEST(FlatAdamW, ClipAndEma) {
  torch::manual_seed(0);
  auto m = small_mlp(4);
  FlatAdamW opt(*m, {});
  opt.zero_grad();
  (m->forward(torch::randn({8, 4})).sum() * 1000).backward();
  const double before = opt.clip_grad_norm(1.0);
  EXPECT_GT(before, 1.0);
  EXPECT_NEAR(opt.grad_norm(), 1.0, 1e-4);
  auto ema0 = opt.named_ema();
  std::map<std::string, torch::Tensor> ema_before;
  for (auto& [k, v] : ema0) ema_before[k] = v.clone();
  opt.step(0.1);
  opt.ema_update(0.75);
  for (auto& [k, v] : opt.named_ema()) {
    auto p = opt.named_params().at(k);
    EXPECT_TRUE(torch::allclose(v, 0.75 * ema_before[k] + 0.25 * p, 1e-6, 1e-7)) << k;
    ema_before[k] = v.clone();
  }
  // The EMA fused into the optimizer pass gives the same update.
  opt.step(0.1, 0.5);
  for (auto& [k, v] : opt.named_ema()) {
    auto p = opt.named_params().at(k);
    EXPECT_TRUE(torch::allclose(v, 0.5 * ema_before[k] + 0.5 * p, 1e-6, 1e-7)) << k;
  }
}

// The update a CUDA graph captures (train.cuda_graphs) reads nothing back to the host: the clip and the
// skip of a non-finite step happen on the device. On the CPU it must give the eager update bit for bit:
// clipped and unclipped steps, no clip at all, EMA on and off, and non-finite losses and gradients
// (nothing changes, the step is not counted).
TEST(FlatAdamW, TheUpdateWithNothingReadBackEqualsTheEagerOneBitForBit) {
  struct Case {
    double gain, max_norm;
    bool ema;
    double poison;  // 0: none; else written into the loss (NaN) or a gradient (inf)
    bool poison_grad;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> cases = {{1000, 1.0, true, 0, false},  {1e-3, 1.0, true, 0, false}, {1000, 0.0, true, 0, false},
                                   {1000, 1.0, false, 0, false}, {1, 1.0, true, nan, false},  {1, 1.0, true, inf, true}};
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    torch::manual_seed(3);
    auto a = small_mlp(16), b = small_mlp(16);
    {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
    }
    FlatAdamW eager(*a, {0.9, 0.99, 1e-8, 0.05}), device(*b, {0.9, 0.99, 1e-8, 0.05});
    const auto x = torch::randn({32, 4}), y = torch::randn({32, 3});
    const torch::Tensor lr = torch::zeros({}, torch::kDouble), step = torch::zeros({}, torch::kFloat),
                        ema_w = k.ema ? torch::zeros({}, torch::kFloat) : torch::Tensor();
    for (int s = 0; s < 4; ++s) {
      const bool poisoned = s == 2 && k.poison != 0;
      eager.zero_grad();
      device.zero_grad();
      auto la = torch::mse_loss(a->forward(x), y) * k.gain, lb = torch::mse_loss(b->forward(x), y) * k.gain;
      la.backward();
      lb.backward();
      double loss = la.item<double>();
      torch::Tensor loss_t = lb.detach().to(torch::kDouble);
      if (poisoned && k.poison_grad) {
        eager.flat_grad()[5] = k.poison;
        device.flat_grad()[5] = k.poison;
      } else if (poisoned) {
        loss = k.poison;
        loss_t.fill_(k.poison);
      }
      const double rate = 1e-2 * (s + 1), decay = ema_decay_at(0.999, eager.step_count() + 1);
      // Eager, as TrainStep::finish runs it.
      const double norm = eager.clip_grad_norm(k.max_norm);
      const bool finite = std::isfinite(loss) && std::isfinite(norm);
      if (finite) eager.step(rate, k.ema ? decay : -1.0);
      // On the device's terms: the scalars written first, the flags read after.
      lr.fill_(rate);
      step.fill_(static_cast<double>(device.step_count() + 1));
      if (k.ema) ema_w.fill_(1.0 - decay);
      const torch::Tensor out = device.clip_and_step_on_device(loss_t, k.max_norm, lr, step, ema_w);
      ASSERT_EQ(out.sizes(), (std::vector<int64_t>{2}));
      EXPECT_EQ(out[1].item<double>() != 0, finite) << c << " step " << s;
      if (std::isfinite(norm)) {
        EXPECT_EQ(out[0].item<double>(), norm) << c << " step " << s;
      }
      if (out[1].item<double>() != 0) device.count_step();
      EXPECT_EQ(device.step_count(), eager.step_count()) << c << " step " << s;
      for (const auto& [what, p, q] :
           {std::tuple{"weights", eager.flat_params(), device.flat_params()}, {"ema", eager.flat_ema(), device.flat_ema()},
            {"exp_avg", eager.flat_exp_avg(), device.flat_exp_avg()},
            {"exp_avg_sq", eager.flat_exp_avg_sq(), device.flat_exp_avg_sq()}, {"gradient", eager.flat_grad(), device.flat_grad()}})
        EXPECT_TRUE(torch::equal(p, q)) << c << " step " << s << ": " << what;
    }
    EXPECT_EQ(eager.step_count(), k.poison != 0 ? 3 : 4) << c;
  }
}

// The EMA warm-up every trainer uses: min(decay, (1 + n) / (10 + n)) at optimizer step n.
TEST(EmaDecay, WarmsUpFromTwoEleventhsAndThenHoldsTheConfiguredDecay) {
  EXPECT_DOUBLE_EQ(ema_decay_at(0.999, 1), 2.0 / 11);  // the first step keeps little of the initial weights
  EXPECT_DOUBLE_EQ(ema_decay_at(0.999, 8), 0.5);
  EXPECT_DOUBLE_EQ(ema_decay_at(0.999, 80), 0.9);
  EXPECT_DOUBLE_EQ(ema_decay_at(0.999, 8989), 8990.0 / 8999);  // still warming up: 0.9989999 < 0.999
  EXPECT_DOUBLE_EQ(ema_decay_at(0.999, 8990), 0.999);          // (1 + n) / (10 + n) reaches 0.999 at n = 8990
  EXPECT_DOUBLE_EQ(ema_decay_at(0.999, 1000000), 0.999);
  EXPECT_DOUBLE_EQ(ema_decay_at(0.0, 5), 0.0);  // decay 0: the EMA is the weights
  EXPECT_DOUBLE_EQ(ema_decay_at(0.5, 7), 8.0 / 17);  // below the configured decay until n = 8
  EXPECT_DOUBLE_EQ(ema_decay_at(0.5, 8), 0.5);
  // Never decreasing in n, and never above the configured decay.
  double last = 0;
  for (int64_t n = 1; n <= 20000; ++n) {
    const double d = ema_decay_at(0.9999, n);
    ASSERT_GE(d, last) << n;
    ASSERT_LE(d, 0.9999) << n;
    last = d;
  }
}

TEST(FlatAdamW, OverfitsOneBatch) {
  // A small U-Net must drive the flow-matching loss on one fixed (x0, eps, t) batch far down.
  ModelConfig mc;
  mc.preset = "unet-tiny";
  mc.channels = 8;
  mc.channel_mult = {1, 2};
  mc.groups = 4;
  mc.in_channels = 1;
  mc.image_size = 8;
  mc.num_classes = 2;
  torch::manual_seed(1);
  Net net = make_net(mc);
  FlatAdamW opt(*net, {});
  NoisePath path(PathKind::kFlow);
  auto x0 = torch::rand({8, 1, 8, 8}) * 2 - 1, eps = torch::randn({8, 1, 8, 8});
  auto t = torch::rand({8}), y = torch::randint(0, 2, {8});
  auto xt = path.alpha(t).view({-1, 1, 1, 1}) * x0 + path.sigma(t).view({-1, 1, 1, 1}) * eps;
  auto target = training_target(path, Prediction::kVelocity, x0, eps, t);
  double first = 0, last = 0;
  for (int i = 0; i < 300; ++i) {
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(xt, t, y), target);
    loss.backward();
    opt.step(3e-3);
    (i == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 0.05) << "first " << first << " last " << last;
}

TEST(ModuleState, ShapeMismatchIsAClearError) {
  auto a = small_mlp(8), b = small_mlp(16);
  const std::string e = error_message([&] { load_module_state(*b, module_state(*a), "ckpt/model.safetensors"); });
  EXPECT_NE(e.find("different model shape"), std::string::npos) << e;
  EXPECT_NE(e.find("ckpt/model.safetensors"), std::string::npos) << e;
  TensorMap partial = module_state(*a);
  partial.erase(partial.begin());
  EXPECT_NE(error_message([&] { load_module_state(*a, partial, "x"); }).find("has no tensor"), std::string::npos);
}

// A checkpoint of step `step` of a run of `steps` steps: the module's weights and its optimizer's state.
static Checkpoint checkpoint_of(torch::nn::Module& m, FlatAdamW& opt, int64_t step, int64_t steps) {
  Checkpoint ck;
  ck.step = step;
  ck.config_toml = "[train]\nsteps = " + std::to_string(steps) + "\n";
  ck.model = module_state(m);
  ck.ema = opt.named_ema();
  ck.optim = opt.optimizer_state();
  return ck;
}

// A checkpoint another run is built on (pin_checkpoint) outlives train.keep_ckpts' rotation; pinning
// twice by the same run records it once; a directory that is no checkpoint is left alone.
TEST(Checkpoint, PinnedCheckpointsAreKeptByTheRotation) {
  test::TempDir dir;
  auto m = small_mlp(4);
  FlatAdamW opt(*m, {});
  const auto write = [&](int64_t step) { return write_checkpoint(dir.path, checkpoint_of(*m, opt, step, 60), /*keep=*/2); };
  const std::string pinned = write(10);
  pin_checkpoint(pinned, dir / "latent-run");
  pin_checkpoint(pinned, dir / "latent-run/");
  pin_checkpoint(pinned, dir / "encoded");
  for (int64_t step : {20, 30, 40, 50, 60}) write(step);
  const auto all = list_checkpoints(dir.path);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0], pinned);
  EXPECT_NE(all[1].find("step-00000050"), std::string::npos);
  EXPECT_EQ(checkpoint_pins(pinned), (std::vector<std::string>{dir / "latent-run", dir / "encoded"}));
  EXPECT_TRUE(checkpoint_pins(all[2]).empty());
  EXPECT_EQ(read_checkpoint(pinned).step, 10);  // still a whole checkpoint
  // Released by what pinned it: the last release removes the file, and the next rotation the checkpoint.
  unpin_checkpoint(pinned, dir / "latent-run/");
  EXPECT_EQ(checkpoint_pins(pinned), (std::vector<std::string>{dir / "encoded"}));
  unpin_checkpoint(pinned, dir / "encoded");
  EXPECT_FALSE(fs::exists(fs::path(pinned) / kPinned));
  write(70);
  EXPECT_FALSE(fs::exists(pinned));
  pin_checkpoint(dir / "nothing-here", dir / "x");
  EXPECT_FALSE(fs::exists(dir / "nothing-here"));
}

TEST(Checkpoint, RoundTripPruneAndCorruption) {
  test::TempDir dir;
  auto m = small_mlp(4);
  FlatAdamW opt(*m, {});
  for (int64_t step : {10, 20, 30, 40}) {
    Checkpoint ck = checkpoint_of(*m, opt, step, 40);
    ck.state["data_cursor"] = {{"epoch", 1}, {"index", step}};
    write_checkpoint(dir.path, ck, /*keep=*/2);
  }
  auto all = list_checkpoints(dir.path);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_NE(all[1].find("step-00000040"), std::string::npos);
  Checkpoint back = read_checkpoint(all[1]);
  EXPECT_EQ(back.step, 40);
  EXPECT_EQ(back.state["data_cursor"]["index"], 40);
  EXPECT_EQ(back.config_toml, "[train]\nsteps = 40\n");
  for (auto& [k, v] : module_state(*m)) EXPECT_TRUE(torch::equal(back.model.at(k), v)) << k;
  EXPECT_EQ(resolve_checkpoint(dir.path), all[1]);
  // What a user may point at instead of the run: its ckpt/ folder (the latest), one checkpoint, or a
  // file in one (that checkpoint).
  EXPECT_EQ(resolve_checkpoint(dir / "ckpt"), all[1]);
  EXPECT_EQ(resolve_checkpoint(dir / "ckpt/"), all[1]);
  EXPECT_EQ(resolve_checkpoint(all[0]), all[0]);
  EXPECT_EQ(resolve_checkpoint(all[0] + "/model.safetensors"), all[0]);

  // Flip one byte of the weights: loading must fail with a checksum message; the other one loads.
  const std::string w = all[1] + "/model.safetensors";
  std::string bytes = test::read_text(w);
  bytes[bytes.size() - 3] ^= 0x5a;
  test::write_text(w, bytes);
  const std::string e = error_message([&] { read_checkpoint(all[1]); });
  EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  // Cut short (a disk that filled up): named as damaged, with what to do, before any checksum.
  test::write_text(w, bytes.substr(0, bytes.size() / 2));
  const std::string cut = error_message([&] { read_checkpoint(all[1]); });
  EXPECT_NE(cut.find("truncated"), std::string::npos) << cut;
  EXPECT_NE(cut.find("delete " + all[1]), std::string::npos) << cut;
  std::filesystem::remove(w);
  EXPECT_NE(error_message([&] { read_checkpoint(all[1]); }).find("model.safetensors is missing"), std::string::npos);
  EXPECT_NO_THROW(read_checkpoint(all[0]));

  // A directory that is not a checkpoint.
  EXPECT_NE(error_message([&] { resolve_checkpoint(dir / "nope"); }).find("does not exist"), std::string::npos);
  std::filesystem::create_directories(dir / "empty");
  EXPECT_NE(error_message([&] { resolve_checkpoint(dir / "empty"); }).find("holds no checkpoint"), std::string::npos);
}

// Tensors held elsewhere (Checkpoint::fetch, a pipeline's rank 0 gathering the other stages): the
// writer fetches each placeholder just before writing it and lets it go before the next, part by
// part (model, ema, optim), and each lands in its file, replacing nothing of the writer's own.
TEST(Checkpoint, PlaceholdersAreFetchedOneTensorAtATime) {
  test::TempDir dir;
  Checkpoint ck;
  ck.step = 5;
  auto meta = [](int64_t n) { return torch::empty({n}, torch::TensorOptions().device(torch::kMeta)); };
  ck.model = {{"a", meta(3)}, {"b", meta(2)}, {"own", torch::ones({2})}};
  ck.ema = {{"a", meta(3)}};
  ck.optim = {{"exp_avg.a", meta(3)}};
  std::vector<std::string> order;
  int alive_at_fetch = 0;  // fetched tensors still held when the next one is fetched
  c10::weak_intrusive_ptr<c10::TensorImpl> last(c10::intrusive_ptr<c10::TensorImpl>{});
  ck.fetch = [&](int part, const std::string& name) {
    order.push_back(std::to_string(part) + name);
    alive_at_fetch += last.expired() ? 0 : 1;
    torch::Tensor t = torch::full({name == "b" ? 2 : 3}, static_cast<float>(part + 1));
    last = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
    return t;
  };
  const std::string path = write_checkpoint(dir.path, ck, 1);
  EXPECT_EQ(order, (std::vector<std::string>{"0a", "0b", "1a", "2exp_avg.a"}));
  EXPECT_EQ(alive_at_fetch, 0);
  EXPECT_TRUE(last.expired());
  const Checkpoint back = read_checkpoint(path);
  EXPECT_TRUE(torch::equal(back.model.at("a"), torch::full({3}, 1.0f)));
  EXPECT_TRUE(torch::equal(back.model.at("b"), torch::full({2}, 1.0f)));
  EXPECT_TRUE(torch::equal(back.model.at("own"), torch::ones({2})));
  EXPECT_TRUE(torch::equal(back.ema.at("a"), torch::full({3}, 2.0f)));
  EXPECT_TRUE(torch::equal(back.optim.at("exp_avg.a"), torch::full({3}, 3.0f)));
  // A fetched tensor that is not what the header promised is an error, and nothing is written.
  ck.step = 6;
  ck.fetch = [](int, const std::string&) { return torch::zeros({7}); };
  const std::string e = error_message([&] { write_checkpoint(dir.path, ck, 1); });
  EXPECT_NE(e.find("but the header says"), std::string::npos) << e;
  EXPECT_EQ(list_checkpoints(dir.path).size(), 1u);
  // What was written of it is removed (it would hold the space of a full disk), and the message says
  // which checkpoint --resume goes on from.
  EXPECT_NE(e.find("the checkpoint of step 6 is not written (its partial files are removed); the earlier ones are "
                   "intact: --resume goes on from the last, " + path),
            std::string::npos) << e;
  EXPECT_FALSE(std::filesystem::exists(dir / "ckpt/.tmp-step-00000006"));
}

// A checksum only proves the file is what was written: weights that are NaN or inf are refused by
// name, not sampled into a black grid.
TEST(ModuleState, NonFiniteWeightsAreAClearError) {
  auto m = small_mlp(4);
  TensorMap state = module_state(*m);
  const std::string name = state.begin()->first;
  state[name] = state[name].clone();
  state[name].view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
  state[name].view({-1})[1] = std::numeric_limits<float>::infinity();
  const std::string e = error_message([&] { load_module_state(*m, state, "ck/ema.safetensors"); });
  EXPECT_NE(e.find("ck/ema.safetensors: tensor '" + name + "' holds 2 non-finite values"), std::string::npos) << e;
}

// Every field of state.json that ddm reads is checked: missing or ill-typed, the message names the
// file and the field (once it was "[json.exception.type_error.306] cannot use value() with null").
TEST(Checkpoint, MalformedStateJsonNamesFileAndField) {
  test::TempDir dir;
  auto m = small_mlp(4);
  FlatAdamW opt(*m, {});
  Checkpoint ck;
  ck.step = 5;
  ck.config_toml = "[train]\nsteps = 5\n";
  ck.model = module_state(*m);
  ck.ema = opt.named_ema();
  ck.optim = opt.optimizer_state();
  ck.state["data_cursor"] = {{"epoch", 0}, {"index", 5}};
  const std::string path = write_checkpoint(dir.path, ck, 1);
  const std::string state_path = path + "/state.json";
  const auto good = nlohmann::json::parse(test::read_text(state_path));
  auto error_with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    test::write_text(state_path, j.dump(2));
    return error_message([&] {
      const Checkpoint back = read_checkpoint(path);
      back.field<int64_t>("/data_cursor/epoch");
    });
  };
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& j) { j.erase("sha256"); }, "field 'sha256.model.safetensors' is missing, expected a string"},
      {[](nlohmann::json& j) { j["sha256"] = 3; }, "field 'sha256.model.safetensors' is missing"},
      {[](nlohmann::json& j) { j["sha256"]["ema.safetensors"] = nullptr; },
       "field 'sha256.ema.safetensors' is null, expected a string"},
      {[](nlohmann::json& j) { j.erase("step"); }, "field 'step' is missing, expected an integer"},
      {[](nlohmann::json& j) { j["step"] = "five"; }, "field 'step' is a string, expected an integer"},
      {[](nlohmann::json& j) { j["step"] = 5.5; }, "field 'step' is a number, expected an integer"},
      {[](nlohmann::json& j) { j["step"] = -1; }, "field 'step' is -1"},
      {[](nlohmann::json& j) { j["config"] = nullptr; }, "field 'config' is null, expected a string"},
      {[](nlohmann::json& j) { j.erase("format"); }, "field 'format' is missing"},
      {[](nlohmann::json& j) { j["data_cursor"].erase("epoch"); }, "field 'data_cursor.epoch' is missing"},
      {[](nlohmann::json& j) { j["data_cursor"] = "x"; }, "field 'data_cursor.epoch' is missing"},
      {[](nlohmann::json& j) { j = nlohmann::json::array(); }, "is JSON but not an object"},
  };
  for (const Case& c : cases) {
    const std::string e = error_with(c.edit);
    EXPECT_NE(e.find(state_path), std::string::npos) << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in: " << e;
  }
  test::write_text(state_path, good.dump(2));
  EXPECT_EQ(read_checkpoint(path).field<int64_t>("/data_cursor/index"), 5);
}
