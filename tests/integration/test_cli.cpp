// The ddm binary on bad input: each case exits non-zero with a message naming the file / key /
// value, and leaves what was already written intact. Also --help for every subcommand.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <torch/cuda.h>

#include "core/fileio.h"
#include "core/safetensors.h"
#include "test_util.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {
const char* kTiny =
    "[data]\nlimit = 64\n[model]\nchannels = 8\nchannel_mult = [1, 2]\ngroups = 4\n"
    "[train]\nsteps = 3\nbatch_size = 8\nthreads = 1\nlog_every = 1\n";

using test::expect_error;
}  // namespace

namespace {
// The subcommands a --help lists (CLI11: "Subcommands:", then one "  name  description" line each).
std::vector<std::string> listed_subcommands(const std::string& help) {
  std::vector<std::string> names;
  std::istringstream lines(help);
  std::string line;
  bool in = false;
  // Under "Subcommands:" or a group's heading (`ddm --help` groups them: "Start here:", ...).
  while (std::getline(lines, line)) {
    const bool heading = !line.empty() && line[0] != ' ' && line.back() == ':';
    if (heading) in = line != "Options:" && line != "Positionals:" && line != "Examples:" && line.find('(') == std::string::npos;
    else if (in && line.size() > 2 && line.compare(0, 2, "  ") == 0 && line[2] != ' ' && line[2] != '[')
      names.push_back(line.substr(2, line.find(' ', 2) - 2));
    else if (in && line.empty()) in = false;
  }
  return names;
}
}  // namespace

// Every subcommand the binary registers (found by walking the --help tree, so a new one is covered
// without touching this test) answers --help.
TEST(Cli, TheQuickstartFileMatchesTheBuiltInConfig) {
  // `ddm quickstart --print-config` shows the built-in config; configs/quickstart.toml documents it.
  auto r = test::run_ddm("quickstart --print-config");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, test::read_text(test::source_dir() + "/configs/quickstart.toml"));
}

