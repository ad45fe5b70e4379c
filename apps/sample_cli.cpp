// `ddm sample` (a PNG grid, and optionally raw samples, from a checkpoint or a routed ensemble, with
// control maps and reference images), and what it shares with `ddm eval` (apps/sample_setup.h).
#include "sample_setup.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/control.h"
#include "data/dataset.h"
#include "data/image_folder.h"
#include "data/origin.h"
#include "data/shard_loader.h"
#include "data/shard_write.h"
#include "decentral/ensemble_dir.h"
#include "diffusion/generate.h"
#include "eval/feature_net.h"
#include "eval/grid.h"
#include "model/graphed_net.h"
#include "run/trainer.h"
#include "train/controlnet.h"
#include "train/loaded_model.h"
#include "train/text.h"

namespace fs = std::filesystem;

namespace ddm {

// (apps/sample_setup.h)
std::string origin_of(const DataConfig& data) {
  try {
    return data_origin(data);
  } catch (const Error&) {
    return data.source;
  }
}

Source open_source(const SampleArgs& a) {
  DDM_INPUT_CHECK(a.ckpt.empty() != a.ensemble.empty(), "give exactly one of --ckpt DIR and --ensemble DIR");
  Source s;
  // A path on the command line that is not there is bad input (exit 2), as a bad flag is.
  if (!a.ckpt.empty() && !fs::exists(a.ckpt))
    throw InputError("--ckpt: checkpoint path '" + a.ckpt + "' does not exist");
  if (!a.ensemble.empty() && !fs::exists(a.ensemble))
    throw InputError("--ensemble: '" + a.ensemble + "' does not exist; make one with ddm ensemble --out DIR ...");
  if (a.cuda_graphs && a.device == "cpu")
    throw InputError("--cuda-graphs replays the network on a CUDA GPU, but --device cpu: leave one of them out");
  const torch::Device device = resolve_device(a.device, 0, "--device");
  if (!a.text_encoder.empty()) {
    DDM_INPUT_CHECK(fs::is_directory(a.text_encoder), "--text-encoder " << a.text_encoder << ": no such directory");
    use_text_encoder_at(a.text_encoder);  // checked against each checkpoint's recorded sha256 as it loads
  }
  if (!a.ckpt.empty()) {
    if (!a.routing.empty() || a.allow_missing || a.one_expert_at_a_time)  // a flag that does not apply: exit 2
      throw InputError("--routing, --allow-missing and --one-expert-at-a-time apply only to --ensemble");
    configure_math(device, false);
    s.model = load_model(a.ckpt, !a.no_ema, device);
    DDM_INPUT_CHECK(a.text_encoder.empty() || s.model->text,
                    "--text-encoder: " << s.model->checkpoint << " is not conditioned on text (model.text_encoder)");
    if (a.cuda_graphs) {
      DDM_INPUT_CHECK(device.is_cuda(), "--cuda-graphs needs a CUDA GPU, but the network runs on "
                                      << device << ": leave --cuda-graphs out, or give --device cuda");
      s.model->net = std::make_shared<GraphedNetImpl>(s.model->net);
    }
    s.den = make_denoiser(*s.model);
    s.den->set_precision(precision_named(a.precision));
    s.name = s.model->checkpoint;
    if (!device.is_cpu() || a.precision != "fp32") s.name += " on " + device.str() + " in " + a.precision;
    return s;
  }
  // An ensemble: its experts and router on the device.
  configure_math(device, false);
  s.members = std::make_unique<LoadedEnsemble>(
      as_input_error([&] { return load_ensemble(a.ensemble, !a.no_ema, a.allow_missing, device); }));
  s.routing = as_input_error([&] { return parse_routing(a.routing.empty() ? s.members->manifest.value("routing", "top1") : a.routing); });
  if (a.cuda_graphs) {  // every expert's and the router's forward from graphs, on padded groups (below)
    DDM_INPUT_CHECK(device.is_cuda(), "--cuda-graphs needs a CUDA GPU, but the ensemble runs on "
                                    << device << ": leave --cuda-graphs out, or give --device cuda");
    for (auto& e : s.members->experts)
      if (e) e->net = std::make_shared<GraphedNetImpl>(e->net, graphed_expert_graphs(s.members->k));
    if (s.members->router.net) s.members->router.net = std::make_shared<GraphedNetImpl>(s.members->router.net);
  }
  for (int64_t m : s.members->missing())
    std::cout << "warning: expert " << m << " is missing (--allow-missing): its router probability is set to 0 and "
              << "the rest renormalized; samples of its cluster come from the other experts" << std::endl;
  s.ensemble = as_input_error([&] {  // a routing the ensemble cannot do (topk:K for K > its experts): bad input
    return make_ensemble(*s.members, s.routing, static_cast<uint64_t>(a.seed), precision_named(a.precision));
  });
  // With graphs, each expert's group is padded to a few sizes (graphed_group_quantum).
  if (a.cuda_graphs) s.ensemble->set_group_quantum(graphed_group_quantum(std::min(a.batch, a.n), s.members->k));
  s.ensemble->set_side_by_side(!a.one_expert_at_a_time);
  s.den = s.ensemble->denoiser();
  s.name = "ensemble " + a.ensemble + " (K = " + std::to_string(s.members->k) + ", routing " + s.routing.spec + ")";
  if (!device.is_cpu() || a.precision != "fp32") s.name += " on " + device.str() + " in " + a.precision;
  return s;
}

// The first n images of a split of the model's data with their labels (--control-from, --reference-from).
static Dataset split_images(const LoadedModel& m, const std::string& split, int64_t n, const std::string& flag) {
  DDM_INPUT_CHECK(m.cfg.data.source == "fashion-mnist",
            flag << " " << split << ": the model's data.source = " << m.cfg.data.source
                 << " has no train/test splits; give the images as a PNG instead");
  DataConfig dc = m.cfg.data;
  dc.split = split;
  dc.limit = 0;
  dc.partition.clear();
  dc.expert = -1;
  Dataset d = load_dataset(dc);
  DDM_INPUT_CHECK(d.images.size(0) >= n, flag << " " << split << ": " << d.description << " has " << d.images.size(0)
                                        << " images, fewer than --n " << n);
  d.images = d.images.narrow(0, 0, n);
  d.labels = d.labels.narrow(0, 0, n);
  return d;
}

static std::optional<ControlSet> open_controls(const SampleArgs& a, const LoadedModel& m, int64_t n) {
  const bool controlnet = !m.cfg.model.controlnet.empty();
  DDM_INPUT_CHECK(a.control_file.empty() || a.control_from.empty(), "give one of --control FILE and --control-from SPLIT");
  DDM_INPUT_CHECK(a.control_from.empty() || a.class_id < 0,
            "--class with --control-from: the samples take the labels of the images their maps come from");
  if (a.control_file.empty() && a.control_from.empty()) {
    DDM_INPUT_CHECK(!controlnet, m.checkpoint << " is a ControlNet (model.control = " << m.cfg.model.control
                                        << "): give its control maps with --control FILE"
                                        << (m.cfg.data.source == "fashion-mnist" ? " or --control-from test" : ""));
    DDM_INPUT_CHECK(a.control_type.empty(), "--control-type needs --control FILE or --control-from SPLIT");
    return std::nullopt;
  }
  ControlSet c;
  c.type = a.control_type.empty() ? m.cfg.model.control : a.control_type;
  DDM_INPUT_CHECK(!controlnet || c.type == m.cfg.model.control,
            "--control-type " << c.type << ": this ControlNet takes " << m.cfg.model.control << " maps");
  const int64_t size = m.latent ? m.latent->shape().image_size : m.cfg.model.image_size;
  const int64_t channels = m.latent ? m.latent->shape().in_channels : m.cfg.model.in_channels;
  const int64_t cc = c.type == "edges" ? 1 : channels;
  if (!a.control_from.empty()) {
    const Dataset d = split_images(m, a.control_from, n, "--control-from");
    c.maps = control_map(c.type, to_unit_range(d.images));  // [n, Cc, S, S]
    c.labels = d.labels;
    c.origin = "the " + c.type + " maps of the first " + std::to_string(n) + " images of " + d.description;
  } else {
    const torch::Tensor tiles = read_image_tiles(a.control_file, size, "--control");  // [N, C', S, S]
    DDM_INPUT_CHECK(tiles.size(1) == cc || (cc == 1 && tiles.size(1) == 3),
              "--control " << a.control_file << ": " << tiles.size(1) << "-channel maps, but " << c.type << " maps of "
                           << channels << "-channel images have " << cc);
    torch::Tensor maps = to_unit_range(tiles);
    if (maps.size(1) != cc) maps = maps.mean(1, /*keepdim=*/true);  // [N, 1, S, S]
    const int64_t tiles_n = maps.size(0);
    // Fewer maps than samples: they repeat in order.
    c.maps = maps.index_select(0, torch::arange(n, torch::kLong).remainder(tiles_n));  // [n, Cc, S, S]
    c.origin = std::to_string(tiles_n) + " " + c.type + " map(s) from " + a.control_file;
  }
  return c;
}

static std::optional<ReferenceSet> open_references(const SampleArgs& a, const LoadedModel& m, int64_t n) {
  DDM_INPUT_CHECK(a.reference_file.empty() || a.reference_from.empty(), "give one of --reference FILE and --reference-from SPLIT");
  if (a.reference_file.empty() && a.reference_from.empty()) return std::nullopt;
  DDM_INPUT_CHECK(a.reference_from.empty() || a.class_id < 0,
            "--class with --reference-from: the samples take the labels of their reference images");
  DDM_INPUT_CHECK(a.reference_from.empty() || a.control_from.empty() || a.reference_from == a.control_from,
            "--control-from " << a.control_from << " and --reference-from " << a.reference_from
                              << " would give the samples two sets of labels; use one split");
  ReferenceSet r;
  const int64_t size = m.latent ? m.latent->shape().image_size : m.cfg.model.image_size;
  const int64_t channels = m.latent ? m.latent->shape().in_channels : m.cfg.model.in_channels;
  if (!a.reference_from.empty()) {
    const Dataset d = split_images(m, a.reference_from, n, "--reference-from");
    r.images = to_unit_range(d.images);  // [n, C, S, S]
    r.labels = d.labels;
    r.origin = "the first " + std::to_string(n) + " images of " + d.description;
  } else {
    torch::Tensor tiles = read_image_tiles(a.reference_file, size, "--reference");  // [N, C', S, S]
    if (tiles.size(1) == 3 && channels == 1) tiles = tiles.to(torch::kFloat).mean(1, true).round().to(torch::kUInt8);
    DDM_INPUT_CHECK(tiles.size(1) == channels, "--reference " << a.reference_file << ": " << tiles.size(1)
                                                        << "-channel images, but the model's have " << channels);
    r.images = to_unit_range(tiles).index_select(0, torch::arange(n, torch::kLong).remainder(tiles.size(0)));
    r.origin = std::to_string(tiles.size(0)) + " reference image(s) from " + a.reference_file;
  }
  // Every model is scored by the shipped network, whatever network it is conditioned on: comparable numbers.
  ModelConfig shipped;
  shipped.embed = default_feature_net_path();
  shipped.embed_sha256 = kDefaultFeatureNetSha256;
  r.embedder = ImageEmbedder::load(shipped);
  DDM_INPUT_CHECK(r.images.size(1) == 1 && r.images.size(2) == 28,
            (a.reference_from.empty() ? "--reference " + a.reference_file : "--reference-from " + a.reference_from)
                << ": embedding similarity is measured by the shipped Fashion-MNIST network, which takes 1x28x28 "
                   "images, not "
                << r.images.size(1) << "x" << r.images.size(2) << "x" << r.images.size(3));
  return r;
}

// (apps/sample_setup.h)
std::vector<std::string> open_prompts(const SampleArgs& a, Source& src, GenerateOptions& g,
                                      std::vector<std::string>* each) {
  const bool given = !a.prompts.empty() || !a.prompts_file.empty() || !a.negative_prompt.empty();
  const LoadedModel& m = src.defaults();  // an ensemble's experts share one encoder (ddm ensemble checks)
  if (!m.text) {
    DDM_INPUT_CHECK(!given, "--prompt, --prompts and --negative-prompt: " << src.name
                                                                   << " is not conditioned on text (model.text_encoder)");
    return {};
  }
  auto texts = read_texts(a.prompts, a.prompts_file, "--prompts");
  if (texts.empty() && !m.cfg.train.sample_prompts.empty()) {  // the prompts of the run's grids, as many as --n takes
    const auto& run = m.cfg.train.sample_prompts;
    const size_t take = std::min<size_t>(run.size(), static_cast<size_t>(a.n));
    for (size_t i = 0; i < take; ++i) texts.emplace_back(run[i], "train.sample_prompts[" + std::to_string(i) + "]");
    std::cout << "note: no --prompt given: sampling " << (take < run.size() ? "the first " + std::to_string(take) + " of " : "")
              << "the prompts of the run's grids (train.sample_prompts)" << std::endl;
  }
  DDM_INPUT_CHECK(!texts.empty(), src.name << " is conditioned on text (model.text_encoder = " << m.cfg.model.text_encoder
                                         << "): give --prompt TEXT (once per row) or --prompts FILE (one per line)");
  const auto p = static_cast<int64_t>(texts.size());
  DDM_INPUT_CHECK(p <= a.n, "--n " << a.n << " is fewer than the " << p << " prompts: give --n " << p << " or more");
  DDM_INPUT_CHECK(m.cfg.model.num_classes == 0 || a.class_id >= 0,
            m.checkpoint << " is conditioned on classes and text: give --class too (the rows are the prompts)");
  std::vector<std::string> prompts, what;
  for (const auto& [text, name] : texts) {
    prompts.push_back(text);
    what.push_back(name);
  }
  // A prompt longer than the text encoder's context is cut to it, as diffusers cuts it; said, as
  // diffusers says it. A prompt that is not UTF-8 is bad input (exit 2), named by its line.
  for (size_t i = 0; i < prompts.size(); ++i) {
    int64_t full = 0;
    as_input_error([&] { (void)m.text->tokenizer().tokenize(prompts[i], 4096, what[i], &full); });
    if (full > m.text->context())
      std::cout << "note: " << what[i] << " is " << full << " tokens; the text encoder reads the first "
                << m.text->context() << " (the rest of the prompt is left out)" << std::endl;
  }
  m.text->cuts_said();
  const torch::Device device = src.den->device();
  // Each prompt encoded once (in batches of 64, every prompt tokenized before any is encoded: a bad
  // one stops sampling before it starts, naming its line), then repeated for its samples.
  std::vector<Cond> parts;
  for (int64_t i = 0; i < p; i += 64) {
    const int64_t b = std::min<int64_t>(64, p - i);
    parts.push_back(encode_texts(*m.text, {prompts.begin() + i, prompts.begin() + i + b}, device,
                                 {what.begin() + i, what.begin() + i + b}));
  }
  Cond enc;
  for (auto field : {&Cond::context, &Cond::context_mask, &Cond::pooled}) {
    std::vector<torch::Tensor> all;
    for (const Cond& part : parts) all.push_back(part.*field);
    enc.*field = torch::cat(all);  // [P, ...]
  }
  const int64_t per = a.n / p;
  g.per_class = per;
  const torch::Tensor which = torch::arange(a.n, torch::kLong).div(per, "floor").remainder(p).to(device);  // [n]
  g.text = enc.select(which);  // [n, T, D], [n, T], [n, P]
  if (each)
    for (int64_t i = 0; i < a.n; ++i) each->push_back(prompts[static_cast<size_t>((i / per) % p)]);
  if (!a.negative_prompt.empty() && g.sample.cfg == 1.0)
    std::cout << "note: --negative-prompt does nothing at cfg 1 (no guidance: only the prompt's branch runs); give "
                 "--cfg above 1 to guide away from it" << std::endl;
  if (!a.negative_prompt.empty()) {
    const Cond negative = encode_texts(*m.text, {a.negative_prompt}, device, {"--negative-prompt"});
    if (src.ensemble) src.ensemble->set_null_text(negative);  // each expert's guidance
    else src.den->set_null_text(negative);
  }
  const int64_t rows = (a.n + per - 1) / per;  // the prompts in turn, row after row; the last may be short
  std::cout << "text: " << p << " prompt(s), " << per << " sample(s) each per row";
  if (rows != p)
    std::cout << " (" << rows << " rows for --n " << a.n << ": the prompts in turn" << (a.n % per ? ", the last row short" : "")
              << ")";
  if (g.sample.cfg == 1.0) std::cout << "; no guidance (cfg 1)" << std::endl;
  else std::cout << "; guidance against " << (a.negative_prompt.empty() ? "the empty prompt" : "--negative-prompt") << std::endl;
  std::vector<std::string> labels;
  for (int64_t r = 0; r * per < a.n; ++r) labels.push_back(grid_row_label(prompts[r % p]));
  return labels;
}

// (apps/sample_setup.h)
std::pair<std::optional<ControlSet>, std::optional<ReferenceSet>> open_conditions(const SampleArgs& a,
                                                                                  const Source& src,
                                                                                  GenerateOptions& g) {
  DDM_INPUT_CHECK(src.model || (a.control_file.empty() && a.control_from.empty()), "--control and --control-from apply only to --ckpt (one model)");
  DDM_INPUT_CHECK(src.model || (a.reference_file.empty() && a.reference_from.empty()), "--reference and --reference-from apply only to --ckpt (one model)");
  if (!src.model) return {};
  const LoadedModel& m = *src.model;
  std::optional<ControlSet> controls = open_controls(a, m, a.n);
  if (controls) {
    if (!m.cfg.model.controlnet.empty()) g.control = controls->maps;
    if (controls->labels.defined()) g.labels = controls->labels;
    std::cout << "control: " << controls->origin << std::endl;
  }
  std::optional<ReferenceSet> refs = open_references(a, m, a.n);
  if (refs) {
    if (m.embedder) g.embed = m.embedder->embed(refs->images);
    if (refs->labels.defined()) g.labels = refs->labels;
    std::cout << "reference: " << refs->origin << (m.embedder ? "" : " (not a model.embed model: compared only)")
              << std::endl;
  }
  return {std::move(controls), std::move(refs)};
}

// Sampling progress: a live counter on a terminal, otherwise a plain line at every 10%.
static std::function<void(int64_t, int64_t)> sampling_progress(bool tty) {
  auto next_tenth = std::make_shared<int64_t>(1);
  return [tty, next_tenth](int64_t done, int64_t total) {
    if (tty) {
      std::printf("\r  sampling %lld/%lld", static_cast<long long>(done), static_cast<long long>(total));
    } else if (done * 10 >= *next_tenth * total) {
      std::printf("  sampled %lld/%lld\n", static_cast<long long>(done), static_cast<long long>(total));
      *next_tenth = done * 10 / total + 1;
    }
    std::fflush(stdout);
  };
}

// --init-noise FILE: its tensor "noise", float [n, C, H, W] of the model's input shape, finite.
static torch::Tensor read_init_noise(const std::string& file, int64_t n, const ModelConfig& m) {
  SafetensorsFile f;
  try {
    f = load_safetensors(file);
  } catch (const Error& e) {
    DDM_INPUT_FAIL("--init-noise " << file << ": " << e.what());
  }
  const auto it = f.tensors.find("noise");
  std::string names;
  for (const auto& [name, t] : f.tensors) names += (names.empty() ? "" : ", ") + name;
  DDM_INPUT_CHECK(it != f.tensors.end(), "--init-noise " << file << ": no tensor named \"noise\" (it holds "
                                                   << (names.empty() ? "none" : names) << "); save the noise as \"noise\"");
  const torch::Tensor& x = it->second;
  const std::vector<int64_t> want{n, m.in_channels, m.image_size, m.image_size};
  DDM_INPUT_CHECK(x.is_floating_point() && x.sizes() == torch::IntArrayRef(want),
            "--init-noise " << file << ": \"noise\" is " << x.scalar_type() << " " << x.sizes() << ", but --n " << n
                            << " samples of this model start from float " << torch::IntArrayRef(want)
                            << (m.latent.empty() ? "" : " (its latents)"));
  DDM_INPUT_CHECK(torch::isfinite(x).all().item<bool>(), "--init-noise " << file << ": \"noise\" holds NaN or inf");
  return x.to(torch::kFloat);
}

// (apps/sample_setup.h)
GenerateOptions generate_options(const SampleArgs& a, const LoadedModel& m) {
  GenerateOptions g;
  g.n = a.n;
  g.sample.sampler = a.sampler.empty() ? m.cfg.sample.sampler : a.sampler;
  g.sample.steps = a.steps > 0 ? a.steps : m.cfg.sample.steps;
  g.sample.cfg = a.cfg >= 0 ? a.cfg : m.cfg.sample.cfg;
  const ModelConfig& mc = m.cfg.model;
  // Nothing to guide by (Denoiser::raw's rule: no classes, prompts or embeddings; a control map stays in
  // both branches): the denoiser ignores the scale, so the run is named and reported as what it is.
  if (mc.num_classes == 0 && mc.text_encoder.empty() && mc.embed.empty() && g.sample.cfg != 1.0) {
    if (a.cfg >= 0)
      std::cout << "note: --cfg " << a.cfg << " does nothing for a model without classes, prompts or embeddings: "
                << "sampling without guidance (cfg 1)" << std::endl;
    g.sample.cfg = 1.0;
  }
  // Guidance steers away from the null condition, which the model learns only from the labels or
  // captions training dropped: with none dropped it is untrained, and guidance extrapolates from noise.
  const bool classes_untrained = mc.num_classes > 0 && m.cfg.train.label_dropout == 0;
  const bool text_untrained = !mc.text_encoder.empty() && m.cfg.train.caption_dropout == 0;
  if (g.sample.cfg != 1.0 && (classes_untrained || text_untrained))
    std::cout << "note: cfg " << g.sample.cfg
              << (g.sample.cfg == 0.0 ? " samples the null condition alone, which " : " guides against the null condition, which ")
              << m.checkpoint << " never trained (" << (text_untrained ? "train.caption_dropout" : "train.label_dropout")
              << " = 0): expect poor samples; give --cfg 1 (no guidance), or train with a dropout of about 0.1"
              << std::endl;
  else if (g.sample.cfg == 0.0 && mc.num_classes > 0)
    std::cout << "note: cfg 0 samples the null condition alone: the images are unconditional, whatever class their "
                 "row names"
              << std::endl;
  g.batch_size = a.batch;
  g.seed = static_cast<uint64_t>(a.seed);
  g.class_id = a.class_id;
  const int64_t classes = m.cfg.model.num_classes;
  g.per_class = classes > 0 ? std::max<int64_t>(1, (a.n + classes - 1) / classes) : a.n;
  g.on_progress = sampling_progress(isatty(fileno(stdout)));
  g.decode = image_decoder(m);  // latent models: the frozen decoder
  as_input_error([&] { sample_labels(1, classes, a.class_id, 1); });  // a --class the model lacks: before sampling
  if (!a.init_noise.empty()) g.init_noise = read_init_noise(a.init_noise, a.n, m.cfg.model);
  return g;
}

// Each image as its own PNG, DIR/000000.png ... (RGB; a grey image's channel three times): the folder
// clean-fid, torch-fidelity and most FID tools take. With prompts, each image's beside it as
// 000000.txt (the captions of a folder dataset, data/captions.h; FID tools read only the images).
static void write_png_folder(const std::string& dir, const torch::Tensor& images, const std::vector<std::string>& prompts) {
  fs::create_directories(dir);
  const torch::Tensor u8 = to_uint8(images);  // [N, C, H, W]
  for (int64_t i = 0; i < u8.size(0); ++i) {
    torch::Tensor rgb = u8[i].permute({1, 2, 0});  // [H, W, C]
    if (rgb.size(2) == 1) rgb = rgb.expand({rgb.size(0), rgb.size(1), 3});
    write_file_atomic((fs::path(dir) / (zero_padded(i, 6) + ".png")).string(), encode_png(rgb.contiguous()));
    if (!prompts.empty())
      write_file_atomic((fs::path(dir) / (zero_padded(i, 6) + ".txt")).string(), prompts[static_cast<size_t>(i)] + "\n");
  }
  std::cout << "wrote " << u8.size(0) << " PNG files into " << dir << " (000000.png ..."
            << (prompts.empty() ? "" : ", each with its prompt in 000000.txt ...") << ")" << std::endl;
}

// The folders the output checks made, removed again (when they hold no file) if the command stops
// before it writes into them: a refused command leaves nothing.
struct MadeFolders {
  std::vector<fs::path> tops;  // the first folder of each path that did not exist
  void make(const std::string& dir, const std::string& what) {
    std::error_code ec;
    fs::path top;
    for (fs::path p = fs::absolute(dir, ec); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
      top = p;
      if (p == p.parent_path()) break;
    }
    as_input_error([&] { create_output_dir(dir, what); });
    if (!top.empty()) tops.push_back(top);
  }
  void undo() const {
    for (const fs::path& top : tops) {
      std::error_code ec;
      bool empty = true;
      for (auto it = fs::recursive_directory_iterator(top, ec); !ec && it != fs::recursive_directory_iterator();
           it.increment(ec))
        empty = empty && it->is_directory(ec);
      if (empty && !ec) fs::remove_all(top, ec);
    }
  }
};

// Refuses (exit 2) an output file that could not be written, before the sampling it would hold: its
// folder is made, and a file beside the target is opened and removed.
static void check_writable(const std::string& path, const std::string& flag, MadeFolders& made) {
  made.make(fs::path(path).parent_path().string(), flag + " " + path + ": the folder");
  const std::string probe = path + ".probe-" + std::to_string(::getpid());
  errno = 0;
  const bool ok = static_cast<bool>(std::ofstream(probe));
  const std::string why = std::strerror(errno);
  std::error_code ec;
  fs::remove(probe, ec);
  DDM_INPUT_CHECK(ok, flag << " " << path << ": cannot write there (" << why << "); give another path (nothing was sampled)");
}

static void write_samples_made(const SampleArgs& a, MadeFolders& made);

void write_samples(const SampleArgs& a) {
  MadeFolders made;
  try {
    write_samples_made(a, made);
  } catch (...) {
    made.undo();
    throw;
  }
}

static void write_samples_made(const SampleArgs& a, MadeFolders& made) {
  as_input_error([&] { check_png_path(a.out); });  // before any sampling
  check_writable(a.out, "--out", made);
  if (!a.raw.empty()) {
    std::string ext = fs::path(a.raw).extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    DDM_INPUT_CHECK(ext == ".safetensors",
                    "--raw " << a.raw << ": the raw samples are written as safetensors; name a .safetensors file");
    check_writable(a.raw, "--raw", made);
  }
  DDM_INPUT_CHECK(a.png_dir.empty() || !fs::exists(a.png_dir) || fs::is_directory(a.png_dir),
                  "--png-dir " << a.png_dir << " is a file: name an empty or new directory (nothing was written)");
  DDM_INPUT_CHECK(a.png_dir.empty() || !fs::exists(a.png_dir) || fs::is_empty(a.png_dir),
            "--png-dir " << a.png_dir << " holds files already: name an empty or new directory (nothing was written)");
  if (!a.png_dir.empty()) made.make(a.png_dir, "--png-dir");
  set_threads(a.threads);
  Source src = open_source(a);
  const LoadedModel& m = src.defaults();
  const Denoiser& den = *src.den;
  GenerateOptions g = generate_options(a, m);
  const int64_t classes = m.cfg.model.num_classes;
  g.per_class = classes > 0 && a.class_id < 0 ? std::max<int64_t>(1, a.n / classes) : a.n;  // whole rows
  if (classes > 0 && a.class_id < 0 && a.n > classes && a.n % classes != 0)
    std::cout << "note: --n " << a.n << " is not a multiple of the " << classes << " classes: a row of "
              << g.per_class << " per class, then " << a.n % classes << " more in rows of the first classes again "
              << "(--n " << classes * (a.n / classes) << " or " << classes * (a.n / classes + 1)
              << " gives a row per class)" << std::endl;
  const bool tty = isatty(fileno(stdout));
  const auto [controls, refs] = open_conditions(a, src, g);  // what they refuse, before anything is said
  std::vector<std::string> sample_prompts;  // text models: each sample's
  std::vector<std::string> labels = open_prompts(a, src, g, &sample_prompts);
  std::cout << "sampling " << a.n << (a.n == 1 ? " image" : " images") << " from " << src.name;
  if (src.model) std::cout << " (step " << m.step << ", " << (a.no_ema ? "raw" : "EMA") << " weights)";
  std::cout << ": " << g.sample.sampler << ", " << g.sample.steps << " steps, cfg " << g.sample.cfg << std::endl;
  Generated out = generate(den, m.cfg.model.in_channels, m.cfg.model.image_size, g);
  if (tty) std::printf("\n");
  int64_t cols = std::min<int64_t>(a.n, 10);
  if (!labels.empty()) {
    cols = g.per_class;  // a row per prompt
  } else if (classes > 0 && a.class_id < 0 && !g.labels.defined()) {
    cols = g.per_class;
    for (int64_t r = 0; r * cols < a.n; ++r) {
      const int64_t c = out.labels[r * cols].item<int64_t>();
      labels.push_back(c < static_cast<int64_t>(m.class_names.size()) ? m.class_names[c]
                                                                      : "class " + std::to_string(c));
    }
  } else if (classes > 0 && a.class_id >= 0 && !g.labels.defined()) {  // --class: every row names it
    const std::string name = a.class_id < static_cast<int64_t>(m.class_names.size())
                                 ? m.class_names[static_cast<size_t>(a.class_id)]
                                 : "class " + std::to_string(a.class_id);
    labels.assign(static_cast<size_t>((a.n + cols - 1) / cols), name);
  }
  save_image_grid(a.out, out.images, cols, labels);
  if (controls) {
    const std::string maps_png =
        (fs::path(a.out).parent_path() / (fs::path(a.out).stem().string() + "-control.png")).string();
    save_image_grid(maps_png, controls->maps, cols, labels);
    std::printf("control fidelity: %s-map MSE %.4f of the samples against the given maps\n", controls->type.c_str(),
                control_error(controls->type, out.images, controls->maps));
    std::cout << "wrote " << maps_png << " (the control maps, laid out as the samples)" << std::endl;
  }
  if (refs) {
    const std::string refs_png =
        (fs::path(a.out).parent_path() / (fs::path(a.out).stem().string() + "-reference.png")).string();
    save_image_grid(refs_png, refs->images, cols, labels);
    std::printf("embedding similarity: %.4f (mean cosine of the samples' and their references' embeddings)\n",
                embed_similarity(*refs->embedder, out.images, refs->images));
    std::cout << "wrote " << refs_png << " (the reference images, laid out as the samples)" << std::endl;
  }
  // (cfg 0 runs the null condition alone: one batch.)
  const bool guided = g.sample.cfg != 1.0 && g.sample.cfg != 0.0 && (classes > 0 || g.text.context.defined());
  std::cout << "NFE " << out.nfe << " per image" << (guided ? " (CFG: batch of 2)" : "")
            << ", " << out.seconds << " s, " << a.n / out.seconds << " img/s\n";
  if (src.ensemble) std::cout << src.ensemble->usage_report(a.n);
  std::cout << "wrote " << a.out << std::endl;
  if (!a.png_dir.empty()) write_png_folder(a.png_dir, out.images, sample_prompts);
  if (!a.raw.empty()) {
    SafetensorsFile f;
    f.tensors["images"] = to_uint8(out.images);
    f.tensors["labels"] = out.labels;
    f.tensors["samples"] = out.images;
    if (out.latents.defined()) f.tensors["latents"] = out.latents;
    f.metadata["checkpoint"] = src.name;
    f.metadata["data_source"] = origin_of(m.cfg.data);  // ddm eval refuses samples of non-Fashion-MNIST models
    f.metadata["sampler"] = g.sample.sampler;
    f.metadata["steps"] = std::to_string(g.sample.steps);
    f.metadata["cfg"] = std::to_string(g.sample.cfg);
    f.metadata["seed"] = std::to_string(g.seed);
    if (!a.init_noise.empty()) f.metadata["init_noise"] = a.init_noise;
    if (!sample_prompts.empty()) {
      f.metadata["prompts"] = nlohmann::json(sample_prompts).dump();  // sample i's prompt: json.loads(...)[i]
      f.metadata["negative_prompt"] = a.negative_prompt;
    }
    save_safetensors(a.raw, f);
    std::cout << "wrote " << a.raw << " (images uint8 NCHW, labels, samples float in [-1, 1]"
              << (out.latents.defined() ? ", latents: the sampled latents before decoding" : "")
              << (sample_prompts.empty() ? "" : "; metadata \"prompts\": each sample's prompt, a JSON list") << ")"
              << std::endl;
  }
}

void add_sample_flags(CLI::App* cmd, SampleArgs& a) {
  // (Every sample is kept in memory for the grid and --raw: a million 64x64 RGB images are 49 GB.)
  cmd->add_option("--n", a.n, "number of images (at most 1000000; all are held in memory)")
      ->check(number_in(1, 1e6, "a positive integer up to 1000000"));
  cmd->add_option("--steps", a.steps, "solver steps (default: the run's sample.steps)")
      ->default_str("")
      ->check(number_in(1, 1e5, "a positive integer up to 100000"));
  cmd->add_option("--sampler", a.sampler,
                  "euler | heun | ddim | ddpm (default: the run's sample.sampler). For Stable Diffusion's "
                  "discrete schedule, ddim is the step of diffusers' EulerDiscreteScheduler with Karras sigmas: "
                  "what diffusers samples from the same noise (docs/stable-diffusion.md)")
      ->check(CLI::IsMember({"euler", "heun", "ddim", "ddpm"}));
  cmd->add_option("--cfg", a.cfg, "classifier-free guidance scale; 1 = off, 0 = unconditional (default: the run's)")
      ->default_str("")
      ->check(kNonNegative);
  cmd->add_option("--class", a.class_id, "sample only this class, 0..classes-1 (default: one row per class)")
      ->default_str("")
      ->check(kNonNegative);
  cmd->add_option("--prompt", a.prompts,
                  "a text model's prompt; give it once per row of the grid (n / prompts samples each)");
  cmd->add_option("--prompts", a.prompts_file,
                  "a UTF-8 file of a text model's prompts, one per line (after --prompt's; a blank line is the empty "
                  "prompt)");
  cmd->add_option("--negative-prompt", a.negative_prompt,
                  "what guidance steers away from (default: the empty prompt, the null condition the model learned)");
  cmd->add_option("--text-encoder", a.text_encoder,
                  "a text model's frozen encoder where it is now, if it moved since training (the same weights: "
                  "checked against the sha256 the checkpoint records)");
  cmd->add_option("--seed", a.seed, "sampling seed")->check(kNonNegative);
  cmd->add_option("--init-noise", a.init_noise,
                  "a safetensors file whose tensor `noise` [n, C, H, W] (float, one row per image; a latent model's "
                  "latent shape) is the noise the samples start from instead of the seeded draws, as diffusers "
                  "pipelines take `latents=` (with --sampler ddim the same images, where diffusers is given that "
                  "scheduler and the noise as docs/stable-diffusion.md says)");
  cmd->add_option("--batch", a.batch, "images per network batch")->check(kPositive);
  cmd->add_option("--threads", a.threads, "intra-op threads (0 = all cores)")->check(kNonNegative);
  cmd->add_flag("--no-ema", a.no_ema, "use the raw weights instead of the EMA");
  cmd->add_option("--device", a.device,
                  "auto | cpu | cuda | cuda:N: where the network (an ensemble: its experts and router; ddm eval: the feature "
                  "network too) runs (auto: the GPU "
                  "if LibTorch sees one, else the "
                  "CPU). The noise is drawn on the CPU, so every device starts from the same noise")
      ->check(kDeviceSpec);
  cmd->add_option("--precision", a.precision,
                  "fp32 | bf16 | fp16: bf16 runs the network under bfloat16 autocast (faster on GPUs of compute "
                  "capability 8.0 and newer), fp16 under float16 autocast (for GPUs without bfloat16 tensor cores: "
                  "T4); the sampler integrates in float32 either way")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cmd->add_flag("--cuda-graphs", a.cuda_graphs,
                "GPUs: capture the network's forward as a CUDA graph (one per batch shape) and replay it at every "
                "step: the same images, fewer kernel launches by the host. With --ensemble, every expert's and the "
                "router's, each expert's batch padded to a multiple of B / 4K rows for K experts and B images per "
                "network batch, the smaller of --batch and --n (images within float rounding of the unpadded ones)");
  cmd->add_option("--ensemble", a.ensemble,
                  "sample a decentralized ensemble: a directory with ensemble.json (from ddm ensemble)");
  cmd->add_option("--routing", a.routing,
                  "with --ensemble: top1 | topk:K | full | threshold:P | sample | oracle (default: the manifest's, "
                  "normally top1). Per step and per sample; see docs/decentralized.md");
  cmd->add_option("--control", a.control_file,
                  "a ControlNet's control maps: a PNG of one map, or a grid of image-size tiles without margins (read "
                  "row by row, repeated if fewer than --n); also measures any model's fidelity to them");
  cmd->add_option("--control-from", a.control_from,
                  "control maps of the first --n images of this split of the model's data, with their labels (a "
                  "ControlNet is steered by them; any model's samples are measured against them)")
      ->check(CLI::IsMember({"train", "test"}));
  cmd->add_option("--reference", a.reference_file,
                  "a model.embed model's reference images: a PNG of one image, or a grid of image-size tiles without "
                  "margins (row by row, repeated if fewer than --n); also measures any model's embedding similarity");
  cmd->add_option("--reference-from", a.reference_from,
                  "reference images: the first --n images of this split of the model's data, with their labels")
      ->check(CLI::IsMember({"train", "test"}));
  cmd->add_option("--control-type", a.control_type,
                  "edges | lowres: the maps of --control-from (default: the model's model.control, edges)")
      ->check(CLI::IsMember({"edges", "lowres"}));
  cmd->add_flag("--one-expert-at-a-time", a.one_expert_at_a_time,
                "GPUs, with --ensemble: run the experts one after another on one CUDA stream, rather than side by side "
                "each on a stream of its own (the default: small experts' kernels leave most of the GPU idle, side by "
                "side they share it). The same images; the memory of one expert's forward pass at a time instead of "
                "all of them at once (a run out of GPU memory side by side goes on one at a time by itself)");
  cmd->add_flag("--allow-missing", a.allow_missing,
                "with --ensemble: sample even if some experts' checkpoints are missing (their probability is "
                "renormalized over the rest)");
}



Command add_sample_command(CLI::App& app) {
  auto a = std::make_shared<SampleArgs>();
  auto* cmd = app.add_subcommand("sample", "Sample a trained model or ensemble into a labelled PNG grid.\n"
                                           "Rows are classes or prompts; --raw keeps the samples as safetensors, --png-dir as "
                                           "PNG files.");
  cmd->add_option("--ckpt", a->ckpt, "run directory (latest checkpoint) or checkpoint directory (or --ensemble)");
  cmd->add_option("--out", a->out, "PNG grid to write");
  cmd->add_option("--raw", a->raw,
                  "also write the samples as a .safetensors file (images, labels, samples; a text model's prompts in its "
                  "metadata \"prompts\", one per sample)");
  cmd->add_option("--png-dir", a->png_dir,
                  "also write each sample as its own PNG into this new directory (for clean-fid, torch-fidelity); "
                  "a text model's prompt beside each, 000000.txt");
  add_sample_flags(cmd, *a);
  cmd->footer("\nExamples:\n"
              "  ddm sample --ckpt runs/mine --out grid.png                 # a row per class\n"
              "  ddm sample --ckpt runs/mine --class 8 --n 16 --sampler heun --steps 10 --out bags.png\n"
              "  ddm sample --ckpt runs/text --prompt 'a red square' --prompt 'a blue circle' --out p.png\n"
              "  ddm sample --ckpt runs/sd --prompt 'a red square' --sampler ddim --steps 30 --cfg 7.5 --out sd.png\n"
              "  ddm sample --ensemble runs/quickstart --routing top1 --out e.png\n"
              "  ddm sample --ckpt runs/photos --n 10000 --png-dir samples/ --out grid.png");
  return Command{cmd, [a] {
                   write_samples(*a);
                   return 0;
                 }};
}

}  // namespace ddm
