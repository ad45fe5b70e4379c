// Config parsing: defaults, presets with overrides, --set, unknown / ill-typed / out-of-range keys,
// and the resolved config round trip.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/config.h"
#include "core/suggest.h"
#include "core/error.h"
#include "core/presets.h"
#include "decentral/islands.h"
#include "test_util.h"

using namespace ddm;

namespace {
std::string error_of(const std::string& toml, const std::vector<std::string>& ov = {}) {
  try {
    parse_config(toml, "test.toml", ov);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAndPresetOverride) {
  RunConfig c = parse_config("[model]\npreset = \"dit-tiny\"\ndepth = 7\n", "test.toml");
  EXPECT_EQ(c.model.arch, "dit");
  EXPECT_EQ(c.model.depth, 7);  // the explicit key wins over the preset
  EXPECT_EQ(c.train.batch_size, 128);
}

TEST(Config, SetOverridesWinAndBareWordsAreStrings) {
  RunConfig c = parse_config("[train]\nsteps = 10\n", "test.toml",
                             {"train.steps=20", "model.preset=dit-small", "train.lr=0.5", "data.hflip=true"});
  EXPECT_EQ(c.train.steps, 20);
  EXPECT_EQ(c.model.preset, "dit-small");
  EXPECT_EQ(c.model.arch, "dit");
  EXPECT_DOUBLE_EQ(c.train.lr, 0.5);
  EXPECT_TRUE(c.data.hflip);
}

TEST(Config, IntegerAcceptedForFloatKey) {
  RunConfig c = parse_config("[sample]\ncfg = 3\n", "test.toml");
  EXPECT_DOUBLE_EQ(c.sample.cfg, 3.0);
}

TEST(Config, UnknownKeyIsAnErrorNamingKeyAndFile) {
  const std::string e = error_of("[train]\nstepz = 10\n");
  EXPECT_NE(e.find("unknown config key 'train.stepz'"), std::string::npos) << e;
  EXPECT_NE(e.find("test.toml"), std::string::npos) << e;
  EXPECT_NE(error_of("", {"nosuch.key=1"}).find("nosuch.key"), std::string::npos);
  // A typo gets the nearest key and the keys of its section, not all hundred of them; an unknown
  // section gets the sections.
  EXPECT_NE(e.find("(did you mean 'train.steps'?)"), std::string::npos) << e;
  EXPECT_NE(e.find("The keys of [train]: "), std::string::npos) << e;
  EXPECT_EQ(e.find("model.preset"), std::string::npos) << e;
  const std::string swapped = error_of("", {"train.batch_szie=4"});
  EXPECT_NE(swapped.find("did you mean 'train.batch_size'"), std::string::npos) << swapped;
  const std::string far = error_of("", {"nosuch.key=1"});
  EXPECT_EQ(far.find("did you mean"), std::string::npos) << far;
  EXPECT_NE(far.find("The sections: "), std::string::npos) << far;
  EXPECT_NE(far.find("train"), std::string::npos) << far;
}

TEST(Suggest, TheNearestNameWithinATypoOrNone) {
  const std::vector<std::string> names{"train", "train-autoencoder", "sample", "shards", "plan"};
  EXPECT_EQ(nearest_name("trian", names), "train");    // two neighbours swapped: one edit
  EXPECT_EQ(nearest_name("smaple", names), "sample");
  EXPECT_EQ(nearest_name("shard", names), "shards");   // one deleted
  EXPECT_EQ(nearest_name("plna", names), "plan");
  EXPECT_EQ(nearest_name("xyz", names), "");           // nothing within a third of its length
  EXPECT_EQ(nearest_name("evaluate", names), "");
  EXPECT_EQ(did_you_mean("trian", names), " (did you mean 'train'?)");
  EXPECT_EQ(did_you_mean("xyz", names), "");
}

TEST(Config, IllTypedValues) {
  EXPECT_NE(error_of("[train]\nsteps = \"many\"\n").find("train.steps must be an integer"), std::string::npos);
  EXPECT_NE(error_of("[train]\nsteps = 1.5\n").find("train.steps must be an integer"), std::string::npos);
  EXPECT_NE(error_of("[data]\nhflip = 1\n").find("data.hflip must be true or false"), std::string::npos);
  EXPECT_NE(error_of("[model]\nchannel_mult = [1, \"x\"]\n").find("model.channel_mult"), std::string::npos);
}

TEST(Config, OutOfRangeValues) {
  EXPECT_NE(error_of("", {"train.steps=-5"}).find("train.steps must be > 0, got -5"), std::string::npos);
  EXPECT_NE(error_of("", {"train.batch_size=0"}).find("train.batch_size must be > 0"), std::string::npos);
  EXPECT_NE(error_of("", {"sample.cfg=-1"}).find("sample.cfg must be >= 0"), std::string::npos);
  EXPECT_NE(error_of("", {"diffusion.objective=score"}).find("not one of: flow, eps, v"), std::string::npos);
  EXPECT_NE(error_of("", {"model.preset=huge"}).find("huge"), std::string::npos);
  EXPECT_NE(error_of("", {"train.steps"}).find("expected section.key=value"), std::string::npos);
  // Keys of shards only are refused elsewhere, not ignored (a folder keeps its images' channels).
  EXPECT_NE(error_of("", {"data.source=folder", "data.channels=1"})
                .find("data.resolution, data.channels, data.crop and data.skip_bad apply to data.source = shards only "
                      "(this is folder)"),
            std::string::npos)
      << error_of("", {"data.source=folder", "data.channels=1"});
}

// parallel.shard_optimizer shards a data-parallel optimizer: refused, with the reason, for a pipeline
// (whose stages hold their own state), DiLoCo (whole optimizers per replica) and CUDA graphs.
TEST(Config, AShardedOptimizerIsRefusedWhereItCannotShard) {
  const std::string on = "parallel.shard_optimizer=true";
  EXPECT_EQ(error_of("", {on}), "");
  const std::string pp = error_of("", {on, "parallel.pp=2"});
  EXPECT_NE(pp.find("a pipeline (parallel.pp = 2)"), std::string::npos) << pp;
  EXPECT_NE(pp.find("set parallel.shard_optimizer = false"), std::string::npos) << pp;
  const std::string dl = error_of("", {on, "parallel.mode=diloco"});
  EXPECT_NE(dl.find("DiLoCo (parallel.mode = diloco)"), std::string::npos) << dl;
  const std::string graphs = error_of("", {on, "train.cuda_graphs=true"});
  EXPECT_NE(graphs.find("parallel.shard_optimizer with train.cuda_graphs is not supported"), std::string::npos) << graphs;
}

// A bucket size becomes bytes (mb * 2^20, truncated): one that would round to (almost) nothing, or
// overflow, is refused when the config is read, naming the key and value, not at the first all-reduce.
TEST(Config, GradientBucketsOfLessThanOneKibOrMoreThanOneTibAreRefused) {
  for (const std::string key : {"parallel.bucket_mb", "parallel.first_bucket_mb"}) {
    for (const std::string v : {"1e-9", "0.0009", "0", "-1"}) {
      const std::string e = error_of("", {key + "=" + v});
      EXPECT_NE(e.find(key + " = "), std::string::npos) << e;
      EXPECT_NE(e.find("less than 1 KiB"), std::string::npos) << e;
      EXPECT_NE(e.find("set it to at least 0.0009765625"), std::string::npos) << e;
    }
    EXPECT_NE(error_of("", {key + "=1e-9"}).find(key + " = 1e-09 MiB"), std::string::npos);
    for (const std::string v : {"inf", "nan", "2e6"})
      EXPECT_NE(error_of("", {key + "=" + v}).find(key + " = "), std::string::npos) << v;
    EXPECT_NE(error_of("", {key + "=inf"}).find("up to 1048576 (1 TiB"), std::string::npos);
    // The bounds themselves are fine.
    EXPECT_EQ(error_of("", {key + "=0.0009765625"}), "");
    EXPECT_EQ(error_of("", {key + "=1048576"}), "");
  }
}

// An invalid value is named where it was set: the --set that set it last, or else the file.
TEST(Config, ValidationErrorsNameTheSetThatGaveTheValue) {
  const std::string from_set = error_of("[parallel]\nbucket_mb = 2\n", {"parallel.bucket_mb=0.0001"});
  EXPECT_EQ(from_set.rfind("--set parallel.bucket_mb=0.0001: parallel.bucket_mb = 0.0001 MiB", 0), 0u) << from_set;
  const std::string from_file = error_of("[parallel]\nbucket_mb = 0.0001\n", {"train.steps=5"});
  EXPECT_EQ(from_file.rfind("test.toml: parallel.bucket_mb = 0.0001 MiB", 0), 0u) << from_file;
  const std::string steps = error_of("[train]\nsteps = 3\n", {"train.steps=-5", "train.batch_size=4"});
  EXPECT_EQ(steps.rfind("--set train.steps=-5: train.steps must be > 0", 0), 0u) << steps;
  // A message that names its key after another's (unset) one is the --set's too, not the file's.
  const std::string later = error_of("[data]\nsource = 'shards'\nroot = 'a-{0..1}.tar'\nresolution = 8\n",
                                     {"model.embed=e.safetensors"});
  EXPECT_EQ(later.rfind("--set model.embed=e.safetensors: model.controlnet and model.embed", 0), 0u) << later;
  // The first key named that was given decides: here the file's data.source.
  const std::string file_first = error_of("[data]\nsource = 'shards'\nroot = 'a.tar'\n", {"train.steps=5"});
  EXPECT_EQ(file_first.rfind("test.toml: data.source = shards needs data.resolution", 0), 0u) << file_first;
}

TEST(Config, AutoencoderAndLatentKeys) {
  const RunConfig ae = parse_config("[model]\npreset = \"ae-f4\"\n", "test.toml");
  EXPECT_EQ(ae.model.arch, "autoencoder");
  EXPECT_EQ(ae.model.latent_channels, 4);
  EXPECT_NE(error_of("[model]\npreset = \"ae-f4\"\nlatent = \"runs/ae\"\n").find("is itself one: remove model.latent"),
            std::string::npos);
  EXPECT_NE(error_of("", {"model.latent_scale=0.5"}).find("model.latent, which is not set"), std::string::npos);
  EXPECT_NE(error_of("", {"model.latent=runs/ae", "model.latent_scale=-1"}).find("model.latent_scale must be >= 0"),
            std::string::npos);
  EXPECT_NE(error_of("", {"train.kl_weight=-1e-6"}).find("train.kl_weight must be >= 0"), std::string::npos);
  EXPECT_NE(error_of("", {"model.latent_channels=0"}).find("model.latent_channels must be > 0"), std::string::npos);
  // A preset replaces the architecture, not what the model is trained on.
  const RunConfig lat = parse_config("[model]\npreset = \"latent-dit\"\nlatent = \"runs/ae\"\n", "test.toml");
  EXPECT_EQ(lat.model.latent, "runs/ae");
  EXPECT_EQ(lat.model.patch, 1);
}

TEST(Config, ControlNetKeys) {
  EXPECT_EQ(parse_config("", "test.toml").model.control, "edges");
  EXPECT_NE(error_of("", {"model.control=canny"}).find("model.control"), std::string::npos);
  EXPECT_NE(error_of("[model]\npreset = \"dit-tiny\"\ncontrolnet = \"runs/base\"\n").find("steers a U-Net"),
            std::string::npos);
  EXPECT_NE(error_of("", {"model.controlnet=runs/b", "model.latent=runs/ae"}).find("latent U-Net is not supported"),
            std::string::npos);
  EXPECT_NE(error_of("", {"model.controlnet_sha256=ab"}).find("model.controlnet, which is not set"), std::string::npos);
  // A preset replaces the architecture, not the base it steers.
  const RunConfig c = parse_config("[model]\npreset = \"unet-small\"\ncontrolnet = \"runs/b\"\ncontrol = \"lowres\"\n",
                                   "test.toml");
  EXPECT_EQ(c.model.controlnet, "runs/b");
  EXPECT_EQ(c.model.control, "lowres");
}

// fp16 trains with dynamic loss scaling (train/loss_scale.h) in every mode, from CUDA graphs too; its
// starting scale is checked.
TEST(Config, Fp16TrainsWithALossScaleInEveryMode) {
  EXPECT_EQ(error_of("", {"train.precision=fp16"}), "");
  EXPECT_EQ(parse_config("", "t.toml").train.loss_scale, 65536.0);
  for (const char* bad : {"0", "-1", "inf", "nan", "1e31", "1e-31"}) {
    const std::string why = error_of("", {"train.precision=fp16", std::string("train.loss_scale=") + bad});
    EXPECT_NE(why.find("train.loss_scale must be between 1e-30 and 1e30"), std::string::npos) << bad << ": " << why;
  }
  EXPECT_EQ(error_of("", {"train.precision=fp16", "parallel.mode=diloco"}), "");
  EXPECT_EQ(error_of("", {"train.precision=fp16", "parallel.shard_optimizer=true"}), "");
  EXPECT_EQ(error_of("", {"train.precision=fp16", "train.cuda_graphs=true", "train.device=cuda"}), "");
  EXPECT_EQ(precision_named("fp16"), Precision::kFp16);
  EXPECT_EQ(name_of(Precision::kFp16), "fp16");
  EXPECT_THROW(precision_named("f16"), Error);
}

TEST(Config, EmbedSelfCondAndCacheKeys) {
  EXPECT_NE(error_of("", {"model.embed=feature-net", "train.label_dropout=0"}).find("null embedding"), std::string::npos);
  EXPECT_NE(error_of("", {"model.embed=feature-net", "train.teacher=ens"}).find("train.teacher"), std::string::npos);
  EXPECT_NE(error_of("", {"model.embed=feature-net", "data.partition=p", "data.expert=0"})
                .find("experts, routers and distillation"),
            std::string::npos);
  // A router given one explicitly is refused; one carried over from an expert's model is dropped by its preset.
  EXPECT_NE(error_of("[model]\npreset = \"router-dit-tiny\"\nembed = \"feature-net\"\n", {"data.partition=p"})
                .find("conditions a diffusion backbone"),
            std::string::npos);
  ModelConfig carried;
  carried.embed = "feature-net";
  carried.self_cond = true;
  apply_preset("router-dit-tiny", carried);
  EXPECT_TRUE(carried.embed.empty());
  EXPECT_FALSE(carried.self_cond);
  EXPECT_NE(error_of("", {"model.embed_dim=128"}).find("model.embed, which is not set"), std::string::npos);
  EXPECT_NE(error_of("", {"train.self_cond=1.5"}).find("train.self_cond must be a probability"), std::string::npos);
  EXPECT_NE(error_of("", {"train.cache_latents=true"}).find("model.latent is not set"), std::string::npos);
  EXPECT_NE(error_of("", {"train.cache_latents=true", "model.latent=runs/ae", "data.hflip=true"}).find("data.hflip"),
            std::string::npos);
}

TEST(Config, DilocoValuesOutOfRange) {
  auto err = [](const std::string& kv) { return error_of("", {"parallel.mode=diloco", kv}); };
  EXPECT_NE(err("diloco.inner_steps=0").find("diloco.inner_steps must be > 0"), std::string::npos);
  EXPECT_NE(err("diloco.inner_steps=-3").find("got -3"), std::string::npos);
  EXPECT_NE(err("diloco.outer_lr=0").find("diloco.outer_lr must be > 0"), std::string::npos);
  EXPECT_NE(err("diloco.outer_momentum=1").find("diloco.outer_momentum must be in [0, 1)"), std::string::npos);
  EXPECT_NE(err("diloco.outer_momentum=-0.1").find("diloco.outer_momentum must be in [0, 1)"), std::string::npos);
  EXPECT_NE(err("diloco.fragments=0").find("diloco.fragments must be > 0"), std::string::npos);
  EXPECT_NE(err("diloco.fragments=60").find("diloco.fragments = 60 is more than diloco.inner_steps = 50"),
            std::string::npos);
  EXPECT_NE(err("diloco.overlap=50").find("diloco.overlap = 50 must be less than diloco.inner_steps / diloco.fragments = 50"), std::string::npos);
  EXPECT_NE(err("diloco.mix=1").find("diloco.mix must be in [0, 1)"), std::string::npos);
  EXPECT_NE(err("diloco.wire=int4").find("diloco.wire"), std::string::npos);
  EXPECT_NE(error_of("", {"parallel.mode=async"}).find("parallel.mode"), std::string::npos);
  EXPECT_EQ(error_of("", {"parallel.mode=diloco", "diloco.fragments=5", "diloco.overlap=9"}), "");
  const std::string wire = error_of("", {"parallel.pipe_wire=float16"});
  EXPECT_NE(wire.find("parallel.pipe_wire"), std::string::npos) << wire;
  EXPECT_NE(wire.find("bfloat16"), std::string::npos) << wire;  // names what it takes
  EXPECT_EQ(error_of("", {"parallel.pp=2", "parallel.pipe_wire=bfloat16"}), "");
  // parallel.backend: spelled out, and nccl only where tensors can be on a GPU.
  EXPECT_NE(error_of("", {"parallel.backend=mpi"}).find("parallel.backend = \"mpi\" is not one of: auto, gloo, nccl"),
            std::string::npos);
  EXPECT_NE(error_of("", {"parallel.backend=nccl", "train.device=cpu"}).find("parallel.backend = nccl carries CUDA tensors, but train.device = cpu"),
            std::string::npos);
  EXPECT_EQ(error_of("", {"parallel.backend=nccl", "train.device=cuda"}), "");
  EXPECT_EQ(error_of("", {"parallel.backend=gloo", "train.device=cuda"}), "");
  EXPECT_NE(error_of("", {"parallel.backend=nccl", "train.device=cuda", "parallel.mode=diloco"})
                .find("DiLoCo (parallel.mode = diloco) synchronizes over Gloo"),
            std::string::npos);
}

TEST(Config, InvalidTomlNamesLine) {
  const std::string e = error_of("[train]\nsteps = = 3\n");
  EXPECT_NE(e.find("test.toml:2"), std::string::npos) << e;
}

TEST(Config, ResolvedConfigRoundTrips) {
  RunConfig c = parse_config("", "a", {"model.preset=dit-tiny", "train.steps=77", "model.attn_levels=[0]"});
  c.model.channel_mult = {1, 2, 2};
  const std::string text = to_toml(c);
  RunConfig d = parse_config(text, "resolved");
  EXPECT_EQ(to_toml(d), text);
  EXPECT_EQ(d.train.steps, 77);
  EXPECT_EQ(d.model.channel_mult, (std::vector<int64_t>{1, 2, 2}));
}

// config.toml says what the user wrote: each float in its shortest form that reads back exactly
// (toml++ alone writes 0.7 as 0.69999999999999996), strings untouched.
TEST(Config, FloatsAreWrittenAsTheyWereGivenAndReadBackExactly) {
  RunConfig c = parse_config("", "a", {"diloco.outer_lr=0.7", "train.lr=3e-4", "train.ema_decay=0.9999",
                                       "sample.cfg=3", "train.label_dropout=0.1"});
  c.train.beta2 = 1.0 / 3.0;
  c.diffusion.logit_mean = -2.5e-300;
  c.data.root = "pics 0.69999999999999996 '=1.50'";
  // toml++ writes a text with a line break as a multi-line literal string, apostrophes and all.
  c.train.sample_prompts = {"it's a 3.10 m statue\non grass", "a \"2.50\" quote", "x'''y 1.0", "z\n'' 4.50''"};
  c.model.text_encoder = "enc";  // (prompts are for text models)
  c.train.sample_n = 8;
  const std::string text = to_toml(c);
  for (const char* want : {"outer_lr = 0.7\n", "lr = 3e-4\n", "adam_eps = 1e-8\n", "ema_decay = 0.9999\n", "cfg = 3.0\n",
                           "label_dropout = 0.1\n", "logit_mean = -2.5e-300\n"})
    EXPECT_NE(text.find(want), std::string::npos) << want << " in\n" << text;
  EXPECT_EQ(text.find("0.6999"), text.find("pics 0.6999") + 5) << text;  // only inside the string
  const RunConfig d = parse_config(text, "resolved");
  EXPECT_EQ(d.diloco.outer_lr, 0.7);
  EXPECT_EQ(d.train.beta2, 1.0 / 3.0);  // bit for bit
  EXPECT_EQ(d.diffusion.logit_mean, -2.5e-300);
  EXPECT_EQ(d.data.root, c.data.root);
  EXPECT_EQ(d.train.sample_prompts, c.train.sample_prompts);
  EXPECT_EQ(to_toml(d), text);
}

TEST(Config, MissingFile) {
  try {
    load_config("/nonexistent/x.toml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.toml"), std::string::npos);
  }
}

// A config path that is a directory, or a file that sets nothing (/dev/null, only comments), once
// trained with built-in defaults and exited 0.
TEST(Config, DirectoryOrEmptyConfigFileIsAnError) {
  test::TempDir dir;
  auto load_error = [](const std::string& path) {
    return test::error_message([&] { load_config(path); });
  };
  std::string e = load_error(dir.path);
  EXPECT_NE(e.find(dir.path), std::string::npos) << e;
  EXPECT_NE(e.find("it is a directory"), std::string::npos) << e;
  e = load_error("/dev/null");
  EXPECT_NE(e.find("/dev/null: the config file sets no keys"), std::string::npos) << e;
  test::write_text(dir / "comments.toml", "# nothing but a comment\n\n");
  e = load_error(dir / "comments.toml");
  EXPECT_NE(e.find("comments.toml: the config file sets no keys"), std::string::npos) << e;
  test::write_text(dir / "one.toml", "[train]\nsteps = 7\n");
  EXPECT_EQ(load_config(dir / "one.toml").train.steps, 7);
}

TEST(Config, EveryShippedConfigParses) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(test::source_dir() + "/configs")) {
    if (e.path().filename().string().rfind("islands", 0) == 0) continue;  // islands files: below
    if (e.path().extension() != ".toml") continue;  // the sbatch example: TheGpuSlurmExamplesAreValid
    EXPECT_NO_THROW(load_config(e.path().string())) << e.path();
    ++n;
  }
  // Islands files name paths relative to the repository root, where their comments say to run them.
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(test::source_dir());
  const IslandsConfig isl = load_islands_config("configs/islands-k4.toml");
  const IslandsConfig latent = load_islands_config("configs/islands-latent.toml");
  std::filesystem::current_path(cwd);
  EXPECT_EQ(latent.features, "latent:runs/ae");
  EXPECT_EQ(latent.router_preset, "latent-router-dit");
  EXPECT_EQ(latent.config, "configs/latent-quickstart.toml");
  EXPECT_EQ(isl.k, 4);
  EXPECT_EQ(isl.config, "configs/quickstart.toml");
  EXPECT_EQ(isl.router_set, std::vector<std::string>{"train.steps=600"});
  EXPECT_EQ(isl.nproc, 1);  // one process per island unless run.nproc says otherwise
  EXPECT_GE(n, 3);
  RunConfig c = load_config(test::source_dir() + "/configs/quickstart.toml");
  EXPECT_EQ(c.model.preset, "unet-tiny");
}