TEST(Cli, HelpForEverySubcommand) {
  std::vector<std::string> todo{""}, seen;
  while (!todo.empty()) {
    const std::string sub = todo.back();
    todo.pop_back();
    // A help text whose examples read as a subcommand list would send the walk on forever.
    ASSERT_LE(std::count(sub.begin(), sub.end(), ' '), 2) << "a subcommand path this deep is an example line: " << sub;
    auto r = test::run_ddm(sub + " --help");
    EXPECT_EQ(r.exit_code, 0) << sub << r.output;
    EXPECT_NE(r.output.find("Usage"), std::string::npos) << r.output;
    // Defaults are shown one way, after the option's type (--n INT=100), not also in its text.
    EXPECT_FALSE(std::regex_search(r.output, std::regex(R"(\(default:? [0-9])"))) << sub << r.output;
    seen.push_back(sub);
    const std::vector<std::string> listed = listed_subcommands(r.output);
    // Every command that runs (not a group of them) shows examples, as the README says.
    if (!sub.empty() && listed.empty()) {
      EXPECT_NE(r.output.find("\nExamples:\n"), std::string::npos) << sub << " has no examples";
    }
    for (const std::string& name : listed) todo.push_back(sub.empty() ? name : sub + " " + name);
  }
  // The walk found them all: the list as of this writing, every one of them.
  for (const char* sub : {"train", "train-autoencoder", "sample", "quickstart", "presets", "eval", "train-classifier",
                          "partition", "train-router", "ensemble", "distill", "islands", "islands run", "islands status",
                          "islands slurm", "launch", "plan", "shards", "shards write", "encode"})
    EXPECT_NE(std::find(seen.begin(), seen.end(), sub), seen.end()) << sub << " was not listed by a --help";
  // `ddm --help`: a line per command, grouped.
  auto r = test::run_ddm("--help");
  for (const char* group : {"Start here:", "Decentralized training:", "Models and data:", "Several processes:"})
    EXPECT_NE(r.output.find(group), std::string::npos) << group << "\n" << r.output;
  {
    std::istringstream lines(r.output);
    for (std::string line; std::getline(lines, line);) EXPECT_LE(line.size(), 120u) << line;
  }
  for (const char* sub : {"train", "sample", "eval", "quickstart"})
    EXPECT_NE(test::run_ddm(std::string(sub) + " --help").output.find("Examples:"), std::string::npos) << sub;
  EXPECT_NE(test::run_ddm("sample --help").output.find("--n INT=100 "), std::string::npos);
  EXPECT_NE(test::run_ddm("eval --help").output.find("--n INT=10000 "), std::string::npos);
  // Training steps and sampling steps have their own names.
  r = test::run_ddm("quickstart --steps 5");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("quickstart's --steps is now --train-steps"), std::string::npos) << r.output;
  // --print-config: every key with its value; --device sets train.device.
  r = test::run_ddm("train --config " + test::source_dir() + "/configs/quickstart.toml --device cpu --print-config");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("steps = 1200"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("device = 'cpu'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sample_every = 0"), std::string::npos) << r.output;
  r = test::run_ddm("presets");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("dit-tiny"), std::string::npos) << r.output;
  // A usage mistake exits 2 under every command, whether CLI11 or the command itself finds it.
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"sample --n 4", "give exactly one of --ckpt DIR and --ensemble DIR"},
           {"eval", "ddm eval: give exactly one of --ckpt DIR"},
           {"plan", "ddm plan: give --config (profile now) or --profile"},
           {"partition --k 2", "--out is required"},
           {"train --out x", "ddm train: --config is required"},
           {"launch --nproc 2", "ddm launch: put the command after `--`"},
           {"text tokenize", "give texts or --file"}}) {
    r = test::run_ddm(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << args << "\n" << r.output;
  }
  // A mistyped subcommand: refused as bad input (exit 2), with the nearest one.
  r = test::run_ddm("trian --config x.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("'trian' is not a ddm command (did you mean 'train'?)"), std::string::npos) << r.output;
  // --version: what a bug report needs.
  r = test::run_ddm("--version");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"ddm 0.", "(commit ", "LibTorch 2.11", "ddm's CUDA kernels: CUDA 13", "7.5 8.0 8.6 8.9 9.0 10.0 12.0",
                           "CUDA GPUs LibTorch sees: ", "LibTorch's CUDA libraries: "})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  // LibTorch's CUDA half (core/cuda_module.h): without a driver it is not loaded; DDM_CUDA=1 loads it
  // all the same (LibTorch then sees no GPU), DDM_CUDA=0 never; a binary copied away from its
  // libddm_cuda.so says where it looked.
  if (r.output.find("LibTorch's CUDA libraries: not loaded: no NVIDIA driver here") == std::string::npos) return;
  const std::string ddm = test::ddm_binary();
  r = test::run_command("DDM_CUDA=1 " + ddm + " --version");
  EXPECT_NE(r.output.find("LibTorch's CUDA libraries: loaded\nCUDA GPUs LibTorch sees: 0"), std::string::npos) << r.output;
  r = test::run_command("DDM_CUDA=0 " + ddm + " --version");
  EXPECT_NE(r.output.find("LibTorch's CUDA libraries: not loaded: DDM_CUDA=0"), std::string::npos) << r.output;
  r = test::run_command("DDM_CUDA=yes " + ddm + " --version");  // neither: an error, as for the switches below
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("error: DDM_CUDA=yes: expected 1 (always load ddm's CUDA module) or 0 (never)"),
            std::string::npos) << r.output;
  // The hand-written kernels (model/fused_gpu.h): on unless DDM_FUSED_CUDA=0.
  EXPECT_NE(test::run_command(ddm + " --version").output.find("12.0; on (DDM_FUSED_CUDA=0 turns them off)"),
            std::string::npos);
  r = test::run_command("DDM_FUSED_CUDA=0 " + ddm + " --version");
  EXPECT_NE(r.output.find("12.0; off (DDM_FUSED_CUDA=0)"), std::string::npos) << r.output;
  // The opt-in GroupNorm kernel and channels-last U-Nets: off unless set.
  r = test::run_command("env -u DDM_FUSED_GROUPNORM -u DDM_CHANNELS_LAST " + ddm + " --version");
  EXPECT_NE(r.output.find("U-Nets' GroupNorm kernel: off (DDM_FUSED_GROUPNORM=1 turns it on); channels-last U-Nets: off"),
            std::string::npos) << r.output;
  // A bad value of a switch: refused before the command writes anything (exit 2).
  test::TempDir bad;
  r = test::run_command("DDM_FUSED_GROUPNORM=1 DDM_CHANNELS_LAST=yes " + ddm + " train --config " + test::source_dir() +
                        "/configs/quickstart.toml --out " + (bad / "run"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("DDM_CHANNELS_LAST=yes: expected 1 (on) or 0 (off)"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(bad / "run"));
  r = test::run_command("DDM_FUSED_GROUPNORM=1 DDM_CHANNELS_LAST=1 " + ddm + " --version");
  EXPECT_NE(r.output.find("GroupNorm kernel: on (DDM_FUSED_GROUPNORM=1); channels-last U-Nets: on"), std::string::npos)
      << r.output;
  test::TempDir dir;
  expect_error(test::run_command("DDM_CUDA=1 " + ddm + " quickstart --device cuda --out " + (dir / "qs")),
               "--device = cuda, but this machine has no CUDA GPU that LibTorch can use (no GPU, or CUDA_VISIBLE_DEVICES "
               "hides them)");
  expect_error(test::run_ddm("quickstart --device cuda --out " + (dir / "qs")),
               "--device = cuda, but this machine has no CUDA GPU that LibTorch can use (CUDA not loaded: no NVIDIA driver");
  fs::copy_file(ddm, dir / "ddm");
  r = test::run_command("DDM_CUDA=1 " + (dir / "ddm") + " --version");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("LibTorch's CUDA libraries: not loaded: " + (dir / "libddm_cuda.so") + " cannot be opened ("),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("keep it with them"), std::string::npos) << r.output;
}

