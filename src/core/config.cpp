// TOML config parsing for RunConfig: one table of fields (key, parse, dump) drives parsing,
// unknown-key detection, `--set` overrides and writing the resolved config, so the three never
// disagree.
#include "core/config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/suggest.h"
#include "core/presets.h"

namespace ddm {
namespace {

struct Field {
  std::string key;  // "section.name"
  std::function<void(const toml::node&, const std::string& where)> set;
  std::function<void(toml::table&)> dump;  // inserts name = value into the section's table
  std::string type;  // for the reference: "integer", "number", "true / false", "string", ...
};

std::string type_name(const toml::node& n) {
  std::ostringstream os;
  os << n.type();
  return os.str();
}

// The node's value as TOML text, for error messages.
std::string node_str(const toml::node& n) {
  std::ostringstream os;
  n.visit([&os](auto&& v) { os << v; });
  return os.str();
}

std::string leaf(const std::string& key) { return key.substr(key.find('.') + 1); }

Field field(const std::string& key, int64_t* p) {
  return {key,
          [key, p](const toml::node& n, const std::string& where) {
            auto v = n.value_exact<int64_t>();
            DDM_CHECK(v, where << ": " << key << " must be an integer, got " << type_name(n) << " " << node_str(n));
            *p = *v;
          },
          [key, p](toml::table& t) { t.insert_or_assign(leaf(key), *p); }, "integer"};
}

Field field(const std::string& key, double* p) {
  return {key,
          [key, p](const toml::node& n, const std::string& where) {
            auto v = n.value<double>();  // integers are accepted for float keys
            DDM_CHECK(v && (n.is_floating_point() || n.is_integer()),
                      where << ": " << key << " must be a number, got " << type_name(n) << " " << node_str(n));
            *p = *v;
          },
          [key, p](toml::table& t) { t.insert_or_assign(leaf(key), *p); }, "number"};
}

Field field(const std::string& key, bool* p) {
  return {key,
          [key, p](const toml::node& n, const std::string& where) {
            auto v = n.value_exact<bool>();
            DDM_CHECK(v, where << ": " << key << " must be true or false, got " << type_name(n) << " " << node_str(n));
            *p = *v;
          },
          [key, p](toml::table& t) { t.insert_or_assign(leaf(key), *p); }, "true / false"};
}

Field field(const std::string& key, std::string* p) {
  return {key,
          [key, p](const toml::node& n, const std::string& where) {
            auto v = n.value_exact<std::string>();
            DDM_CHECK(v, where << ": " << key << " must be a string, got " << type_name(n) << " " << node_str(n));
            *p = *v;
          },
          [key, p](toml::table& t) { t.insert_or_assign(leaf(key), *p); }, "string"};
}

Field field(const std::string& key, std::vector<int64_t>* p) {
  return {key,
          [key, p](const toml::node& n, const std::string& where) {
            const toml::array* arr = n.as_array();
            DDM_CHECK(arr, where << ": " << key << " must be an array of integers, got " << type_name(n) << " " << node_str(n));
            std::vector<int64_t> out;
            for (const toml::node& e : *arr) {
              auto v = e.value_exact<int64_t>();
              DDM_CHECK(v, where << ": " << key << " must be an array of integers, got element " << node_str(e));
              out.push_back(*v);
            }
            *p = out;
          },
          [key, p](toml::table& t) {
            toml::array arr;
            for (int64_t v : *p) arr.push_back(v);
            t.insert_or_assign(leaf(key), arr);
          }, "integers"};
}

Field field(const std::string& key, std::vector<std::string>* p) {
  return {key,
          [key, p](const toml::node& n, const std::string& where) {
            const toml::array* arr = n.as_array();
            DDM_CHECK(arr, where << ": " << key << " must be an array of strings, got " << type_name(n) << " " << node_str(n));
            std::vector<std::string> out;
            for (const toml::node& e : *arr) {
              auto v = e.value_exact<std::string>();
              DDM_CHECK(v, where << ": " << key << " must be an array of strings, got element " << node_str(e));
              out.push_back(*v);
            }
            *p = out;
          },
          [key, p](toml::table& t) {
            toml::array arr;
            for (const std::string& v : *p) arr.push_back(v);
            t.insert_or_assign(leaf(key), arr);
          }, "strings"};
}

std::string join_names(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& a : v) out += (out.empty() ? "" : ", ") + a;
  return out;
}

// The names of each choice key's enum (config.h), in the order errors list them.
template <class E>
const std::vector<std::pair<std::string, E>>& names();
template <>
const std::vector<std::pair<std::string, SyncMode>>& names() {
  static const std::vector<std::pair<std::string, SyncMode>> t = {{"dp", SyncMode::kDp}, {"diloco", SyncMode::kDiloco}};
  return t;
}
template <>
const std::vector<std::pair<std::string, ScheduleKind>>& names() {
  static const std::vector<std::pair<std::string, ScheduleKind>> t = {{"gpipe", ScheduleKind::kGpipe},
                                                                      {"1f1b", ScheduleKind::k1f1b},
                                                                      {"zb-h1", ScheduleKind::kZbH1},
                                                                      {"1f1b-v", ScheduleKind::k1f1bV},
                                                                      {"zb-v", ScheduleKind::kZbV}};
  return t;
}
template <>
const std::vector<std::pair<std::string, Precision>>& names() {
  static const std::vector<std::pair<std::string, Precision>> t = {{"fp32", Precision::kFp32}, {"bf16", Precision::kBf16},
                                                                    {"fp16", Precision::kFp16}};
  return t;
}
template <>
const std::vector<std::pair<std::string, CommBackend>>& names() {
  static const std::vector<std::pair<std::string, CommBackend>> t = {
      {"auto", CommBackend::kAuto}, {"gloo", CommBackend::kGloo}, {"nccl", CommBackend::kNccl}};
  return t;
}
template <>
const std::vector<std::pair<std::string, WireFormat>>& names() {
  static const std::vector<std::pair<std::string, WireFormat>> t = {
      {"float32", WireFormat::kFloat32}, {"float16", WireFormat::kFloat16}, {"bfloat16", WireFormat::kBfloat16}};
  return t;
}

template <class E>
std::string enum_name(E e) {
  for (const auto& [name, v] : names<E>())
    if (v == e) return name;
  DDM_FAIL("no name for config choice " << static_cast<int>(e));
}

// A key whose value is one of `allowed` (names of E), parsed into the enum.
template <class E>
Field choice(const std::string& key, E* p, const std::vector<std::string>& allowed) {
  return {key,
          [key, p, allowed](const toml::node& n, const std::string& where) {
            auto v = n.value_exact<std::string>();
            DDM_CHECK(v, where << ": " << key << " must be a string, got " << type_name(n) << " " << node_str(n));
            std::string list;
            for (const std::string& a : allowed) {
              list += (list.empty() ? "" : ", ") + a;
              if (a != *v) continue;
              for (const auto& [name, e] : names<E>())
                if (name == a) *p = e;
              return;
            }
            DDM_FAIL(where << ": " << key << " = \"" << *v << "\" is not one of: " << list);
          },
          [key, p](toml::table& t) { t.insert_or_assign(leaf(key), enum_name(*p)); }, "one of: " + join_names(allowed)};
}

// What each key means, for `ddm train --config-reference` and docs/config.md (generated from it and
// checked against it by a test). One line each; where a key has more to say, its docs/ page does.
const std::map<std::string, std::string>& key_docs() {
  static const std::map<std::string, std::string> d = {
      {"data.source",
       "where the images come from: fashion-mnist, folder (class sub-folders or plain images, all one size), safetensors (a file of `images`, optional `labels`), shards (tar files, streamed) or latents (a `ddm encode` directory)"},
      {"data.root",
       "the data's directory, file, shard pattern (`x-{000000..000009}.tar`) or `ddm encode` directory; empty: Debian's Fashion-MNIST"},
      {"data.split",
       "Fashion-MNIST's split: train or test"},
      {"data.hflip",
       "flip each image horizontally at random (only where a mirrored image is as valid)"},
      {"data.limit",
       "use only the first N images (0: all)"},
      {"data.partition",
       "a `ddm partition` directory: train on one of its clusters (with data.expert)"},
      {"data.expert",
       "the cluster to train on, 0..K-1 (-1: all data; routers)"},
      {"data.holdout",
       "routers: keep N images, drawn at random (seeded by train.seed), out of training, to measure the router on"},
      {"data.resolution",
       "shards: crop each image square and resize it to this side (required for shards)"},
      {"data.channels",
       "shards: 1 (grey) or 3 (RGB); 0: as the first image is"},
      {"data.crop",
       "shards: which square of the shorter side: center or random"},
      {"data.shuffle_buffer",
       "shards: samples mixed across shard boundaries (0 or 1: none)"},
      {"data.skip_bad",
       "shards (and latent shards): skip and count samples that cannot be used instead of stopping at the first"},
      {"data.decode_threads",
       "threads decoding shard images (0: a quarter of the cores, at least 1)"},
      {"data.scan_cache",
       "keep what the scan of each shard found, so the next run starts at once"},
      {"model.preset",
       "a named architecture (`ddm presets`); the keys below override its values (the defaults shown are this "
       "default preset's)"},
      {"model.arch",
       "unet, dit, router-dit, router-conv, autoencoder or sd-unet (diffusers' UNet; model.unet)"},
      {"model.in_channels",
       "input channels; 0: taken from the data (recorded)"},
      {"model.image_size",
       "input side in pixels (latents: the latents'); 0: taken from the data (recorded)"},
      {"model.num_classes",
       "classes the model is conditioned on; -1: taken from the data, 0: unconditional"},
      {"model.num_experts",
       "routers: K, the number of experts (0: taken from the partition)"},
      {"model.channels",
       "U-Net: base width"},
      {"model.channel_mult",
       "U-Net: the width of each resolution level, times model.channels"},
      {"model.res_blocks",
       "U-Net: residual blocks per level"},
      {"model.attn_levels",
       "U-Net: levels with self-attention (0: full resolution)"},
      {"model.groups",
       "U-Net: GroupNorm groups"},
      {"model.patch",
       "DiT: patch side in pixels"},
      {"model.width",
       "DiT: token width"},
      {"model.depth",
       "DiT: transformer blocks"},
      {"model.heads",
       "attention heads (DiT blocks, U-Net attention)"},
      {"model.mlp_ratio",
       "DiT: MLP width over token width"},
      {"model.latent_channels",
       "autoencoders: latent channels"},
      {"model.latent",
       "latent diffusion: a `ddm train-autoencoder` run or diffusers' AutoencoderKL folder; the model learns its latents"},
      {"model.latent_sha256",
       "the autoencoder's weights, pinned (filled in at train time)"},
      {"model.latent_scale",
       "latents are (z - shift) * scale; 0: the autoencoder's own (filled in)"},
      {"model.latent_shift",
       "see latent_scale (filled in)"},
      {"model.controlnet",
       "a ControlNet on this locked base run (`ddm train --controlnet`); sd-unet: from-unet or a ControlNetModel folder"},
      {"model.controlnet_sha256",
       "the base's weights, pinned (filled in)"},
      {"model.control",
       "the ControlNet's control maps: edges or lowres"},
      {"model.self_cond",
       "self-conditioning input channels (set from train.self_cond)"},
      {"model.embed",
       "image-embedding conditioning: feature-net or a `ddm train-classifier` file (empty: off)"},
      {"model.embed_sha256",
       "the embedding network's file, pinned (filled in)"},
      {"model.embed_dim",
       "the embedding's width (filled in)"},
      {"model.text_encoder",
       "a frozen text encoder's directory (CLIP, BERT, sentence-transformers, a diffusers pipeline): the model attends to each caption's encoding (docs/text.md)"},
      {"model.text_sha256",
       "the encoder's weights, pinned (filled in)"},
      {"model.text_skip",
       "CLIP: states from this many layers before the last (1: the penultimate; 0 for diffusers' SD 2.x "
       "text_encoder/, stored cut to it)"},
      {"model.text_dim",
       "width of the encoder's token states (filled in)"},
      {"model.text_pooled_dim",
       "width of its pooled embedding (filled in)"},
      {"model.text_tokens",
       "tokens per caption (0: the encoder's; e.g. 32 to cut BERT's 256)"},
      {"model.unet",
       "sd-unet: diffusers' UNet2DConditionModel folder (or a pipeline directory holding unet/)"},
      {"model.unet_sha256",
       "the UNet's config.json, pinned (filled in)"},
      {"diffusion.objective",
       "what the network predicts: flow (velocity), eps or v"},
      {"diffusion.schedule",
       "eps / v: linear, cosine, or discrete (DDPM's and Stable Diffusion's betas)"},
      {"diffusion.beta_schedule",
       "discrete: linear, scaled_linear or squaredcos_cap_v2 (diffusers' names)"},
      {"diffusion.beta_start",
       "discrete: the first beta"},
      {"diffusion.beta_end",
       "discrete: the last beta"},
      {"diffusion.timesteps",
       "discrete: the number of timesteps"},
      {"diffusion.scheduler",
       "a diffusers scheduler (folder or pipeline): sets the discrete schedule and checks the objective"},
      {"diffusion.time_dist",
       "how training draws t: uniform or logit-normal"},
      {"diffusion.logit_mean",
       "logit-normal: the mean of logit(t)"},
      {"diffusion.logit_std",
       "logit-normal: the standard deviation of logit(t)"},
      {"train.steps",
       "optimizer steps of the run"},
      {"train.batch_size",
       "images per step, over all processes"},
      {"train.lr",
       "AdamW's peak learning rate"},
      {"train.lr_schedule",
       "constant or cosine, after the linear warm-up"},
      {"train.warmup",
       "steps of linear warm-up from 0 to train.lr"},
      {"train.weight_decay",
       "AdamW's decoupled weight decay"},
      {"train.beta1",
       "AdamW's first-moment decay"},
      {"train.beta2",
       "AdamW's second-moment decay"},
      {"train.adam_eps",
       "AdamW's epsilon"},
      {"train.grad_clip",
       "clip the global gradient norm to this (0: off)"},
      {"train.ema_decay",
       "decay of the weights' exponential moving average, which sampling uses"},
      {"train.label_dropout",
       "probability of training a sample without its class (classifier-free guidance)"},
      {"train.caption_dropout",
       "text models: probability of training a sample on the empty prompt"},
      {"train.self_cond",
       "self-conditioning: probability a sample gets a first pass's estimate (0: off; Chen et al. use 0.5)"},
      {"train.cache_latents",
       "latent models: encode the data once before training instead of every step"},
      {"train.kl_weight",
       "autoencoders: weight of the KL term against the L1 reconstruction"},
      {"train.seed",
       "every random draw is keyed by it (with the step and the sample's position)"},
      {"train.threads",
       "intra-op threads per process (0: the cores divided among the job's processes on this machine)"},
      {"train.device",
       "auto, cpu, cuda or cuda:N (auto and cuda: the GPU of the process's LOCAL_RANK)"},
      {"train.precision",
       "fp32, or bf16: bfloat16 autocast with float32 weights, optimizer and EMA, or fp16: float16 autocast with "
       "dynamic loss scaling (for GPUs without bfloat16 tensor cores: T4)"},
      {"train.loss_scale",
       "fp16: the loss scale to start from (it halves at every overflow, doubles after 2000 good steps)"},
      {"train.deterministic",
       "GPUs: deterministic algorithms only, so a run repeats bit for bit (slower)"},
      {"train.checkpoint_activations",
       "keep only each unit's inputs and recompute it in backward: less memory, a third more compute"},
      {"train.cuda_graphs",
       "GPUs: capture the step once as a CUDA graph and replay it (one process; the prepare phase stays outside)"},
      {"train.grad_accum",
       "micro-batches per step (per process); the same step as the whole batch at once"},
      {"train.log_every",
       "steps between metrics records (metrics.jsonl, TensorBoard) and progress lines"},
      {"train.ckpt_every",
       "steps between checkpoints (the last step always writes one)"},
      {"train.keep_ckpts",
       "checkpoints kept, newest first (and any older one pinned by what is built on it: a latent model's or `ddm encode`'s autoencoder, a ControlNet's base, an ensemble's members)"},
      {"train.sample_every",
       "steps between grids of samples in RUN/grids/ and TensorBoard (0: none)"},
      {"train.sample_n",
       "samples in each grid (a row per class or prompt)"},
      {"train.sample_prompts",
       "text models: the grid's prompts, a row each (\"\": a row of unconditional samples; none: the data's "
       "first 4 distinct captions, recorded here; `ddm sample` of the run takes them when given no --prompt)"},
      {"train.expert_budget",
       "experts: full, split-batch (batch_size / K) or split-steps (steps / K)"},
      {"train.teacher",
       "distillation: an ensemble directory whose experts the model learns from"},
      {"sample.sampler",
       "`ddm sample`'s default solver: euler, heun, ddim or ddpm"},
      {"sample.steps",
       "its default solver steps"},
      {"sample.cfg",
       "its default classifier-free guidance scale (1: off, 0: unconditional)"},
      {"sample.n",
       "its default number of samples"},
      {"sample.use_ema",
       "sample the EMA weights (also the training grids)"},
      {"parallel.mode",
       "dp (every step all-reduces the gradients) or diloco (replicas synchronize every diloco.inner_steps)"},
      {"parallel.dp",
       "data-parallel degree (0: every process; with pipelines: the replicas)"},
      {"parallel.timeout",
       "seconds a collective waits for the other ranks before the job fails (more than 0, at most 86400)"},
      {"parallel.backend",
       "auto, gloo or nccl (auto: NCCL where each rank has its own GPU)"},
      {"parallel.bucket_mb",
       "cap of a gradient all-reduce bucket, MiB"},
      {"parallel.first_bucket_mb",
       "the first bucket's cap, MiB (the last layers' gradients, ready first)"},
      {"parallel.wire",
       "the gradients on the wire: float32 or float16"},
      {"parallel.shard_optimizer",
       "each data-parallel rank holds AdamW's moments and the EMA of 1/dp of the parameters (ZeRO-1)"},
      {"parallel.pp",
       "pipeline stages, one process each (1: no pipeline)"},
      {"parallel.schedule",
       "gpipe, 1f1b, zb-h1, or the V-shaped 1f1b-v, zb-v (two stages per process)"},
      {"parallel.cuts",
       "the first unit of each stage after the first (`ddm plan` lists them); empty: balanced"},
      {"parallel.fill",
       "run the frozen work in the pipeline's bubbles (DiffusionPipe); false: before the pipeline"},
      {"parallel.pipe_wire",
       "activations and their gradients between stages: float32 or bfloat16"},
      {"diloco.inner_steps",
       "H: inner steps between two synchronizations of a fragment"},
      {"diloco.outer_lr",
       "outer Nesterov learning rate (the paper's 0.7)"},
      {"diloco.outer_momentum",
       "outer Nesterov momentum, in [0, 1)"},
      {"diloco.fragments",
       "1: DiLoCo; more: Streaming DiLoCo's staggered fragments"},
      {"diloco.overlap",
       "inner steps each fragment's all-reduce overlaps (< inner_steps / fragments)"},
      {"diloco.mix",
       "with overlap: local = mix * local + (1 - mix) * global"},
      {"diloco.wire",
       "the outer gradient on the wire: float32 or float16"},
      {"diloco.peer_wait",
       "seconds a synchronization waits for a failed replica before going on without it (more than 0, at most 86400)"},
  };
  return d;
}

std::vector<Field> fields(RunConfig& c) {
  return {
      field("data.source", &c.data.source),
      field("data.root", &c.data.root),
      field("data.split", &c.data.split),
      field("data.hflip", &c.data.hflip),
      field("data.limit", &c.data.limit),
      field("data.partition", &c.data.partition),
      field("data.expert", &c.data.expert),
      field("data.holdout", &c.data.holdout),
      field("data.resolution", &c.data.resolution),
      field("data.channels", &c.data.channels),
      field("data.crop", &c.data.crop),
      field("data.shuffle_buffer", &c.data.shuffle_buffer),
      field("data.skip_bad", &c.data.skip_bad),
      field("data.decode_threads", &c.data.decode_threads),
      field("data.scan_cache", &c.data.scan_cache),
      field("model.preset", &c.model.preset),
      field("model.arch", &c.model.arch),
      field("model.in_channels", &c.model.in_channels),
      field("model.image_size", &c.model.image_size),
      field("model.num_classes", &c.model.num_classes),
      field("model.num_experts", &c.model.num_experts),
      field("model.channels", &c.model.channels),
      field("model.channel_mult", &c.model.channel_mult),
      field("model.res_blocks", &c.model.res_blocks),
      field("model.attn_levels", &c.model.attn_levels),
      field("model.groups", &c.model.groups),
      field("model.patch", &c.model.patch),
      field("model.width", &c.model.width),
      field("model.depth", &c.model.depth),
      field("model.heads", &c.model.heads),
      field("model.mlp_ratio", &c.model.mlp_ratio),
      field("model.latent_channels", &c.model.latent_channels),
      field("model.latent", &c.model.latent),
      field("model.latent_sha256", &c.model.latent_sha256),
      field("model.latent_scale", &c.model.latent_scale),
      field("model.latent_shift", &c.model.latent_shift),
      field("model.controlnet", &c.model.controlnet),
      field("model.controlnet_sha256", &c.model.controlnet_sha256),
      field("model.control", &c.model.control),
      field("model.self_cond", &c.model.self_cond),
      field("model.embed", &c.model.embed),
      field("model.embed_sha256", &c.model.embed_sha256),
      field("model.embed_dim", &c.model.embed_dim),
      field("model.text_encoder", &c.model.text_encoder),
      field("model.text_sha256", &c.model.text_sha256),
      field("model.text_skip", &c.model.text_skip),
      field("model.text_dim", &c.model.text_dim),
      field("model.text_pooled_dim", &c.model.text_pooled_dim),
      field("model.text_tokens", &c.model.text_tokens),
      field("model.unet", &c.model.unet),
      field("model.unet_sha256", &c.model.unet_sha256),
      field("diffusion.objective", &c.diffusion.objective),
      field("diffusion.schedule", &c.diffusion.schedule),
      field("diffusion.beta_schedule", &c.diffusion.beta_schedule),
      field("diffusion.beta_start", &c.diffusion.beta_start),
      field("diffusion.beta_end", &c.diffusion.beta_end),
      field("diffusion.timesteps", &c.diffusion.timesteps),
      field("diffusion.scheduler", &c.diffusion.scheduler),
      field("diffusion.time_dist", &c.diffusion.time_dist),
      field("diffusion.logit_mean", &c.diffusion.logit_mean),
      field("diffusion.logit_std", &c.diffusion.logit_std),
      field("train.steps", &c.train.steps),
      field("train.batch_size", &c.train.batch_size),
      field("train.lr", &c.train.lr),
      field("train.lr_schedule", &c.train.lr_schedule),
      field("train.warmup", &c.train.warmup),
      field("train.weight_decay", &c.train.weight_decay),
      field("train.beta1", &c.train.beta1),
      field("train.beta2", &c.train.beta2),
      field("train.adam_eps", &c.train.adam_eps),
      field("train.grad_clip", &c.train.grad_clip),
      field("train.ema_decay", &c.train.ema_decay),
      field("train.label_dropout", &c.train.label_dropout),
      field("train.caption_dropout", &c.train.caption_dropout),
      field("train.self_cond", &c.train.self_cond),
      field("train.cache_latents", &c.train.cache_latents),
      field("train.kl_weight", &c.train.kl_weight),
      field("train.seed", &c.train.seed),
      field("train.threads", &c.train.threads),
      field("train.device", &c.train.device),
      choice("train.precision", &c.train.precision, {"fp32", "bf16", "fp16"}),
      field("train.loss_scale", &c.train.loss_scale),
      field("train.deterministic", &c.train.deterministic),
      field("train.checkpoint_activations", &c.train.checkpoint_activations),
      field("train.cuda_graphs", &c.train.cuda_graphs),
      field("train.grad_accum", &c.train.grad_accum),
      field("train.log_every", &c.train.log_every),
      field("train.ckpt_every", &c.train.ckpt_every),
      field("train.keep_ckpts", &c.train.keep_ckpts),
      field("train.sample_every", &c.train.sample_every),
      field("train.sample_n", &c.train.sample_n),
      field("train.sample_prompts", &c.train.sample_prompts),
      field("train.expert_budget", &c.train.expert_budget),
      field("train.teacher", &c.train.teacher),
      field("sample.sampler", &c.sample.sampler),
      field("sample.steps", &c.sample.steps),
      field("sample.cfg", &c.sample.cfg),
      field("sample.n", &c.sample.n),
      field("sample.use_ema", &c.sample.use_ema),
      choice("parallel.mode", &c.parallel.mode, {"dp", "diloco"}),
      field("parallel.dp", &c.parallel.dp),
      field("parallel.timeout", &c.parallel.timeout),
      choice("parallel.backend", &c.parallel.backend, {"auto", "gloo", "nccl"}),
      field("parallel.bucket_mb", &c.parallel.bucket_mb),
      field("parallel.first_bucket_mb", &c.parallel.first_bucket_mb),
      choice("parallel.wire", &c.parallel.wire, {"float32", "float16"}),
      field("parallel.shard_optimizer", &c.parallel.shard_optimizer),
      field("parallel.pp", &c.parallel.pp),
      choice("parallel.schedule", &c.parallel.schedule, {"gpipe", "1f1b", "zb-h1", "1f1b-v", "zb-v"}),
      field("parallel.cuts", &c.parallel.cuts),
      field("parallel.fill", &c.parallel.fill),
      choice("parallel.pipe_wire", &c.parallel.pipe_wire, {"float32", "bfloat16"}),
      field("diloco.inner_steps", &c.diloco.inner_steps),
      field("diloco.outer_lr", &c.diloco.outer_lr),
      field("diloco.outer_momentum", &c.diloco.outer_momentum),
      field("diloco.fragments", &c.diloco.fragments),
      field("diloco.overlap", &c.diloco.overlap),
      field("diloco.mix", &c.diloco.mix),
      choice("diloco.wire", &c.diloco.wire, {"float32", "float16"}),
      field("diloco.peer_wait", &c.diloco.peer_wait),
  };
}

struct Entry {
  std::string key;
  const toml::node* node;
  std::string where;
};

void flatten(const toml::table& t, const std::string& prefix, const std::string& where, std::vector<Entry>& out) {
  for (auto&& [k, v] : t) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = v.as_table())
      flatten(*sub, key, where, out);
    else
      out.push_back({key, &v, where});
  }
}

