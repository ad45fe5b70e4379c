// Measuring a trained autoencoder (see autoencoder_report.h).
#include "train/autoencoder_report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/keyed_random.h"
#include "core/rng.h"
#include "core/run_dir.h"
#include "data/dataset.h"
#include "data/shard_loader.h"
#include "eval/grid.h"
#include "train/loaded_model.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// Keys of images first..first+n-1 for the statistics' posterior noise (a purpose of its own, and a
// "step" no training step has, so they never coincide with a training draw).
std::vector<uint64_t> stats_keys(uint64_t seed, int64_t first, int64_t n) {
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j)
    keys[static_cast<size_t>(j)] = derive_seed({seed, static_cast<uint64_t>(RngPurpose::kPosterior),
                                                ~uint64_t{0}, static_cast<uint64_t>(first + j)});
  return keys;
}

// Up to `per_class` images of each class (or the first per_class * 10 without labels), originals and
// reconstructions in alternating rows.
void save_reconstruction_grid(const std::string& png, const torch::Tensor& x, const torch::Tensor& recon,
                              const torch::Tensor& labels, const std::vector<std::string>& names) {
  const int64_t cols = 8;
  std::vector<torch::Tensor> rows;
  std::vector<std::string> row_names;
  auto add = [&](const torch::Tensor& idx, const std::string& name) {
    if (idx.numel() == 0) return;
    auto pad = [&](torch::Tensor t) {  // [k, C, H, W] -> [cols, C, H, W], blank (black) when short
      if (t.size(0) == cols) return t;
      return torch::cat({t, torch::full({cols - t.size(0), t.size(1), t.size(2), t.size(3)}, -1.0f)});
    };
    rows.push_back(pad(x.index_select(0, idx)));
    rows.push_back(pad(recon.index_select(0, idx)));
    row_names.push_back(name);
    row_names.push_back("  reconstructed");
  };
  if (!names.empty()) {
    for (int64_t c = 0; c < static_cast<int64_t>(names.size()); ++c) {
      const auto idx = (labels == c).nonzero().view(-1);
      add(idx.slice(0, 0, std::min<int64_t>(cols, idx.numel())), names[static_cast<size_t>(c)]);
    }
  } else {
    for (int64_t r = 0; r < 10 && r * cols < x.size(0); ++r)
      add(torch::arange(r * cols, std::min<int64_t>((r + 1) * cols, x.size(0))), "original");
  }
  save_image_grid(png, torch::cat(rows), cols, row_names);
}

}  // namespace

LatentStats measure_latent_stats(AutoencoderImpl& ae, const torch::Tensor& images, uint64_t seed, int64_t batch) {
  torch::NoGradGuard no_grad;
  const AutoencoderShape& s = ae.shape();
  double sum = 0, sum_sq = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < images.size(0); i += batch) {
    const torch::Tensor x = images.slice(0, i, std::min(i + batch, images.size(0)));  // [b, C, H, W]
    const Posterior q = ae.encode(x);
    const torch::Tensor eps = normal_rows(stats_keys(seed, i, x.size(0)),
                                          {s.latent_channels, s.latent_size(), s.latent_size()});
    const torch::Tensor z = q.sample(eps).to(torch::kDouble);  // [b, z, h, w]
    sum += z.sum().item<double>();
    sum_sq += z.square().sum().item<double>();
    count += z.numel();
  }
  DDM_CHECK(count > 1, "measure_latent_stats: no images");
  LatentStats st;
  st.n = images.size(0);
  st.shift = sum / static_cast<double>(count);
  const double var = (sum_sq - sum * st.shift) / static_cast<double>(count - 1);
  DDM_CHECK(std::isfinite(var) && var > 0, "the autoencoder's latents have variance " << var
                                               << ": it cannot be normalized (did its training diverge?)");
  st.scale = 1.0 / std::sqrt(var);
  return st;
}

double mean_psnr(const torch::Tensor& recon, const torch::Tensor& original) {
  DDM_CHECK(recon.sizes() == original.sizes(), "mean_psnr: " << recon.sizes() << " against " << original.sizes());
  // [-1, 1] -> [0, 1] halves the differences: mse01 = mse / 4.
  const torch::Tensor mse = (recon.to(torch::kDouble) - original.to(torch::kDouble)).square().flatten(1).mean(1) / 4;
  const torch::Tensor psnr = torch::where(mse > 0, -10 * torch::log10(mse), torch::full_like(mse, 100.0));  // [N]
  return psnr.mean().item<double>();
}