TEST(Cli, BadConfigInputs) {
  test::TempDir dir;
  test::write_text(dir / "bad_key.toml", "[train]\nsteps = 3\nbatchsize = 4\n");
  expect_error(test::run_ddm("train --config " + (dir / "bad_key.toml") + " --out " + (dir / "r")),
               "unknown config key 'train.batchsize'");
  test::write_text(dir / "bad_type.toml", "[train]\nsteps = \"ten\"\n");
  expect_error(test::run_ddm("train --config " + (dir / "bad_type.toml") + " --out " + (dir / "r")),
               "train.steps must be an integer");
  test::write_text(dir / "tiny.toml", kTiny);
  expect_error(test::run_ddm("train --config " + (dir / "tiny.toml") + " --set train.steps=-1 --out " + (dir / "r")),
               "train.steps must be > 0, got -1");
  expect_error(test::run_ddm("train --config " + (dir / "tiny.toml") + " --set train.batch_size=0 --out " + (dir / "r")),
               "train.batch_size must be > 0");
  expect_error(test::run_ddm("train --config " + (dir / "missing.toml") + " --out " + (dir / "r")), "missing.toml");
  // A directory or an empty file is not "all defaults".
  expect_error(test::run_ddm("train --config " + dir.path + " --out " + (dir / "r")), "it is a directory");
  expect_error(test::run_ddm("train --config /dev/null --out " + (dir / "r")), "the config file sets no keys");
  expect_error(test::run_ddm("train --config " + (dir / "tiny.toml") + " --set data.root=/nonexistent --out " +
                             (dir / "r")),
               "dataset-fashion-mnist");
  EXPECT_FALSE(fs::exists(dir / "r/ckpt"));
}

