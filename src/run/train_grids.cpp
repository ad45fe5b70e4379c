// Grids of samples while a model trains (see train_grids.h).
#include "run/train_grids.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/fileio.h"
#include "core/run_dir.h"
#include "data/control.h"
#include "data/shard_write.h"
#include "diffusion/generate.h"
#include "diffusion/path.h"
#include "eval/grid.h"
#include "train/embed.h"
#include "train/text.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// A text model's rows: train.sample_prompts, else the data's first 4 distinct captions.
std::vector<std::string> grid_prompts(const RunConfig& cfg, const std::vector<std::string>& captions) {
  if (!cfg.train.sample_prompts.empty()) return cfg.train.sample_prompts;
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const std::string& c : captions) {
    if (c.empty() || !seen.insert(c).second) continue;
    out.push_back(c);
    if (static_cast<int64_t>(out.size()) == std::min<int64_t>(4, cfg.train.sample_n)) break;
  }
  DDM_CHECK(!out.empty(), "train.sample_every = " << cfg.train.sample_every << ": the model is conditioned on text "
                          "and the data holds no caption to take the grid's prompts from: set "
                          "train.sample_prompts = [\"a first prompt\", \"a second\"] (one row each)");
  return out;
}

// Swaps the named tensors into the network's parameters of the same names, and back on destruction.
class SwappedWeights {
 public:
  SwappedWeights(NetImpl& net, const TensorMap& weights) {
    torch::NoGradGuard no_grad;
    for (const auto& item : net.named_parameters()) {
      const auto it = weights.find(item.key());
      if (it == weights.end()) continue;  // frozen: no EMA of its own
      const torch::Tensor& p = item.value();
      kept_.emplace_back(p, p.detach().clone());
      p.detach().copy_(it->second);
    }
  }
  ~SwappedWeights() {
    torch::NoGradGuard no_grad;
    for (auto& [p, was] : kept_) p.detach().copy_(was);
  }
  SwappedWeights(const SwappedWeights&) = delete;
  SwappedWeights& operator=(const SwappedWeights&) = delete;

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> kept_;
};

// Puts the network in evaluation mode for a scope, and back into the mode it was in.
class EvalMode {
 public:
  explicit EvalMode(NetImpl& net) : net_(net), was_training_(net.is_training()) { net_.eval(); }
  ~EvalMode() { net_.train(was_training_); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  NetImpl& net_;
  bool was_training_;
};

}  // namespace

TrainingGrids::TrainingGrids(const RunConfig& cfg, Net net, std::shared_ptr<const LatentSpace> latent,
                             const Dataset& data, torch::Device device, std::string dir)
    : cfg_(cfg),
      net_(std::move(net)),
      latent_(std::move(latent)),
      class_names_(data.class_names),
      device_(device),
      dir_(std::move(dir)),
      every_(cfg.train.sample_every) {
  if (every_ == 0) return;
  den_ = std::make_unique<Denoiser>(net_, make_path(cfg_.diffusion), prediction_for(cfg_.diffusion),
                                    cfg_.model.num_classes);
  const int64_t n = cfg_.train.sample_n, classes = cfg_.model.num_classes;
  if (!cfg_.model.controlnet.empty() || !cfg_.model.embed.empty()) {
    // Rows: the data's first images (at most 4), each led by what its samples are conditioned on.
    const int64_t rows = std::min<int64_t>({4, n, data.images.size(0)});
    DDM_CHECK(rows > 0, "train.sample_every: the data holds no image to condition the grid's samples on");
    cols_ = std::max<int64_t>(1, n / rows);
    const torch::Tensor images = to_unit_range(data.images.slice(0, 0, rows));        // [rows, C, H, W]
    const torch::Tensor row_of = torch::arange(rows * cols_, torch::kLong).div(cols_, "floor");  // [rows * cols]
    if (!cfg_.model.controlnet.empty()) {
      const torch::Tensor maps = control_map(cfg_.model.control, images);            // [rows, Cc, H, W]
      control_ = maps.index_select(0, row_of).to(device_);                            // [n, Cc, H, W]
      leads_ = maps.size(1) == images.size(1) ? maps : maps.mean(1, true).expand_as(images);  // [rows, C, H, W]
    } else {
      const auto embedder = ImageEmbedder::load(cfg_.model, device_);
      embed_ = embedder->embed(images.to(device_)).index_select(0, row_of.to(device_));  // [n, D]
      leads_ = images;
    }
    if (classes > 0) labels_ = data.labels.slice(0, 0, rows).index_select(0, row_of).to(device_);  // [n]
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = classes > 0 ? data.labels[r].item<int64_t>() : -1;
      rows_.push_back(c >= 0 && c < static_cast<int64_t>(class_names_.size()) ? class_names_[c]
                                                                             : "image " + std::to_string(r));
    }
  } else if (!cfg_.model.text_encoder.empty()) {
    const std::vector<std::string> prompts = grid_prompts(cfg_, data.captions);
    const auto p = static_cast<int64_t>(prompts.size());
    // The encoder is needed once: for the prompts and guidance's empty prompt.
    const auto encoder = load_pinned_text_encoder(cfg_.model, device_);
    const Cond enc = encode_texts(*encoder, prompts, device_);  // [P, T, D], [P, T], [P, Pd]
    den_->set_null_text(encode_texts(*encoder, {""}, device_));
    cols_ = std::max<int64_t>(1, n / p);
    text_ = enc.select(torch::arange(n, torch::kLong).div(cols_, "floor").remainder(p).to(device_));  // [n, ...]
    for (int64_t r = 0; r * cols_ < n; ++r) rows_.push_back(grid_row_label(prompts[r % p]));
  } else if (classes > 0) {
    cols_ = std::max<int64_t>(1, n / classes);
    for (int64_t r = 0; r * cols_ < n; ++r) {
      const int64_t c = r % classes;
      rows_.push_back(c < static_cast<int64_t>(class_names_.size()) ? class_names_[c] : "class " + std::to_string(c));
    }
  } else {
    cols_ = std::min<int64_t>(n, 10);
  }
}

