// CLIP's byte-level BPE tokenizer, in its two spellings:
// - open_clip's SimpleTokenizer (OpenAI CLIP's and Stable Diffusion 2's OpenCLIP text encoders):
//   text cleaned as open_clip does (text/clean.h: ftfy, HTML entities, whitespace, lower case),
//   split by CLIP's pattern (its <start_of_text> / <end_of_text> included), padded with 0. The
//   vocabulary is the file open_clip ships (bpe_simple_vocab_16e6.txt.gz: a header line, then the
//   merges "a b"; gzip or plain): the 256 byte symbols, the same with '</w>', one per merge, then
//   the two special tokens (49408 ids).
// - transformers' CLIPTokenizer (diffusers' Stable Diffusion directories keep it in `tokenizer/`):
//   the special tokens <|startoftext|> / <|endoftext|> found in the raw text first, the rest NFC,
//   runs of white space made one space, lower-cased character by character (no final sigma), split
//   by the same pattern; padded with the directory's pad token (<|endoftext|> for SD 1.x, "!" for
//   SD 2.x). Read from tokenizer.json (what transformers 5 writes) or vocab.json + merges.txt (what
//   older hub repositories hold), with tokenizer_config.json.
// Both: each piece's UTF-8 bytes mapped to printable characters (GPT-2's bytes_to_unicode) and
// merged by the ranked merges, '</w>' marking a word's last symbol; then start ... end, cut to the
// context with the end token last, padded to the context.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/tokens.h"

namespace ddm::text {

class ClipTokenizer : public Tokenizer {
 public:
  enum class Flavor { open_clip, transformers };

  // Reads open_clip's vocabulary file. Throws ddm::Error naming the file (and line) if it cannot
  // be read or a merge line is malformed.
  static ClipTokenizer from_open_clip_file(const std::string& path);
  // Reads a transformers CLIPTokenizer directory (above). Throws ddm::Error naming the file and key.
  static ClipTokenizer from_transformers_dir(const std::string& dir);

  // The ids of `text` (UTF-8) without the added start and end. Throws ddm::Error "<what>: not UTF-8..."
  std::vector<int64_t> encode(std::string_view text, std::string_view what = "text") const;
  // What the model gets: start, encode(text), end, cut to `context` ids (0: the tokenizer's own,
  // 77 for CLIP) with the end token last, then padded to `context`.
  std::vector<int64_t> tokenize(std::string_view text, int context = 0, std::string_view what = "text",
                                int64_t* length = nullptr) const override;

  Flavor flavor() const { return flavor_; }
  int context() const override { return context_; }
  int64_t start_id() const { return start_id_; }
  int64_t end_id() const { return end_id_; }
  int64_t pad_id() const override { return pad_id_; }
  int64_t vocab_size() const override { return static_cast<int64_t>(symbols_.size()); }
  std::string kind() const override {
    return flavor_ == Flavor::open_clip ? "CLIP BPE (open_clip)" : "CLIP BPE (transformers)";
  }
  // The symbol (byte-unicode characters, '</w>' on a word's end) of an id, as the vocabulary names it.
  const std::string& symbol(int64_t id) const { return symbols_.at(static_cast<size_t>(id)); }

  ClipTokenizer(ClipTokenizer&&) noexcept;
  ClipTokenizer& operator=(ClipTokenizer&&) noexcept;
  ~ClipTokenizer();

 private:
  ClipTokenizer();
  static ClipTokenizer load_transformers_dir(const std::string& dir);  // from_transformers_dir, unguarded
  struct Pattern;  // the compiled split pattern (PCRE2)
  struct Cache;    // piece -> ids, shared by the threads that tokenize with this tokenizer

  // Compiles the split pattern and looks up the special ids, once the vocabulary is in.
  void finish(const std::string& source, const std::string& start, const std::string& end);
  // Splits cleaned UTF-8 text by the pattern and appends each piece's ids.
  void encode_clean(const std::string& clean, std::vector<int64_t>& ids, std::string_view what) const;
  // BPE of one piece (its byte-unicode form), appended to `ids`.
  void bpe(const std::string& piece, std::vector<int64_t>& ids) const;

  Flavor flavor_ = Flavor::open_clip;
  std::unordered_map<std::string, int64_t> vocab_;  // symbol -> id
  std::vector<std::string> symbols_;                // id -> symbol ("" where the vocabulary has none)
  std::unordered_map<std::string, int32_t> ranks_;  // "a b" -> merge rank (lower merges first)
  std::string byte_symbol_[256];                    // byte -> its printable character, UTF-8
  std::vector<std::pair<std::u32string, int64_t>> added_;  // transformers: found in the raw text first (AddedTokens)
  std::string start_, end_;                         // the special tokens' names
  int64_t start_id_ = 0, end_id_ = 0, pad_id_ = 0;
  int context_ = 77;
  std::unique_ptr<Pattern> pattern_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace ddm::text
