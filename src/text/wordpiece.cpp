// WordPiece: a transformers BERT tokenizer directory read, and text normalized, split and cut.
#include "text/wordpiece.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "text/added_tokens.h"
#include "text/code_ranges.h"
#include "text/unicode.h"

namespace ddm::text {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json parse_json(const fs::path& path) { return read_json_file(path.string()); }

// The CJK ideograph blocks BERT sets apart, as the tokenizers library lists them (its BertNormalizer
// starts one block at U+2B920 where Google's BERT has U+2B820).
bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

#include "text/split_tables.inc"

// The tokenizers library classes characters by Unicode 8.0's tables (its unicode_categories
// dependency), so its punctuation, controls and accents are not today's: every P* character
// assigned since (U+061D, U+2E43, ...) stays inside its word, U+1885 is a letter there and U+1734
// an accent. The sets come from running the library on every code point (split_tables.inc).
// BERT's whitespace: \t \n \r and White_Space.
bool bert_space(char32_t c) { return c == U'\t' || c == U'\n' || c == U'\r' || is_white_space(c); }
bool bert_dropped(char32_t c) { return in_ranges(kBertDropped, c); }
bool bert_punctuation(char32_t c) { return in_ranges(kBertPunctuation, c); }
bool bert_accent(char32_t c) { return in_ranges(kBertStripped, c); }

}  // namespace

WordPieceTokenizer WordPieceTokenizer::from_dir(const std::string& dir) {
  try {
    return load_dir(dir);
  } catch (const json::exception& e) {  // a field of another type than transformers writes
    throw Error(dir + ": its tokenizer files do not have the structure transformers writes (" + e.what() + ")");
  }
}

WordPieceTokenizer WordPieceTokenizer::load_dir(const std::string& dir_name) {
  const fs::path dir(dir_name);
  WordPieceTokenizer t;
  json config = json::object();
  const fs::path config_file = dir / "tokenizer_config.json";
  if (fs::exists(config_file)) config = parse_json(config_file);
  auto name = [&](const char* key, const char* fallback) { return config_token(config, key, fallback, config_file.string()); };
  std::string source;
  if (fs::exists(dir / "tokenizer.json")) {
    source = (dir / "tokenizer.json").string();
    const json tj = parse_json(dir / "tokenizer.json");
    const json model = tj.value("model", json::object());
    DDM_CHECK(model.value("type", "") == "WordPiece" && model.contains("vocab") && model["vocab"].is_object(),
              source << ": not a WordPiece tokenizer (its \"model\" is not a WordPiece with a \"vocab\" object)");
    for (const auto& [symbol, id] : model["vocab"].items()) {
      t.vocab_[symbol] = json_int(id, source + ": the id of \"" + symbol + "\"", 0, 1 << 24);
    }
    t.prefix_ = model.value("continuing_subword_prefix", "##");
    t.max_chars_ = json_int32(model.value("max_input_chars_per_word", json(100)), source + ": max_input_chars_per_word", 1);
    const json norm = tj.value("normalizer", json::object());
    DDM_CHECK(norm.value("type", "") == "BertNormalizer",
              source << ": its normalizer is not a BertNormalizer (ddm reads BERT's WordPiece tokenizers)");
    t.clean_text_ = norm.value("clean_text", true);
    t.chinese_chars_ = norm.value("handle_chinese_chars", true);
    t.lowercase_ = norm.value("lowercase", true);
    t.strip_accents_ = norm.contains("strip_accents") && norm["strip_accents"].is_boolean()
                           ? norm["strip_accents"].get<bool>() : t.lowercase_;
    t.added_ = read_added_tokens(tj, source);
  } else {
    source = (dir / "vocab.txt").string();
    DDM_CHECK(fs::exists(source), dir_name << ": holds neither tokenizer.json nor vocab.txt (a transformers BERT"
                                            << " tokenizer directory)");
    std::istringstream lines(read_file(source));
    std::string line;
    for (int64_t id = 0; std::getline(lines, line); ++id) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      t.vocab_.emplace(line, id);  // the first of duplicates keeps its id
    }
    t.lowercase_ = config.value("do_lower_case", true);
    t.chinese_chars_ = config.value("tokenize_chinese_chars", true);
    t.strip_accents_ = config.contains("strip_accents") && config["strip_accents"].is_boolean()
                           ? config["strip_accents"].get<bool>() : t.lowercase_;
  }
  auto id_of = [&](const std::string& token) {
    auto it = t.vocab_.find(token);
    DDM_CHECK(it != t.vocab_.end(), source << ": the vocabulary has no \"" << token << "\"");
    return it->second;
  };
  t.cls_id_ = id_of(name("cls_token", "[CLS]"));
  t.sep_id_ = id_of(name("sep_token", "[SEP]"));
  t.pad_id_ = id_of(name("pad_token", "[PAD]"));
  t.unk_id_ = id_of(name("unk_token", "[UNK]"));
  for (const char* key : {"cls_token", "sep_token", "pad_token", "unk_token", "mask_token"}) {
    const char* fallback = std::string(key) == "mask_token" ? "[MASK]" : "";
    const std::string token = name(key, fallback);
    if (!token.empty() && t.vocab_.count(token)) t.added_.emplace_back(utf8_to_u32(token, source), t.vocab_.at(token));
  }
  if (config.contains("model_max_length") && config["model_max_length"].is_number_integer()) {
    const int64_t n = config["model_max_length"].get<int64_t>();
    if (n >= 2 && n <= 1 << 16) t.max_length_ = static_cast<int>(n);
  }
  return t;
}

