// CLIP's BPE: the vocabulary read from open_clip's file or a transformers directory, the split by
// PCRE2, the merges by rank.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/clip_tokenizer.h"

#include <pcre2.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "text/added_tokens.h"
#include "text/clean.h"
#include "text/code_ranges.h"
#include "text/unicode.h"

namespace ddm::text {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#include "text/split_tables.inc"

// open_clip keeps lines [1, 49152 - 256 - 2 + 1) of its file: 48894 merges after the header line.
constexpr size_t kMergeLines = 49152 - 256 - 2;

// The whole file (gzip or plain: zlib reads both).
std::string read_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  DDM_CHECK(f != nullptr, path << ": cannot open the CLIP vocabulary file (open_clip ships it as "
                               << "open_clip/bpe_simple_vocab_16e6.txt.gz)");
  std::string out;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  int err = 0;
  const std::string message = n < 0 ? gzerror(f, &err) : "";
  gzclose(f);
  DDM_CHECK(n == 0, path << ": cannot read the CLIP vocabulary file: " << message);
  return out;
}

json parse_json(const fs::path& path) { return read_json_file(path.string()); }

// Returns the bytes in the order bytes_to_unicode lists them: the printable ones, then the others;
// out[b] is the character byte b stands for (GPT-2's map: printable bytes themselves, the others
// U+0100, U+0101, ... in order), UTF-8.
std::vector<int> byte_symbols(std::string (&out)[256]) {
  auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
  std::vector<int> order, others;
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    out[b].clear();
    append_utf8(out[b], static_cast<char32_t>(printable(b) ? b : 256 + next++));
    (printable(b) ? order : others).push_back(b);
  }
  order.insert(order.end(), others.begin(), others.end());
  return order;
}

// PCRE2's pattern syntax for a literal.
std::string quote(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.[]|()?*+{}").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// transformers' normalizer for CLIP: NFC, each run of white space one space, then lower case one
// character at a time (the tokenizers library maps characters alone: no final sigma).
std::u32string transformers_normalize(std::u32string_view text) {
  std::u32string t = nfc(text), out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    if (is_white_space(t[i])) {
      while (i < t.size() && is_white_space(t[i])) ++i;
      out.push_back(U' ');
    } else {
      out += lower(std::u32string_view(&t[i], 1));
      ++i;
    }
  }
  return out;
}

}  // namespace

struct ClipTokenizer::Pattern {
  pcre2_code* code = nullptr;
  ~Pattern() { pcre2_code_free(code); }
};

struct ClipTokenizer::Cache {
  static constexpr size_t kMaxEntries = 1 << 18;  // emptied when full: memory stays bounded
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<int64_t>> ids;
};

ClipTokenizer::ClipTokenizer() : cache_(std::make_unique<Cache>()) {}
ClipTokenizer::ClipTokenizer(ClipTokenizer&&) noexcept = default;
ClipTokenizer& ClipTokenizer::operator=(ClipTokenizer&&) noexcept = default;
ClipTokenizer::~ClipTokenizer() = default;

void ClipTokenizer::finish(const std::string& source, const std::string& start, const std::string& end) {
  start_ = start;
  end_ = end;
  auto id_of = [&](const std::string& name) {
    auto it = vocab_.find(name);
    DDM_CHECK(it != vocab_.end(), source << ": the vocabulary has no \"" << name << "\"");
    return it->second;
  };
  start_id_ = id_of(start);
  end_id_ = id_of(end);
  // CLIP's split, with Unicode classes (PCRE2's UTF + UCP modes); open_clip's is case-insensitive.
  // Its \s is written \p{White_Space}: that is what \s means to Python's regex module and to the
  // tokenizers library, and PCRE2's own \s also takes U+180E (a format character since Unicode 6.3),
  // which both keep as a symbol.
  const std::string pattern = quote(start) + "|" + quote(end) +
                              R"(|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\p{White_Space}\p{L}\p{N}]+)";
  int error = 0;
  PCRE2_SIZE offset = 0;
  pattern_ = std::make_unique<Pattern>();
  const uint32_t flags = PCRE2_UTF | PCRE2_UCP | (flavor_ == Flavor::open_clip ? PCRE2_CASELESS : 0);
  pattern_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), flags, &error,
                                 &offset, nullptr);
  DDM_CHECK(pattern_->code != nullptr, "PCRE2 refused CLIP's split pattern (error " << error << ")");
}

