// Run configuration: plain structs for every section of a TOML config, parsing with unknown-key and
// type checks, `--set section.key=value` overrides, validation, and writing the resolved config.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ddm {

// The choices of the parallel keys, parsed from their names once (the field table in config.cpp, which
// rejects any other name) and compared as enums everywhere else; name_of gives the config's name back.
enum class SyncMode { kDp, kDiloco };                           // parallel.mode
enum class ScheduleKind { kGpipe, k1f1b, kZbH1, k1f1bV, kZbV };  // parallel.schedule
enum class WireFormat { kFloat32, kFloat16, kBfloat16 };        // parallel.wire, parallel.pipe_wire, diloco.wire
enum class Precision { kFp32, kBf16, kFp16 };                   // train.precision, --precision
enum class CommBackend { kAuto, kGloo, kNccl };                 // parallel.backend
std::string name_of(SyncMode m);
std::string name_of(ScheduleKind s);
std::string name_of(WireFormat w);
std::string name_of(Precision p);
Precision precision_named(const std::string& name);  // fp32 | bf16 | fp16; another name throws ddm::Error
std::string name_of(CommBackend b);
// 1f1b-v and zb-v run two stages on each process, in a V.
inline bool v_shaped(ScheduleKind s) { return s == ScheduleKind::k1f1bV || s == ScheduleKind::kZbV; }

struct DataConfig {
  std::string source = "fashion-mnist";  // fashion-mnist | folder | safetensors | shards | latents
  std::string root;          // directory (fashion-mnist, folder) or file (safetensors); "" = default
  std::string split = "train";  // fashion-mnist: train | test
  bool hflip = false;        // random horizontal flip
  int64_t limit = 0;         // use only the first N images (0 = all)
  std::string partition;     // a `ddm partition` directory: train on one of its clusters ("" = all data)
  int64_t expert = -1;       // the cluster to train on, 0..K-1 (an expert); -1 with a router model
  int64_t holdout = 0;       // routers: withhold the last N images from training to measure accuracy on
  // Tar shards (source = "shards", root = a shard list; source = "latents", root = a `ddm encode`
  // directory; see docs/data.md)
  int64_t resolution = 0;       // images are cropped square and resized to this (required for shards)
  int64_t channels = 0;         // 1 (grey) or 3 (RGB); 0 = as the first image is
  std::string crop = "center";  // center | random: which square of the shorter side
  int64_t shuffle_buffer = 1000;  // samples mixed across shard boundaries (0 or 1: none)
  bool skip_bad = false;        // skip (and count) samples that cannot be used instead of stopping
  int64_t decode_threads = 0;   // threads decoding images (0 = a quarter of the cores, at least 1)
  bool scan_cache = true;       // keep what the scan of each shard found (data/scan_cache.h)
};