AutoencoderReport report_autoencoder(const std::string& path, const AutoencoderReportOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel m = load_model(path, /*use_ema=*/true);
  auto ae = std::dynamic_pointer_cast<AutoencoderImpl>(m.net);
  DDM_CHECK(ae, m.checkpoint << " holds a " << m.cfg.model.arch << " model, not an autoencoder (model.arch = "
                             << "autoencoder, trained by `ddm train-autoencoder`)");
  AutoencoderReport r;
  r.checkpoint = m.checkpoint;
  r.step = m.step;
  r.weights = (fs::path(m.checkpoint) / RunDir::kEma).string();
  r.weights_sha256 = sha256_file(r.weights);
  r.latent_channels = ae->shape().latent_channels;
  r.latent_size = ae->shape().latent_size();
  r.factor = ae->shape().factor();
  const auto say = [&](const std::string& s) {
    if (!opt.eval.quiet) std::cout << s << std::endl;
  };

  // Latent statistics on the training data (as trained, without augmentation).
  DataConfig train_data = m.cfg.data;
  // Only images the autoencoder trained on (data.limit), at most stats_n of them.
  train_data.limit = train_data.limit > 0 ? std::min(train_data.limit, opt.stats_n) : opt.stats_n;
  // Shards are streamed: their first images stand for the data here.
  const bool shards = m.cfg.data.source == "shards";
  const int threads = at::get_num_threads();
  const Dataset train = shards ? shard_prefix(train_data, train_data.limit, threads) : load_dataset(train_data);
  say("measuring the latent statistics on " + std::to_string(train.images.size(0)) + " images of " + train.description);
  r.latent = measure_latent_stats(*ae, to_unit_range(train.images), static_cast<uint64_t>(m.cfg.train.seed));

  // Reconstructions of the test split (Fashion-MNIST), else of the training data itself (for shards
  // their first images, as above).
  const bool fmnist = m.cfg.data.source == "fashion-mnist";
  DataConfig test_data = m.cfg.data;
  if (fmnist) test_data.split = "test";
  test_data.limit = opt.n;
  const Dataset test = shards ? shard_prefix(test_data, test_data.limit, threads) : load_dataset(test_data);
  const torch::Tensor x = to_unit_range(test.images);  // [N, C, H, W]
  r.reconstructed = test.description;
  say("reconstructing " + std::to_string(x.size(0)) + " images of " + test.description);
  torch::Tensor recon = torch::empty_like(x);
  {
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < x.size(0); i += 500) {
      const int64_t e = std::min<int64_t>(i + 500, x.size(0));
      recon.slice(0, i, e).copy_(ae->forward(x.slice(0, i, e), {}, {}).clamp(-1, 1));
    }
  }
  r.psnr = mean_psnr(recon, x);
  if (fmnist) {
    SampleSet set;
    set.images = recon;
    set.labels = test.labels;
    set.origin = "reconstructions by " + m.checkpoint;
    r.eval = evaluate_samples(set, opt.eval);
    r.has_fd = true;
  }
  if (!opt.png.empty())
    save_reconstruction_grid(opt.png, x, recon, test.labels, test.num_classes > 0 ? test.class_names : std::vector<std::string>{});
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

nlohmann::json AutoencoderReport::json() const {
  nlohmann::json j = {{"checkpoint", fs::path(checkpoint).filename().string()},
                      {"step", step},
                      {"weights", fs::path(weights).filename().string()},
                      {"weights_sha256", weights_sha256},
                      {"latent_shape", {latent_channels, latent_size, latent_size}},
                      {"factor", factor},
                      {"latent_shift", latent.shift},
                      {"latent_scale", latent.scale},
                      {"latent_stats_images", latent.n},
                      {"reconstructed", reconstructed},
                      {"psnr_db", psnr},
                      {"seconds", seconds}};
  if (has_fd) j["eval"] = nlohmann::json::parse(eval.json());
  return j;
}

std::string AutoencoderReport::table() const {
  std::ostringstream o;
  char buf[200];
  o << "autoencoder      " << checkpoint << " (step " << step << ", " << fs::path(weights).filename().string() << ")\n";
  std::snprintf(buf, sizeof buf, "latents          %lldx%lldx%lld (downsampling %lld)\n",
                static_cast<long long>(latent_channels), static_cast<long long>(latent_size),
                static_cast<long long>(latent_size), static_cast<long long>(factor));
  o << buf;
  std::snprintf(buf, sizeof buf, "latent scale     %.5f, shift %.5f (of %lld training images)\n", latent.scale,
                latent.shift, static_cast<long long>(latent.n));
  o << buf;
  o << "reconstructed    " << reconstructed << "\n";
  std::snprintf(buf, sizeof buf, "PSNR             %.2f dB\n", psnr);
  o << buf;
  if (has_fd) o << eval.table();
  return o.str();
}

}  // namespace ddm