ClipTokenizer ClipTokenizer::from_open_clip_file(const std::string& path) {
  const std::string file = read_gz(path);
  ClipTokenizer t;
  t.flavor_ = Flavor::open_clip;
  // The first 512 ids: the byte symbols in bytes_to_unicode's order, then the same with '</w>'.
  const std::vector<int> order = byte_symbols(t.byte_symbol_);
  for (int b : order) t.symbols_.push_back(t.byte_symbol_[b]);
  for (int b : order) t.symbols_.push_back(t.byte_symbol_[b] + "</w>");
  size_t pos = file.find('\n');  // the header line ("#version: ...") is not a merge
  DDM_CHECK(pos != std::string::npos, path << ": not a CLIP vocabulary file (no line after the header)");
  ++pos;
  for (size_t line = 1; line <= kMergeLines; ++line) {
    DDM_CHECK(pos < file.size(), path << ": has " << line - 1 << " merges; CLIP's vocabulary has " << kMergeLines
                                      << " (is the file cut short?)");
    size_t end = file.find('\n', pos);
    if (end == std::string::npos) end = file.size();
    const std::string text = file.substr(pos, end - pos);
    pos = end + 1;
    const size_t space = text.find(' ');
    DDM_CHECK(space != std::string::npos && space > 0 && space + 1 < text.size() &&
                  text.find(' ', space + 1) == std::string::npos,
              path << ": line " << line + 1 << " is not a merge of two symbols (\"a b\"): \"" << text << "\"");
    t.ranks_.emplace(text, static_cast<int32_t>(line - 1));
    t.symbols_.push_back(text.substr(0, space) + text.substr(space + 1));
  }
  t.symbols_.push_back("<start_of_text>");
  t.symbols_.push_back("<end_of_text>");
  // Later duplicates win, as in open_clip's dict(zip(vocab, range(len(vocab)))).
  for (size_t id = 0; id < t.symbols_.size(); ++id) t.vocab_[t.symbols_[id]] = static_cast<int64_t>(id);
  t.finish(path, "<start_of_text>", "<end_of_text>");
  t.pad_id_ = 0;
  return t;
}

ClipTokenizer ClipTokenizer::from_transformers_dir(const std::string& dir) {
  try {
    return load_transformers_dir(dir);
  } catch (const json::exception& e) {  // a field of another type than transformers writes
    throw Error(dir + ": its tokenizer files do not have the structure transformers writes (" + e.what() + ")");
  }
}