// configs/islands-gpu.toml and configs/slurm-train-gpu.sbatch: the islands file's batches split into
// its ranks, its [slurm] lines reach the script, the script is valid bash; the data-parallel script's
// config and overrides are valid.
TEST(Config, TheGpuSlurmExamplesAreValid) {
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(test::source_dir());
  const IslandsConfig isl = load_islands_config("configs/islands-gpu.toml");
  EXPECT_NO_THROW(check_island_batches(isl));
  const std::string script = slurm_script(isl, isl.k, "/opt/ddm/build/ddm");
  std::filesystem::current_path(cwd);
  EXPECT_EQ(isl.nproc, 8);
  for (const char* line : {"#SBATCH --array=0-8\n", "#SBATCH --ntasks=8\n", "#SBATCH --cpus-per-task=4\n",
                           "#SBATCH --gpus-per-node=8\n", "#SBATCH --time=24:00:00\n", "export NCCL_DEBUG=WARN\n",
                           "srun --ntasks=8 --cpus-per-task=4 "})
    EXPECT_NE(script.find(line), std::string::npos) << line << " not in:\n" << script;
  const test::TempDir dir;
  test::write_text(dir / "islands.sbatch", script);
  EXPECT_EQ(test::run_command("bash -n " + (dir / "islands.sbatch")).exit_code, 0) << script;

  const std::string dp = test::read_text(test::source_dir() + "/configs/slurm-train-gpu.sbatch");
  EXPECT_EQ(test::run_command("bash -n " + test::source_dir() + "/configs/slurm-train-gpu.sbatch").exit_code, 0);
  const std::string config = "CONFIG=${CONFIG:-";
  ASSERT_NE(dp.find(config), std::string::npos);
  const size_t at = dp.find(config) + config.size();
  std::vector<std::string> sets;
  for (size_t p = dp.find("--set "); p != std::string::npos; p = dp.find("--set ", p + 1))
    sets.push_back(dp.substr(p + 6, dp.find_first_of(" \n", p + 6) - p - 6));
  EXPECT_EQ(sets.size(), 4u);
  const RunConfig c = load_config(test::source_dir() + "/" + dp.substr(at, dp.find('}', at) - at), sets);
  EXPECT_EQ(c.train.device, "cuda");
  EXPECT_EQ(c.train.batch_size % 32, 0) << "4 nodes x 8 ranks split the batch";
}

