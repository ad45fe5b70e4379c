// Pipeline-parallel training through the real trainer (parallel.pp), stages as threads of this
// process sharing a c10d HashStore (Gloo send/recv over loopback): a pipeline of S stages trains what
// one process with the same micro-batches trains, for GPipe, 1F1B and ZB-H1, on a U-Net with its
// skips crossing the cuts and on a DiT, bit-identical when repeated, and with a stage that has no
// trainable parameters (a ControlNet's locked output layer); a run resumes under another stage split and as one process;
// bad stage configurations are clear errors on every stage; data-parallel replicas of a pipeline
// (parallel.pp x parallel.dp) train what one process trains too. Bubble filling: a micro-batch prepared in
// pieces is the whole one bit for bit, and a filled pipeline trains exactly what an unfilled one does.
// Text models (model.text_encoder, the real all-MiniLM-L6-v2): the captions' encodings travel to the
// stages, and the encoder is fill work.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "core/fileio.h"
#include "core/run_dir.h"
#include "model/net.h"
#include "pipeline/prepare.h"
#include "pipeline/profile.h"
#include "pipeline/routes.h"
#include "pipeline/runtime.h"
#include "pipeline/timeline.h"
#include "unit/test_dist_util.h"
#include "test_util.h"
#include "train/controlnet.h"
#include "unit/run/train_test_util.h"

using namespace ddm;
using namespace ddm::test;
namespace fs = std::filesystem;