TEST(Cli, RunDirectoryProtection) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  const std::string base = "train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "run");
  ASSERT_EQ(test::run_ddm(base).exit_code, 0);
  const std::string before = test::read_text(dir / "run/config.toml");
  // A second run into the same directory is refused and changes nothing.
  expect_error(test::run_ddm(base + " --set train.lr=0.1"), "already holds a run");
  EXPECT_EQ(test::read_text(dir / "run/config.toml"), before);
  // Resuming with a different model is refused.
  expect_error(test::run_ddm(base + " --resume --set model.channels=16"), "config differs");
  // Another preset is named as such, not by the first of the keys it sets.
  expect_error(test::run_ddm(base + " --resume --set model.preset=dit-tiny"),
               "[model] preset = 'unet-tiny'  (stored run)  vs  preset = 'dit-tiny'  (now)");
  // Resuming with more steps continues; --force starts over.
  auto more = test::run_ddm(base + " --resume --set train.steps=5");
  EXPECT_EQ(more.exit_code, 0) << more.output;
  EXPECT_TRUE(fs::exists(dir / "run/ckpt/step-00000005"));
  fs::create_directories(dir / "run/eval");
  test::write_text(dir / "run/eval/old-report.json", "{}");  // `ddm eval`'s reports on the old model
  EXPECT_EQ(test::run_ddm(base + " --force").exit_code, 0);
  EXPECT_FALSE(fs::exists(dir / "run/ckpt/step-00000005"));
  EXPECT_FALSE(fs::exists(dir / "run/eval"));
  {
    // While another process trains into the directory (here: this one holds its lock), neither
    // --resume nor --force may touch it.
    const FileLock held(dir / "run/train.lock", "test");
    expect_error(test::run_ddm(base + " --resume --set train.steps=5"), "another `ddm train` is writing to");
    expect_error(test::run_ddm(base + " --force"), "another `ddm train` is writing to");
    EXPECT_TRUE(fs::exists(dir / "run/ckpt/step-00000003"));
    EXPECT_FALSE(fs::exists(dir / "run/ckpt/step-00000005"));
  }
  auto after = test::run_ddm(base + " --resume --set train.steps=5");  // the lock went with its holder
  EXPECT_EQ(after.exit_code, 0) << after.output;
  // --resume without --config takes the run's own config.toml.
  auto own = test::run_ddm("train --out " + (dir / "run") + " --resume --set train.steps=6");
  EXPECT_EQ(own.exit_code, 0) << own.output;
  EXPECT_NE(own.output.find("note: --resume without --config: the run's own"), std::string::npos) << own.output;
  EXPECT_TRUE(fs::exists(dir / "run/ckpt/step-00000006"));
  // A directory left with only the lock file (a run killed before it wrote its config) is empty.
  fs::create_directories(dir / "stale");
  test::write_text(dir / "stale/train.lock", "");
  auto stale = test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "stale"));
  EXPECT_EQ(stale.exit_code, 0) << stale.output;
  // A run that fails while building its model leaves nothing that blocks the corrected re-run (it
  // once left config.toml and was refused with "already holds a run").
  const std::string fresh = "train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "early");
  expect_error(test::run_ddm(fresh + " --set model.channel_mult=[1,2,2,2,2]"), "is not divisible by 2^(levels-1)");
  EXPECT_FALSE(fs::exists(dir / "early/config.toml"));
  auto corrected = test::run_ddm(fresh);
  EXPECT_EQ(corrected.exit_code, 0) << corrected.output;
  // A run that saved no checkpoint (killed before its first) does not block a fresh start either,
  // with or without --resume, whatever its config was.
  fs::remove_all(dir / "early/ckpt");
  auto again = test::run_ddm(fresh + " --set train.lr=0.01");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(fs::exists(dir / "early/ckpt/step-00000003"));
  fs::remove_all(dir / "early/ckpt");
  auto resumed = test::run_ddm(fresh + " --resume --set model.channels=16");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  // A non-empty directory that is not a run.
  fs::create_directories(dir / "other");
  test::write_text(dir / "other/file.txt", "x");
  expect_error(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "other")),
               "holds no ddm run");
}