toml::table parse_toml(const std::string& text, const std::string& origin) {
  try {
    return toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    DDM_FAIL(origin << ":" << e.source().begin.line << ":" << e.source().begin.column
                    << ": invalid TOML: " << e.description());
  }
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

void check_choice(const std::string& key, const std::string& value, const std::vector<std::string>& choices) {
  for (const auto& c : choices)
    if (c == value) return;
  DDM_FAIL(key << " = \"" << value << "\" is not one of: " << join(choices, ", "));
}

}  // namespace

std::string name_of(SyncMode m) { return enum_name(m); }
std::string name_of(ScheduleKind s) { return enum_name(s); }
std::string name_of(WireFormat w) { return enum_name(w); }
std::string name_of(Precision p) { return enum_name(p); }
Precision precision_named(const std::string& name) {
  for (const auto& [n, v] : names<Precision>())
    if (n == name) return v;
  DDM_FAIL("precision " << name << ": not one of fp32, bf16, fp16");
}
std::string name_of(CommBackend b) { return enum_name(b); }

std::string unknown_key_message(const std::string& key) {
  // The nearest key if it looks like a typo, then the keys of its section (or the sections): not
  // all of them, which is a wall of a hundred names.
  const std::vector<std::string> keys = config_keys();
  std::ostringstream m;
  m << "unknown config key '" << key << "'" << did_you_mean(key, keys) << ". ";
  const std::string section = key.substr(0, key.find('.'));
  std::vector<std::string> in_section, sections;
  for (const std::string& k : keys) {
    const std::string s = k.substr(0, k.find('.'));
    if (s == section) in_section.push_back(k);
    if (std::find(sections.begin(), sections.end(), s) == sections.end()) sections.push_back(s);
  }
  if (!in_section.empty())
    m << "The keys of [" << section << "]: " << join(in_section, ", ");
  else
    m << "The sections: " << join(sections, ", ");
  m << " (`ddm train --help` lists every key)";
  return m.str();
}