namespace {

// parallel.schedule as a user writes it.
ScheduleKind schedule_named(const std::string& name) {
  return parse_config("", "test.toml", {"parallel.schedule=" + name}).parallel.schedule;
}

RunConfig piped(RunConfig cfg, int stages, const std::string& schedule, std::vector<int64_t> cuts = {}) {
  cfg.parallel.pp = stages;
  cfg.parallel.schedule = schedule_named(schedule);
  cfg.parallel.cuts = std::move(cuts);
  return cfg;
}

std::string validate_error(const RunConfig& cfg) {
  try {
    validate(cfg);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

RunConfig base(const std::string& arch) {
  RunConfig cfg = tiny(arch);
  cfg.train.grad_accum = 4;  // the pipeline's micro-batches; the single process accumulates the same ones
  return cfg;
}

// Tolerance as in test_data_parallel.cpp: the same sums in another order (the conditioning embedding's
// gradient adds up per stage; the gradient norm is a sum of the stages' squares), so float32
// rounding: losses within 1e-4 relative, weights within 1e-3 (AdamW's division by the running RMS
// can turn a rounding-level gradient into a step of up to ~3 lr).
void expect_same_training(const std::string& run, const std::string& reference, const std::string& what) {
  const auto l = losses(run), want = losses(reference);
  ASSERT_EQ(l.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < l.size(); ++i) worst = std::max(worst, std::abs(l[i] - want[i]) / want[i]);
  const double w = max_weight_difference(final_weights(run), final_weights(reference));
  EXPECT_LE(worst, 1e-4) << what;
  EXPECT_LE(w, 1e-3) << what;
  std::printf("%s: losses within %.2e (relative), weights within %.2e\n", what.c_str(), worst, w);
}

}  // namespace

TEST(PipelineTrain, StagesTrainWhatOneProcessTrains) {
  for (const char* arch : {"unet", "dit"}) {
    test::TempDir dir;
    const RunConfig cfg = base(arch);
    ASSERT_EQ(train_ranks(1, {cfg}, dir / "one"), std::vector<std::string>{""});
    ASSERT_EQ(losses(dir / "one").size(), 20u);
    // The U-Net's cut after its second unit leaves the first skip open across it.
    const std::vector<int64_t> cut = {2};
    for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
      const RunConfig two = piped(cfg, 2, schedule, cut);
      ASSERT_EQ(train_ranks(2, {two, two}, dir / schedule), (std::vector<std::string>{"", ""})) << schedule;
      expect_same_training(dir / schedule, dir / "one", std::string(arch) + " 2 stages " + schedule);
    }
    // Same config, stages, split and threads: bit-identical.
    const RunConfig again = piped(cfg, 2, "1f1b", cut);
    ASSERT_EQ(train_ranks(2, {again, again}, dir / "again"), (std::vector<std::string>{"", ""}));
    EXPECT_EQ(losses(dir / "again"), losses(dir / "1f1b")) << arch;
    EXPECT_EQ(max_weight_difference(final_weights(dir / "again"), final_weights(dir / "1f1b")), 0.0) << arch;
    const RunConfig three = piped(cfg, 3, "1f1b");  // automatic cuts
    ASSERT_EQ(train_ranks(3, {three, three, three}, dir / "three"), (std::vector<std::string>(3, "")));
    expect_same_training(dir / "three", dir / "one", std::string(arch) + " 3 stages 1f1b");
    // V-shaped placement: 4 stages on 2 processes, rank 0 running the first and the last (the loss),
    // split by the V's DP; what one rank's stages pass each other stays in the process.
    for (const char* schedule : {"1f1b-v", "zb-v"}) {
      RunConfig v = piped(cfg, 2, schedule);
      v.parallel.fill = false;
      ASSERT_EQ(train_ranks(2, {v, v}, dir / schedule), (std::vector<std::string>{"", ""})) << schedule;
      expect_same_training(dir / schedule, dir / "one", std::string(arch) + " 2 ranks x 2 stages " + schedule);
      ASSERT_EQ(train_ranks(2, {v, v}, dir / (std::string(schedule) + "-again")), (std::vector<std::string>{"", ""}));
      EXPECT_EQ(losses(dir / (std::string(schedule) + "-again")), losses(dir / schedule)) << arch << " " << schedule;
      EXPECT_EQ(max_weight_difference(final_weights(dir / (std::string(schedule) + "-again")), final_weights(dir / schedule)), 0.0)
          << arch << " " << schedule;
    }
    // A real difference is seen: the single process without its last micro-batches' worth of data.
    RunConfig half = cfg;
    half.train.batch_size = 8;
    half.train.grad_accum = 2;
    ASSERT_EQ(train_ranks(1, {half}, dir / "half"), std::vector<std::string>{""});
    EXPECT_GT(max_weight_difference(final_weights(dir / "half"), final_weights(dir / "one")), 1e-2);
  }
}

// A ControlNet's last unit (its locked decoder's output layer) has no trainable parameter: a stage of
// it alone runs forwards and input gradients and has nothing to update.
TEST(PipelineTrain, AStageWithoutTrainableParametersTrains) {
  test::TempDir dir;
  const RunConfig unet = base("unet");
  ASSERT_EQ(train_ranks(1, {unet}, dir / "base"), std::vector<std::string>{""});
  RunConfig cn = unet;
  cn.model.controlnet = dir / "base";
  cn.train.steps = 6;
  const TrainJob job = job_for(cn);
  Net net = make_net(job.cfg.model);
  attach_controlnet(*net, job.cfg.model);
  const std::vector<NetUnit> all = net->units();
  const int units = static_cast<int>(all.size());
  for (const torch::Tensor& p : all.back().params) ASSERT_FALSE(p.requires_grad()) << all.back().name;
  ASSERT_EQ(train_ranks(1, {cn}, dir / "one"), std::vector<std::string>{""});
  const RunConfig two = piped(cn, 2, "zb-h1", {units - 1});
  ASSERT_EQ(train_ranks(2, {two, two}, dir / "two"), (std::vector<std::string>{"", ""}));
  expect_same_training(dir / "two", dir / "one", "ControlNet, last stage without parameters");
}

TEST(PipelineTrain, ResumesUnderAnotherSplitAndAsOneProcess) {
  test::TempDir dir;
  const RunConfig cfg = base("unet");
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "one"), std::vector<std::string>{""});
  RunConfig first = piped(cfg, 2, "1f1b", {2});
  first.train.steps = 10;
  // Two stages for 10 steps, then three stages (another split, another schedule) to step 20.
  ASSERT_EQ(train_ranks(2, {first, first}, dir / "split"), (std::vector<std::string>{"", ""}));
  const RunConfig three = piped(cfg, 3, "gpipe");
  ASSERT_EQ(train_ranks(3, {three, three, three}, dir / "split", true), (std::vector<std::string>(3, "")));
  expect_same_training(dir / "split", dir / "one", "2 stages, resumed as 3");
  // Two stages for 10 steps, then one process to step 20.
  ASSERT_EQ(train_ranks(2, {first, first}, dir / "single"), (std::vector<std::string>{"", ""}));
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "single", true), std::vector<std::string>{""});
  expect_same_training(dir / "single", dir / "one", "2 stages, resumed as 1 process");
  // V-shaped, 2 processes x 2 stages, for 10 steps, then one process to step 20.
  RunConfig v = piped(cfg, 2, "zb-v", {2, 3, 5});  // enc0_0's skip stays on rank 0 (stage 0 to 3)
  v.parallel.fill = false, v.train.steps = 10;
  {
    const TrainJob job = job_for(v);
    Net net = make_net(job.cfg.model);
    Prepared sample;
    torch::NoGradGuard no_grad;
    BatchLoader probe(job.data, 1, 1, false);
    sample = make_objective(job.cfg)->prepare(probe.next(), 0);
    const int L = static_cast<int>(net->units().size());
    const PipeSkipRoutes r = pipe_skip_routes(*net, sample, {0, 2, 3, 5, L});
    EXPECT_EQ(r.out[0], std::vector<int>{3});  // sent straight from stage 0 to stage 3, both on rank 0
  }
  ASSERT_EQ(train_ranks(2, {v, v}, dir / "v"), (std::vector<std::string>{"", ""}));
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "v", true), std::vector<std::string>{""});
  expect_same_training(dir / "v", dir / "one", "2 ranks x 2 stages (V), resumed as 1 process");
  // The pipeline's checkpoint is an ordinary one: every parameter, by name, and its state.
  const Checkpoint ck = read_checkpoint(*latest_checkpoint(dir / "split"), true);
  EXPECT_EQ(ck.state["pipeline"]["stages"].get<int>(), 3);
  EXPECT_EQ(ck.model.size(), read_checkpoint(*latest_checkpoint(dir / "one"), true).model.size());
}

