// Which tokenizer a model's text goes through, named the way users name it:
//   clip                CLIP's BPE as open_clip tokenizes, with the vocabulary ddm ships (assets/clip/)
//   FILE                a CLIP vocabulary file (open_clip's bpe_simple_vocab_16e6.txt.gz)
//   DIR                 a transformers tokenizer directory: CLIPTokenizer (tokenizer.json with a BPE
//                       model, or vocab.json + merges.txt) or BertTokenizer (tokenizer.json with a
//                       WordPiece model, or vocab.txt), or a directory holding one in tokenizer/
//                       (diffusers' Stable Diffusion layout) or model/ (a packaged sentence-transformers model)
#pragma once
#include <memory>
#include <string>

#include "text/tokens.h"

namespace ddm::text {

// The tokenizer `spec` names (above). Throws ddm::Error naming the path and what it expected.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

// One line saying what was loaded: "CLIP BPE (open_clip), 49408 ids, context 77, pad 0: PATH".
std::string describe(const Tokenizer& t, const std::string& spec);

}  // namespace ddm::text
