// CLIP's BPE tokenizer (src/text/clip_tokenizer.*, clean.*, unicode.*) against open_clip's own
// SimpleTokenizer and transformers' CLIPTokenizer: the ids of 6000 strings computed by those
// libraries in the reference environment (tests/reference/clip_tokenizer.py), on the vocabulary
// file open_clip ships and the tokenizer directories transformers writes; and bad inputs.
#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"
#include "text/clean.h"
#include "text/clip_tokenizer.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

using ddm::test::TempDir;
using ddm::text::ClipTokenizer;

namespace {

// The vocabulary file inside the reference environment's open_clip (found without importing it).
std::string open_clip_vocab() {
  static const std::string path = [] {
    const std::string python = ddm::test::reference_python();
    const auto r = ddm::test::run_command(
        python + " -c \"import importlib.util, os; print(os.path.join(importlib.util.find_spec('open_clip')"
                 ".submodule_search_locations[0], 'bpe_simple_vocab_16e6.txt.gz'))\"");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.output.substr(0, r.output.find('\n'));
  }();
  return path;
}

const ClipTokenizer& tokenizer() {
  static const ClipTokenizer t = ClipTokenizer::from_open_clip_file(open_clip_vocab());
  return t;
}

// A printable form of a string for failure messages: non-ASCII and controls as \u{...}.
std::string visible(const std::string& utf8) {
  std::ostringstream os;
  for (char32_t c : ddm::text::utf8_to_u32(utf8, "case")) {
    if (c >= 0x20 && c < 0x7F) os << static_cast<char>(c); else os << "\\u{" << std::hex << c << std::dec << "}";
  }
  return os.str();
}

std::string ids_text(const std::vector<int64_t>& ids) {  // to the first <end_of_text> after the start
  std::ostringstream os;
  const auto end = std::find(ids.begin() + 1, ids.end(), 49407);
  for (auto it = ids.begin(); it != ids.end() && it <= end; ++it) os << *it << " ";
  return os.str();
}

}  // namespace

// The corpus and the three tokenizers' ids for it (open_clip's; transformers' from the two
// directories the script has transformers write), computed once per test process.
struct Reference {
  std::string dir;  // shared: read only
  nlohmann::json cases;
};
const Reference& reference() {
  static const Reference* r = [] {
    auto* ref = new Reference;
    const auto made = ddm::test::reference_outputs("tests/reference/clip_tokenizer.py", "{dir}/reference.json 400 {dir}");
    EXPECT_EQ(made.run.exit_code, 0) << made.run.output;
    ref->dir = made.dir;
    const auto all = nlohmann::json::parse(ddm::test::read_text(made.dir + "/reference.json"));
    EXPECT_EQ(all["vocab"].get<std::string>(), open_clip_vocab());
    ref->cases = all["cases"];
    return ref;
  }();
  return *r;
}

// Every case's ids from `t` equal the reference's `key`; failures show the text and both id lists.
void expect_equal_on_corpus(const ClipTokenizer& t, const std::string& key) {
  const auto& cases = reference().cases;
  ASSERT_GE(cases.size(), 5000u);
  std::map<std::string, int> checked, differing;
  int mojibake = 0, shown = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"].get<std::string>(), kind = c["kind"].get<std::string>();
    if (key == "open_clip" && c["mojibake"].get<bool>()) {  // ftfy's mojibake repair is not ddm's (text/clean.h)
      ++mojibake;
      continue;
    }
    const auto expected = c[key].get<std::vector<int64_t>>();
    const auto got = t.tokenize(text);
    ++checked[kind];
    if (got != expected) {
      ++differing[kind];
      if (shown++ < 10) {
        ADD_FAILURE() << key << ": " << kind << " \"" << visible(text) << "\"\n  reference: " << ids_text(expected)
                      << "\n  ddm:       " << ids_text(got);
      }
    }
  }
  for (const auto& [kind, n] : checked) {
    EXPECT_EQ(differing[kind], 0) << key << ": " << differing[kind] << " of " << n << " '" << kind << "' strings differ";
  }
  EXPECT_LE(mojibake, 10) << "the corpus should test ddm's cleaning, not skip it";
}