TEST(PipelineTrain, BadStageConfigsAreClearErrors) {
  test::TempDir dir;
  const RunConfig cfg = base("unet");
  // A process count that is not the stage count.
  const RunConfig three = piped(cfg, 3, "1f1b");
  for (const std::string& e : train_ranks(2, {three, three}, dir / "a"))
    EXPECT_NE(e.find("parallel.pp = 3 pipeline stages but the job has 2 processes"), std::string::npos) << e;
  // More stages than units, and a cut past the last unit.
  RunConfig many = piped(cfg, 2, "1f1b", {400});
  for (const std::string& e : train_ranks(2, {many, many}, dir / "b"))
    EXPECT_NE(e.find("parallel.cuts = 400 is not a unit index"), std::string::npos) << e;
  // Stages that disagree on the schedule.
  const RunConfig g = piped(cfg, 2, "gpipe"), z = piped(cfg, 2, "zb-h1");
  for (const std::string& e : train_ranks(2, {g, z}, dir / "c"))
    EXPECT_NE(e.find("parallel.schedule"), std::string::npos) << e;
  // Keys checked by the config: cut count and order.
  RunConfig bad = piped(cfg, 3, "1f1b", {4});
  EXPECT_NE(validate_error(bad).find("parallel.cuts has 1 entries but parallel.pp = 3"), std::string::npos) << validate_error(bad);
  bad = piped(cfg, 3, "1f1b", {4, 2});
  EXPECT_NE(validate_error(bad).find("parallel.cuts must be increasing"), std::string::npos) << validate_error(bad);
  EXPECT_NE(error_message([] { schedule_named("1f2b"); }).find("parallel.schedule = \"1f2b\" is not one of: gpipe, 1f1b, zb-h1, 1f1b-v, zb-v"),
            std::string::npos);
  bad = piped(cfg, 2, "zb-v", {4});  // V: 2 ranks run 4 stages, 3 cuts
  EXPECT_NE(validate_error(bad).find("parallel.cuts has 1 entries but parallel.pp = 2 V-shaped ranks (4 stages) need 3"),
            std::string::npos)
      << validate_error(bad);
  // V-shaped placement needs 2 units a rank.
  Net whole = make_net(job_for(cfg).cfg.model);
  EXPECT_NE(error_message([&] { pipe_stage_bounds(*whole, Prepared{}, 80, {}, true); })
                .find("parallel.pp = 40 V-shaped ranks run 80 stages, but the model has only"),
            std::string::npos);
  // The keys as a user writes them.
  const RunConfig parsed = parse_config("", "test.toml", {"parallel.pp=3", "parallel.cuts=[4, 9]", "parallel.schedule=zb-h1"});
  EXPECT_EQ(parsed.parallel.cuts, (std::vector<int64_t>{4, 9}));
  EXPECT_FALSE(fs::exists(dir / "a/ckpt"));
}

// A micro-batch prepared in pieces, each a whole number of quanta prepared alone, is the same bit for
// bit however it is cut (and within float32 rounding of one prepare call on all its rows), for a plain
// U-Net and for a ControlNet whose locked encoder runs in prepare.
TEST(PipePrepare, PiecesConcatenateToTheWholeMicroBatch) {
  test::TempDir dir;
  RunConfig unet = base("unet");
  unet.train.label_dropout = 0.5;  // dropped labels too are keyed per row
  ASSERT_EQ(train_ranks(1, {unet}, dir / "base"), std::vector<std::string>{""});
  RunConfig cn = unet;
  cn.model.controlnet = dir / "base";
  for (const RunConfig& cfg : {unet, cn}) {
    const bool controlnet = !cfg.model.controlnet.empty();
    const TrainJob job = job_for(cfg);
    Net net = make_net(job.cfg.model);
    attach_controlnet(*net, job.cfg.model);
    const auto objective = make_objective(job.cfg);
    BatchLoader loader(job.data, 16, 3, true);
    const Batch micro = loader.next().rows(8, 8);  // the second micro-batch of 8: rows keyed from position 8
    ASSERT_EQ(micro.first, 8);
    torch::NoGradGuard no_grad;
    const PrepNeeds all{true, true, true};
    const TensorMap whole = prepared_tensors(prepare_rows(*objective, *net, micro, 0, 8, 2, 5), all);
    EXPECT_EQ(whole.count("frozen.0"), controlnet ? 1u : 0u);
    EXPECT_EQ(whole.count("control"), controlnet ? 1u : 0u);
    std::vector<std::pair<int64_t, TensorMap>> pieces;
    for (const auto& [first, n] : std::vector<std::pair<int64_t, int64_t>>{{6, 2}, {0, 4}, {4, 2}})
      pieces.emplace_back(first, prepared_tensors(prepare_rows(*objective, *net, micro, first, n, 2, 5), all));
    const TensorMap joined = prepared_tensors(prepared_from(pieces, 8, "test"), all);
    ASSERT_EQ(joined.size(), whole.size());
    for (const auto& [key, t] : whole) EXPECT_TRUE(torch::equal(t, joined.at(key))) << key << (controlnet ? " (ControlNet)" : "");
    // One prepare call on all 8 rows: the frozen encoder's batch differs, so float32 rounding apart.
    Prepared one = objective->prepare(micro, 5);
    one.cond = net->precompute(one.xt, one.t, one.cond);
    for (const auto& [key, t] : prepared_tensors(one, all))
      EXPECT_TRUE(torch::allclose(t.to(torch::kDouble), whole.at(key).to(torch::kDouble), 1e-5, 1e-6)) << key;
    // What a middle stage reads: t and the small conditioning tensors, no x_t, target or frozen features.
    const TensorMap middle = prepared_tensors(prepare_rows(*objective, *net, micro, 0, 8, 2, 5), PrepNeeds{});
    EXPECT_TRUE(middle.count("t") && middle.count("y"));
    EXPECT_FALSE(middle.count("xt") || middle.count("target") || middle.count("frozen.0"));
    // Rows missing, or twice.
    auto gap = pieces;
    gap.pop_back();
    EXPECT_NE(test::error_message([&] { prepared_from(gap, 8, "micro-batch 1"); }).find("micro-batch 1: prepared rows are missing at row 4"),
              std::string::npos);
    auto twice = pieces;
    twice.push_back(pieces[1]);
    EXPECT_NE(test::error_message([&] { prepared_from(twice, 8, "m"); }).find("overlap"), std::string::npos);
    EXPECT_NE(test::error_message([&] { prepare_rows(*objective, *net, micro, 0, 3, 2, 5); }).find("not a whole number of quanta"),
              std::string::npos);
  }
}

namespace {
// How many prepare pieces of the run's fill plan prepare the next step's rows in a bubble (the run's
// last step runs none of them: there is no next step).
int ahead_pieces(const std::string& run) {
  const nlohmann::json tl = nlohmann::json::parse(read_file(RunDir(run) / RunDir::kPipeTimeline));
  EXPECT_TRUE(tl.at("fill").at("used").get<bool>()) << run;
  int n = 0;
  for (const auto& r : tl.at("fill").at("ranks"))
    for (const auto& e : r)
      if (e.at(0) == "T" && e.at(5).get<bool>()) ++n;
  return n;
}
}  // namespace