void WordPieceTokenizer::word_pieces(const std::u32string& word, std::vector<int64_t>& ids) const {
  if (word.size() > static_cast<size_t>(max_chars_)) {
    ids.push_back(unk_id_);
    return;
  }
  std::vector<int64_t> pieces;
  for (size_t start = 0; start < word.size();) {
    int64_t found = -1;
    size_t end = word.size();
    for (; end > start; --end) {  // the longest piece from `start` the vocabulary has
      const std::string piece = (start > 0 ? prefix_ : "") + u32_to_utf8(word.substr(start, end - start));
      auto it = vocab_.find(piece);
      if (it != vocab_.end()) {
        found = it->second;
        break;
      }
    }
    if (found < 0) {  // no cut: the whole word is unknown
      ids.push_back(unk_id_);
      return;
    }
    pieces.push_back(found);
    start = end;
  }
  ids.insert(ids.end(), pieces.begin(), pieces.end());
}

void WordPieceTokenizer::encode_normalized(std::u32string_view raw, std::vector<int64_t>& ids) const {
  // BertNormalizer: clean, set CJK apart, strip accents, lower-case (character by character).
  std::u32string t;
  t.reserve(raw.size());
  for (char32_t c : raw) {
    if (clean_text_) {
      if (bert_dropped(c)) continue;  // controls, U+0000, U+FFFD
      if (bert_space(c)) c = U' ';
    }
    if (chinese_chars_ && is_cjk(c)) {
      t.push_back(U' ');
      t.push_back(c);
      t.push_back(U' ');
    } else {
      t.push_back(c);
    }
  }
  if (strip_accents_) {
    std::u32string kept;
    for (char32_t c : nfd(t))
      if (!bert_accent(c)) kept.push_back(c);
    t.swap(kept);
  }
  if (lowercase_) {
    std::u32string lowered;
    for (char32_t c : t) lowered += lower(std::u32string_view(&c, 1));
    t.swap(lowered);
  }
  // BertPreTokenizer: words between white space, each punctuation character a word of its own.
  std::u32string word;
  for (char32_t c : t) {
    if (is_white_space(c) || bert_punctuation(c)) {
      if (!word.empty()) word_pieces(word, ids);
      word.clear();
      if (bert_punctuation(c)) word_pieces(std::u32string(1, c), ids);
    } else {
      word.push_back(c);
    }
  }
  if (!word.empty()) word_pieces(word, ids);
}

std::vector<int64_t> WordPieceTokenizer::encode(std::string_view text, std::string_view what) const {
  const std::u32string raw = utf8_to_u32(text, what);
  std::vector<int64_t> ids;
  // The special tokens are cut out of the raw text first (text/added_tokens.h).
  split_on_added(raw, added_, ids, [&](std::u32string_view part) { encode_normalized(part, ids); });
  return ids;
}

std::vector<int64_t> WordPieceTokenizer::tokenize(std::string_view text, int max_length, std::string_view what,
                                                  int64_t* length) const {
  if (max_length == 0) max_length = max_length_;
  DDM_CHECK(max_length >= 2, "a BERT max_length must hold at least [CLS] and [SEP], got " << max_length);
  std::vector<int64_t> body = encode(text, what);
  if (body.size() > static_cast<size_t>(max_length - 2)) body.resize(static_cast<size_t>(max_length - 2));
  std::vector<int64_t> ids{cls_id_};
  ids.insert(ids.end(), body.begin(), body.end());
  ids.push_back(sep_id_);
  if (length) *length = static_cast<int64_t>(ids.size());
  ids.resize(static_cast<size_t>(max_length), pad_id_);
  return ids;
}

}  // namespace ddm::text
