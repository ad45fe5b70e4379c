// A frozen CLIP text encoder (token + position embeddings, pre-norm causal transformer layers, a
// final layer norm, the end token's state projected), read from the directory either library
// writes, never converted:
//   transformers  config.json + model.safetensors (or its sharded index): CLIPTextModel,
//                 CLIPTextModelWithProjection (Stable Diffusion's text_encoder/), or a whole
//                 CLIPModel, whose text_config and text tensors are used
//   open_clip     open_clip_config.json + open_clip_model.safetensors, as open_clip's save_for_hf
//                 writes and create_model("local-dir:DIR") reads (ViT-H/14's is SD 2.x's encoder);
//                 only the text tower's tensors are read from the file
// Inference only: the weights are plain tensors, no gradients.
#pragma once
#include <string>
#include <vector>

#include <torch/torch.h>

namespace ddm::text {

struct ClipTextEncoder {
  // Reads DIR in whichever layout it holds. Throws ddm::Error naming the file and the key: a missing
  // tensor, a shape that contradicts the config, a config option ddm does not run.
  static ClipTextEncoder load(const std::string& dir);

  struct Output {
    torch::Tensor states;  // [B, T, width]
    torch::Tensor pooled;  // [B, projection or width]
  };
  // ids: [B, T] int64, T at most `positions`. states: the output of layer (layers - skip) through the
  // final layer norm: skip 0 is the last layer (SD 1.x's), 1 the penultimate (SD 2.x's, diffusers'
  // clip_skip 1). pooled: the end token's state after the last layer and the final layer norm,
  // projected where the model has a projection (open_clip's encode_text, transformers' text_embeds or,
  // without a projection, pooler_output).
  Output encode(const torch::Tensor& ids, int64_t skip = 0) const;

  // A copy on `device` in `dtype` (the ids stay int64).
  ClipTextEncoder to(torch::Device device, torch::ScalarType dtype = torch::kFloat32) const;

  struct Layer {
    torch::Tensor ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
  };
  std::string format;  // "transformers" or "open_clip"
  std::vector<std::string> files;  // the weights' files (a run pins them by sha256)
  int64_t width = 0, heads = 0, positions = 0, vocab = 0;
  bool quick_gelu = false;  // x * sigmoid(1.702 x), as OpenAI's CLIP; otherwise exact GELU
  double eps = 1e-5;
  // Which position pools: the largest id (the end token, 49407, is CLIP's largest), or the first
  // position holding end_id (transformers' rule when its config's eos_token_id is not the legacy 2).
  bool pool_argmax = true;
  int64_t end_id = 49407;
  torch::Tensor token_embedding, position_embedding, final_ln_w, final_ln_b;
  torch::Tensor projection_w, projection_b;  // [projection, width] and [projection]; undefined when absent
  std::vector<Layer> layers;
};

}  // namespace ddm::text