// Bubble filling (parallel.fill): after two measured steps the stages plan where the prepare work
// fits, then run it there, a piece's rows sent to the stages that read them, the next step's
// micro-batches prepared ahead. It changes no result: the same losses and weights bit for bit as
// every stage preparing everything, for each schedule, a DiT, a ControlNet whose second stage reads
// the locked encoder's features, and a run resumed in the middle (the rows prepared ahead are not in
// a checkpoint: prepared again, alike). The runs plan from fixed timings (their measured bytes kept),
// so that every machine, sanitized or not, runs the same plans: one that fills bubbles.
// The stages' measures fixed while it lives (the pieces of the prepare phase then fit the bubbles,
// whatever this machine's speed), as the plan of a filled pipeline reads them.
struct FixedFillMeasures {
  FixedFillMeasures() {
    PipeStep::override_measures([](std::vector<PipeStageMeasure>& stages) {
      for (PipeStageMeasure& m : stages) {
        const bool split = m.weight_grad > 0;  // ZB: B is I + W
        m.forward = 2;
        m.input_grad = split ? 2 : 4;
        m.weight_grad = split ? 2 : 0;
        m.optimizer = 0.5;
        m.prepare_quantum = 0.25;
        if (m.first_pass >= 0) m.first_pass = 1;
        if (m.link_bytes_per_ms > 0 || m.link_latency > 0) m.link_latency = 0.01, m.link_bytes_per_ms = 1e6;
      }
    });
  }
  ~FixedFillMeasures() { PipeStep::override_measures(nullptr); }
};

TEST(PipelineTrain, FillingTheBubblesChangesNoResult) {
  test::TempDir dir;
  const FixedFillMeasures fixed;
  auto filled_and_not = [&](RunConfig cfg, const std::string& name) {
    cfg.parallel.fill = false;
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / (name + "-serial")), (std::vector<std::string>{"", ""})) << name;
    cfg.parallel.fill = true;
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, dir / name), (std::vector<std::string>{"", ""})) << name;
    EXPECT_EQ(losses(dir / name), losses(dir / (name + "-serial"))) << name;
    EXPECT_EQ(max_weight_difference(final_weights(dir / name), final_weights(dir / (name + "-serial"))), 0.0) << name;
    EXPECT_GT(ahead_pieces(dir / name), 0) << name;
  };
  auto sized = [](RunConfig cfg) {
    cfg.train.batch_size = 32;  // micro-batches of 8 rows, prepared in quanta of 4: partial batches
    cfg.train.steps = 8;
    return cfg;
  };
  filled_and_not(piped(sized(base("unet")), 2, "1f1b", {2}), "unet-1f1b");
  filled_and_not(piped(sized(base("unet")), 2, "zb-h1", {2}), "unet-zb-h1");
  filled_and_not(piped(sized(base("dit")), 2, "gpipe"), "dit-gpipe");
  filled_and_not(piped(sized(base("unet")), 2, "1f1b-v", {2, 3, 5}), "unet-1f1b-v");  // 4 stages on 2 processes
  filled_and_not(piped(sized(base("dit")), 2, "zb-v"), "dit-zb-v");

  RunConfig first = piped(sized(base("unet")), 2, "1f1b", {2});
  first.train.steps = 5;
  ASSERT_EQ(train_ranks(2, {first, first}, dir / "resumed"), (std::vector<std::string>{"", ""}));
  const RunConfig rest = piped(sized(base("unet")), 2, "1f1b", {2});
  ASSERT_EQ(train_ranks(2, {rest, rest}, dir / "resumed", true), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(losses(dir / "resumed"), losses(dir / "unet-1f1b"));
  EXPECT_EQ(max_weight_difference(final_weights(dir / "resumed"), final_weights(dir / "unet-1f1b")), 0.0);

  ASSERT_EQ(train_ranks(1, {base("unet")}, dir / "base"), std::vector<std::string>{""});
  RunConfig cn = sized(base("unet"));
  cn.model.controlnet = dir / "base";
  const TrainJob job = job_for(cn);
  Net net = make_net(job.cfg.model);
  attach_controlnet(*net, job.cfg.model);
  const std::vector<NetUnit> units = net->units();
  int64_t zero = 0;
  while (units[static_cast<size_t>(zero)].name != "zero") ++zero;
  ASSERT_TRUE(units[static_cast<size_t>(zero)].reads_frozen);
  filled_and_not(piped(cn, 2, "1f1b", {zero}), "controlnet");
  filled_and_not(piped(cn, 2, "1f1b-v"), "controlnet-v");  // the control maps' reader on a rank's second stage
}