ClipTokenizer ClipTokenizer::load_transformers_dir(const std::string& dir_name) {
  const fs::path dir(dir_name);
  ClipTokenizer t;
  t.flavor_ = Flavor::transformers;
  byte_symbols(t.byte_symbol_);
  json config = json::object();
  if (fs::exists(dir / "tokenizer_config.json")) config = parse_json(dir / "tokenizer_config.json");
  const fs::path config_file = dir / "tokenizer_config.json";
  std::string source;
  std::vector<std::pair<std::string, std::string>> merges;
  json vocab;
  AddedTokens added;  // from tokenizer.json, then the config's special tokens
  if (fs::exists(dir / "tokenizer.json")) {
    source = (dir / "tokenizer.json").string();
    const json tj = parse_json(dir / "tokenizer.json");
    const json model = tj.value("model", json::object());
    DDM_CHECK(model.value("type", "") == "BPE" && model.value("end_of_word_suffix", "") == "</w>",
              source << ": not CLIP's tokenizer (its \"model\" is not a BPE with end_of_word_suffix \"</w>\"; ddm reads"
                     << " CLIP's tokenizers, as transformers' CLIPTokenizer writes them)");
    DDM_CHECK(model.contains("vocab") && model["vocab"].is_object() && model.contains("merges") &&
                  model["merges"].is_array(),
              source << ": \"model\" has no \"vocab\" object or \"merges\" list");
    vocab = model["vocab"];
    for (size_t i = 0; i < model["merges"].size(); ++i) {
      const json& m = model["merges"][i];
      if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else if (m.is_string() && m.get<std::string>().find(' ') != std::string::npos) {  // older files: "a b"
        const std::string s = m.get<std::string>();
        merges.emplace_back(s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1));
      } else {
        DDM_FAIL(source << ": model.merges[" << i << "] is not a pair of symbols");
      }
    }
    added = read_added_tokens(tj, source);
  } else {
    DDM_CHECK(fs::exists(dir / "vocab.json") && fs::exists(dir / "merges.txt"),
              dir_name << ": holds neither tokenizer.json nor vocab.json + merges.txt (a transformers CLIPTokenizer"
                       << " directory, such as a Stable Diffusion directory's tokenizer/)");
    source = (dir / "vocab.json").string();
    vocab = parse_json(dir / "vocab.json");
    DDM_CHECK(vocab.is_object(), source << ": not a JSON object of symbol -> id");
    std::istringstream lines(read_file((dir / "merges.txt").string()));
    std::string line;
    for (int number = 1; std::getline(lines, line); ++number) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty() || (number == 1 && line.rfind("#version", 0) == 0)) continue;
      const size_t space = line.find(' ');
      DDM_CHECK(space != std::string::npos && space > 0 && line.find(' ', space + 1) == std::string::npos,
                (dir / "merges.txt").string() << ": line " << number << " is not a merge of two symbols (\"a b\"): \""
                                              << line << "\"");
      merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    }
  }
  for (const auto& [symbol, id] : vocab.items()) {
    const int64_t i = json_int(id, source + ": the id of \"" + symbol + "\"", 0, 1 << 24);
    t.vocab_[symbol] = i;
    if (t.symbols_.size() <= static_cast<size_t>(i)) t.symbols_.resize(static_cast<size_t>(i) + 1);
    t.symbols_[static_cast<size_t>(i)] = symbol;
  }
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    DDM_CHECK(t.vocab_.count(a + b), source << ": merge " << rank << " (\"" << a << " " << b << "\") makes \"" << a + b
                                            << "\", which the vocabulary lacks");
    t.ranks_.emplace(a + " " + b, static_cast<int32_t>(rank));  // the first of duplicates keeps its rank
  }
  for (int b = 0; b < 256; ++b) {
    DDM_CHECK(t.vocab_.count(t.byte_symbol_[b] + "</w>") && t.vocab_.count(t.byte_symbol_[b]),
              source << ": not a byte-level CLIP vocabulary (no symbol for byte " << b << ")");
  }
  const std::string start = config_token(config, "bos_token", "<|startoftext|>", config_file.string());
  const std::string end = config_token(config, "eos_token", "<|endoftext|>", config_file.string());
  const std::string pad = config_token(config, "pad_token", "<|endoftext|>", config_file.string());
  t.finish(source, start, end);
  auto pad_it = t.vocab_.find(pad);
  DDM_CHECK(pad_it != t.vocab_.end(), config_file.string() << ": pad_token \"" << pad << "\" is not in the vocabulary");
  t.pad_id_ = pad_it->second;
  // Special tokens found in the raw text: tokenizer.json's added tokens and the ones the config
  // names, as transformers adds them. So SD 2.x's pad token "!" is cut out of the text as itself
  // (id 0), not merged as the end of a word ("!</w>", 256) as open_clip's tokenizer does.
  const std::string unk = config_token(config, "unk_token", "<|endoftext|>", config_file.string());
  for (const std::string& token : {start, end, pad, unk}) {
    if (!token.empty() && t.vocab_.count(token)) added.emplace_back(utf8_to_u32(token, config_file.string()), t.vocab_.at(token));
  }
  t.added_ = std::move(added);
  if (config.contains("model_max_length") && config["model_max_length"].is_number_integer()) {
    const int64_t n = config["model_max_length"].get<int64_t>();  // transformers writes 1e30 for "none"
    if (n >= 2 && n <= 4096) t.context_ = static_cast<int>(n);
  }
  return t;
}

