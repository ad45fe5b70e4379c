// CLIP's byte-level BPE tokenizer, as open_clip's SimpleTokenizer (the tokenizer of OpenAI CLIP and
// of Stable Diffusion's OpenCLIP text encoders): text cleaned (text/clean.h), split by CLIP's
// pattern, each piece's UTF-8 bytes mapped to printable characters and merged by the vocabulary's
// ranked merges, '</w>' marking a word's last symbol; then <start_of_text> ... <end_of_text>, cut
// to the context length with its last id <end_of_text>, padded with 0.
//
// The vocabulary is the file open_clip ships (bpe_simple_vocab_16e6.txt.gz: a header line, then
// merges, one "a b" per line; gzip or plain): the 256 byte symbols, the same with '</w>', one
// entry per merge, then the two special tokens (49408 ids with the standard file).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ddm::text {

class ClipTokenizer {
 public:
  // Reads open_clip's vocabulary file. Throws ddm::Error naming the file (and line) if it cannot
  // be read or a merge line is malformed.
  static ClipTokenizer from_open_clip_file(const std::string& path);

  // The ids of `text` (UTF-8) without the special tokens. Throws ddm::Error "<what>: not UTF-8..."
  std::vector<int64_t> encode(std::string_view text, std::string_view what = "text") const;
  // What the model gets: <start_of_text>, encode(text), <end_of_text>, cut to `context` ids with
  // <end_of_text> last, then padded with 0 to `context`.
  std::vector<int64_t> tokenize(std::string_view text, int context = 77, std::string_view what = "text") const;

  int64_t start_id() const { return start_id_; }
  int64_t end_id() const { return end_id_; }
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  // The symbol (byte-unicode characters, '</w>' on a word's end) of an id, as the vocabulary names it.
  const std::string& symbol(int64_t id) const { return symbols_.at(static_cast<size_t>(id)); }

  ClipTokenizer(ClipTokenizer&&) noexcept;
  ClipTokenizer& operator=(ClipTokenizer&&) noexcept;
  ~ClipTokenizer();

 private:
  ClipTokenizer();
  struct Pattern;  // the compiled split pattern (PCRE2)

  // BPE of one piece (its byte-unicode form), appended to `ids`.
  void bpe(const std::string& piece, std::vector<int64_t>& ids) const;

  std::unordered_map<std::string, int64_t> vocab_;  // symbol -> id
  std::vector<std::string> symbols_;                // id -> symbol
  std::unordered_map<std::string, int32_t> ranks_;  // "a b" -> merge rank (lower merges first)
  std::string byte_symbol_[256];                    // byte -> its printable character, UTF-8
  int64_t start_id_ = 0, end_id_ = 0;
  std::unique_ptr<Pattern> pattern_;
  struct Cache;  // piece -> ids, shared by the threads that tokenize with this tokenizer
  std::unique_ptr<Cache> cache_;
};

}  // namespace ddm::text