struct ModelConfig {
  std::string preset = "unet-tiny";  // see src/core/presets.h; explicit keys below override it
  std::string arch = "unet";         // unet | dit | router-dit | router-conv | autoencoder | sd-unet
  // Filled from the dataset at train time (0 = take from data); recorded in the resolved config.
  int64_t in_channels = 0;
  int64_t image_size = 0;
  int64_t num_classes = -1;          // -1 = take from data; 0 = unconditional
  int64_t num_experts = 0;           // routers: K, the number of outputs (0 = take from the partition)
  // U-Net
  int64_t channels = 32;                       // base width
  std::vector<int64_t> channel_mult = {1, 2};  // one entry per resolution level
  int64_t res_blocks = 1;                      // residual blocks per level
  std::vector<int64_t> attn_levels = {};       // levels (0 = full resolution) with self-attention
  int64_t groups = 8;                          // GroupNorm groups
  // DiT (router-dit uses these too; router-conv uses patch and the U-Net keys)
  int64_t patch = 4;
  int64_t width = 128;
  int64_t depth = 4;
  int64_t heads = 4;
  double mlp_ratio = 4.0;
  // Autoencoder (arch = autoencoder, `ddm train-autoencoder`; also uses channels, channel_mult,
  // res_blocks and groups): latent channels; the downsampling factor is 2^(len(channel_mult) - 1).
  int64_t latent_channels = 4;
  // Latent diffusion: a `ddm train-autoencoder` run (or one of its checkpoints). The model then learns
  // (and samples) the frozen autoencoder's latents, (z - latent_shift) * latent_scale, instead of pixels;
  // in_channels and image_size become the latents'. Resolved at train time and recorded: latent names
  // the checkpoint directory, latent_sha256 its weights (checked on every load), and the scale and
  // shift measured by train-autoencoder (0 = take them from its autoencoder.json).
  std::string latent;
  std::string latent_sha256;
  double latent_scale = 0;
  double latent_shift = 0;
  // ControlNet (`ddm train --controlnet BASE`, model/controlnet.h): a trained U-Net run whose model is
  // locked and steered by a trainable copy of its encoder fed the control map `control` (edges |
  // lowres, data/control.h). Resolved at train time and recorded: the other model keys become the
  // base's, controlnet names its checkpoint directory and controlnet_sha256 its EMA weights (checked
  // on every load). With arch = sd-unet the locked base is model.unet's UNet: controlnet is
  // "from-unet" (diffusers' from_unet) or a diffusers ControlNetModel folder to start from, and
  // controlnet_sha256 pins the UNet's weights (train/network.h).
  std::string controlnet;
  std::string controlnet_sha256;
  std::string control = "edges";
  // Self-conditioning (Chen et al. 2023): the network takes a previous x0 estimate as extra input
  // channels (in_channels more; zeros when there is none). Derived from train.self_cond > 0 when a
  // run is resolved, whatever was written here (recorded).
  bool self_cond = false;
  // Image-embedding conditioning ("image variations"): the model is also conditioned on a frozen
  // feature network's embedding of a reference image (in training: of the image itself), with a
  // learned null embedding for guidance. "" = off, "feature-net" = the shipped network, or a
  // `ddm train-classifier` file. Resolved at train time and recorded: the absolute file, its sha256
  // (checked on every load) and the embedding's dimension.
  std::string embed;
  std::string embed_sha256;
  int64_t embed_dim = 0;
  // Text conditioning (docs/text.md): a frozen text encoder's directory (text/encoder.h: open_clip's,
  // transformers' CLIP or BERT, sentence-transformers', a diffusers Stable Diffusion one) whose
  // encoding of each sample's caption the model attends to. "" = none. Resolved at train time and
  // recorded: the absolute directory, text_sha256 of its weight files (checked on every load), the
  // width of its token states (text_dim: the U-Net's attention levels become SD's transformers,
  // every DiT block gets PixArt-α's cross-attention), of its pooled embedding (text_pooled_dim,
  // added to the time embedding) and its tokens per text (text_tokens; set it to cut a BERT
  // encoder's 256 to what captions need, e.g. 32).
  std::string text_encoder;
  std::string text_sha256;
  int64_t text_skip = 0;  // CLIP: states from this many layers before the last (1: SD 2.x's penultimate)
  int64_t text_dim = 0;
  int64_t text_pooled_dim = 0;
  int64_t text_tokens = 0;
  // Stable Diffusion's UNet (model.arch = sd-unet, docs/stable-diffusion.md): diffusers'
  // UNet2DConditionModel of `unet`, its folder (config.json, and its weights to fine-tune them; without
  // weights it trains from its initialization) or a pipeline directory holding it as unet/. The other
  // U-Net and DiT keys do not apply. Resolved at train time and recorded: unet names the absolute
  // folder and unet_sha256 its config.json (the architecture, checked on every load; the checkpoints
  // hold the weights).
  std::string unet;
  std::string unet_sha256;
};