// One test for the three, so that the reference (about 8 s of Python) is computed once.
TEST(ClipTokenizer, EqualsOpenClipsAndTransformersTokenizersOnSixThousandStrings) {
  expect_equal_on_corpus(tokenizer(), "open_clip");
  const auto from_json = ClipTokenizer::from_transformers_dir(reference().dir + "/json");
  EXPECT_EQ(from_json.pad_id(), from_json.end_id());  // SD 1.x's padding
  expect_equal_on_corpus(from_json, "json");
  const auto legacy = ClipTokenizer::from_transformers_dir(reference().dir + "/legacy");
  EXPECT_EQ(legacy.pad_id(), 0);  // "!": SD 2.x's padding
  EXPECT_EQ(legacy.context(), 77);
  expect_equal_on_corpus(legacy, "legacy");
}

TEST(ClipTokenizer, ShippedVocabularyIsOpenClipsFile) {
  // assets/clip/ (what `--tokenizer clip` reads) is the file of the pinned open_clip wheel, unchanged.
  EXPECT_TRUE(ddm::test::read_text(ddm::test::source_dir() + "/assets/clip/bpe_simple_vocab_16e6.txt.gz") ==
              ddm::test::read_text(open_clip_vocab()));
  const auto shipped = ddm::text::load_tokenizer("clip");
  EXPECT_EQ(shipped->tokenize("a photo of a cat"), tokenizer().tokenize("a photo of a cat"));
}

TEST(ClipTokenizer, VocabularyHasOpenClipsSizeAndSpecialIds) {
  const auto& t = tokenizer();
  EXPECT_EQ(t.vocab_size(), 49408);
  EXPECT_EQ(t.start_id(), 49406);
  EXPECT_EQ(t.end_id(), 49407);
  // bytes_to_unicode lists the printable bytes first: '!' is id 0, "a</w>" is 256 + ('a' - '!').
  EXPECT_EQ(t.symbol(0), "!");
  EXPECT_EQ(t.symbol(256 + 'a' - '!'), "a</w>");
  EXPECT_EQ(t.tokenize("a")[1], 256 + 'a' - '!');
}

TEST(ClipTokenizer, TextPastTheContextIsCutWithEndOfTextLastAndShortTextPaddedWithZeros) {
  const auto& t = tokenizer();
  std::string long_text;
  for (int i = 0; i < 100; ++i) long_text += "photo ";
  const auto ids = t.tokenize(long_text);
  ASSERT_EQ(ids.size(), 77u);
  EXPECT_EQ(ids.front(), t.start_id());
  EXPECT_EQ(ids.back(), t.end_id());
  EXPECT_EQ(ids[1], ids[75]);  // "photo" all the way
  const auto short_ids = t.tokenize("a photo", 10);
  ASSERT_EQ(short_ids.size(), 10u);
  EXPECT_EQ(short_ids[3], t.end_id());
  for (size_t i = 4; i < 10; ++i) EXPECT_EQ(short_ids[i], 0);
  EXPECT_EQ(t.tokenize("", 77)[1], t.end_id());
  EXPECT_NE(ddm::test::error_message([&] { t.tokenize("x", 1); }).find("at least"), std::string::npos);
}

TEST(ClipTokenizer, BadTextAndBadVocabularyFilesAreClearErrors) {
  TempDir dir;
  // Text that is not UTF-8: named, with the byte.
  const std::string bad = std::string("caf") + char(0xE9) + " au lait";
  EXPECT_NE(ddm::test::error_message([&] { tokenizer().encode(bad, "captions.txt line 3"); })
                .find("captions.txt line 3: not UTF-8 at byte 3"),
            std::string::npos);
  const std::string overlong = std::string("a") + char(0xC0) + char(0xAF);
  EXPECT_NE(ddm::test::error_message([&] { tokenizer().encode(overlong); }).find("not UTF-8 at byte 1"), std::string::npos);
  // A missing file, a file cut short, a line that is not a merge.
  EXPECT_NE(ddm::test::error_message([&] { ClipTokenizer::from_open_clip_file(dir / "none.txt.gz"); })
                .find("cannot open the CLIP vocabulary file"),
            std::string::npos);
  std::string whole;
  {
    gzFile f = gzopen(open_clip_vocab().c_str(), "rb");
    char buf[1 << 16];
    int n;
    while ((n = gzread(f, buf, sizeof buf)) > 0) whole.append(buf, static_cast<size_t>(n));
    gzclose(f);
  }
  size_t cut = 0;
  for (int line = 0; line < 1001; ++line) cut = whole.find('\n', cut) + 1;
  ddm::test::write_text(dir / "short.txt", whole.substr(0, cut));
  EXPECT_NE(ddm::test::error_message([&] { ClipTokenizer::from_open_clip_file(dir / "short.txt"); })
                .find("has 1000 merges; CLIP's vocabulary has 48894"),
            std::string::npos);
  std::string broken = whole;
  broken.insert(whole.find('\n') + 1, "abc\n");
  ddm::test::write_text(dir / "broken.txt", broken);
  EXPECT_NE(ddm::test::error_message([&] { ClipTokenizer::from_open_clip_file(dir / "broken.txt"); })
                .find("line 2 is not a merge of two symbols (\"a b\"): \"abc\""),
            std::string::npos);
}