std::vector<std::string> config_keys() {
  RunConfig c;
  std::vector<std::string> keys;
  for (const Field& f : fields(c)) keys.push_back(f.key);
  return keys;
}

static std::string shortest_floats(const std::string& text);  // below, beside to_toml

std::string config_reference() {
  RunConfig c;
  apply_preset(c.model.preset, c.model);  // the defaults a config without [model] keys gets
  const std::map<std::string, std::string>& docs = key_docs();
  std::ostringstream md;
  md << "# Config keys\n\n"
        "Every key of a run's TOML config, with its type, its default and what it does. Generated from the config's "
        "field table (`ddm train --config-reference > docs/config.md`; a test checks that this file is what it "
        "writes). A key set in the config file or with `--set section.key=value` overrides the default; an unknown "
        "key, a value of the wrong type or out of range is an error naming the key. `ddm train --config C "
        "--print-config` shows C's values; `ddm presets` the model presets. Keys marked *filled in* are resolved "
        "when a run starts and recorded in its config.toml.\n";
  std::string section;
  for (const Field& f : fields(c)) {
    const std::string sec = f.key.substr(0, f.key.find('.'));
    if (sec != section) {
      section = sec;
      md << "\n## [" << sec << "]\n\n| key | type | default | meaning |\n|---|---|---|---|\n";
    }
    toml::table t;
    f.dump(t);
    std::ostringstream value;
    t.begin()->second.visit([&](auto&& n) { value << n; });
    std::string v = shortest_floats(" " + value.str()).substr(1);  // 0.1, not 0.10000000000000001
    if (v == "''" || v == "\"\"") v = "(empty)";
    const auto doc = docs.find(f.key);
    md << "| `" << f.key.substr(sec.size() + 1) << "` | " << f.type << " | `" << v << "` | "
       << (doc == docs.end() ? "" : doc->second) << " |\n";
  }
  return md.str();
}