// A text model in a pipeline: the encodings of the micro-batch's captions (made in the prepare phase,
// caption dropout keyed as in one process) travel to every stage, whose cross-attention and pooled
// embedding read them; 2 stages train what one process trains, and with the prepare phase, text
// encoder included, placed into the bubbles in pieces, exactly what the unfilled pipeline trains.
TEST(PipelineTrain, TextModelsTrainThroughTheStagesAndTheEncoderFillsTheBubbles) {
  test::TempDir dir;
  auto text = [](RunConfig cfg) {
    cfg.model.text_encoder = test::minilm_package_dir() + "/model";
    cfg.model.text_tokens = 8;
    cfg.model.attn_levels = {1};
    cfg.train.caption_dropout = 0.3;
    cfg.train.steps = 8;
    cfg.data.hflip = false;
    return cfg;
  };
  for (const char* arch : {"unet", "dit"}) {
    const RunConfig cfg = text(base(arch));
    const std::string one = dir / (std::string(arch) + "-one"), two = dir / (std::string(arch) + "-two");
    ASSERT_EQ(train_ranks(1, {cfg}, one), std::vector<std::string>{""});
    const RunConfig piped2 = piped(cfg, 2, "1f1b");
    ASSERT_EQ(train_ranks(2, {piped2, piped2}, two), (std::vector<std::string>{"", ""})) << arch;
    expect_same_training(two, one, std::string("text ") + arch + " 2 stages 1f1b");
  }
  // The captions matter: without dropout the text weights train otherwise.
  RunConfig no_drop = text(base("dit"));
  no_drop.train.caption_dropout = 0;
  ASSERT_EQ(train_ranks(1, {no_drop}, dir / "no-drop"), std::vector<std::string>{""});
  EXPECT_GT(max_weight_difference(final_weights(dir / "no-drop"), final_weights(dir / "dit-one")), 1e-3);
  // Bubble filling, its measures fixed so that the prepare phase's pieces fit the bubbles.
  const FixedFillMeasures fixed;
  for (const char* schedule : {"1f1b", "zb-v"}) {
    RunConfig cfg = piped(text(base("unet")), 2, schedule);
    cfg.train.batch_size = 32;  // micro-batches of 8 rows, prepared in quanta of 4
    cfg.train.steps = 6;
    const std::string name = dir / (std::string("fill-") + schedule);
    cfg.parallel.fill = false;
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, name + "-serial"), (std::vector<std::string>{"", ""})) << schedule;
    cfg.parallel.fill = true;
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, name), (std::vector<std::string>{"", ""})) << schedule;
    EXPECT_EQ(losses(name), losses(name + "-serial")) << schedule;
    EXPECT_EQ(max_weight_difference(final_weights(name), final_weights(name + "-serial")), 0.0) << schedule;
    EXPECT_GT(ahead_pieces(name), 0) << schedule;
  }
}

// Pipelines of data-parallel replicas: 2 stages x 2 replicas (4 processes, rank = stage x 2 +
// replica) train on the replicas' halves of each batch what one process trains on the whole, with
// the same micro-batches; parallel.dp = 0 takes every process; a run resumes as one pipeline.
TEST(PipelineTrain, DataParallelReplicasOfAPipeline) {
  test::TempDir dir;
  const RunConfig cfg = base("unet");  // batch 16 in 4 micro-batches of 4
  ASSERT_EQ(train_ranks(1, {cfg}, dir / "one"), std::vector<std::string>{""});
  RunConfig hybrid = piped(cfg, 2, "1f1b", {2});
  hybrid.parallel.dp = 2;
  hybrid.train.grad_accum = 2;  // each replica: 8 rows in 2 micro-batches of 4
  ASSERT_EQ(train_ranks(4, std::vector<RunConfig>(4, hybrid), dir / "hybrid"), std::vector<std::string>(4, ""));
  expect_same_training(dir / "hybrid", dir / "one", "2 stages x 2 replicas");
  // The measured timeline (`ddm plan --measured` simulates its micro-batches) records what one
  // pipeline ran: its replica's 8 rows in 2 micro-batches of 4, not the global batch's 16 / 2.
  const MeasuredPipeTimeline tl = read_pipe_timeline(RunDir(dir / "hybrid") / RunDir::kPipeTimeline);
  EXPECT_EQ(tl.run.stages, 2);
  EXPECT_EQ(tl.run.replicas, 2);
  EXPECT_EQ(tl.run.micro, 2);
  EXPECT_EQ(tl.run.rows, 4);
  // V-shaped: 4 stages on each replica's 2 processes (the replicas' sync after the last action).
  RunConfig vhybrid = piped(hybrid, 2, "1f1b-v", {2, 3, 5});
  vhybrid.parallel.fill = false;
  ASSERT_EQ(train_ranks(4, std::vector<RunConfig>(4, vhybrid), dir / "vhybrid"), std::vector<std::string>(4, ""));
  expect_same_training(dir / "vhybrid", dir / "one", "2 ranks x 2 stages (V) x 2 replicas");
  RunConfig every = hybrid;
  every.parallel.dp = 0;
  ASSERT_EQ(train_ranks(4, std::vector<RunConfig>(4, every), dir / "every"), std::vector<std::string>(4, ""));
  EXPECT_EQ(losses(dir / "every"), losses(dir / "hybrid"));
  EXPECT_EQ(max_weight_difference(final_weights(dir / "every"), final_weights(dir / "hybrid")), 0.0);
  // 10 steps as 2 x 2, then one pipeline of 2 stages with the same micro-batches.
  RunConfig first = hybrid;
  first.train.steps = 10;
  ASSERT_EQ(train_ranks(4, std::vector<RunConfig>(4, first), dir / "resumed"), std::vector<std::string>(4, ""));
  const RunConfig line = piped(cfg, 2, "zb-h1", {2});
  ASSERT_EQ(train_ranks(2, {line, line}, dir / "resumed", true), (std::vector<std::string>{"", ""}));
  expect_same_training(dir / "resumed", dir / "one", "2 x 2 resumed as one pipeline");
  // Process counts that do not fit.
  RunConfig three = hybrid;
  three.parallel.dp = 3;
  for (const std::string& e : train_ranks(4, std::vector<RunConfig>(4, three), dir / "bad"))
    EXPECT_NE(e.find("parallel.pp = 2 pipeline stages x parallel.dp = 3 replicas but the job has 4 processes"), std::string::npos) << e;
  const RunConfig odd = piped(cfg, 3, "1f1b");
  for (const std::string& e : train_ranks(4, std::vector<RunConfig>(4, odd), dir / "bad"))
    EXPECT_NE(e.find("launch 3 processes (or a multiple of 3 for data-parallel replicas)"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "bad/ckpt"));
}

