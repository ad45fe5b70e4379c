// Resolves a tokenizer name or path to a loaded tokenizer.
#include "text/tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/assets.h"
#include "core/error.h"
#include "core/json.h"
#include "text/clip_tokenizer.h"
#include "text/wordpiece.h"

namespace ddm::text {

namespace fs = std::filesystem;

namespace {

const char* kShippedClip = "clip/bpe_simple_vocab_16e6.txt.gz";

// Whether a transformers tokenizer directory holds WordPiece (BERT) rather than BPE (CLIP).
bool is_wordpiece(const fs::path& dir) {
  if (fs::exists(dir / "tokenizer.json")) {
    const auto j = read_json_file((dir / "tokenizer.json").string());
    return j.is_object() && j.contains("model") && j["model"].is_object() && j["model"].contains("type") &&
           j["model"]["type"] == "WordPiece";
  }
  return fs::exists(dir / "vocab.txt") && !fs::exists(dir / "vocab.json");
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "clip") return std::make_unique<ClipTokenizer>(ClipTokenizer::from_open_clip_file(asset_path(kShippedClip)));
  DDM_CHECK(fs::exists(spec), spec << ": no such tokenizer file or directory (give `clip`, a CLIP vocabulary file, a"
                                   << " transformers tokenizer directory or a Stable Diffusion directory)");
  if (!fs::is_directory(spec)) return std::make_unique<ClipTokenizer>(ClipTokenizer::from_open_clip_file(spec));
  fs::path dir(spec);
  for (const char* sub : {"tokenizer", "model"}) {  // diffusers' layout; a packaged sentence-transformers model
    if (!fs::exists(dir / "tokenizer.json") && !fs::exists(dir / "vocab.json") && !fs::exists(dir / "vocab.txt") &&
        fs::is_directory(dir / sub)) {
      dir /= sub;
      break;
    }
  }
  if (is_wordpiece(dir)) return std::make_unique<WordPieceTokenizer>(WordPieceTokenizer::from_dir(dir.string()));
  return std::make_unique<ClipTokenizer>(ClipTokenizer::from_transformers_dir(dir.string()));
}

std::string describe(const Tokenizer& t, const std::string& spec) {
  return t.kind() + ", " + std::to_string(t.vocab_size()) + " ids, context " + std::to_string(t.context()) + ", pad " +
         std::to_string(t.pad_id()) + ": " + (spec == "clip" ? asset_path(kShippedClip) : spec);
}

}  // namespace ddm::text