TEST(Cli, BadSampleInputs) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "run")).exit_code, 0);
  for (const char* flag : {"--ckpt ", "--ensemble "}) {  // bad input: exit 2
    const auto missing = test::run_ddm(std::string("sample ") + flag + (dir / "nope"));
    EXPECT_EQ(missing.exit_code, 2) << missing.output;
    EXPECT_NE(missing.output.find("'" + (dir / "nope") + "' does not exist"), std::string::npos) << missing.output;
  }
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --cfg -1"), "cfg");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --steps 0"), "steps");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --sampler magic"), "sampler");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --class 11 --out " + (dir / "g.png")),
               "out of range");
  // --class -1 once sampled every class; a grid named .jpg got PNG bytes; cfg inf made NaN samples.
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --class -1 --out " + (dir / "g.png")), "--class");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --out " + (dir / "g.jpg")),
               "g.jpg: ddm writes image grids as PNG");
  // An --out under a file: named before any sampling (the message, not "sampling").
  test::write_text(dir / "afile", "x");
  const auto under_file = test::run_ddm("sample --ckpt " + (dir / "run") + " --out " + (dir / "afile/g.png"));
  expect_error(under_file, "--out " + (dir / "afile/g.png") + ": the folder " + (dir / "afile") +
                               ": cannot create the directory, " + (dir / "afile") + " is a file");
  EXPECT_EQ(under_file.output.find("sampling"), std::string::npos) << under_file.output;
  EXPECT_FALSE(fs::exists(dir / "g.jpg"));
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --cfg inf --out " + (dir / "g.png")), "cfg");
  EXPECT_FALSE(fs::exists(dir / "g.png"));
  // A number beyond what the flag holds is refused, not capped; a refused command leaves none of the
  // folders its outputs would have gone to.
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --n 99999999999999999999"),
               "--n: must be a positive integer up to 1000000");
  const auto refused = test::run_ddm("sample --ckpt " + (dir / "nope") + " --out " + (dir / "d1/x.png") + " --png-dir " +
                                     (dir / "pd1/p") + " --raw " + (dir / "d1r/r.safetensors"));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  for (const char* made : {"d1", "pd1", "d1r"}) EXPECT_FALSE(fs::exists(dir / made)) << made;
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --device gpu --out " + (dir / "g.png")),
               "--device = \"gpu\" is not one of: auto, cpu, cuda, cuda:N");
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --precision fp8 --out " + (dir / "g.png")),
               "--precision: fp8 not in {fp32,bf16,fp16}");
  if (!torch::cuda::is_available())  // a GPU machine samples there instead
    expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --device cuda --out " + (dir / "g.png")),
                 "--device = cuda, but this machine has no CUDA GPU that LibTorch can use");
  EXPECT_FALSE(fs::exists(dir / "g.png"));
  // CUDA graphs replay a network on a GPU: on the CPU they are bad input (exit 2), for a model or an ensemble.
  for (const std::string source : {"--ckpt ", "--ensemble "}) {
    auto r = test::run_ddm("sample " + source + (dir / "run") + " --cuda-graphs --device cpu --out " + (dir / "g.png"));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--cuda-graphs replays the network on a CUDA GPU, but --device cpu"), std::string::npos)
        << r.output;
  }
  if (!torch::cuda::is_available())
    expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --cuda-graphs --out " + (dir / "g.png")),
                 "--cuda-graphs needs a CUDA GPU, but the network runs on cpu");
  EXPECT_FALSE(fs::exists(dir / "g.png"));
  // The quickstart checks its device and data directory before anything starts.
  if (!torch::cuda::is_available()) {
    expect_error(test::run_ddm("quickstart --device cuda --out " + (dir / "qs")),
                 "--device = cuda, but this machine has no CUDA GPU that LibTorch can use");
    EXPECT_FALSE(fs::exists(dir / "qs"));
  }
  expect_error(test::run_ddm("quickstart --device cpu --data-root " + (dir / "nowhere") + " --out " + (dir / "qs")),
               "is not a directory");
  // --device auto (the default) samples on the CPU here, bf16 and fp16 too.
  for (const std::string p : {"bf16", "fp16"}) {
    ASSERT_EQ(test::run_ddm("sample --ckpt " + (dir / "run") + " --n 4 --steps 2 --precision " + p + " --out " +
                            (dir / (p + ".png")))
                  .exit_code,
              0)
        << p;
    EXPECT_TRUE(fs::exists(dir / (p + ".png"))) << p;
  }
  // Corrupt the weights of the only checkpoint: sampling refuses with a checksum message.
  const std::string w = *latest_checkpoint(dir / "run") + "/ema.safetensors";
  std::string bytes = test::read_text(w);
  bytes[bytes.size() / 2] ^= 0x11;
  test::write_text(w, bytes);
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --out " + (dir / "g.png")), "checksum mismatch");
  EXPECT_FALSE(fs::exists(dir / "g.png"));
}

