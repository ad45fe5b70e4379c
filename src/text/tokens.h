// What every tokenizer gives a text model: a text's ids, cut and padded to a context, and what
// describes it. Implemented by ClipTokenizer (text/clip_tokenizer.h) and WordPieceTokenizer
// (text/wordpiece.h); text/tokenizer.h loads one by name.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ddm::text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids the model gets for `text` (UTF-8): the start token, the text's ids, the end token, cut
  // to `context` ids (0: the tokenizer's own) with the end token kept, padded to `context`.
  // `length` (if given) receives the count before padding (an attention mask's ones). Throws
  // ddm::Error "<what>: not UTF-8 at byte N ..." for text that is not UTF-8.
  virtual std::vector<int64_t> tokenize(std::string_view text, int context = 0, std::string_view what = "text",
                                        int64_t* length = nullptr) const = 0;
  virtual int context() const = 0;
  virtual int64_t pad_id() const = 0;
  virtual int64_t vocab_size() const = 0;
  // "CLIP BPE (open_clip)", "CLIP BPE (transformers)", "BERT WordPiece (uncased)", ...
  virtual std::string kind() const = 0;
};

}  // namespace ddm::text