void ClipTokenizer::bpe(const std::string& piece, std::vector<int64_t>& ids) const {
  // open_clip's cache holds its special tokens as they are; transformers' merges them like any text.
  if (flavor_ == Flavor::open_clip && (piece == start_ || piece == end_)) {
    ids.push_back(vocab_.at(piece));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    auto it = cache_->ids.find(piece);
    if (it != cache_->ids.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  // The piece's characters (each one UTF-8 sequence), '</w>' joined to the last.
  std::vector<std::string> word;
  for (size_t i = 0; i < piece.size();) {
    const auto b = static_cast<unsigned char>(piece[i]);
    const size_t len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    word.push_back(piece.substr(i, len));
    i += len;
  }
  word.back() += "</w>";
  // Merge the lowest-ranked adjacent pair everywhere it occurs (left to right), until none has a rank.
  std::string key;
  while (word.size() > 1) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      key.assign(word[i]).append(" ").append(word[i + 1]);
      auto it = ranks_.find(key);
      if (it != ranks_.end() && it->second < best) best = it->second, at = i;
    }
    if (best == std::numeric_limits<int32_t>::max()) break;
    const std::string first = word[at], second = word[at + 1];
    std::vector<std::string> merged;
    merged.reserve(word.size());
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(word[i++]);
      }
    }
    word.swap(merged);
  }
  std::vector<int64_t> out;
  out.reserve(word.size());
  for (const auto& symbol : word) out.push_back(vocab_.at(symbol));
  ids.insert(ids.end(), out.begin(), out.end());
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->ids.size() >= Cache::kMaxEntries) cache_->ids.clear();
  cache_->ids.emplace(piece, std::move(out));
}

void ClipTokenizer::encode_clean(const std::string& clean, std::vector<int64_t>& ids, std::string_view what) const {
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(pattern_->code, nullptr);
  DDM_CHECK(match != nullptr, "out of memory tokenizing " << what);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(clean.data());
  std::string piece;
  for (PCRE2_SIZE start = 0; start < clean.size();) {
    const int rc = pcre2_match(pattern_->code, subject, clean.size(), start, 0, match, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(match);
      DDM_FAIL("PCRE2 failed splitting " << what << " (error " << rc << ")");
    }
    const PCRE2_SIZE* at = pcre2_get_ovector_pointer(match);
    piece.clear();
    for (PCRE2_SIZE i = at[0]; i < at[1]; ++i) piece += byte_symbol_[static_cast<unsigned char>(clean[i])];
    bpe(piece, ids);
    start = at[1];
  }
  pcre2_match_data_free(match);
}

std::vector<int64_t> ClipTokenizer::encode(std::string_view text, std::string_view what) const {
  const std::u32string raw = utf8_to_u32(text, what);
  std::vector<int64_t> ids;
  if (flavor_ == Flavor::open_clip) {
    // The characters open_clip's pattern never matches (U+0345 alone: Python's regex module,
    // matching case-insensitively, takes it neither as a letter nor as "not a letter") are skipped
    // and end the piece before them, as a space does.
    std::u32string clean = clip_clean(raw);
    std::replace_if(clean.begin(), clean.end(), [](char32_t c) { return in_ranges(kClipSkipped, c); }, U' ');
    encode_clean(u32_to_utf8(clean), ids, what);
    return ids;
  }
  // transformers: the added tokens are cut out of the raw text first (text/added_tokens.h).
  split_on_added(raw, added_, ids, [&](std::u32string_view part) {
    encode_clean(u32_to_utf8(transformers_normalize(part)), ids, what);
  });
  return ids;
}

std::vector<int64_t> ClipTokenizer::tokenize(std::string_view text, int context, std::string_view what,
                                             int64_t* length) const {
  if (context == 0) context = context_;
  DDM_CHECK(context >= 2, "a CLIP context must hold at least the start and end tokens, got " << context);
  std::vector<int64_t> ids{start_id_};
  const std::vector<int64_t> body = encode(text, what);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.push_back(end_id_);
  if (ids.size() > static_cast<size_t>(context)) {
    ids.resize(static_cast<size_t>(context));
    ids.back() = end_id_;
  }
  if (length) *length = static_cast<int64_t>(ids.size());
  ids.resize(static_cast<size_t>(context), pad_id_);
  return ids;
}

}  // namespace ddm::text
