// BERT's WordPiece tokenizer, as transformers' BertTokenizer (the tokenizers library's BertNormalizer,
// BertPreTokenizer and WordPiece model): the special tokens ([CLS], [SEP], [PAD], [UNK], [MASK])
// found in the raw text first; the rest cleaned (control characters, U+0000 and U+FFFD dropped,
// white space made ' '), CJK ideographs set apart, accents stripped (NFD, nonspacing marks dropped)
// and lower-cased for uncased models; split on white space and around each punctuation character;
// each word greedily cut into the longest vocabulary pieces from its start ("##" marking the
// continuations), [UNK] for a word with no cut or of over 100 characters. Then [CLS] ... [SEP], the
// text cut to fit max_length, padded with [PAD].
//
// Read from a transformers directory: tokenizer.json (a WordPiece model with a BertNormalizer, as
// sentence-transformers' all-MiniLM-L6-v2 ships) or vocab.txt with tokenizer_config.json.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/tokens.h"

namespace ddm::text {

class WordPieceTokenizer : public Tokenizer {
 public:
  // Throws ddm::Error naming the file and key.
  static WordPieceTokenizer from_dir(const std::string& dir);

  // The ids of `text` (UTF-8) without [CLS] and [SEP].
  std::vector<int64_t> encode(std::string_view text, std::string_view what = "text") const;
  // [CLS], encode(text) cut to max_length - 2, [SEP], padded with [PAD] to max_length (0: the
  // directory's model_max_length). `length` (if given) receives the count before padding: the
  // attention mask's ones.
  std::vector<int64_t> tokenize(std::string_view text, int max_length = 0, std::string_view what = "text",
                                int64_t* length = nullptr) const override;

  int max_length() const { return max_length_; }
  int context() const override { return max_length_; }
  int64_t cls_id() const { return cls_id_; }
  int64_t sep_id() const { return sep_id_; }
  int64_t pad_id() const override { return pad_id_; }
  int64_t vocab_size() const override { return static_cast<int64_t>(vocab_.size()); }
  std::string kind() const override { return lowercase_ ? "BERT WordPiece (uncased)" : "BERT WordPiece (cased)"; }
  bool lowercase() const { return lowercase_; }

 private:
  static WordPieceTokenizer load_dir(const std::string& dir);  // from_dir, unguarded
  // The normalized text's words, each cut into pieces, appended to `ids`.
  void encode_normalized(std::u32string_view text, std::vector<int64_t>& ids) const;
  void word_pieces(const std::u32string& word, std::vector<int64_t>& ids) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::pair<std::u32string, int64_t>> added_;  // special tokens, found in the raw text
  std::string prefix_ = "##";
  int max_chars_ = 100;
  bool clean_text_ = true, chinese_chars_ = true, strip_accents_ = true, lowercase_ = true;
  int64_t cls_id_ = 0, sep_id_ = 0, pad_id_ = 0, unk_id_ = 0;
  int max_length_ = 512;
};

}  // namespace ddm::text