struct DiffusionConfig {
  std::string objective = "flow";     // flow (velocity) | eps | v
  // eps / v only: linear | cosine (continuous VP schedules) | discrete (DDPM's and Stable
  // Diffusion's: `timesteps` betas of `beta_schedule`, diffusion/path.h). Flow is always linear interp.
  std::string schedule = "linear";
  // The discrete schedule, under diffusers' names; the defaults are Stable Diffusion's.
  std::string beta_schedule = "scaled_linear";  // linear | scaled_linear | squaredcos_cap_v2
  double beta_start = 0.00085;
  double beta_end = 0.012;
  int64_t timesteps = 1000;  // also the scale of a diffusers UNet's timestep input (t * timesteps - 1)
  // A diffusers scheduler (scheduler_config.json, its folder or a pipeline directory): resolved at
  // train time into schedule = discrete and the four keys above, and checked against the objective.
  std::string scheduler;
  std::string time_dist = "uniform";  // uniform | logit-normal
  double logit_mean = 0.0;
  double logit_std = 1.0;
};

struct TrainConfig {
  int64_t steps = 1500;
  int64_t batch_size = 128;
  double lr = 2e-3;
  std::string lr_schedule = "constant";  // constant | cosine (both after linear warm-up)
  int64_t warmup = 100;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double adam_eps = 1e-8;
  double grad_clip = 1.0;        // max global grad norm (0 = off)
  double ema_decay = 0.999;
  double label_dropout = 0.1;    // probability of replacing the label by the null class
  double caption_dropout = 0.1;  // text models: probability of replacing the caption by the empty prompt
  // Self-conditioning: the probability that a sample's training pass receives the x0 estimate of a
  // first no-grad pass of the current model (else zeros); samplers feed each step's estimate to the
  // next. 0 = off; > 0 sets model.self_cond. Chen et al. use 0.5.
  double self_cond = 0;
  // Latent models: encode the training set's posteriors (mean, log-variance) once before training
  // instead of every batch in every step; each step still samples them with keyed noise. Needs
  // model.latent; forbids data.hflip (a flip needs a fresh encode of the flipped image).
  bool cache_latents = false;
  double kl_weight = 1e-6;       // autoencoders: weight of the KL term per latent element against L1 per pixel
  int64_t seed = 0;
  int64_t threads = 0;           // intra-op threads per process (0 = the cores / the job's processes on this machine)
  // Where each process computes: auto | cpu | cuda | cuda:N (core/device.h; auto and cuda: the GPU of
  // the process's LOCAL_RANK; auto: the CPU where LibTorch sees no GPU). Every mode runs on a GPU.
  std::string device = "auto";
  // fp32: every op in float32 (TF32 off on GPUs). bf16: the forward passes and their backward under
  // bfloat16 autocast; weights, gradients, AdamW state and EMA stay float32 (core/device.h). fp16: the
  // same under float16 autocast, with dynamic loss scaling (train/loss_scale.h), for GPUs without
  // bfloat16 tensor cores (T4).
  Precision precision = Precision::kFp32;
  double loss_scale = 65536;  // fp16: the loss scale to start from (torch.amp.GradScaler's 2^16)
  // GPUs: deterministic algorithms only (cuBLAS workspace, no atomics-based kernels), so a run repeats
  // bit for bit on the same card; slower. The CPU path is deterministic either way.
  bool deterministic = false;
  // Activation checkpointing: each unit of the network (a ResBlock and its attention, a transformer
  // block; NetImpl::units) keeps only its inputs and runs again in backward (model/recompute.h).
  // Activation memory falls to what flows between units for about a third more compute. U-Nets,
  // DiTs, ControlNets and diffusers' UNet / ControlNet; not with pipeline stages (parallel.pp > 1).
  bool checkpoint_activations = false;
  // GPUs: the step's device work (forward, backward, clip, AdamW + EMA) captured once as a CUDA graph
  // and replayed every step, so that the host's kernel launches leave the step (train/step_graph.cpp).
  // The prepare phase stays outside. One process only; not with checkpoint_activations.
  bool cuda_graphs = false;
  // Micro-batches per step: batch_size is split into grad_accum equal parts (per rank), whose
  // gradients accumulate before one optimizer step; the result equals one step on the whole batch.
  int64_t grad_accum = 1;
  int64_t log_every = 50;
  int64_t ckpt_every = 500;      // steps between checkpoints (a final one is always written)
  int64_t keep_ckpts = 3;        // keep the last N checkpoints
  // Every sample_every steps (and at the last step), a grid of sample_n samples into RUN/grids/ and
  // the TensorBoard event files (0 = off): fixed noise (train.seed) and rows of classes or prompts,
  // EMA weights (sample.use_ema), sample.sampler / steps / cfg. Text models: sample_prompts, one row
  // each (empty: the data's first 4 distinct captions). Needs the whole model in one process (not
  // parallel.pp > 1); not for ControlNets, model.embed models, routers or autoencoders.
  int64_t sample_every = 0;
  int64_t sample_n = 40;
  std::vector<std::string> sample_prompts;
  // With data.partition: how an expert's budget relates to the numbers above. full: as written (per
  // expert); split-batch: batch_size / K per step (the paper's 256 -> 8 x 32), so K experts together
  // cost what one model with these numbers costs; split-steps: steps / K at the full batch size.
  std::string expert_budget = "full";
  // Distillation: an ensemble directory (`ddm ensemble`). The model then learns, on every image, the
  // prediction of the expert of that image's cluster instead of the data target ("" = off).
  std::string teacher;
};