namespace {

RunConfig parse_config_text(const std::string& toml_text, const std::string& origin,
                            const std::vector<std::string>& overrides) {
  std::vector<toml::table> tables;  // keeps the parsed nodes alive
  tables.reserve(overrides.size() + 1);
  std::vector<Entry> entries;
  tables.push_back(parse_toml(toml_text, origin));
  flatten(tables.back(), "", origin, entries);
  for (const std::string& ov : overrides) {
    const size_t eq = ov.find('=');
    DDM_CHECK(eq != std::string::npos && eq > 0,
              "--set " << ov << ": expected section.key=value, e.g. --set train.steps=100");
    const std::string key = ov.substr(0, eq), value = ov.substr(eq + 1);
    const std::string where = "--set " + ov;
    toml::table t;
    try {
      t = toml::parse("v = " + value, where);
    } catch (const toml::parse_error&) {
      t = toml::table{};
      t.insert("v", value);  // a bare word is taken as a string: --set model.preset=dit-tiny
    }
    tables.push_back(std::move(t));
    entries.push_back({key, tables.back().get("v"), where});
  }

  RunConfig cfg;
  std::vector<Field> fs = fields(cfg);
  std::map<std::string, const Field*> by_key;
  for (const Field& f : fs) by_key[f.key] = &f;
  for (const Entry& e : entries)
    if (!by_key.count(e.key)) DDM_FAIL(e.where << ": " << unknown_key_message(e.key));

  // The preset is applied first so that explicit model keys override it.
  for (const Entry& e : entries)
    if (e.key == "model.preset") by_key["model.preset"]->set(*e.node, e.where);
  apply_preset(cfg.model.preset, cfg.model);
  for (const Entry& e : entries) by_key[e.key]->set(*e.node, e.where);
  try {
    validate(cfg);
  } catch (const Error& err) {
    // Named where the value came from: of the keys the message names, the first that the file or a
    // --set gave (the last to set it), else the file ("model.controlnet and model.embed ..." is
    // about the --set model.embed=... that set the one).
    const std::string message = err.what();
    const auto is_key_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
    std::map<std::string, std::string> last_where;  // key -> who set it last
    for (const Entry& e : entries) last_where[e.key] = e.where;
    std::string where = origin;
    size_t first = std::string::npos;
    for (const auto& [key, by] : last_where) {
      for (size_t at = message.find(key); at != std::string::npos && at < first; at = message.find(key, at + 1)) {
        const size_t end = at + key.size();
        const bool starts = at == 0 || !(is_key_char(message[at - 1]) || message[at - 1] == '.');
        const bool ends = end == message.size() || !(is_key_char(message[end]) ||
                                                     (message[end] == '.' && end + 1 < message.size() && is_key_char(message[end + 1])));
        if (starts && ends) {
          first = at, where = by;
          break;
        }
      }
    }
    DDM_FAIL(where << ": " << message);
  }
  return cfg;
}

RunConfig load_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  try {
    text = read_file(path);  // refuses a directory
  } catch (const Error& e) {
    DDM_FAIL("config file: " << e.what());
  }
  // A file that sets nothing (empty, /dev/null, only comments) is a mistake, not "all defaults".
  DDM_CHECK(!parse_toml(text, path).empty(),
            path << ": the config file sets no keys (is it empty?); start from one of configs/*.toml");
  return parse_config_text(text, path, overrides);
}

}  // namespace

