// Fuzz target: the files a tokenizer is read from. The first byte picks the file the rest of the
// input becomes; the directory's other files are small valid ones:
//   0 open_clip's vocabulary file (gzip or plain)   1 tokenizer.json (CLIP's BPE)
//   2 vocab.json + 3 merges.txt (CLIP's older layout)   4 tokenizer_config.json
//   5 tokenizer.json (BERT's WordPiece)   6 vocab.txt (BERT)
// A bad file must be a ddm::Error; a tokenizer that loads must tokenize.
#include <filesystem>
#include <fstream>

#include "fuzz_util.h"
#include "text/clip_tokenizer.h"
#include "text/unicode.h"
#include "text/wordpiece.h"

namespace {

std::string g_dir;
std::string g_vocab_json;  // CLIP's 512 byte symbols and its two special tokens, no merges

void put(const std::string& name, const std::string& bytes) {
  ddm::fuzz::write_bytes(g_dir + "/" + name, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_dir = ddm::fuzz::scratch_dir() + "/tok";
  // bytes_to_unicode's characters, JSON-escaped.
  g_vocab_json = "{";
  int id = 0, next = 0;
  for (const char* suffix : {"", "</w>"}) {
    next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      char escaped[16];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", printable ? b : 256 + next++);
      g_vocab_json += std::string("\"") + escaped + suffix + "\": " + std::to_string(id++) + ", ";
    }
  }
  g_vocab_json += "\"<|startoftext|>\": 512, \"<|endoftext|>\": 513}";
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int which = data[0] % 7;
  const std::string bytes = ddm::fuzz::as_string(data + 1, size - 1);
  std::filesystem::remove_all(g_dir);
  std::filesystem::create_directories(g_dir);
  ddm::fuzz::expect_errors([&] {
    if (which == 0) {
      put("bpe.txt", bytes);
      ddm::text::ClipTokenizer::from_open_clip_file(g_dir + "/bpe.txt").tokenize("a photo of a cat");
    } else if (which <= 4) {
      if (which == 1) {
        put("tokenizer.json", bytes);
      } else {
        put("vocab.json", which == 2 ? bytes : g_vocab_json);
        put("merges.txt", which == 3 ? bytes : "#version: 0.2\n");
      }
      if (which == 4) put("tokenizer_config.json", bytes);
      ddm::text::ClipTokenizer::from_transformers_dir(g_dir).tokenize("a photo <|endoftext|> of a cat");
    } else {
      put(which == 5 ? "tokenizer.json" : "vocab.txt", bytes);
      ddm::text::WordPieceTokenizer::from_dir(g_dir).tokenize("[CLS] a photo of a cat");
    }
  });
  return 0;
}