// Self-conditioning in a pipeline: each micro-batch's chosen rows first pass through every stage
// without gradients, the last stage's output returns to stage 0 as the x0 estimate its forward takes.
// The same training as one process (within float32 rounding), for a U-Net and a DiT, filled or not
// (bit for bit).
TEST(PipelineTrain, SelfConditioningPassesThroughTheStages) {
  test::TempDir dir;
  for (const char* arch : {"unet", "dit"}) {
    RunConfig cfg = base(arch);
    cfg.train.self_cond = 0.5;
    cfg.train.steps = 8;
    const std::string one = dir / (std::string(arch) + "-one");
    ASSERT_EQ(train_ranks(1, {cfg}, one), std::vector<std::string>{""});
    RunConfig two = piped(cfg, 2, "1f1b", std::string(arch) == "unet" ? std::vector<int64_t>{2} : std::vector<int64_t>{});
    const std::string filled = dir / (std::string(arch) + "-filled"), serial = dir / (std::string(arch) + "-serial");
    ASSERT_EQ(train_ranks(2, {two, two}, filled), (std::vector<std::string>{"", ""}));
    expect_same_training(filled, one, std::string(arch) + " 2 stages, self-conditioning");
    two.parallel.fill = false;
    ASSERT_EQ(train_ranks(2, {two, two}, serial), (std::vector<std::string>{"", ""}));
    EXPECT_EQ(losses(filled), losses(serial)) << arch;
    EXPECT_EQ(max_weight_difference(final_weights(filled), final_weights(serial)), 0.0) << arch;
    // The first pass ran on both stages (the timeline's "T" events that prepare nothing ahead).
    const nlohmann::json tl = nlohmann::json::parse(read_file(RunDir(serial) / RunDir::kPipeTimeline));
    for (const auto& r : tl.at("ranks")) {
      int64_t rows = 0;
      for (const auto& e : r.at("events"))
        if (e.at(0) == "T" && !e.at(5).get<bool>()) rows += e.at(4).get<int64_t>();
      EXPECT_GT(rows, 0) << arch << " stage " << r.at("stage");
    }
    // V-shaped: the first pass crosses 4 stages on 2 processes; its output returns within process 0.
    RunConfig v = piped(cfg, 2, "zb-v");
    v.parallel.fill = false;
    const std::string vdir = dir / (std::string(arch) + "-v");
    ASSERT_EQ(train_ranks(2, {v, v}, vdir), (std::vector<std::string>{"", ""}));
    expect_same_training(vdir, one, std::string(arch) + " 2 ranks x 2 stages (V), self-conditioning");
  }
}

// Self-conditioning's first passes in partial batches, through PipeStep itself (stages as threads):
// a fill plan made from measurements chosen so that stage 0's pass of a micro-batch is cut into
// pieces (part at the step's start, part in a bubble) trains what the unfilled pipeline trains,
// whose passes run whole, bit for bit: every stage runs each quantum of positions alone.
TEST(PipelineTrain, FirstPassesInPartialBatchesChangeNoResult) {
  RunConfig cfg = piped(base("unet"), 2, "1f1b", {2});
  cfg.train.self_cond = 0.5;
  cfg.train.batch_size = 64;  // 4 micro-batches of 16 rows, in quanta of 2
  cfg.parallel.fill = false;  // no plan of the run's own
  const TrainJob job = job_for(cfg);
  const PipeSchedule schedule = make_schedule("1f1b", 2, 4);
  // Stage 0's pass (1.6 per micro-batch) is longer than its bubbles: partial batches.
  std::vector<PipeStageMeasure> m(2);
  m[0] = {2, 3, 0, 0.5, 0.4, 5000, {1000, 600}, 0.1, 1000, {0, 0}, 1.6, 2000};
  m[1] = {1.5, 2.5, 0, 0.7, 0.6, 0, {1000, 600}, 0, 0, {0, 0}, 0.3, 2000};
  const PipeFillPlan plan = plan_fill(schedule, m, 16, prepare_quantum(16));
  int partial = 0;
  for (const auto& r : plan.fill.schedule.ranks)
    for (const PipeAction& a : r) partial += a.op == PipeOp::kTask && a.task > 0 && a.rows < 16;
  ASSERT_GT(partial, 0) << "the plan cuts no pass into pieces";

  // Four steps of the two stages; per rank its losses and its stage's final weights.
  auto run = [&](bool with_plan) {
    std::vector<std::vector<double>> losses(2);
    std::vector<std::vector<torch::Tensor>> weights(2);
    std::vector<Net> nets;
    Prepared sample;
    for (int r = 0; r < 2; ++r) {  // built here: the global generator is not for threads
      torch::manual_seed(7);
      nets.push_back(make_net(job.cfg.model));
    }
    std::shared_ptr<Objective> probe = make_objective(job.cfg);
    {
      torch::NoGradGuard no_grad;
      BatchLoader one(job.data, 1, 1, false);
      sample = probe->prepare(one.next(), 0);
    }
    const std::vector<int> bounds = pipe_stage_bounds(*nets[0], sample, 2, cfg.parallel.cuts);
    const PipeSkipRoutes routes = pipe_skip_routes(*nets[0], sample, bounds);
    const int64_t whole = count_params(*nets[0]);
    const auto errors = run_ranks(2, short_timeouts(), [&](Comm& c) {
      const int r = c.rank();
      PipeStep step(job.cfg, nets[static_cast<size_t>(r)], make_objective(job.cfg), std::shared_ptr<Comm>(&c, [](Comm*) {}),
                    bounds, schedule, 16, nullptr, nullptr, routes);
      // A stage keeps only its own weights: the other stage's were let go.
      int64_t held = 0;
      for (const torch::Tensor& p : nets[static_cast<size_t>(r)]->parameters()) held += p.numel();
      EXPECT_EQ(held, step.optim().flat_params().numel()) << "stage " << r;
      EXPECT_LT(held, whole) << "stage " << r;
      if (with_plan) step.use_fill_plan(plan);
      BatchLoader loader(job.data, 64, 3, true);
      auto micro = [](const Batch& b) {
        std::vector<Batch> out;
        for (int64_t i = 0; i < 4; ++i) out.push_back(b.rows(i * 16, 16));
        return out;
      };
      for (int64_t i = 0; i < 4; ++i) {
        const Batch now = loader.next();
        std::vector<Batch> next;
        if (i + 1 < 4) {
          const BatchLoader::Cursor at = loader.cursor();
          next = micro(loader.next());
          loader.set_cursor(at);
        }
        losses[static_cast<size_t>(r)].push_back(step.run(micro(now), i, next).loss);
      }
      for (const torch::Tensor& p : step.optim().params()) weights[static_cast<size_t>(r)].push_back(p.detach().clone());
    });
    EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
    return std::make_pair(losses, weights);
  };
  const auto [whole_losses, whole_weights] = run(false);
  const auto [piece_losses, piece_weights] = run(true);
  EXPECT_EQ(piece_losses, whole_losses);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(piece_weights[r].size(), whole_weights[r].size());
    ASSERT_FALSE(whole_weights[r].empty());
    for (size_t i = 0; i < whole_weights[r].size(); ++i)
      EXPECT_TRUE(torch::equal(piece_weights[r][i], whole_weights[r][i])) << "stage " << r << " parameter " << i;
  }
}