// The config is input: its errors are InputErrors (core/error.h), which the CLI exits 2 on.
RunConfig parse_config(const std::string& toml_text, const std::string& origin,
                       const std::vector<std::string>& overrides) {
  return as_input_error([&] { return parse_config_text(toml_text, origin, overrides); });
}

RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return as_input_error([&] { return load_config_file(path, overrides); });
}

namespace {

// What the run trains on and as what: the data source and split, an expert's cluster, a router's
// partition, the expert budget, distillation.
void validate_data(const RunConfig& c) {
  check_choice("data.source", c.data.source, {"fashion-mnist", "folder", "safetensors", "shards", "latents"});
  check_choice("data.crop", c.data.crop, {"center", "random"});
  DDM_CHECK(c.data.channels == 0 || c.data.channels == 1 || c.data.channels == 3,
            "data.channels must be 1 (grey), 3 (RGB) or 0 (as the first image), got " << c.data.channels);
  DDM_CHECK(c.data.shuffle_buffer >= 0, "data.shuffle_buffer must be >= 0 samples (0: no mixing), got " << c.data.shuffle_buffer);
  DDM_CHECK(c.data.decode_threads >= 0, "data.decode_threads must be >= 0 (0 = automatic), got " << c.data.decode_threads);
  DDM_CHECK(c.data.resolution >= 0, "data.resolution must be >= 0, got " << c.data.resolution);
  if (c.data.source == "shards") {
    DDM_CHECK(!c.data.root.empty(), "data.source = shards needs data.root: a shard pattern (data/train-{000000..000127}.tar), "
                                    "a glob or a list file");
    DDM_CHECK(c.data.resolution > 0, "data.source = shards needs data.resolution: the size (e.g. 64) its images are "
                                     "cropped square and resized to");
    DDM_CHECK(c.data.limit == 0, "data.limit does not apply to shards; name fewer shards in data.root instead");
    DDM_CHECK(!c.train.cache_latents, "train.cache_latents keeps every image's latent in memory, which shards are "
                                      "streamed to avoid; remove it");
    DDM_CHECK(c.model.controlnet.empty() && c.model.embed.empty(),
              "model.controlnet and model.embed read their data in memory; with shards they are not supported yet");
  } else if (c.data.source == "latents") {
    // data.resolution, channels, crop and hflip are checked against the directory's encode.json when
    // it is opened (a directory of latents takes them as encoded; one of images, as image shards do),
    // model.latent when the data's shape is resolved (run/setup.cpp).
    DDM_CHECK(!c.data.root.empty(), "data.source = latents needs data.root: a directory `ddm encode --out` wrote");
    DDM_CHECK(c.model.arch != "autoencoder", "model.arch = autoencoder learns images, and data.source = latents "
                                             "holds latents; train it on the images");
    DDM_CHECK(c.data.limit == 0, "data.limit does not apply to latent shards; encode fewer samples instead");
    DDM_CHECK(!c.train.cache_latents, "train.cache_latents with data.source = latents: the latents are already "
                                      "encoded; remove it");
    DDM_CHECK(c.model.controlnet.empty() && c.model.embed.empty(),
              "model.controlnet and model.embed condition on images, and data.source = latents has none; train them "
              "on the images");
  } else {
    // (A folder, a safetensors file or Fashion-MNIST keeps its images' own size and channels.)
    DDM_CHECK(c.data.resolution == 0 && c.data.channels == 0 && !c.data.skip_bad && c.data.crop == "center",
              "data.resolution, data.channels, data.crop and data.skip_bad apply to data.source = shards only (this is "
                  << c.data.source << ")");
  }
  check_choice("data.split", c.data.split, {"train", "test"});
  DDM_CHECK(c.data.limit >= 0, "data.limit must be >= 0 (0 = all), got " << c.data.limit);
  DDM_CHECK(c.data.expert >= -1, "data.expert must be a cluster index >= 0 (or -1 = none), got " << c.data.expert);
  const ModelConfig& m = c.model;
  const bool router = m.arch == "router-dit" || m.arch == "router-conv";
  if (router) {
    DDM_CHECK(!c.data.partition.empty(), "model.arch = " << m.arch << " trains a router, which needs "
                                         "data.partition (use `ddm train-router --partition DIR`)");
    DDM_CHECK(c.data.expert == -1, "data.expert = " << c.data.expert << " selects one cluster, but a router "
                                   "trains on all of them; remove data.expert (or set it to -1)");
  } else {
    DDM_CHECK(c.data.partition.empty() == (c.data.expert == -1),
              (c.data.partition.empty() ? "data.expert is set but data.partition is not; pass --partition DIR"
                                        : "data.partition is set but data.expert is not; pass --expert k (0..K-1)"));
    DDM_CHECK(c.data.holdout == 0, "data.holdout applies only to routers (model.arch = router-dit | router-conv)");
  }
  DDM_CHECK(c.data.holdout >= 0, "data.holdout must be >= 0, got " << c.data.holdout);
  check_choice("train.expert_budget", c.train.expert_budget, {"full", "split-batch", "split-steps"});
  DDM_CHECK(c.train.expert_budget == "full" || (!c.data.partition.empty() && !router),
            "train.expert_budget = " << c.train.expert_budget << " applies only to experts (with data.partition)");

  DDM_CHECK(c.train.teacher.empty() || (!router && c.data.partition.empty()),
            "train.teacher = " << c.train.teacher << " distills an ensemble into one "
                               << (router ? "diffusion model, not a router" : "model trained on all the data")
                               << "; remove " << (router ? "train.teacher" : "data.partition and data.expert"));
}

// The model: its architecture, latent / ControlNet / embedding conditioning, sizes.
void validate_model(const RunConfig& c) {
  const ModelConfig& m = c.model;
  check_choice("model.arch", m.arch, {"unet", "dit", "router-dit", "router-conv", "autoencoder", "sd-unet"});
  if (m.arch == "sd-unet") {
    DDM_CHECK(!m.unet.empty(), "model.arch = sd-unet is diffusers' UNet2DConditionModel: set model.unet to its folder "
                               "(config.json, and weights to fine-tune) or to a Stable Diffusion pipeline directory");
    DDM_CHECK(!m.text_encoder.empty(), "model.arch = sd-unet attends to a text encoder's states: set model.text_encoder "
                                       "(a Stable Diffusion pipeline directory gives its own)");
    DDM_CHECK(m.embed.empty() && c.train.self_cond == 0,
              "model.arch = sd-unet: " << (!m.embed.empty() ? "model.embed" : "train.self_cond")
                                       << " is not supported with diffusers' UNet yet; remove it");
  }
  DDM_CHECK(m.arch == "sd-unet" || (m.unet.empty() && m.unet_sha256.empty()),
            "model.unet and model.unet_sha256 describe diffusers' UNet, which model.arch = sd-unet trains; set it, or "
            "remove them");
  if (m.arch == "autoencoder") {
    DDM_CHECK(c.data.partition.empty(), "model.arch = autoencoder trains on all the data: remove data.partition");
    DDM_CHECK(c.train.teacher.empty(), "model.arch = autoencoder cannot be distilled: remove train.teacher");
    DDM_CHECK(m.latent.empty(), "model.latent = " << m.latent << " trains on an autoencoder's latents, but "
                                "model.arch = autoencoder is itself one: remove model.latent");
  }
  DDM_CHECK(m.latent_channels > 0, "model.latent_channels must be > 0, got " << m.latent_channels);
  DDM_CHECK(std::isfinite(m.latent_scale) && m.latent_scale >= 0,
            "model.latent_scale must be >= 0 (0 = from the autoencoder run), got " << m.latent_scale);
  DDM_CHECK(std::isfinite(m.latent_shift), "model.latent_shift must be finite, got " << m.latent_shift);
  DDM_CHECK(!m.latent.empty() || (m.latent_sha256.empty() && m.latent_scale == 0 && m.latent_shift == 0),
            "model.latent_sha256, latent_scale and latent_shift describe model.latent, which is not set");
  check_choice("model.control", m.control, {"edges", "lowres"});
  DDM_CHECK(m.controlnet.empty() || m.arch == "unet" || m.arch == "sd-unet",
            "model.controlnet = " << m.controlnet << " steers a U-Net (ddm's or Stable Diffusion's), but model.arch = "
                                  << m.arch << " (the base run's model keys are taken over when it is resolved)");
  DDM_CHECK(m.controlnet.empty() || m.arch == "sd-unet" || m.latent.empty(),
            "model.controlnet with model.latent: a ControlNet on a latent U-Net is not supported yet; use a pixel "
            "base run");
  DDM_CHECK(m.controlnet.empty() || (c.train.teacher.empty() && c.data.partition.empty()),
            "model.controlnet trains a ControlNet on all the data: remove train.teacher and data.partition");
  DDM_CHECK(m.embed.empty() || m.arch == "unet" || m.arch == "dit",
            "model.embed = " << m.embed << " conditions a diffusion backbone (model.arch = unet | dit), not " << m.arch);
  DDM_CHECK(m.embed.empty() || m.controlnet.empty(),
            "model.embed with model.controlnet: a ControlNet on a base conditioned on image embeddings is not supported "
            "yet");
  DDM_CHECK(m.embed.empty() || (c.train.teacher.empty() && c.data.partition.empty()),
            "model.embed with " << (c.train.teacher.empty() ? "data.partition" : "train.teacher")
                                << ": experts, routers and distillation do not pass image embeddings yet; remove one");
  DDM_CHECK(m.embed.empty() || c.train.label_dropout > 0,
            "model.embed with train.label_dropout = 0: the null embedding that guidance and sampling without "
            "references use would never be trained; set train.label_dropout > 0 (e.g. 0.1)");
  DDM_CHECK(m.text_encoder.empty() || m.arch != "autoencoder",
            "model.text_encoder = " << m.text_encoder << " conditions a diffusion backbone or a router (model.arch = unet | dit | "
                                    "sd-unet | router-dit | router-conv), not " << m.arch);
  DDM_CHECK(m.text_encoder.empty() || ((m.controlnet.empty() || m.arch == "sd-unet") && m.embed.empty()),
            "model.text_encoder with model." << (m.controlnet.empty() ? "embed" : "controlnet") << ": not supported yet; remove one");
  DDM_CHECK(!m.text_encoder.empty() || (m.text_sha256.empty() && m.text_skip == 0 && m.text_dim == 0 &&
                                        m.text_pooled_dim == 0 && m.text_tokens == 0),
            "model.text_sha256, text_skip, text_dim, text_pooled_dim and text_tokens describe model.text_encoder, which is not set");
  DDM_CHECK(m.text_skip >= 0 && m.text_dim >= 0 && m.text_pooled_dim >= 0 && m.text_tokens >= 0,
            "model.text_skip, text_dim, text_pooled_dim and text_tokens must be >= 0 (the dims: 0 = from the encoder)");
  DDM_CHECK(!m.embed.empty() || (m.embed_sha256.empty() && m.embed_dim == 0),
            "model.embed_sha256 and model.embed_dim describe model.embed, which is not set");
  DDM_CHECK(m.embed_dim >= 0, "model.embed_dim must be >= 0 (0 = from the network), got " << m.embed_dim);
  DDM_CHECK(!m.controlnet.empty() || m.controlnet_sha256.empty(),
            "model.controlnet_sha256 describes model.controlnet, which is not set");
  DDM_CHECK(m.num_experts == 0 || m.num_experts >= 2,
            "model.num_experts must be 0 (from the partition) or >= 2, got " << m.num_experts);
  DDM_CHECK(m.in_channels >= 0, "model.in_channels must be >= 0 (0 = from data), got " << m.in_channels);
  DDM_CHECK(m.image_size >= 0, "model.image_size must be >= 0 (0 = from data), got " << m.image_size);
  DDM_CHECK(m.num_classes >= -1, "model.num_classes must be >= -1 (-1 = from data), got " << m.num_classes);
  DDM_CHECK(m.channels > 0, "model.channels must be > 0, got " << m.channels);
  DDM_CHECK(!m.channel_mult.empty(), "model.channel_mult must have at least one level");
  for (int64_t v : m.channel_mult) DDM_CHECK(v > 0, "model.channel_mult entries must be > 0, got " << v);
  DDM_CHECK(m.res_blocks > 0, "model.res_blocks must be > 0, got " << m.res_blocks);
  for (int64_t v : m.attn_levels)
    DDM_CHECK(v >= 0 && v < static_cast<int64_t>(m.channel_mult.size()),
              "model.attn_levels entry " << v << " is not a level index 0.." << m.channel_mult.size() - 1);
  DDM_CHECK(m.groups > 0, "model.groups must be > 0, got " << m.groups);
  DDM_CHECK(m.patch > 0, "model.patch must be > 0, got " << m.patch);
  DDM_CHECK(m.width > 0, "model.width must be > 0, got " << m.width);
  DDM_CHECK(m.depth > 0, "model.depth must be > 0, got " << m.depth);
  DDM_CHECK(m.heads > 0, "model.heads must be > 0, got " << m.heads);
  DDM_CHECK(m.mlp_ratio > 0, "model.mlp_ratio must be > 0, got " << m.mlp_ratio);
}

// The noise process and the objective.
void validate_diffusion(const RunConfig& c) {
  const DiffusionConfig& d = c.diffusion;
  check_choice("diffusion.objective", d.objective, {"flow", "eps", "v"});
  check_choice("diffusion.schedule", d.schedule, {"linear", "cosine", "discrete"});
  DDM_CHECK(d.objective != "flow" || d.schedule != "discrete",
            "diffusion.schedule = discrete is a VP schedule, for diffusion.objective = eps or v (flow has its own path)");
  check_choice("diffusion.beta_schedule", d.beta_schedule, {"linear", "scaled_linear", "squaredcos_cap_v2"});
  DDM_CHECK(d.beta_start > 0 && d.beta_start < 1, "diffusion.beta_start must be in (0, 1), got " << d.beta_start);
  DDM_CHECK(d.beta_end > 0 && d.beta_end < 1, "diffusion.beta_end must be in (0, 1), got " << d.beta_end);
  DDM_CHECK(d.beta_schedule == "squaredcos_cap_v2" || d.beta_start < d.beta_end,
            "diffusion.beta_start (" << d.beta_start << ") must be below diffusion.beta_end (" << d.beta_end << ")");
  DDM_CHECK(d.timesteps >= 2 && d.timesteps <= 100000, "diffusion.timesteps must be in [2, 100000], got " << d.timesteps);
  check_choice("diffusion.time_dist", d.time_dist, {"uniform", "logit-normal"});
  DDM_CHECK(d.logit_std > 0, "diffusion.logit_std must be > 0, got " << d.logit_std);
}

// The optimization: steps, batch, learning rate, AdamW, EMA, checkpoints, threads.
void validate_sample_every(const RunConfig& c);

void validate_train(const RunConfig& c) {
  const TrainConfig& t = c.train;
  DDM_CHECK(t.steps > 0, "train.steps must be > 0, got " << t.steps);
  DDM_CHECK(t.batch_size > 0, "train.batch_size must be > 0, got " << t.batch_size);
  DDM_CHECK(t.lr > 0, "train.lr must be > 0, got " << t.lr);
  check_choice("train.lr_schedule", t.lr_schedule, {"constant", "cosine"});
  DDM_CHECK(t.warmup >= 0, "train.warmup must be >= 0, got " << t.warmup);
  DDM_CHECK(t.weight_decay >= 0, "train.weight_decay must be >= 0, got " << t.weight_decay);
  DDM_CHECK(t.beta1 >= 0 && t.beta1 < 1, "train.beta1 must be in [0, 1), got " << t.beta1);
  DDM_CHECK(t.beta2 >= 0 && t.beta2 < 1, "train.beta2 must be in [0, 1), got " << t.beta2);
  DDM_CHECK(t.adam_eps > 0, "train.adam_eps must be > 0, got " << t.adam_eps);
  DDM_CHECK(t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = off), got " << t.grad_clip);
  DDM_CHECK(t.ema_decay >= 0 && t.ema_decay < 1, "train.ema_decay must be in [0, 1), got " << t.ema_decay);
  DDM_CHECK(t.self_cond >= 0 && t.self_cond <= 1, "train.self_cond must be a probability in [0, 1], got " << t.self_cond);
  DDM_CHECK(!(c.model.self_cond || t.self_cond > 0) || c.model.arch == "unet" || c.model.arch == "dit",
            "train.self_cond / model.self_cond apply to diffusion backbones (model.arch = unet | dit), not "
                << c.model.arch);
  DDM_CHECK(!(c.model.self_cond || t.self_cond > 0) || c.model.controlnet.empty(),
            "train.self_cond with model.controlnet is not supported: a ControlNet steers its base as trained");
  DDM_CHECK(!t.cache_latents || !c.model.latent.empty(),
            "train.cache_latents caches a latent model's encodes, but model.latent is not set");
  DDM_CHECK(!t.cache_latents || !c.data.hflip,
            "train.cache_latents with data.hflip: a flipped image needs a fresh encode (its latent is not the flip of "
            "the unflipped one's); turn one of them off");
  DDM_CHECK(t.label_dropout >= 0 && t.label_dropout <= 1,
            "train.label_dropout must be in [0, 1], got " << t.label_dropout);
  // (Beyond 1e30 the scaled loss or 1 / scale leaves float32's range.)
  DDM_CHECK(t.loss_scale >= 1e-30 && t.loss_scale <= 1e30,
            "train.loss_scale must be between 1e-30 and 1e30 (fp16's starting loss scale; 65536 = 2^16), got "
                << t.loss_scale);
  DDM_CHECK(t.caption_dropout >= 0 && t.caption_dropout <= 1,
            "train.caption_dropout must be in [0, 1], got " << t.caption_dropout);
  DDM_CHECK(std::isfinite(t.kl_weight) && t.kl_weight >= 0, "train.kl_weight must be >= 0, got " << t.kl_weight);
  DDM_CHECK(t.seed >= 0, "train.seed must be >= 0, got " << t.seed);
  check_device_spec(t.device, "train.device");
  DDM_CHECK(!t.cuda_graphs || t.device != "cpu",
            "train.cuda_graphs captures the step on a CUDA GPU, but train.device = cpu: turn train.cuda_graphs off, or "
            "set train.device = cuda");
  DDM_CHECK(!t.cuda_graphs || !t.checkpoint_activations,
            "train.cuda_graphs with train.checkpoint_activations is not supported: turn one of them off");
  DDM_CHECK(t.threads >= 0, "train.threads must be >= 0 (0 = the cores divided among the job's processes on this machine), got " << t.threads);
  DDM_CHECK(t.log_every > 0, "train.log_every must be > 0, got " << t.log_every);
  DDM_CHECK(t.ckpt_every > 0, "train.ckpt_every must be > 0, got " << t.ckpt_every);
  DDM_CHECK(t.keep_ckpts > 0, "train.keep_ckpts must be > 0, got " << t.keep_ckpts);
  DDM_CHECK(t.grad_accum > 0, "train.grad_accum must be > 0, got " << t.grad_accum);
  validate_sample_every(c);
}

// Grids during training (train.sample_every): only where a process holds a whole diffusion model
// that samples from classes, prompts or nothing.
void validate_sample_every(const RunConfig& c) {
  const TrainConfig& t = c.train;
  DDM_CHECK(t.sample_every >= 0, "train.sample_every must be >= 0 (steps between grids; 0 = none), got " << t.sample_every);
  DDM_CHECK(t.sample_n >= 1, "train.sample_n must be >= 1 (samples in each grid), got " << t.sample_n);
  // (More prompts than train.sample_n: the grid shows the first sample_n, one sample each.)
  DDM_CHECK(t.sample_prompts.empty() || !c.model.text_encoder.empty(),
            "train.sample_prompts is set, but the model is not conditioned on text (model.text_encoder)");
  if (t.sample_every == 0) return;
  const std::string& arch = c.model.arch;
  DDM_CHECK(arch != "autoencoder" && arch.rfind("router", 0) != 0,
            "train.sample_every = " << t.sample_every << ": model.arch = " << arch
                                    << " is not a diffusion model; set train.sample_every = 0");
  DDM_CHECK(c.parallel.pp == 1,
            "train.sample_every = " << t.sample_every << " samples from the whole model, and with parallel.pp = "
                                    << c.parallel.pp << " no process holds it: set train.sample_every = 0 and sample "
                                    << "the checkpoints (ddm sample --ckpt RUN)");
  // A ControlNet's or model.embed model's grid is conditioned on the data's first images, in pixels:
  // not on latents (their maps and references would need the images the latents came from), not on
  // Stable Diffusion's ControlNet (it is conditioned on text as well).
  const bool conditioned = !c.model.controlnet.empty() || !c.model.embed.empty();
  const bool latent = !c.model.latent.empty() || c.data.source == "latents";
  DDM_CHECK(!conditioned || (!latent && arch != "sd-unet"),
            "train.sample_every = " << t.sample_every << ": a " << (c.model.embed.empty() ? "ControlNet" : "model.embed model")
                                    << (arch == "sd-unet" ? " of Stable Diffusion" : " on latents")
                                    << " samples from conditioning images, which training grids do not take for it: set "
                                    << "train.sample_every = 0 and sample the checkpoints (ddm sample --ckpt RUN "
                                    << (c.model.embed.empty() ? "--control-from test" : "--reference-from test") << ")");
}

// How the processes divide the training: data parallel, pipeline stages and schedule, wires.
void validate_parallel(const RunConfig& c) {
  const ParallelConfig& par = c.parallel;
  DDM_CHECK(par.dp >= 0, "parallel.dp must be >= 0 (0 = every process), got " << par.dp);
  DDM_CHECK(par.timeout > 0 && par.timeout <= 86400,
            "parallel.timeout must be in (0, 86400] seconds, got " << par.timeout);
  // The gradient buckets' sizes become byte counts, mb * 2^20 truncated (comm/grad_sync.cpp). At least
  // 1 KiB, 256 float32 gradients: below that nearly every tensor is an all-reduce of its own, paying the
  // collective's latency for a few values, and under 4 bytes a bucket holds nothing. At most 1 TiB: a
  // bucket larger than every gradient holds them all anyway, and the byte count must fit in 64 bits.
  const auto check_bucket = [](const char* key, double mb) {
    DDM_CHECK(!(mb < 1.0 / 1024),
              key << " = " << mb << " MiB is less than 1 KiB: a gradient bucket must hold at least 256 float32 "
                  << "gradients, or nearly every tensor pays an all-reduce's latency alone (and under 4 bytes a "
                  << "bucket holds nothing); set it to at least 0.0009765625 (1/1024 MiB; the default is 1)");
    DDM_CHECK(std::isfinite(mb) && mb <= 1048576,
              key << " = " << mb << " MiB: it must be a number of MiB up to 1048576 (1 TiB; a bucket larger than "
                  << "the model's gradients holds them all anyway)");
  };
  check_bucket("parallel.bucket_mb", par.bucket_mb);
  check_bucket("parallel.first_bucket_mb", par.first_bucket_mb);
  DDM_CHECK(par.pp >= 1, "parallel.pp must be >= 1 (pipeline stages; 1 = no pipeline), got " << par.pp);
  // V-shaped schedules run 2 stages on each of the pp processes.
  const bool v = v_shaped(par.schedule);
  const int64_t stages = v ? 2 * par.pp : par.pp;
  DDM_CHECK(par.cuts.empty() || static_cast<int64_t>(par.cuts.size()) == stages - 1,
            "parallel.cuts has " << par.cuts.size() << " entries but parallel.pp = " << par.pp
                                 << (v ? " V-shaped ranks (" + std::to_string(stages) + " stages)" : std::string(" stages"))
                                 << " need " << stages - 1
                                 << " (the first unit of each stage after the first), or none (automatic)");
  for (size_t i = 0; i < par.cuts.size(); ++i)
    DDM_CHECK(par.cuts[i] > (i == 0 ? 0 : par.cuts[i - 1]),
              "parallel.cuts must be increasing unit indices > 0, got " << par.cuts[i] << " at position " << i);
  DDM_CHECK(par.pp == 1 || par.mode == SyncMode::kDp, "parallel.pp = " << par.pp << " needs parallel.mode = \"dp\" (DiLoCo replicas are whole models)");
  if (par.shard_optimizer) {
    DDM_CHECK(par.mode == SyncMode::kDp && par.pp == 1,
              "parallel.shard_optimizer shards the optimizer state over data-parallel ranks, but this run is "
                  << (par.pp > 1 ? "a pipeline (parallel.pp = " + std::to_string(par.pp) + "), whose stages hold only their own state already"
                                 : std::string("DiLoCo (parallel.mode = diloco), whose replicas each keep a whole optimizer"))
                  << ": set parallel.shard_optimizer = false");
    DDM_CHECK(!c.train.cuda_graphs, "parallel.shard_optimizer with train.cuda_graphs is not supported (the "
                                    "parameters' broadcast after the update is not captured): turn one of them off");
  }
  DDM_CHECK(par.backend != CommBackend::kNccl || par.mode != SyncMode::kDiloco,
            "parallel.backend = nccl, but DiLoCo (parallel.mode = diloco) synchronizes over Gloo, so that its "
            "replicas survive a lost one (NCCL's watchdog ends every process of a failed group): set "
            "parallel.backend = gloo or auto");
  DDM_CHECK(par.backend != CommBackend::kNccl || c.train.device != "cpu",
            "parallel.backend = nccl carries CUDA tensors, but train.device = cpu: set train.device = cuda (or "
            "auto), or parallel.backend = gloo (or auto)");
}

// DiLoCo's outer loop.
void validate_diloco(const RunConfig& c) {
  const DilocoConfig& dl = c.diloco;
  DDM_CHECK(dl.inner_steps > 0, "diloco.inner_steps must be > 0 (inner steps between synchronizations), got "
                                   << dl.inner_steps);
  DDM_CHECK(dl.outer_lr > 0, "diloco.outer_lr must be > 0 (the paper uses 0.7), got " << dl.outer_lr);
  DDM_CHECK(dl.outer_momentum >= 0 && dl.outer_momentum < 1,
            "diloco.outer_momentum must be in [0, 1) (the paper uses 0.9), got " << dl.outer_momentum);
  DDM_CHECK(dl.fragments > 0, "diloco.fragments must be > 0 (1 = plain DiLoCo), got " << dl.fragments);
  DDM_CHECK(dl.fragments <= dl.inner_steps,
            "diloco.fragments = " << dl.fragments << " is more than diloco.inner_steps = " << dl.inner_steps
                                  << ": each fragment needs its own step in a cycle; lower diloco.fragments");
  DDM_CHECK(dl.overlap >= 0, "diloco.overlap must be >= 0, got " << dl.overlap);
  DDM_CHECK(dl.overlap < dl.inner_steps / dl.fragments,
            "diloco.overlap = " << dl.overlap << " must be less than diloco.inner_steps / diloco.fragments = "
                                << dl.inner_steps / dl.fragments
                                << ", so that one fragment's all-reduce ends before the next one starts");
  DDM_CHECK(dl.mix >= 0 && dl.mix < 1, "diloco.mix must be in [0, 1), got " << dl.mix);
  DDM_CHECK(dl.peer_wait > 0 && dl.peer_wait <= 86400,
            "diloco.peer_wait must be in (0, 86400] seconds, got " << dl.peer_wait);
}

// The defaults of `ddm sample`.
void validate_sample(const RunConfig& c) {
  const SampleConfig& s = c.sample;
  check_choice("sample.sampler", s.sampler, {"euler", "heun", "ddim", "ddpm"});
  DDM_CHECK(s.steps > 0, "sample.steps must be > 0, got " << s.steps);
  DDM_CHECK(s.cfg >= 0, "sample.cfg must be >= 0 (1 = no guidance), got " << s.cfg);
  DDM_CHECK(s.n > 0, "sample.n must be > 0, got " << s.n);
}

}  // namespace

