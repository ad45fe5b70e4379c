// Fuzz target: the configuration files a frozen text encoder is read from. The first byte picks the
// file the rest of the input becomes; the directory's other files (the weights among them) are small
// valid ones, so that a config that parses goes on to the weights' checks and a forward pass:
//   0 config.json of a transformers CLIPTextModel   1 its model.safetensors.index.json (two shards)
//   2 open_clip_config.json                         3 config.json of a BERT model
//   4 modules.json   5 1_Pooling/config.json   6 sentence_bert_config.json (sentence-transformers)
// A bad file must be a ddm::Error; an encoder that loads must encode.
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "fuzz_util.h"
#include "text/bert_encoder.h"
#include "text/clip_text_encoder.h"

namespace {

std::string g_root;
ddm::SafetensorsFile g_clip, g_open_clip, g_bert;

const char* kClipConfig = R"({"model_type": "clip_text_model", "hidden_size": 8, "num_attention_heads": 2,
    "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12,
    "hidden_act": "quick_gelu", "eos_token_id": 11})";
const char* kBertConfig = R"({"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2,
    "num_hidden_layers": 1, "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12})";

void put(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  ddm::fuzz::write_bytes(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// The tensors of a one-layer pre-LN transformer block under `p`, with `names` of its norms and linears.
void block(ddm::SafetensorsFile& f, const std::string& p, int64_t w, int64_t inner, const std::vector<std::string>& norms,
           const std::vector<std::string>& square, const std::string& up, const std::string& down) {
  for (const auto& n : norms) {
    f.tensors[p + n + ".weight"] = torch::randn({w});
    f.tensors[p + n + ".bias"] = torch::randn({w});
  }
  for (const auto& n : square) {
    f.tensors[p + n + ".weight"] = torch::randn({w, w});
    f.tensors[p + n + ".bias"] = torch::randn({w});
  }
  f.tensors[p + up + ".weight"] = torch::randn({inner, w});
  f.tensors[p + up + ".bias"] = torch::randn({inner});
  f.tensors[p + down + ".weight"] = torch::randn({w, inner});
  f.tensors[p + down + ".bias"] = torch::randn({w});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_root = ddm::fuzz::scratch_dir() + "/enc";
  torch::manual_seed(0);
  // transformers' CLIPTextModel, as kClipConfig describes it.
  auto& c = g_clip.tensors;
  c["text_model.embeddings.token_embedding.weight"] = torch::randn({12, 8});
  c["text_model.embeddings.position_embedding.weight"] = torch::randn({5, 8});
  block(g_clip, "text_model.encoder.layers.0.", 8, 16, {"layer_norm1", "layer_norm2"},
        {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"}, "mlp.fc1", "mlp.fc2");
  c["text_model.final_layer_norm.weight"] = torch::randn({8});
  c["text_model.final_layer_norm.bias"] = torch::randn({8});
  // open_clip's text tower: width 8, 2 heads, 1 layer, context 5, vocabulary 12, embed_dim 4, mlp_ratio 4
  // (inner 32), as fuzz/make_seeds.py's open_clip_config.json seed describes it.
  auto& o = g_open_clip.tensors;
  o["token_embedding.weight"] = torch::randn({12, 8});
  o["positional_embedding"] = torch::randn({5, 8});
  block(g_open_clip, "transformer.resblocks.0.", 8, 32, {"ln_1", "ln_2"}, {"attn.out_proj"}, "mlp.c_fc", "mlp.c_proj");
  o["transformer.resblocks.0.attn.in_proj_weight"] = torch::randn({24, 8});
  o["transformer.resblocks.0.attn.in_proj_bias"] = torch::randn({24});
  o["ln_final.weight"] = torch::randn({8});
  o["ln_final.bias"] = torch::randn({8});
  o["text_projection"] = torch::randn({8, 4});
  // A BERT, as kBertConfig describes it.
  auto& b = g_bert.tensors;
  b["embeddings.word_embeddings.weight"] = torch::randn({12, 8});
  b["embeddings.position_embeddings.weight"] = torch::randn({5, 8});
  b["embeddings.token_type_embeddings.weight"] = torch::randn({2, 8});
  b["embeddings.LayerNorm.weight"] = torch::randn({8});
  b["embeddings.LayerNorm.bias"] = torch::randn({8});
  block(g_bert, "encoder.layer.0.", 8, 16, {"attention.output.LayerNorm", "output.LayerNorm"},
        {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"},
        "intermediate.dense", "output.dense");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int which = data[0] % 7;
  const std::string bytes = ddm::fuzz::as_string(data + 1, size - 1);
  std::filesystem::remove_all(g_root);
  std::filesystem::create_directories(g_root);
  const auto ids = torch::tensor({{3, 4, 11}}, torch::kInt64);  // [1, 3]
  ddm::fuzz::expect_errors([&] {
    if (which <= 1) {
      put(g_root + "/config.json", which == 0 ? bytes : kClipConfig);
      if (which == 0) {
        ddm::save_safetensors(g_root + "/model.safetensors", g_clip);
      } else {  // two shards and the fuzzed index naming each tensor's
        ddm::SafetensorsFile a, b;
        int i = 0;
        for (const auto& [name, t] : g_clip.tensors) (i++ % 2 ? a : b).tensors[name] = t;
        ddm::save_safetensors(g_root + "/model-00001-of-00002.safetensors", a);
        ddm::save_safetensors(g_root + "/model-00002-of-00002.safetensors", b);
        put(g_root + "/model.safetensors.index.json", bytes);
      }
      ddm::text::ClipTextEncoder::load(g_root).encode(ids, 0);
    } else if (which == 2) {
      put(g_root + "/open_clip_config.json", bytes);
      ddm::save_safetensors(g_root + "/open_clip_model.safetensors", g_open_clip);
      ddm::text::ClipTextEncoder::load(g_root).encode(ids, 0);
    } else {
      put(g_root + "/config.json", which == 3 ? bytes : kBertConfig);
      ddm::save_safetensors(g_root + "/model.safetensors", g_bert);
      if (which == 4) put(g_root + "/modules.json", bytes);
      if (which == 5) put(g_root + "/1_Pooling/config.json", bytes);
      if (which == 6) put(g_root + "/sentence_bert_config.json", bytes);
      const auto enc = ddm::text::BertEncoder::load(g_root);
      enc.sentence_embedding(ids, torch::ones_like(ids));
    }
  });
  return 0;
}