// Direct skip routes: with 3 stages cut so that the first level's skip (made on stage 0, read on
// stage 2) would cross two cuts, it goes straight from stage 0 to stage 2 and stage 1 carries a
// placeholder; the second level's skip stays on stage 1, which makes and reads it. The training is
// what one process trains, under every schedule.
TEST(PipelineTrain, SkipsGoStraightToTheStageThatReadsThem) {
  test::TempDir dir;
  const RunConfig cfg = base("unet");
  const TrainJob job = job_for(cfg);
  Net net = make_net(job.cfg.model);
  std::vector<std::string> names;
  for (const NetUnit& u : net->units()) names.push_back(u.name);
  auto at = [&](const std::string& n) {
    return static_cast<int64_t>(std::find(names.begin(), names.end(), n) - names.begin());
  };
  const std::vector<int64_t> cuts{at("down0"), at("up0")};
  ASSERT_LT(cuts[1], static_cast<int64_t>(names.size())) << "no unit up0";
  Prepared sample;
  {
    torch::NoGradGuard no_grad;
    BatchLoader probe(job.data, 1, 1, false);
    sample = make_objective(job.cfg)->prepare(probe.next(), 0);
  }
  const PipeSkipRoutes r =
      pipe_skip_routes(*net, sample, {0, static_cast<int>(cuts[0]), static_cast<int>(cuts[1]), static_cast<int>(names.size())});
  ASSERT_EQ(r.out.size(), 2u);
  EXPECT_EQ(r.out[0], std::vector<int>{2});                              // slot 0 straight to stage 2
  EXPECT_EQ(r.out[1], std::vector<int>{PipeSkipRoutes::kElsewhere});     // stage 1: a placeholder
  ASSERT_EQ(r.in[2].size(), 1u);
  EXPECT_EQ(r.in[2][0].from, 0);
  EXPECT_EQ(r.in[2][0].slot, 0);
  EXPECT_EQ(r.in[2][0].row_shape, (std::vector<int64_t>{8, 8, 8}));     // [c0, S, S] of the 8x8 images
  EXPECT_TRUE(r.in[0].empty() && r.in[1].empty());
  // Two stages: every skip is read by the next stage, nothing is routed.
  const PipeSkipRoutes two = pipe_skip_routes(*net, sample, {0, static_cast<int>(cuts[0]), static_cast<int>(names.size())});
  for (int route : two.out[0]) EXPECT_EQ(route, PipeSkipRoutes::kCarried);
  // The planner routes it alike: a profile of the same network, split the same way, costs one
  // route from stage 0 to stage 2 of one [8, 8, 8] float32 skip per row (1 byte per time unit).
  PipeProfile profile;
  profile.units = profile_units(*net, job.cfg.model, {2}, 1);
  double held = 0;  // what the forwards keep for the backward, as the allocator counts it
  for (const PipeUnitProfile& u : profile.units) held += u.samples[0].activation_bytes;
  EXPECT_GT(held, 0);
  PipePartition split;
  split.first = {0, static_cast<int>(cuts[0]), static_cast<int>(cuts[1]), static_cast<int>(names.size())};
  const PipeCosts costs = costs_of_partition(profile.units_at(2), split, PipeLink{1.0, 0.0});
  ASSERT_EQ(costs.skips.size(), 1u);
  EXPECT_EQ(costs.skips[0].from, 0);
  EXPECT_EQ(costs.skips[0].to, 2);
  EXPECT_DOUBLE_EQ(costs.skips[0].forward, 2 * 8 * 8 * 8 * 4);

  ASSERT_EQ(train_ranks(1, {cfg}, dir / "one"), std::vector<std::string>{""});
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    const RunConfig three = piped(cfg, 3, schedule, cuts);
    ASSERT_EQ(train_ranks(3, {three, three, three}, dir / schedule), std::vector<std::string>(3, "")) << schedule;
    expect_same_training(dir / schedule, dir / "one", std::string("3 stages, a skip routed past stage 1, ") + schedule);
  }
}

