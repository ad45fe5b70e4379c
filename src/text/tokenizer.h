// Which tokenizer a model's text goes through, named the way users name it: `clip` (CLIP's BPE
// as open_clip tokenizes, with the vocabulary ddm ships in assets/clip/), a CLIP vocabulary file
// (open_clip's bpe_simple_vocab_16e6.txt.gz), or a transformers tokenizer directory: a CLIPTokenizer
// (tokenizer.json, or vocab.json + merges.txt), or a Stable Diffusion directory whose tokenizer/
// holds one (diffusers' layout).
#pragma once
#include <memory>
#include <string>

#include "text/clip_tokenizer.h"

namespace ddm::text {

// The tokenizer `spec` names (above). Throws ddm::Error naming the path and what it expected.
std::unique_ptr<ClipTokenizer> load_tokenizer(const std::string& spec);

// One line saying what was loaded: "CLIP BPE (open_clip), 49408 ids, context 77, pad 0: PATH".
std::string describe(const ClipTokenizer& t, const std::string& spec);

}  // namespace ddm::text
