// BertModel's forward in LibTorch's functional ops over the safetensors weights.
#include "text/bert_encoder.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "core/weights_dir.h"

namespace ddm::text {

BertEncoder BertEncoder::load(const std::string& dir) {
  const std::string config_path = dir + "/config.json";
  const nlohmann::json config = read_json_file(config_path);
  BertEncoder e;
  int64_t inter = 0;
  try {
    DDM_CHECK(config.value("model_type", "bert") == "bert" && config.value("hidden_act", "gelu") == "gelu" &&
                  config.value("position_embedding_type", "absolute") == "absolute",
              config_path << ": ddm runs BERT models with gelu and absolute positions (model_type, hidden_act, "
                          << "position_embedding_type)");
    e.hidden = json_int(config.at("hidden_size"), config_path + ": hidden_size", 1, 1 << 16);
    e.heads = json_int(config.at("num_attention_heads"), config_path + ": num_attention_heads", 1, 1024);
    e.layers = json_int(config.at("num_hidden_layers"), config_path + ": num_hidden_layers", 1, 1024);
    e.eps = config.value("layer_norm_eps", 1e-12);
    inter = config.contains("intermediate_size")
                ? json_int(config["intermediate_size"], config_path + ": intermediate_size", 1, 1 << 20)
                : 4 * e.hidden;
  } catch (const nlohmann::json::exception& err) {
    throw Error(config_path + ": " + err.what());
  }
  DDM_CHECK(e.hidden % e.heads == 0, config_path << ": hidden_size " << e.hidden << " is not a multiple of "
                                                 << "num_attention_heads " << e.heads);
  // sentence-transformers' modules: mean pooling (the only one ddm runs), then Normalize or not.
  if (std::filesystem::exists(dir + "/modules.json")) {
    const std::string modules_path = dir + "/modules.json";
    const nlohmann::json modules = read_json_file(modules_path);
    DDM_CHECK(modules.is_array(), modules_path << ": not a JSON array of modules");
    for (const auto& m : modules) {
      const bool typed = m.is_object() && m.contains("type") && m["type"].is_string();
      if (typed && m["type"].get<std::string>() == "sentence_transformers.models.Normalize") e.normalize = true;
    }
  }
  if (std::filesystem::exists(dir + "/1_Pooling/config.json")) {
    const std::string pooling_path = dir + "/1_Pooling/config.json";
    const nlohmann::json pooling = read_json_file(pooling_path);
    auto mode = [&](const char* key) {  // true only for a JSON true
      return pooling.is_object() && pooling.contains(key) && pooling[key].is_boolean() && pooling[key].get<bool>();
    };
    auto unset = [&](const char* key) {  // absent, null or false
      return !pooling.is_object() || !pooling.contains(key) || pooling[key].is_null() || pooling[key] == false;
    };
    DDM_CHECK(pooling.is_object() && mode("pooling_mode_mean_tokens") && unset("pooling_mode_cls_token") &&
                  unset("pooling_mode_max_tokens") && unset("pooling_mode_mean_sqrt_len_tokens"),
              pooling_path << ": ddm pools BERT sentence embeddings by the mean of the tokens only "
                           << "(pooling_mode_mean_tokens true, the other modes false)");
  }
  if (std::filesystem::exists(dir + "/sentence_bert_config.json")) {
    const std::string st_path = dir + "/sentence_bert_config.json";
    const nlohmann::json st = read_json_file(st_path);
    if (st.is_object() && st.contains("max_seq_length"))
      e.max_seq_length = json_int(st["max_seq_length"], st_path + ": max_seq_length", 1, 1 << 20);
  }
  const std::string weights = dir + "/model.safetensors";
  e.files = weights_dir_files(dir, "model");
  for (auto& [name, t] : load_weights_dir(dir, "model").tensors) {
    const std::string key = name.rfind("bert.", 0) == 0 ? name.substr(5) : name;
    e.w[key] = t.to(torch::kFloat32);
  }
  auto need = [&](const std::string& key, std::vector<int64_t> shape) {
    auto it = e.w.find(key);
    DDM_CHECK(it != e.w.end(), weights << ": no tensor \"" << key << "\" (a BERT model's, as transformers names it)");
    if (shape[0] < 0) shape[0] = it->second.size(0);  // the vocabulary / positions: any count
    DDM_CHECK(it->second.sizes() == torch::IntArrayRef(shape),
              weights << ": \"" << key << "\" has shape " << it->second.sizes() << ", config.json says " << torch::IntArrayRef(shape));
  };
  const int64_t h = e.hidden;
  need("embeddings.word_embeddings.weight", {-1, h});
  need("embeddings.position_embeddings.weight", {-1, h});
  need("embeddings.token_type_embeddings.weight", {-1, h});
  need("embeddings.LayerNorm.weight", {h});
  need("embeddings.LayerNorm.bias", {h});
  for (int64_t l = 0; l < e.layers; ++l) {
    const std::string p = "encoder.layer." + std::to_string(l) + ".";
    for (const char* m : {"attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"}) {
      need(p + m + ".weight", {h, h});
      need(p + m + ".bias", {h});
    }
    need(p + "intermediate.dense.weight", {inter, h});
    need(p + "intermediate.dense.bias", {inter});
    need(p + "output.dense.weight", {h, inter});
    need(p + "output.dense.bias", {h});
    for (const char* n : {"attention.output.LayerNorm", "output.LayerNorm"}) {
      need(p + n + ".weight", {h});
      need(p + n + ".bias", {h});
    }
  }
  return e;
}

torch::Tensor BertEncoder::forward(const torch::Tensor& ids, const torch::Tensor& mask) const {
  torch::NoGradGuard no_grad;
  namespace F = torch::nn::functional;
  const int64_t B = ids.size(0), T = ids.size(1), d = hidden / heads;
  DDM_CHECK(T <= w.at("embeddings.position_embeddings.weight").size(0),
            "a text of " << T << " tokens is longer than the encoder's " << w.at("embeddings.position_embeddings.weight").size(0)
                         << " positions");
  auto ln = [&](const torch::Tensor& x, const std::string& p) {
    return torch::layer_norm(x, {hidden}, w.at(p + ".weight"), w.at(p + ".bias"), eps);
  };
  auto linear = [&](const torch::Tensor& x, const std::string& p) {
    return torch::linear(x, w.at(p + ".weight"), w.at(p + ".bias"));
  };
  // Embeddings: word + position + token type 0, then LayerNorm.   x: [B, T, hidden]
  torch::Tensor x = torch::embedding(w.at("embeddings.word_embeddings.weight"), ids) +
                    w.at("embeddings.position_embeddings.weight").slice(0, 0, T).unsqueeze(0) +
                    w.at("embeddings.token_type_embeddings.weight")[0];
  x = ln(x, "embeddings.LayerNorm");
  // Padding is masked out of every attention: [B, 1, 1, T], 0 or the dtype's lowest.
  const torch::Tensor bias = (1 - mask.to(torch::kFloat32)).view({B, 1, 1, T}) * std::numeric_limits<float>::lowest();
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "encoder.layer." + std::to_string(l) + ".";
    auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, d}).transpose(1, 2); };  // [B, heads, T, d]
    const torch::Tensor q = split(linear(x, p + "attention.self.query"));
    const torch::Tensor k = split(linear(x, p + "attention.self.key"));
    const torch::Tensor v = split(linear(x, p + "attention.self.value"));
    const torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(d)) + bias;
    const torch::Tensor attended = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, hidden});
    x = ln(linear(attended, p + "attention.output.dense") + x, p + "attention.output.LayerNorm");
    const torch::Tensor inner = torch::gelu(linear(x, p + "intermediate.dense"));  // exact (erf) GELU, as "gelu"
    x = ln(linear(inner, p + "output.dense") + x, p + "output.LayerNorm");
  }
  return x;
}

torch::Tensor BertEncoder::sentence_embedding(const torch::Tensor& ids, const torch::Tensor& mask) const {
  const torch::Tensor states = forward(ids, mask);                       // [B, T, hidden]
  const torch::Tensor m = mask.to(torch::kFloat32).unsqueeze(-1);       // [B, T, 1]
  const torch::Tensor mean = (states * m).sum(1) / m.sum(1).clamp_min(1e-9);  // [B, hidden]
  if (!normalize) return mean;
  return torch::nn::functional::normalize(mean, torch::nn::functional::NormalizeFuncOptions().p(2).dim(1));
}

}  // namespace ddm::text
