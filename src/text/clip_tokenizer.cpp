// CLIP's BPE: the vocabulary read from open_clip's file, the split by PCRE2, the merges by rank.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/clip_tokenizer.h"

#include <pcre2.h>
#include <zlib.h>

#include <algorithm>
#include <limits>
#include <mutex>

#include "core/error.h"
#include "text/clean.h"
#include "text/unicode.h"

namespace ddm::text {
namespace {

constexpr const char* kStart = "<start_of_text>";
constexpr const char* kEnd = "<end_of_text>";
// open_clip keeps lines [1, 49152 - 256 - 2 + 1) of the file: 48894 merges after the header line.
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

// GPT-2's bytes_to_unicode: printable bytes stand for themselves; the others, in order, for
// U+0100, U+0101, ... so that every byte is a visible character the merges can name.
// Returns the bytes in the order bytes_to_unicode lists them: the printable ones, then the others.
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

ClipTokenizer ClipTokenizer::from_open_clip_file(const std::string& path) {
  const std::string file = read_gz(path);
  ClipTokenizer t;
  // The first 512 ids: the byte symbols, printable bytes first (as bytes_to_unicode lists them),
  // then the same with '</w>'.
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
  t.symbols_.push_back(kStart);
  t.symbols_.push_back(kEnd);
  for (size_t id = 0; id < t.symbols_.size(); ++id) t.vocab_[t.symbols_[id]] = static_cast<int64_t>(id);
  // Later duplicates win, as in open_clip's dict(zip(vocab, range(len(vocab)))).
  t.start_id_ = t.vocab_.at(kStart);
  t.end_id_ = t.vocab_.at(kEnd);

  // CLIP's split, case-insensitive, with Unicode classes (PCRE2's UTF + UCP modes).
  const std::string pattern = std::string(kStart) + "|" + kEnd +
                              R"(|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+)";
  int error = 0;
  PCRE2_SIZE offset = 0;
  t.pattern_ = std::make_unique<Pattern>();
  t.pattern_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_CASELESS, &error, &offset, nullptr);
  DDM_CHECK(t.pattern_->code != nullptr, "PCRE2 refused CLIP's split pattern (error " << error << ")");
  return t;
}

void ClipTokenizer::bpe(const std::string& piece, std::vector<int64_t>& ids) const {
  if (piece == kStart || piece == kEnd) {  // open_clip's cache holds the special tokens as they are
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

std::vector<int64_t> ClipTokenizer::encode(std::string_view text, std::string_view what) const {
  const std::string clean = u32_to_utf8(clip_clean(utf8_to_u32(text, what)));
  std::vector<int64_t> ids;
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
  return ids;
}

std::vector<int64_t> ClipTokenizer::tokenize(std::string_view text, int context, std::string_view what) const {
  DDM_CHECK(context >= 2, "a CLIP context must hold at least <start_of_text> and <end_of_text>, got " << context);
  std::vector<int64_t> ids{start_id_};
  const std::vector<int64_t> body = encode(text, what);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.push_back(end_id_);
  if (ids.size() > static_cast<size_t>(context)) {
    ids.resize(static_cast<size_t>(context));
    ids.back() = end_id_;
  }
  ids.resize(static_cast<size_t>(context), 0);
  return ids;
}

}  // namespace ddm::text