struct SampleConfig {
  std::string sampler = "euler";  // euler | heun | ddim | ddpm
  int64_t steps = 20;
  double cfg = 2.0;               // classifier-free guidance scale (1 = off, 0 = unconditional)
  int64_t n = 100;
  bool use_ema = true;
};

// How the processes of one job share the training (docs/distributed.md). The world size and ranks
// come from the launcher (ddm launch, torchrun, Slurm, mpirun), not from the config.
struct ParallelConfig {
  // dp: every step all-reduces the gradients (data parallel). diloco: every process is a replica that
  // trains on its own share of the batch and synchronizes only every diloco.inner_steps (DiLoCo).
  SyncMode mode = SyncMode::kDp;   // dp | diloco
  int64_t dp = 0;                  // data-parallel degree (0 = every process); must equal the world size
  double timeout = 120;            // seconds a collective waits for the other ranks before the job fails
  // What carries the tensors of collectives (docs/gpu.md, "Backends"). gloo: everything. nccl: tensors
  // on CUDA GPUs go over NCCL (Gloo still coordinates: store, config agreement, stop decisions).
  // auto: nccl when this rank trains on its own GPU (train.device = auto or cuda), else gloo.
  CommBackend backend = CommBackend::kAuto;
  double bucket_mb = 1;            // cap of a gradient all-reduce bucket, MiB (docs/results.md: 25 left 78% exposed)
  double first_bucket_mb = 1;      // the first bucket (the last layers' gradients, ready first), MiB
  WireFormat wire = WireFormat::kFloat32;  // float32 | float16: the gradients' format on the wire
  // ZeRO stage 1 (train/shard.h): each data-parallel rank keeps AdamW's moments and the EMA for 1/dp
  // of the trainable parameters and updates only those; the ranks then broadcast their updated
  // parameters. Saves 3 (dp - 1) / dp float32 copies of the trainable model per rank for one more copy
  // on the wire per step; the same training, checkpoints as an unsharded run's.
  bool shard_optimizer = false;
  // Pipeline parallelism (docs/pipeline.md): the backbone's units split into pp stages, one process
  // each; train.grad_accum is the number of micro-batches every step pipelines.
  int64_t pp = 1;                  // pipeline stages (1: none)
  ScheduleKind schedule = ScheduleKind::k1f1b;  // gpipe | 1f1b | zb-h1 | 1f1b-v | zb-v (two stages per process)
  // The first unit of stages 1..pp-1 (`ddm plan` prints them); empty: balanced by each unit's
  // parameters x output positions (its multiply-adds, attention aside).
  std::vector<int64_t> cuts;
  // DiffusionPipe's bubble filling (docs/pipeline.md): the stages measure their first steps, plan
  // where the prepare phase's frozen work fits into the schedule's bubbles (the next step's
  // micro-batches included), and run it there, sending each piece's result to the stages that read
  // it. false: every stage prepares every micro-batch itself before the pipeline starts. Either way
  // the results are the same, bit for bit.
  bool fill = true;
  // The format of what a pipeline sends between processes: the activations (the carry, skips sent
  // straight on, self-conditioning's first pass) and their gradients. bfloat16 halves the bytes,
  // rounding each value to 8 significant bits (float32's range, so no gradient underflows as in
  // float16); a pipeline then trains within that rounding of one process, not of float32's.
  WireFormat pipe_wire = WireFormat::kFloat32;  // float32 | bfloat16
};

// DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025): replicas take inner_steps ordinary
// steps with no communication, then average their pseudo-gradients (global - local weights) and take
// an outer Nesterov step on the global weights. With fragments > 1 the parameters are split into
// fragments synchronized at staggered steps; with overlap > 0 a fragment's all-reduce runs during the
// next `overlap` inner steps and the result is mixed into the local weights (docs/distributed.md).
struct DilocoConfig {
  int64_t inner_steps = 50;       // H: inner steps between two synchronizations of a fragment
  double outer_lr = 0.7;          // outer Nesterov SGD learning rate (the paper's 0.7)
  double outer_momentum = 0.9;    // outer Nesterov momentum, in [0, 1) (the paper's 0.9)
  int64_t fragments = 1;          // 1: DiLoCo; > 1: Streaming DiLoCo's staggered fragments
  int64_t overlap = 0;            // inner steps each fragment's all-reduce overlaps (< inner_steps / fragments)
  double mix = 0.5;               // with overlap: local = mix * local + (1 - mix) * global (the paper's alpha)
  WireFormat wire = WireFormat::kFloat32;  // float32 | float16: the outer gradient's format on the wire
  // Seconds the replicas wait at a synchronization for a replica that failed (a lost connection or
  // a timeout) before going on without it; a restarted one that asks to rejoin meanwhile is taken.
  double peer_wait = 30;
};

struct RunConfig {
  DataConfig data;
  ModelConfig model;
  DiffusionConfig diffusion;
  TrainConfig train;
  SampleConfig sample;
  ParallelConfig parallel;
  DilocoConfig diloco;
};

// Parses TOML text (origin names the file in errors) plus overrides "section.key=value".
// Unknown keys, ill-typed values and out-of-range values throw ddm::InputError (a ddm::Error: the
// CLI exits 2, core/error.h) naming key and origin; so do load_config's unreadable or empty files.
RunConfig parse_config(const std::string& toml_text, const std::string& origin,
                       const std::vector<std::string>& overrides = {});
RunConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Validates ranges and choices; throws ddm::InputError naming the key.
void validate(const RunConfig& cfg);
// The complete resolved config as TOML text (every key, including defaults).
std::string to_toml(const RunConfig& cfg);
// The first line where two config texts (to_toml) differ, with its [section] and each side named
// ("[train] steps = 10  (stored run)  vs  steps = 20  (now)"), or "" when they are equal.
std::string first_difference(const std::string& a, const std::string& b, const std::string& name_a = "stored run",
                             const std::string& name_b = "now");

// All valid keys, "section.key", for help and error messages.
std::vector<std::string> config_keys();
// Every key with its type, default and meaning, as Markdown: docs/config.md (`ddm train
// --config-reference`).
std::string config_reference();
// "unknown config key 'K' (did you mean ...?). The keys of [section]: ..."
std::string unknown_key_message(const std::string& key);

}  // namespace ddm