// parallel.pipe_wire = bfloat16: every activation and gradient that crosses processes is rounded to
// bfloat16 (8 significant bits), so the pipeline no longer trains what one process trains within
// float32 rounding, and no bound on the whole training follows from the rounding alone. What is
// checked: it is deterministic (bit-identical when repeated); the rounding is applied (the weights
// differ from the float32 pipeline's) but small (the 20 steps' losses within 1e-3 of the float32
// pipeline's, an empirical margin: 4e-5 here, each value perturbed by at most 2^-9 relative and the
// loss an average; a broken conversion misses it by orders of magnitude); and rank 0 sends about
// half the bytes (its carries; the loss and norm all-reduce is a few bytes).
TEST(PipelineTrain, ABfloat16WireHalvesTheBytesAndStaysClose) {
  test::TempDir dir;
  for (const char* arch : {"unet", "dit"}) {
    RunConfig cfg = piped(base(arch), 2, "1f1b", std::string(arch) == "unet" ? std::vector<int64_t>{2} : std::vector<int64_t>{});
    cfg.parallel.fill = false;
    const std::string f32 = dir / (std::string(arch) + "-f32"), b16 = dir / (std::string(arch) + "-bf16"),
                      again = dir / (std::string(arch) + "-bf16-again");
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, f32), (std::vector<std::string>{"", ""}));
    cfg.parallel.pipe_wire = WireFormat::kBfloat16;
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, b16), (std::vector<std::string>{"", ""}));
    ASSERT_EQ(train_ranks(2, {cfg, cfg}, again), (std::vector<std::string>{"", ""}));
    EXPECT_EQ(losses(again), losses(b16)) << arch;
    EXPECT_EQ(max_weight_difference(final_weights(again), final_weights(b16)), 0.0) << arch;
    const auto l = losses(b16), want = losses(f32);
    ASSERT_EQ(l.size(), want.size());
    for (size_t i = 0; i < l.size(); ++i) EXPECT_LE(std::abs(l[i] - want[i]) / want[i], 1e-3) << arch << " step " << i + 1;
    EXPECT_GT(max_weight_difference(final_weights(b16), final_weights(f32)), 0.0) << arch;
    auto sent = [](const std::string& run) {
      std::ifstream in(run + "/metrics.jsonl");
      std::string line;
      int64_t last = 0;
      while (std::getline(in, line)) last = nlohmann::json::parse(line)["sent_bytes_per_step"].get<int64_t>();
      return static_cast<double>(last);
    };
    EXPECT_LT(sent(b16), 0.6 * sent(f32)) << arch;
    EXPECT_GT(sent(b16), 0.4 * sent(f32)) << arch;
    double worst = 0;
    for (size_t i = 0; i < l.size(); ++i) worst = std::max(worst, std::abs(l[i] - want[i]) / want[i]);
    std::printf("%s bfloat16 wire: losses within %.2e (relative) of float32's; %.3fx the bytes\n", arch, worst,
                sent(b16) / sent(f32));
  }
}

// train.precision = bf16 through a pipeline (here on the CPU; tests/gpu runs it on CUDA): each stage's
// units run under bfloat16 autocast, the carry crosses the cut in float32 (a bfloat16 output widened
// exactly, the widening part of the graph), the loss and the state stay float32. It trains what one
// process in bf16 trains, within bf16 rounding: the carry is rounded where a cut falls, not where the
// single process rounds it (a residual sum in float32 instead of bfloat16), so losses agree within
// 2e-2 relative (the bf16-vs-fp32 bound of one step in test_train_step.cpp) over 12 steps, and it
// repeats bit for bit. With self-conditioning, the first pass's bfloat16 output returns to stage 0 too.
TEST(PipelineTrain, StagesTrainInBfloat16) {
  test::TempDir dir;
  for (const char* arch : {"unet", "dit"}) {
    RunConfig cfg = base(arch);
    cfg.train.steps = 12;
    cfg.train.precision = Precision::kBf16;
    if (std::string(arch) == "dit") cfg.train.self_cond = 0.5;
    const std::string one = dir / (std::string(arch) + "-one"), two_dir = dir / (std::string(arch) + "-two"),
                      again = dir / (std::string(arch) + "-again"), f32 = dir / (std::string(arch) + "-fp32");
    ASSERT_EQ(train_ranks(1, {cfg}, one), std::vector<std::string>{""});
    RunConfig two = piped(cfg, 2, "1f1b", std::string(arch) == "unet" ? std::vector<int64_t>{2} : std::vector<int64_t>{});
    ASSERT_EQ(train_ranks(2, {two, two}, two_dir), (std::vector<std::string>{"", ""})) << arch;
    ASSERT_EQ(train_ranks(2, {two, two}, again), (std::vector<std::string>{"", ""})) << arch;
    EXPECT_EQ(losses(again), losses(two_dir)) << arch;
    EXPECT_EQ(max_weight_difference(final_weights(again), final_weights(two_dir)), 0.0) << arch;
    const auto l = losses(two_dir), want = losses(one);
    ASSERT_EQ(l.size(), want.size()) << arch;
    double worst = 0;
    for (size_t i = 0; i < l.size(); ++i) worst = std::max(worst, std::abs(l[i] - want[i]) / want[i]);
    EXPECT_LE(worst, 2e-2) << arch;
    // Autocast was on: the same pipeline in fp32 computes other losses.
    RunConfig fp32 = two;
    fp32.train.precision = Precision::kFp32;
    ASSERT_EQ(train_ranks(2, {fp32, fp32}, f32), (std::vector<std::string>{"", ""})) << arch;
    EXPECT_NE(losses(f32), l) << arch;
    for (const auto& [name, t] : final_weights(two_dir)) EXPECT_EQ(t.scalar_type(), torch::kFloat) << arch << " " << name;
    std::printf("%s: 2 stages in bf16, losses within %.2e (relative) of one process in bf16\n", arch, worst);
  }
}
