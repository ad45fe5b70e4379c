// CLIP's text transformer in LibTorch's functional ops over the weights of a transformers or an
// open_clip directory: the two layouts are read into one set of tensors (transformers' separate q, k,
// v projections joined as open_clip keeps them), so there is one forward.
#include "text/clip_text_encoder.h"

#include <filesystem>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "core/weights_dir.h"

namespace ddm::text {
namespace {

using json = nlohmann::json;

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// Tensors of one file looked up by name, each checked against the shape its config implies.
struct Weights {
  std::string file;
  std::map<std::string, torch::Tensor> t;
  torch::Tensor need(const std::string& key, std::vector<int64_t> shape, const char* kind) {
    auto it = t.find(key);
    DDM_CHECK(it != t.end(), file << ": no tensor \"" << key << "\" (" << kind << ")");
    for (size_t i = 0; i < shape.size(); ++i)
      if (shape[i] < 0) shape[i] = i < static_cast<size_t>(it->second.dim()) ? it->second.size(static_cast<int64_t>(i)) : -1;
    DDM_CHECK(it->second.sizes() == torch::IntArrayRef(shape),
              file << ": \"" << key << "\" has shape " << it->second.sizes() << ", its config says "
                   << torch::IntArrayRef(shape));
    return it->second.to(torch::kFloat32);
  }
};

int64_t config_int(const json& c, const char* key, const std::string& path, int64_t lo, int64_t hi) {
  DDM_CHECK(c.contains(key), path << ": no \"" << key << "\"");
  return json_int(c[key], path + ": " + key, lo, hi);
}

void check_size(const ClipTextEncoder& e, const std::string& path) {
  DDM_CHECK(e.width % e.heads == 0, path << ": the width " << e.width << " is not a multiple of the "
                                         << e.heads << " attention heads");
}

// The two layouts name a layer's tensors differently (their q, k, v also differ: the callers read
// those); everything else about a layer is read here, each tensor checked against its shape.
struct LayerNames {
  const char *ln1, *ln2, *out, *fc1, *fc2;  // each a module: ".weight" and ".bias" follow
};

ClipTextEncoder::Layer read_layer(Weights& w, const std::string& q, const LayerNames& n, int64_t W, int64_t inner,
                                  const char* kind) {
  auto pair = [&](const char* m, std::vector<int64_t> shape) {
    std::vector<int64_t> bias{shape.front()};
    return std::make_pair(w.need(q + m + ".weight", shape, kind), w.need(q + m + ".bias", bias, kind));
  };
  ClipTextEncoder::Layer L;
  std::tie(L.ln1_w, L.ln1_b) = pair(n.ln1, {W});
  std::tie(L.out_w, L.out_b) = pair(n.out, {W, W});
  std::tie(L.ln2_w, L.ln2_b) = pair(n.ln2, {W});
  std::tie(L.fc1_w, L.fc1_b) = pair(n.fc1, {inner, W});
  std::tie(L.fc2_w, L.fc2_b) = pair(n.fc2, {W, inner});
  return L;
}

ClipTextEncoder load_transformers(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const json config = read_json_file(path);
  DDM_CHECK(config.is_object(), path << ": not a JSON object");
  ClipTextEncoder e;
  e.format = "transformers";
  int64_t inner = 0, n_layers = 0, proj = 0;  // proj: CLIPTextModelWithProjection's (0: none given)
  try {  // every value read in here: one of the wrong type is named with the file
    const std::string type = config.value("model_type", "");
    DDM_CHECK(type == "clip_text_model" || type == "clip",
              path << ": model_type \"" << type << "\" is not a CLIP text model (ddm reads clip_text_model, as "
                   << "CLIPTextModel and CLIPTextModelWithProjection save it, or clip, a whole CLIPModel)");
    DDM_CHECK(type != "clip" || (config.contains("text_config") && config["text_config"].is_object()),
              path << ": model_type \"clip\" without a \"text_config\" object");
    const json& c = type == "clip" ? config["text_config"] : config;
    e.width = config_int(c, "hidden_size", path, 1, 1 << 16);
    e.heads = config_int(c, "num_attention_heads", path, 1, 1024);
    n_layers = config_int(c, "num_hidden_layers", path, 1, 1024);
    inner = config_int(c, "intermediate_size", path, 1, 1 << 20);
    e.positions = config_int(c, "max_position_embeddings", path, 1, 1 << 20);
    e.vocab = config_int(c, "vocab_size", path, 1, 1 << 24);
    const std::string act = c.value("hidden_act", "quick_gelu");
    DDM_CHECK(act == "quick_gelu" || act == "gelu",
              path << ": hidden_act \"" << act << "\": ddm runs CLIP text models with quick_gelu or gelu");
    e.quick_gelu = act == "quick_gelu";
    e.eps = c.value("layer_norm_eps", 1e-5);
    // transformers' rule: a config from before its eos fix says 2 and pools the largest id.
    const int64_t eos = c.contains("eos_token_id") ? json_int(c["eos_token_id"], path + ": eos_token_id", 0, 1 << 24) : 49407;
    e.pool_argmax = eos == 2;
    e.end_id = e.pool_argmax ? 49407 : eos;
    const json& with_proj = c.contains("projection_dim") ? c : config;
    if (with_proj.contains("projection_dim")) proj = config_int(with_proj, "projection_dim", path, 1, 1 << 16);
  } catch (const json::exception& err) {
    throw Error(path + ": " + err.what());
  }
  check_size(e, path);
  Weights w;
  w.file = dir + "/model.safetensors";
  e.files = weights_dir_files(dir, "model");
  w.t = load_weights_dir(dir, "model", [](const std::string& k) {
          return starts_with(k, "text_model.") || starts_with(k, "text_projection.") || starts_with(k, "embeddings.") ||
                 starts_with(k, "encoder.") || starts_with(k, "final_layer_norm.");
        }).tensors;
  // save_pretrained writes "text_model."; a state dict saved from the inner module has no prefix.
  const std::string p = w.t.count("text_model.embeddings.token_embedding.weight") ? "text_model." : "";
  const char* kind = "a CLIP text model's, as transformers names it";
  const int64_t W = e.width;
  e.token_embedding = w.need(p + "embeddings.token_embedding.weight", {e.vocab, W}, kind);
  e.position_embedding = w.need(p + "embeddings.position_embedding.weight", {e.positions, W}, kind);
  for (int64_t l = 0; l < n_layers; ++l) {
    const std::string q = p + "encoder.layers." + std::to_string(l) + ".";
    ClipTextEncoder::Layer L = read_layer(w, q, {"layer_norm1", "layer_norm2", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"},
                                          W, inner, kind);
    L.qkv_w = torch::cat({w.need(q + "self_attn.q_proj.weight", {W, W}, kind), w.need(q + "self_attn.k_proj.weight", {W, W}, kind),
                          w.need(q + "self_attn.v_proj.weight", {W, W}, kind)});
    L.qkv_b = torch::cat({w.need(q + "self_attn.q_proj.bias", {W}, kind), w.need(q + "self_attn.k_proj.bias", {W}, kind),
                          w.need(q + "self_attn.v_proj.bias", {W}, kind)});
    e.layers.push_back(L);
  }
  DDM_CHECK(!w.t.count(p + "encoder.layers." + std::to_string(n_layers) + ".layer_norm1.weight"),
            w.file << ": it holds more layers than the " << n_layers << " of config.json's num_hidden_layers");
  e.final_ln_w = w.need(p + "final_layer_norm.weight", {W}, kind);
  e.final_ln_b = w.need(p + "final_layer_norm.bias", {W}, kind);
  if (w.t.count("text_projection.weight")) {
    DDM_CHECK(proj > 0, path << ": no \"projection_dim\", but " << w.file << " holds text_projection.weight");
    e.projection_w = w.need("text_projection.weight", {proj, W}, kind);
  }
  return e;
}

ClipTextEncoder load_open_clip(const std::string& dir) {
  const std::string path = dir + "/open_clip_config.json";
  const json config = read_json_file(path);
  DDM_CHECK(config.is_object() && config.contains("model_cfg") && config["model_cfg"].is_object(),
            path << ": no \"model_cfg\" object (open_clip's save_for_hf writes one)");
  const json& m = config["model_cfg"];
  DDM_CHECK(m.contains("text_cfg") && m["text_cfg"].is_object(), path << ": model_cfg has no \"text_cfg\" object");
  const json& c = m["text_cfg"];
  auto text = [&](const json& o, const char* key, const std::string& otherwise) {
    if (!o.contains(key) || o[key].is_null()) return otherwise;
    DDM_CHECK(o[key].is_string(), path << ": " << key << " must be a string, got " << o[key].dump());
    return o[key].get<std::string>();
  };
  auto flag = [&](const json& o, const char* key) {
    if (!o.contains(key) || o[key].is_null()) return false;
    DDM_CHECK(o[key].is_boolean(), path << ": " << key << " must be true or false, got " << o[key].dump());
    return o[key].get<bool>();
  };
  // Text towers open_clip builds otherwise than CLIP's (a Hugging Face model inside, layer scale,
  // other attention or pooling): ddm refuses them by name rather than run them wrong.
  for (const char* option : {"hf_model_name", "ls_init_value", "embed_cls", "no_causal_mask", "final_ln_after_pool",
                             "qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc",
                             "act_kwargs", "norm_kwargs", "output_tokens"}) {
    const bool set = c.contains(option) && !c[option].is_null() && c[option] != false && c[option] != json::object();
    DDM_CHECK(!set, path << ": text_cfg." << option << " = " << c[option].dump()
                         << ": ddm runs open_clip's standard CLIP text tower, without this option");
  }
  const std::string block = text(c, "block_type", "default");
  DDM_CHECK(block == "default", path << ": text_cfg.block_type \"" << block << "\": ddm runs the default block");
  const std::string pool = text(c, "pool_type", "argmax");
  DDM_CHECK(pool == "argmax" || pool == "eos", path << ": text_cfg.pool_type \"" << pool
                                                    << "\": ddm pools CLIP text as argmax or eos");
  const std::string proj_type = text(c, "proj_type", "linear");
  DDM_CHECK(proj_type == "linear" || proj_type == "none",
            path << ": text_cfg.proj_type \"" << proj_type << "\": ddm runs linear or no projection");
  ClipTextEncoder e;
  e.format = "open_clip";
  int64_t n_layers = 0, inner = 0, embed = 0;
  try {
    e.width = c.contains("width") ? json_int(c["width"], path + ": text_cfg.width", 1, 1 << 16) : 512;
    e.heads = c.contains("heads") ? json_int(c["heads"], path + ": text_cfg.heads", 1, 1024) : 8;
    n_layers = c.contains("layers") ? json_int(c["layers"], path + ": text_cfg.layers", 1, 1024) : 12;
    e.positions = c.contains("context_length") ? json_int(c["context_length"], path + ": text_cfg.context_length", 1, 1 << 20) : 77;
    e.vocab = c.contains("vocab_size") ? json_int(c["vocab_size"], path + ": text_cfg.vocab_size", 1, 1 << 24) : 49408;
    const double ratio = c.value("mlp_ratio", 4.0);
    DDM_CHECK(ratio > 0 && ratio < 64, path << ": text_cfg.mlp_ratio " << ratio << " is not in (0, 64)");
    inner = static_cast<int64_t>(static_cast<double>(e.width) * ratio);  // int(width * mlp_ratio), as open_clip
    embed = config_int(m, "embed_dim", path, 1, 1 << 16);
    e.quick_gelu = flag(m, "quick_gelu");
    e.pool_argmax = pool == "argmax";
    e.end_id = e.pool_argmax ? 49407 : (c.contains("eos_id") ? json_int(c["eos_id"], path + ": text_cfg.eos_id", 0, 1 << 24) : 2);
  } catch (const json::exception& err) {
    throw Error(path + ": " + err.what());
  }
  check_size(e, path);
  // CLIP keeps the text tower at the top level; CustomTextCLIP (custom_text) under "text.".
  const std::string p = flag(m, "custom_text") ? "text." : "";
  std::string stem = "open_clip_model";
  for (const char* s : {"open_clip_model", "open_clip_pytorch_model", "model"})
    if (std::filesystem::exists(dir + "/" + s + ".safetensors") || std::filesystem::exists(dir + "/" + s + ".safetensors.index.json")) {
      stem = s;
      break;
    }
  Weights w;
  w.file = dir + "/" + stem + ".safetensors";
  e.files = weights_dir_files(dir, stem);
  w.t = load_weights_dir(dir, stem, [&](const std::string& k) {
          return !starts_with(k, "visual.") && (p.empty() || starts_with(k, p));
        }).tensors;
  const char* kind = "an open_clip CLIP text tower's";
  const int64_t W = e.width;
  e.token_embedding = w.need(p + "token_embedding.weight", {e.vocab, W}, kind);
  e.position_embedding = w.need(p + "positional_embedding", {e.positions, W}, kind);
  for (int64_t l = 0; l < n_layers; ++l) {
    const std::string q = p + "transformer.resblocks." + std::to_string(l) + ".";
    ClipTextEncoder::Layer L = read_layer(w, q, {"ln_1", "ln_2", "attn.out_proj", "mlp.c_fc", "mlp.c_proj"}, W, inner, kind);
    L.qkv_w = w.need(q + "attn.in_proj_weight", {3 * W, W}, kind);
    L.qkv_b = w.need(q + "attn.in_proj_bias", {3 * W}, kind);
    e.layers.push_back(L);
  }
  DDM_CHECK(!w.t.count(p + "transformer.resblocks." + std::to_string(n_layers) + ".ln_1.weight"),
            w.file << ": it holds more layers than the " << n_layers << " of text_cfg.layers");
  e.final_ln_w = w.need(p + "ln_final.weight", {W}, kind);
  e.final_ln_b = w.need(p + "ln_final.bias", {W}, kind);
  if (proj_type == "linear") {
    if (flag(c, "proj_bias")) {  // an nn.Linear
      e.projection_w = w.need(p + "text_projection.weight", {embed, W}, kind);
      e.projection_b = w.need(p + "text_projection.bias", {embed}, kind);
    } else {  // a [width, embed] matrix that x is multiplied by
      e.projection_w = w.need(p + "text_projection", {W, embed}, kind).t().contiguous();
    }
  }
  return e;
}

}  // namespace

ClipTextEncoder ClipTextEncoder::load(const std::string& dir) {
  namespace fs = std::filesystem;
  DDM_CHECK(fs::is_directory(dir), dir << ": not a directory (a CLIP text encoder is a directory with config.json "
                                       << "and model.safetensors, or open_clip_config.json and open_clip_model.safetensors)");
  if (fs::exists(dir + "/open_clip_config.json")) return load_open_clip(dir);
  DDM_CHECK(fs::exists(dir + "/config.json"),
            dir << ": neither config.json (transformers) nor open_clip_config.json (open_clip): not a CLIP text encoder directory");
  return load_transformers(dir);
}

ClipTextEncoder ClipTextEncoder::to(torch::Device device, torch::ScalarType dtype) const {
  ClipTextEncoder e = *this;
  auto move = [&](torch::Tensor& t) {
    if (t.defined()) t = t.to(device, dtype);
  };
  for (torch::Tensor* t : {&e.token_embedding, &e.position_embedding, &e.final_ln_w, &e.final_ln_b, &e.projection_w, &e.projection_b})
    move(*t);
  for (auto& L : e.layers)
    for (torch::Tensor* t : {&L.ln1_w, &L.ln1_b, &L.qkv_w, &L.qkv_b, &L.out_w, &L.out_b, &L.ln2_w, &L.ln2_b, &L.fc1_w,
                             &L.fc1_b, &L.fc2_w, &L.fc2_b})
      move(*t);
  return e;
}

ClipTextEncoder::Output ClipTextEncoder::encode(const torch::Tensor& ids, int64_t skip) const {
  torch::NoGradGuard no_grad;
  DDM_CHECK(ids.dim() == 2, "CLIP text encoder: ids must be [batch, tokens], got " << ids.sizes());
  const int64_t B = ids.size(0), T = ids.size(1), H = heads, d = width / heads, n = static_cast<int64_t>(layers.size());
  DDM_CHECK(T >= 1 && T <= positions, "CLIP text encoder: " << T << " tokens, but the model has " << positions << " positions");
  DDM_CHECK(skip >= 0 && skip < n, "CLIP text encoder: cannot skip " << skip << " of its " << n << " layers");
  // Ids on a GPU were checked on the host before they went there (TextEncoder::encode): reading them
  // back here would wait for the GPU.
  DDM_CHECK(!ids.is_cpu() || ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < vocab),
            "CLIP text encoder: a token id outside the vocabulary of " << vocab);
  auto ln = [&](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    return torch::layer_norm(x, {width}, w, b, eps);
  };
  // x: [B, T, width]
  torch::Tensor x = torch::embedding(token_embedding, ids) + position_embedding.slice(0, 0, T).unsqueeze(0);
  torch::Tensor selected;
  for (int64_t l = 0; l < n; ++l) {
    const Layer& L = layers[static_cast<size_t>(l)];
    const auto qkv = torch::linear(ln(x, L.ln1_w, L.ln1_b), L.qkv_w, L.qkv_b).view({B, T, 3, H, d}).permute({2, 0, 3, 1, 4});
    // q, k, v: [B, H, T, d]; each position attends to itself and those before it.
    const auto attended = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, /*is_causal=*/true);
    x = x + torch::linear(attended.transpose(1, 2).reshape({B, T, width}), L.out_w, L.out_b);
    torch::Tensor h = torch::linear(ln(x, L.ln2_w, L.ln2_b), L.fc1_w, L.fc1_b);  // [B, T, inner]
    h = quick_gelu ? h * torch::sigmoid(1.702 * h) : torch::gelu(h);
    x = x + torch::linear(h, L.fc2_w, L.fc2_b);
    if (l == n - 1 - skip) selected = x;
  }
  Output out;
  out.states = ln(selected, final_ln_w, final_ln_b);
  const torch::Tensor last = skip == 0 ? out.states : ln(x, final_ln_w, final_ln_b);
  const torch::Tensor where = pool_argmax ? ids.argmax(1) : (ids == end_id).to(torch::kInt32).argmax(1);  // [B]
  out.pooled = last.index({torch::arange(B, ids.device()), where});  // [B, width]
  if (projection_w.defined()) out.pooled = torch::linear(out.pooled, projection_w, projection_b);
  return out;
}

}  // namespace ddm::text