std::string TrainingGrids::describe() const {
  if (every_ == 0) return "";
  const SampleConfig& s = cfg_.sample;
  std::string rows = !text_.context.defined() ? (cfg_.model.num_classes > 0 ? "a row per class" : "unconditional")
                                              : std::to_string(rows_.size()) + " prompt row(s)";
  if (leads_.defined())
    rows = std::to_string(rows_.size()) + " row(s) of the data's first images, each led by its " +
           (control_.defined() ? cfg_.model.control + " map" : std::string("reference image"));
  const int64_t n = leads_.defined() ? static_cast<int64_t>(rows_.size()) * cols_ : cfg_.train.sample_n;
  return "grids: every " + std::to_string(every_) + " steps, " + std::to_string(n) + " samples (" +
         rows + "; " + (s.use_ema ? "EMA" : "raw") + " weights, " + s.sampler + ", " + std::to_string(s.steps) +
         " steps, cfg " + format_number("%g", s.cfg) + ") into " + dir_ + "/" + RunDir::kGrids + "/ and " + dir_ + "/" +
         RunDir::kTensorBoard + "/";
}

TrainingGrids::Written TrainingGrids::write(int64_t step, const TensorMap& ema) {
  DDM_CHECK(den_, "TrainingGrids::write: train.sample_every is 0");
  GenerateOptions g;
  g.n = leads_.defined() ? static_cast<int64_t>(rows_.size()) * cols_ : cfg_.train.sample_n;
  g.sample.sampler = cfg_.sample.sampler;
  g.sample.steps = cfg_.sample.steps;
  g.sample.cfg = cfg_.sample.cfg;
  g.seed = static_cast<uint64_t>(cfg_.train.seed);  // the same noise at every step: the grids show the training
  g.per_class = cols_;
  g.batch_size = std::max<int64_t>(1, std::min(g.n, cfg_.train.batch_size));
  if (latent_) g.decode = [latent = latent_](const torch::Tensor& z) { return latent->decode(z); };  // [B, C, H, W]
  g.text = text_;
  g.control = control_;
  g.embed = embed_;
  g.labels = labels_;
  Generated out;
  {
    torch::NoGradGuard no_grad;
    const EvalMode eval(*net_);
    std::optional<SwappedWeights> swapped;
    if (cfg_.sample.use_ema && !ema.empty()) swapped.emplace(*net_, ema);
    out = generate(*den_, cfg_.model.in_channels, cfg_.model.image_size, g);
  }
  Written w;
  w.path = (fs::path(dir_) / RunDir::kGrids / ("step-" + zero_padded(step, 8) + ".png")).string();
  fs::create_directories(fs::path(w.path).parent_path());
  if (leads_.defined()) {  // each row: its map or reference, then its samples
    const int64_t rows = leads_.size(0);
    const torch::Tensor samples = out.images.to(torch::kCPU).reshape({rows, cols_, out.images.size(1),
                                                                      out.images.size(2), out.images.size(3)});
    const torch::Tensor grid = torch::cat({leads_.unsqueeze(1).to(samples.dtype()), samples}, 1);  // [rows, 1 + cols, C, H, W]
    save_image_grid(w.path, grid.flatten(0, 1), cols_ + 1, rows_);
  } else {
    save_image_grid(w.path, out.images, cols_, rows_);
  }
  w.png = read_file(w.path);
  return w;
}

}  // namespace ddm