// Weights that are NaN, with a checksum that matches them, once sampled an all-black grid and exited 0.
TEST(Cli, NonFiniteWeightsAreRefused) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --out " + (dir / "run")).exit_code, 0);
  const std::string ck = *latest_checkpoint(dir / "run");
  SafetensorsFile f = load_safetensors(ck + "/ema.safetensors");
  torch::Tensor& w = f.tensors.begin()->second;
  w = w.clone();
  w.view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
  const std::string bytes = safetensors_bytes(f);
  write_file_atomic(ck + "/ema.safetensors", bytes);
  auto state = nlohmann::json::parse(test::read_text(ck + "/state.json"));
  state["sha256"]["ema.safetensors"] = sha256_hex(bytes);
  test::write_text(ck + "/state.json", state.dump(2));
  expect_error(test::run_ddm("sample --ckpt " + (dir / "run") + " --out " + (dir / "g.png")),
               "ema.safetensors: tensor '" + f.tensors.begin()->first + "' holds 1 non-finite value");
  EXPECT_FALSE(fs::exists(dir / "g.png"));
}

TEST(Cli, EvalWritesAReportAndRefusesBadSamples) {
  test::TempDir dir;
  const std::string cache = " --cache-dir " + (dir / "cache");
  auto r = test::run_ddm("eval --anchor train --n 300 --threads 2 --out " + (dir / "e") + cache);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("FD-fmnist"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Ankle boot"), std::string::npos) << r.output;  // per-class accuracy rows
  const std::string json = test::read_text(dir / "e/anchor-train-n300.json");
  EXPECT_NE(json.find("\"feature_net_sha256\": \"61e01b19"), std::string::npos) << json;
  EXPECT_TRUE(fs::exists(dir / "e/anchor-train-n300.png"));

  expect_error(test::run_ddm("eval --anchor train --samples x.safetensors" + cache), "exactly one of");
  expect_error(test::run_ddm("eval --samples " + (dir / "missing.safetensors") + cache), "no such samples file");
  test::write_text(dir / "junk.safetensors", "not a safetensors file");
  expect_error(test::run_ddm("eval --samples " + (dir / "junk.safetensors") + cache), "junk.safetensors");
  expect_error(test::run_ddm("eval --anchor train --n 100" + cache), "100 images, but FD needs more than the feature network's 128");
  expect_error(test::run_ddm("eval --anchor train --feature-net " + (dir / "junk.safetensors") + cache),
               "junk.safetensors");
}

// Guidance against a null condition the model never trained (no label dropped in training) is said
// where it is asked for, and not at cfg 1.
TEST(Cli, GuidanceWithoutATrainedNullConditionIsSaid) {
  test::TempDir dir;
  test::write_text(dir / "tiny.toml", kTiny);
  ASSERT_EQ(test::run_ddm("train --quiet --config " + (dir / "tiny.toml") + " --set train.steps=1 "
                          "--set train.label_dropout=0 --out " + (dir / "run")).exit_code,
            0);
  const std::string sample = "sample --ckpt " + (dir / "run") + " --n 10 --steps 1 --out " + (dir / "s.png");
  auto r = test::run_ddm(sample);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("never trained (train.label_dropout = 0): expect poor samples; give --cfg 1"), std::string::npos)
      << r.output;
  r = test::run_ddm(sample + " --cfg 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("never trained"), std::string::npos) << r.output;
}
