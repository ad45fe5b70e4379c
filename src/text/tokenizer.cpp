// Resolves a tokenizer name or path to a loaded tokenizer.
#include "text/tokenizer.h"

#include <filesystem>

#include "core/assets.h"
#include "core/error.h"

namespace ddm::text {

namespace fs = std::filesystem;

std::unique_ptr<ClipTokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "clip") {
    return std::make_unique<ClipTokenizer>(ClipTokenizer::from_open_clip_file(asset_path("clip/bpe_simple_vocab_16e6.txt.gz")));
  }
  DDM_CHECK(fs::exists(spec), spec << ": no such tokenizer file or directory (give `clip`, a CLIP vocabulary file, a"
                                   << " transformers tokenizer directory or a Stable Diffusion directory)");
  if (!fs::is_directory(spec)) return std::make_unique<ClipTokenizer>(ClipTokenizer::from_open_clip_file(spec));
  const fs::path dir(spec);
  if (fs::exists(dir / "model_index.json") && fs::is_directory(dir / "tokenizer")) {  // diffusers' pipeline directory
    return std::make_unique<ClipTokenizer>(ClipTokenizer::from_transformers_dir((dir / "tokenizer").string()));
  }
  return std::make_unique<ClipTokenizer>(ClipTokenizer::from_transformers_dir(spec));
}

std::string describe(const ClipTokenizer& t, const std::string& spec) {
  const bool open_clip = t.flavor() == ClipTokenizer::Flavor::open_clip;
  return std::string("CLIP BPE (") + (open_clip ? "open_clip" : "transformers") + "), " +
         std::to_string(t.vocab_size()) + " ids, context " + std::to_string(t.context()) + ", pad " +
         std::to_string(t.pad_id()) + ": " + (spec == "clip" ? asset_path("clip/bpe_simple_vocab_16e6.txt.gz") : spec);
}

}  // namespace ddm::text