TEST(ClipTokenizer, BadTransformersDirectoriesAreClearErrorsNamingFileAndKey) {
  TempDir dir, made;  // made: the directories transformers writes, with a corpus of one string per kind
  const auto run = ddm::test::run_command(ddm::test::reference_python() + " " + ddm::test::source_dir() +
                                          "/tests/reference/clip_tokenizer.py " + (made / "r.json") + " 1 " + made.path);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  auto message = [](const std::string& d) {
    return ddm::test::error_message([&] { ClipTokenizer::from_transformers_dir(d); });
  };
  EXPECT_NE(message(dir.path).find("holds neither tokenizer.json nor vocab.json + merges.txt"), std::string::npos);
  const std::string legacy = made / "legacy";
  const std::string vocab = ddm::test::read_text(legacy + "/vocab.json");
  const std::string merges = ddm::test::read_text(legacy + "/merges.txt");
  ddm::test::write_text(dir / "vocab.json", vocab);
  ddm::test::write_text(dir / "merges.txt", merges + "abc\n");
  EXPECT_NE(message(dir.path).find("merges.txt: line 48896 is not a merge of two symbols"), std::string::npos)
      << message(dir.path);
  ddm::test::write_text(dir / "merges.txt", merges + "zq zz\n");
  EXPECT_NE(message(dir.path).find("makes \"zqzz\", which the vocabulary lacks"), std::string::npos) << message(dir.path);
  ddm::test::write_text(dir / "merges.txt", merges);
  ddm::test::write_text(dir / "tokenizer_config.json", R"({"pad_token": "<pad>"})");
  EXPECT_NE(message(dir.path).find("tokenizer_config.json: pad_token \"<pad>\" is not in the vocabulary"),
            std::string::npos);
  ddm::test::write_text(dir / "tokenizer_config.json", "{not json");
  EXPECT_NE(message(dir.path).find("tokenizer_config.json: not valid JSON"), std::string::npos);
  ddm::test::write_text(dir / "tokenizer_config.json", "{}");
  ddm::test::write_text(dir / "vocab.json", "[1, 2]");
  EXPECT_NE(message(dir.path).find("vocab.json: not a JSON object of symbol -> id"), std::string::npos);
  ddm::test::write_text(dir / "tokenizer.json", R"({"model": {"type": "WordPiece"}})");
  EXPECT_NE(message(dir.path).find("tokenizer.json: not CLIP's tokenizer"), std::string::npos);
  ddm::test::write_text(dir / "tokenizer.json", R"("")");  // found by fuzz_tokenizer_files
  EXPECT_NE(message(dir.path).find("its tokenizer files do not have the structure transformers writes"),
            std::string::npos) << message(dir.path);
}

TEST(TextTables, AreWhatTheGeneratorWritesFromTheLibraries) {
  // src/text/{text,split}_tables.inc are generated; a changed generator or library version shows here.
  const auto made = ddm::test::reference_outputs("scripts/gen-text-tables.py", "{dir}");
  ASSERT_EQ(made.run.exit_code, 0) << made.run.output;
  for (const std::string name : {"text_tables.inc", "split_tables.inc"}) {
    EXPECT_TRUE(ddm::test::read_text(made.dir + "/" + name) == ddm::test::read_text(ddm::test::source_dir() + "/src/text/" + name))
        << "src/text/" << name << " is not what scripts/gen-text-tables.py writes: regenerate it (its header says how)";
  }
}