void validate(const RunConfig& c) {
  as_input_error([&] {
    validate_data(c);
    validate_model(c);
    validate_diffusion(c);
    validate_train(c);
    validate_parallel(c);
    validate_diloco(c);
    validate_sample(c);
  });
}

std::string first_difference(const std::string& a, const std::string& b, const std::string& name_a,
                             const std::string& name_b) {
  std::istringstream sa(a), sb(b);
  std::string la, lb, section;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(sa, la)), gb = static_cast<bool>(std::getline(sb, lb));
    if (!ga && !gb) return "";
    if (ga && !la.empty() && la[0] == '[') section = la;
    if (la != lb) return section + " " + la + "  (" + name_a + ")  vs  " + lb + "  (" + name_b + ")";
  }
}

// toml++ (Debian's build of it) writes a double with 17 significant digits: `outer_lr = 0.7` comes
// out as 0.69999999999999996. Each float of the written text (outside its strings) is rewritten in
// the shortest form that reads back to the same double (std::to_chars), so config.toml says what
// the user wrote.
static std::string shortest_floats(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  std::string quote;  // inside a string: its delimiter, ' or " or a multi-line string's three
  const auto run_of = [&](size_t at, char q) {  // how many q start at `at`
    size_t n = 0;
    while (at + n < text.size() && text[at + n] == q) ++n;
    return n;
  };
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (!quote.empty()) {  // copied as it is (literal strings; basic ones with their escapes)
      if (quote[0] == '"' && c == '\\' && i + 1 < text.size()) {
        out += text.substr(i, 2), i += 2;
        continue;
      }
      if (c == quote[0] && text.compare(i, quote.size(), quote) == 0) {
        // A multi-line string closes at the last three of a run of up to five quotes (TOML 1.0).
        const size_t n = quote.size() == 3 ? std::min<size_t>(run_of(i, c), 5) : 1;
        out += text.substr(i, n), i += n;
        quote.clear();
        continue;
      }
      out += c, ++i;
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = run_of(i, c) >= 3 ? std::string(3, c) : std::string(1, c);
      out += quote, i += quote.size();
      continue;
    }
    // A value starts after "= ", "[" or ", ": keys are never rewritten.
    const bool value_start = !out.empty() && (out.back() == ' ' || out.back() == '[');
    if (value_start && (std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
      size_t j = i + (c == '-');
      bool is_float = false;
      while (j < text.size() && (std::isdigit(static_cast<unsigned char>(text[j])) || text[j] == '.' || text[j] == 'e' ||
                                 text[j] == 'E' || ((text[j] == '+' || text[j] == '-') && (text[j - 1] == 'e' || text[j - 1] == 'E')))) {
        is_float |= !std::isdigit(static_cast<unsigned char>(text[j]));
        ++j;
      }
      const std::string token = text.substr(i, j - i);
      char* end = nullptr;
      const double v = is_float ? std::strtod(token.c_str(), &end) : 0.0;
      if (is_float && end == token.c_str() + token.size()) {
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, v);
        std::string s(buf, r.ptr);
        if (const size_t e = s.find('e'); e != std::string::npos) {  // 3e-04 as 3e-4
          const size_t digits = e + 1 + (s[e + 1] == '-' || s[e + 1] == '+');
          while (s.size() > digits + 1 && s[digits] == '0') s.erase(digits, 1);
        }
        if (s.find_first_of(".eE") == std::string::npos) s += ".0";  // still a TOML float
        out += s;
      } else {
        out += token;
      }
      i = j;
      continue;
    }
    out += c, ++i;
  }
  return out;
}

std::string to_toml(const RunConfig& cfg) {
  RunConfig copy = cfg;
  std::vector<Field> fs = fields(copy);
  toml::table root;
  for (const Field& f : fs) {
    const std::string section = f.key.substr(0, f.key.find('.'));
    if (!root.contains(section)) root.insert(section, toml::table{});
    f.dump(*root.get_as<toml::table>(section));
  }
  std::ostringstream os;
  os << root << "\n";
  return shortest_floats(os.str());
}

}  // namespace ddm
