// Batched generation with per-sample seeded noise (see generate.h).
#include "diffusion/generate.h"

#include <chrono>

#include "core/error.h"
#include "core/rng.h"

namespace ddm {

torch::Tensor sample_labels(int64_t n, int64_t num_classes, int64_t class_id, int64_t per_class) {
  DDM_CHECK(num_classes > 0 || class_id < 0,
            "--class " << class_id << ": the model has no classes (trained without labels); drop --class");
  if (num_classes == 0) return torch::zeros({n}, torch::kLong);
  DDM_CHECK(class_id >= -1 && class_id < num_classes,
            "--class " << class_id << " is out of range: the model has classes 0.." << num_classes - 1);
  if (class_id >= 0) return torch::full({n}, class_id, torch::kLong);
  DDM_CHECK(per_class > 0, "per_class must be > 0");
  return torch::arange(n, torch::kLong).div(per_class, "floor").remainder(num_classes);
}

Generated generate(const Denoiser& den, int64_t channels, int64_t size, const GenerateOptions& opt) {
  DDM_CHECK(opt.n > 0, "the number of samples must be > 0, got " << opt.n);
  DDM_CHECK(opt.batch_size > 0, "the sampling batch size must be > 0, got " << opt.batch_size);
  const auto t0 = std::chrono::steady_clock::now();
  Generated g;
  if (opt.labels.defined()) {
    DDM_CHECK(opt.labels.dim() == 1 && opt.labels.size(0) == opt.n, "generate: " << opt.labels.sizes()
                                                                              << " labels for " << opt.n << " samples");
    g.labels = den.num_classes() == 0 ? torch::zeros({opt.n}, torch::kLong) : opt.labels;
  } else {
    g.labels = sample_labels(opt.n, den.num_classes(), opt.class_id, opt.per_class);
  }
  DDM_CHECK(!opt.control.defined() || opt.control.size(0) == opt.n,
            "generate: " << opt.control.size(0) << " control maps for " << opt.n << " samples");
  DDM_CHECK(!opt.embed.defined() || opt.embed.size(0) == opt.n,
            "generate: " << opt.embed.size(0) << " embeddings for " << opt.n << " samples");
  DDM_CHECK(!opt.text.context.defined() || opt.text.context.size(0) == opt.n,
            "generate: " << opt.text.context.size(0) << " prompt encodings for " << opt.n << " samples");
  DDM_CHECK(!opt.init_noise.defined() || opt.init_noise.sizes() == torch::IntArrayRef({opt.n, channels, size, size}),
            "generate: initial noise of shape " << opt.init_noise.sizes() << " for " << opt.n << " samples of "
                                                << channels << "x" << size << "x" << size);
  std::vector<torch::Tensor> chunks, latents;
  for (int64_t start = 0; start < opt.n; start += opt.batch_size) {
    const int64_t b = std::min(opt.batch_size, opt.n - start);
    std::vector<torch::Tensor> noise;
    if (opt.init_noise.defined()) noise.push_back(opt.init_noise.narrow(0, start, b).to(torch::kFloat));  // [b,C,H,W]
    for (int64_t i = start; i < start + b && !opt.init_noise.defined(); ++i) {
      auto gen = make_generator(derive_seed({opt.seed, static_cast<uint64_t>(RngPurpose::kSample), 0xfeedULL,
                                             static_cast<uint64_t>(i)}));
      noise.push_back(torch::randn({1, channels, size, size}, gen));  // [1,C,H,W]
    }
    SampleOptions so = opt.sample;
    so.seed = opt.seed;
    so.first_index = start;  // later draws are keyed by the sample's number too, not by this batch
    Cond c(g.labels.narrow(0, start, b));                                // [b]
    if (opt.control.defined()) c.control = opt.control.narrow(0, start, b);  // [b, Cc, H, W]
    if (opt.embed.defined()) c.embed = opt.embed.narrow(0, start, b);        // [b, D]
    if (opt.text.context.defined()) {
      const Cond t = opt.text.rows(start, b);
      c.context = t.context;            // [b, T, D]
      c.context_mask = t.context_mask;  // [b, T]
      c.pooled = t.pooled;              // [b, P]
    }
    // On the network's device (the noise is drawn on the CPU, the same on every device); back on the CPU.
    const torch::Device dev = den.device();
    c = c.to(dev);
    auto res = sample(den, torch::cat(noise).to(dev), c, so);                            // [b,C,H,W]
    chunks.push_back((opt.decode ? opt.decode(res.x) : res.x.clamp(-1, 1)).to(torch::kCPU));  // [b, C, H, W]
    if (opt.decode) latents.push_back(res.x.to(torch::kCPU));                                  // [b, z, h, w]
    g.nfe = res.nfe;
    if (opt.on_progress) opt.on_progress(start + b, opt.n);
  }
  g.images = torch::cat(chunks);
  if (!latents.empty()) g.latents = torch::cat(latents);
  // A NaN survives clamp() and would be written as a black tile: refuse instead.
  const int64_t bad = torch::isfinite(g.images.reshape({opt.n, -1})).all(1).logical_not().sum().item<int64_t>();
  DDM_CHECK(bad == 0, bad << " of " << opt.n << " samples hold NaN or inf: the model produced non-finite output "
                          << "(cfg " << opt.sample.cfg << ", " << opt.sample.sampler << ", " << opt.sample.steps
                          << " steps). Try a smaller --cfg, another sampler, or an earlier checkpoint");
  g.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return g;
}

}  // namespace ddm
