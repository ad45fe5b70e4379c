// Resolving, pinning and attaching a frozen text encoder for training (train/text.h).
#include "train/text.h"

#include <filesystem>
#include <map>
#include <mutex>
#include <tuple>

#include "core/error.h"
#include "core/fileio.h"
#include "core/weights_dir.h"
#include "data/latent_shards.h"
#include "data/shard_stream.h"
#include "sd/pipeline_dir.h"

namespace ddm {

namespace fs = std::filesystem;

namespace {

text::TextEncoderOptions options_of(const ModelConfig& m) {
  text::TextEncoderOptions o;
  o.skip = m.text_skip;
  o.context = static_cast<int>(m.text_tokens);  // 0: the tokenizer's
  return o;
}

}  // namespace

void resolve_text(ModelConfig& m, const Dataset& data) {
  const std::string key = "model.text_encoder = " + m.text_encoder;
  const bool captioned = data.shards ? data.shards->captioned > 0 : !data.captions.empty();
  DDM_CHECK(captioned, key << ": the data (" << data.description << ") has no captions; text-to-image training reads "
                           << "each image's caption (.txt or .json in shards, a .txt beside each image or a "
                           << "captions.jsonl in a folder: docs/data.md, Captions)");
  DDM_CHECK(fs::is_directory(m.text_encoder), key << ": no such directory (a text encoder's: docs/text.md; if it "
                                                    "moved, name its new place: --set model.text_encoder=DIR)");
  const std::string dir = absolute_dir(m.text_encoder);
  std::shared_ptr<text::TextEncoder> e;
  try {
    if (sd::is_pipeline_dir(dir)) {  // diffusers' layout: the parts model_index.json records, of CLIP's classes
      sd::pipeline_component(dir, "text_encoder", {"CLIPTextModel", "CLIPTextModelWithProjection"});
      sd::pipeline_component(dir, "tokenizer", {"CLIPTokenizer", "CLIPTokenizerFast"});
    }
    e = text::load_text_encoder(dir, options_of(m));
  } catch (const Error& err) {
    // (the encoder's own errors start with its directory, which the key names already)
    const std::string what = err.what(), named = dir + ": ";
    DDM_FAIL(key << ": " << (what.rfind(named, 0) == 0 ? what.substr(named.size()) : what));
  }
  const std::string sha = weights_sha256(e->weight_files());
  DDM_CHECK(m.text_sha256.empty() || m.text_sha256 == sha,
            "the frozen text encoder changed: " << dir << " has weights of sha256 " << sha << ", but model.text_sha256 = "
                                                << m.text_sha256 << "; restore it (the model is tied to its own)");
  for (auto [name, have, want] : {std::tuple<const char*, int64_t*, int64_t>{"text_dim", &m.text_dim, e->state_dim()},
                                  {"text_pooled_dim", &m.text_pooled_dim, e->pooled_dim()},
                                  {"text_tokens", &m.text_tokens, e->context()}}) {
    DDM_CHECK(*have == 0 || *have == want, "model." << name << " = " << *have << " but " << dir << " gives " << want
                                                    << "; remove the key (it is taken from the encoder)");
    *have = want;
  }
  m.text_encoder = dir;
  m.text_sha256 = sha;
  if (data.encoded && !data.encoded->text.encoder.empty()) {  // cached encodings: they must be this encoder's
    const auto& t = data.encoded->text;
    const std::string rec = (fs::path(data.encoded->pattern).parent_path() / kLatentShardsInfo).string();
    DDM_CHECK(t.sha256 == sha, key << " has weights of sha256 " << sha.substr(0, 12) << ", but the text encodings in "
                                   << rec << " are those of " << t.encoder << " (sha256 " << t.sha256.substr(0, 12)
                                   << "); set model.text_encoder to it, or encode the data again with this one");
    for (auto [name, have, want] : {std::tuple<const char*, int64_t, int64_t>{"text_skip", m.text_skip, t.skip},
                                    {"text_tokens", m.text_tokens, t.tokens}})
      DDM_CHECK(have == want, "model." << name << " = " << have << ", but the text encodings in " << rec
                                       << " were made with " << want << "; set model." << name << " = " << want
                                       << ", or encode the data again with `ddm encode --text`");
  }
}

bool cached_text(const ModelConfig& m, const Dataset& data) {
  return !m.text_encoder.empty() && data.encoded && !data.encoded->text.encoder.empty();
}

std::shared_ptr<const text::TextEncoder> load_pinned_text_encoder(const ModelConfig& m, torch::Device device) {
  // One encoder per process for every model that pins the same one (a routed ensemble's experts and
  // router: K + 1 loads of a 1.4 GB CLIP tower otherwise), while any of them holds it.
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<const text::TextEncoder>> loaded;
  const std::string key = m.text_encoder + "\n" + m.text_sha256 + "\n" + std::to_string(m.text_skip) + "\n" +
                          std::to_string(m.text_tokens) + "\n" + device.str();
  std::lock_guard<std::mutex> lock(mutex);
  if (auto kept = loaded[key].lock()) return kept;
  DDM_CHECK(fs::is_directory(m.text_encoder),
            "the model's frozen text encoder " << m.text_encoder << " (model.text_encoder) is not there: restore it, "
                << "or, if it moved, name its new place (`ddm sample --text-encoder DIR`; to train on, `ddm train ... "
                << "--set model.text_encoder=DIR --resume`): the same weights (sha256 " << m.text_sha256.substr(0, 12)
                << ") are accepted");
  std::shared_ptr<text::TextEncoder> e = text::load_text_encoder(m.text_encoder, options_of(m));
  const std::string sha = weights_sha256(e->weight_files());
  DDM_CHECK(sha == m.text_sha256, "the frozen text encoder changed: " << m.text_encoder << " has weights of sha256 " << sha
                                                                      << ", but the model was trained with sha256 "
                                                                      << m.text_sha256 << " (model.text_sha256); restore it");
  DDM_CHECK(e->state_dim() == m.text_dim && e->pooled_dim() == m.text_pooled_dim && e->context() == m.text_tokens,
            m.text_encoder << ": the encoder gives states of " << e->state_dim() << ", pooled " << e->pooled_dim() << ", "
                           << e->context() << " tokens, the model was trained on " << m.text_dim << ", " << m.text_pooled_dim
                           << ", " << m.text_tokens);
  e->to(device);
  loaded[key] = e;
  return e;
}

Cond encode_texts(const text::TextEncoder& e, const std::vector<std::string>& texts, torch::Device device,
                  const std::vector<std::string>& what) {
  torch::NoGradGuard no_grad;
  const text::TextEncoding enc = e.encode(texts, what);
  Cond c;
  c.context = enc.states.to(device);     // [B, T, D]
  c.context_mask = enc.mask.to(device);  // [B, T]
  c.pooled = enc.pooled.to(device);      // [B, P]
  return c;
}

std::shared_ptr<const text::TextEncoder> attach_text(Objective& objective, const ModelConfig& m, const Dataset& data,
                                                     torch::Device device) {
  if (m.text_encoder.empty()) return nullptr;
  auto e = load_pinned_text_encoder(m, device);
  if (cached_text(m, data)) {  // the batches hold the encodings; the empty prompt's is the one left to make
    objective.set_cached_text(encode_texts(*e, {""}, device));  // [1, T, D], [1, T], [1, P]
    return nullptr;
  }
  objective.set_text_encoder([e](const std::vector<std::string>& captions, torch::Device dev) {
    return encode_texts(*e, captions, dev);
  });
  return e;
}

}  // namespace ddm