TEST(Config, IslandsFileWithAnEmptyPathIsAClearError) {
  // Found by fuzzing: partition.path = "" reached std::filesystem::absolute("") in plan_islands,
  // which threw std::filesystem::filesystem_error instead of an error naming the file and key.
  const test::TempDir tmp;
  for (const std::string key : {"out", "config", "partition.path"}) {
    auto value = [&](const std::string& k, const std::string& v) { return k == key ? std::string() : v; };
    test::write_text(tmp / "isl.toml", "out = \"" + value("out", "runs/x") + "\"\nconfig = \"" +
                                           value("config", test::source_dir() + "/configs/quickstart.toml") +
                                           "\"\n[partition]\npath = \"" + value("partition.path", "parts/x") + "\"\n");
    const std::string msg = test::error_message([&] { plan_islands(load_islands_config(tmp / "isl.toml"), 2); });
    EXPECT_NE(msg.find("isl.toml: '" + key + "' must not be empty"), std::string::npos) << key << ": " << msg;
  }
}

// docs/config.md is the reference `ddm train --config-reference` writes from the field table, and
// every key in it says what it does.
TEST(Config, TheReferenceInDocsIsWhatTheFieldTableWrites) {
  const std::string ref = config_reference();
  EXPECT_EQ(ref, test::read_text(test::source_dir() + "/docs/config.md"))
      << "docs/config.md is out of date: run `build/ddm train --config-reference > docs/config.md`";
  for (const std::string& key : config_keys()) {
    const std::string leaf = key.substr(key.find('.') + 1);
    const size_t row = ref.find("| `" + leaf + "` |", ref.find("## [" + key.substr(0, key.find('.')) + "]"));
    ASSERT_NE(row, std::string::npos) << key;
    const std::string line = ref.substr(row, ref.find('\n', row) - row);
    EXPECT_EQ(line.find("|  |"), std::string::npos) << key << " has no meaning: " << line;
  }
  EXPECT_NE(ref.find("| `steps` | integer | `1500` | optimizer steps of the run |"), std::string::npos) << ref;
}
