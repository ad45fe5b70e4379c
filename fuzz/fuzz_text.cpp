// Fuzz target: text (captions, prompts) -> each tokenizer: CLIP's as open_clip (the vocabulary ddm
// ships: ftfy's fixes, HTML entities, lower-casing, the split, BPE), CLIP's as transformers (the
// same vocabulary: added tokens cut from the raw text) and BERT's WordPiece (a small vocabulary).
// Invalid UTF-8 must be a ddm::Error; valid text must give ids inside the vocabulary, cut and
// padded to the context with the end token kept.
#include <fstream>
#include <memory>

#include "core/assets.h"
#include "fuzz_util.h"
#include "text/clip_tokenizer.h"
#include "text/wordpiece.h"

namespace {

std::unique_ptr<ddm::text::ClipTokenizer> g_clip;
std::unique_ptr<ddm::text::WordPieceTokenizer> g_bert;

void check(const ddm::text::Tokenizer& t, const std::string& text, int context) {
  int64_t length = 0;
  const auto ids = t.tokenize(text, context, "fuzz input", &length);
  if (ids.size() != static_cast<size_t>(context) || length < 2 || length > context) std::abort();
  for (auto id : ids)
    if (id < 0 || id >= t.vocab_size()) std::abort();
  for (size_t i = static_cast<size_t>(length); i < ids.size(); ++i)
    if (ids[i] != t.pad_id()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_clip = std::make_unique<ddm::text::ClipTokenizer>(
      ddm::text::ClipTokenizer::from_open_clip_file(ddm::asset_path("clip/bpe_simple_vocab_16e6.txt.gz")));
  const std::string dir = ddm::fuzz::scratch_dir() + "/bert";
  std::filesystem::create_directories(dir);
  std::ofstream vocab(dir + "/vocab.txt");
  vocab << "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\nb\nc\nthe\nphoto\n##s\n##ing\n.\n,\n!\n\xE4\xB8\xAD\ncafe\n";
  vocab.close();
  g_bert = std::make_unique<ddm::text::WordPieceTokenizer>(ddm::text::WordPieceTokenizer::from_dir(dir));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = ddm::fuzz::as_string(data, size);
  const int context = size > 0 ? 2 + data[0] % 80 : 77;
  ddm::fuzz::expect_errors([&] {
    check(*g_clip, text, context);
    check(*g_bert, text, context);
  });
  return 0;
}
