// The PyTorch models ddm's speed is measured against (bench/reference.py, docs/results.md) compute
// ddm's models: `ddm_bench forward` draws every weight of a preset's network at random and writes
// them with one float32 forward; `reference.py --check` loads them under ddm's parameter names into
// its own model and must give the same output within float32 rounding. For the class-conditional
// U-Nets and DiTs, and for them as text models (--text: cross-attention on token states with a
// padding mask). A file with one weight changed must fail the check (the check can fail).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "test_util.h"

using ddm::test::TempDir;

namespace {

std::string bench_binary() { return ddm::test::helper_binary("ddm_bench"); }

// reference.py --check on `file` for `preset` (and --text); the command's result.
ddm::test::CommandResult check(const std::string& preset, const std::string& text, const std::string& file) {
  return ddm::test::run_command(ddm::test::reference_python() + " " + ddm::test::source_dir() + "/bench/reference.py " +
                                preset + " --check " + file + (text.empty() ? "" : " --text " + text) + " 2>&1");
}

}  // namespace

TEST(BenchReference, ThePyTorchModelsDdmIsMeasuredAgainstComputeDdmsModels) {
  if (!std::filesystem::exists(bench_binary())) GTEST_SKIP() << "ddm_bench is not built (DDM_BUILD_BENCH=OFF)";
  TempDir dir;
  struct Case {
    std::string preset, text;
  };
  const std::vector<Case> cases = {{"unet-tiny", ""},     {"unet-small", ""},        {"dit-tiny", ""},
                                   {"dit-small", ""},     {"unet-small", "13:48"},   {"dit-tiny", "13:48"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.preset + (c.text.empty() ? "" : " --text " + c.text));
    const std::string file = dir / (c.preset + (c.text.empty() ? "" : "-text") + ".safetensors");
    const auto made = ddm::test::run_command(bench_binary() + " forward " + c.preset + " --batch 3 --out " + file +
                                             (c.text.empty() ? "" : " --text " + c.text) + " 2>&1");
    ASSERT_EQ(made.exit_code, 0) << made.output;
    const auto run = check(c.preset, c.text, file);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find("\"rel_err\""), std::string::npos) << run.output;
  }
  // One weight of ddm's changed (a text DiT's cross-attention key projection): the check fails.
  const std::string file = dir / "dit-tiny-text.safetensors";
  auto f = ddm::load_safetensors(file);
  ASSERT_TRUE(f.tensors.count("param/block1.cross.k.weight"));
  f.tensors.at("param/block1.cross.k.weight").mul_(1.01);
  ddm::save_safetensors(file, f);
  const auto run = check("dit-tiny", "13:48", file);
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("differs from ddm's"), std::string::npos) << run.output;
}
