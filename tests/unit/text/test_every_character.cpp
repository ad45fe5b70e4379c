// Every assigned character (Python's Unicode 14.0) between two letters, through each tokenizer ddm
// reads, against the libraries themselves (tests/reference/every_character.py): open_clip's CLIP
// tokenizer, transformers' CLIP tokenizer and transformers' BERT tokenizer (all-MiniLM-L6-v2).
// What this pins down: the character classes of each library (letters, numbers, punctuation,
// white space, controls, marks), their normalization, case mapping and cleaning, character by
// character. Not run under the sanitizers (146k strings x 3; test_clip_tokenizer and test_wordpiece are).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"
#include "text/clip_tokenizer.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "text/wordpiece.h"


namespace {

struct Reference {
  std::string dir;  // shared: read only
  nlohmann::json all;
};
const Reference& reference() {
  static const Reference* r = [] {
    auto* ref = new Reference;
    const auto made = ddm::test::reference_outputs("tests/reference/every_character.py", "{dir}/every.json {dir}");
    EXPECT_EQ(made.run.exit_code, 0) << made.run.output;
    ref->dir = made.dir;
    ref->all = nlohmann::json::parse(ddm::test::read_text(made.dir + "/every.json"));
    return ref;
  }();
  return *r;
}

// Each code point's ids from `tokenize` equal the reference's `key` (up to and with `end`).
template <class F>
void expect_every_character(const std::string& key, int64_t end, F tokenize) {
  const auto& cps = reference().all["code_points"];
  const auto& expected = reference().all[key];
  ASSERT_GT(cps.size(), 140000u);
  int differing = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    const auto c = cps[i].get<uint32_t>();
    std::string text = "a";
    ddm::text::append_utf8(text, c);
    text += "b";
    std::vector<int64_t> got = tokenize(text);
    got.erase(std::find(got.begin() + 1, got.end(), end) + 1, got.end());
    const auto want = expected[i].get<std::vector<int64_t>>();
    if (got != want && differing++ < 10) {
      std::ostringstream os;
      for (auto id : want) os << id << " ";
      os << "| ddm: ";
      for (auto id : got) os << id << " ";
      ADD_FAILURE() << key << ": U+" << std::hex << c << std::dec << ": " << os.str();
    }
  }
  EXPECT_EQ(differing, 0) << key << ": " << differing << " of " << cps.size() << " characters differ";
}

}  // namespace

// One test, so that the reference (about 15 s of Python) is computed once.
TEST(EveryCharacter, EachTokenizerEqualsItsLibrary) {
  const auto shipped = ddm::text::load_tokenizer("clip");
  const auto& open_clip = dynamic_cast<const ddm::text::ClipTokenizer&>(*shipped);
  expect_every_character("open_clip", open_clip.end_id(), [&](const std::string& s) { return open_clip.tokenize(s, 16); });
  const auto clip = ddm::text::ClipTokenizer::from_transformers_dir(reference().dir + "/json");
  expect_every_character("transformers_clip", clip.end_id(), [&](const std::string& s) { return clip.tokenize(s, 16); });
  const auto bert = ddm::text::WordPieceTokenizer::from_dir(reference().all["bert_model"].get<std::string>());
  expect_every_character("bert", bert.sep_id(), [&](const std::string& s) { return bert.tokenize(s, 16); });
}
