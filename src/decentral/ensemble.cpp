// Routed expert ensemble (see ensemble.h).
#include "decentral/ensemble.h"

#include <cstdio>
#include <iostream>
#include <sstream>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "core/cuda_graph.h"
#include "core/cuda_module.h"
#include "core/error.h"
#include "core/rng.h"
#include "diffusion/path.h"

namespace ddm {

namespace {
torch::Tensor col(const torch::Tensor& v) { return v.view({-1, 1, 1, 1}); }

const char* kRoutingForms = "top1, topk:K (e.g. topk:2), full, threshold:P (e.g. threshold:0.05), sample, oracle";

double parse_number(const std::string& spec, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  DDM_FAIL("--routing " << spec << ": '" << text << "' is not a number; the forms are " << kRoutingForms);
}
}  // namespace

Routing parse_routing(const std::string& spec) {
  Routing r;
  r.spec = spec;
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon), arg = colon == std::string::npos ? "" : spec.substr(colon + 1);
  const bool has_arg = colon != std::string::npos;
  if (name == "top1" && !has_arg) {
    r.kind = Routing::Kind::kTop1;
  } else if (name == "full" && !has_arg) {
    r.kind = Routing::Kind::kFull;
  } else if (name == "sample" && !has_arg) {
    r.kind = Routing::Kind::kSample;
  } else if (name == "oracle" && !has_arg) {
    r.oracle = true;
  } else if (name == "topk" && has_arg) {
    const double k = parse_number(spec, arg);
    // Range first: casting a double beyond int64 (or NaN) to int64 is undefined.
    DDM_CHECK(k >= 1 && k <= 1e9 && k == static_cast<double>(static_cast<int64_t>(k)),
              "--routing " << spec << ": K must be a whole number >= 1");
    r.kind = Routing::Kind::kTopK;
    r.k = static_cast<int64_t>(k);
  } else if (name == "threshold" && has_arg) {
    r.threshold = parse_number(spec, arg);
    DDM_CHECK(r.threshold >= 0 && r.threshold < 1, "--routing " << spec << ": P must be in [0, 1)");
    r.kind = Routing::Kind::kThreshold;
  } else {
    DDM_FAIL("--routing " << spec << " is not a routing strategy; the forms are " << kRoutingForms);
  }
  return r;
}

torch::Tensor routing_weights(const torch::Tensor& probs, const Routing& r, const torch::Tensor& uniforms) {
  const int64_t K = probs.size(1);
  auto one_hot = [&](const torch::Tensor& idx) {  // idx int64 [B] -> [B, K]
    return torch::zeros_like(probs).scatter_(1, idx.unsqueeze(1), 1.0);
  };
  auto renormalize = [](const torch::Tensor& w) { return w / w.sum(1, true); };
  switch (r.kind) {
    case Routing::Kind::kTop1: return one_hot(probs.argmax(1));
    case Routing::Kind::kFull: return renormalize(probs);
    case Routing::Kind::kSample: {
      DDM_CHECK(uniforms.defined() && uniforms.numel() == probs.size(0), "sample routing needs one uniform per row");
      auto cdf = probs.to(torch::kDouble).cumsum(1);                                      // [B, K]
      auto target = uniforms.to(torch::kDouble).view({-1, 1}) * cdf.narrow(1, K - 1, 1);  // [B, 1]
      return one_hot(cdf.le(target).sum(1).clamp_max(K - 1));  // the first expert with cdf > target
    }
    case Routing::Kind::kTopK: {
      auto top = probs.topk(std::min(r.k, K), 1);  // values, indices [B, k]
      return renormalize(torch::zeros_like(probs).scatter_(1, std::get<1>(top), std::get<0>(top)));
    }
    case Routing::Kind::kThreshold: {
      auto kept = torch::where(probs > r.threshold, probs, torch::zeros_like(probs));  // [B, K]
      auto none = kept.sum(1, true).eq(0);                                             // [B, 1]
      return renormalize(torch::where(none, one_hot(probs.argmax(1)), kept));
    }
  }
  DDM_FAIL("unknown routing strategy");
}

RouterFn net_router(Net router, NoisePath router_path, NoisePath sampling_path) {
  return [router, router_path, sampling_path](const torch::Tensor& x, const torch::Tensor& t, const Cond& y) {
    const PathMatch m = match_path(sampling_path, t, router_path);
    return torch::softmax(router->forward(x * col(m.scale), m.t, y), 1);  // [B, K]
  };
}

RouterFn oracle_router(const Dataset& data, const torch::Tensor& clusters, int64_t k, NoisePath sampling_path,
                       torch::Tensor x0, torch::Device device) {
  const int64_t n = data.images.size(0);
  DDM_CHECK(clusters.size(0) == n, "oracle router: " << clusters.size(0) << " cluster labels for " << n << " images");
  DDM_CHECK(!x0.defined() || x0.size(0) == n, "oracle router: " << x0.size(0) << " rows for " << n << " images");
  x0 = (x0.defined() ? x0 : to_unit_range(data.images)).reshape({n, -1}).to(device);  // [N, D]
  const auto sq = x0.pow(2).sum(1);                                                  // [N]
  const auto member = torch::one_hot(clusters, k).to(torch::kFloat32).to(device);    // [N, K]
  const auto labels = data.labels.to(device);
  const int64_t classes = data.num_classes;
  // The prompt is not conditioned on: text ensembles' oracle is the posterior given the class alone.
  return [=](const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
    const torch::Tensor& y = c.y;
    const int64_t b = x.size(0);
    auto a = sampling_path.alpha(t).view({-1, 1}), s = sampling_path.sigma(t).view({-1, 1});  // [B, 1]
    // log N(x; a x0_i, s^2 I) up to terms constant in i: (a x.x0_i - a^2 |x0_i|^2 / 2) / s^2.
    auto logits = (a * torch::mm(x.reshape({b, -1}), x0.t()) - 0.5 * a * a * sq.unsqueeze(0)) / (s * s);  // [B, N]
    if (classes > 0) {  // condition on the class unless the label is null
      auto other = labels.unsqueeze(0).ne(y.unsqueeze(1)) & y.lt(classes).unsqueeze(1);  // [B, N]
      logits = logits.masked_fill(other, -std::numeric_limits<float>::infinity());
    }
    auto w = torch::exp(logits - std::get<0>(logits.max(1, true)));  // [B, N]
    auto p = torch::mm(w, member);                                     // [B, K]
    return p / p.sum(1, true);
  };
}

Ensemble::Ensemble(std::vector<std::optional<Denoiser>> experts, std::vector<double> expert_flops, RouterFn router,
                   double router_flops, NoisePath sampling_path, int64_t num_classes, Routing routing, uint64_t seed,
                   torch::Device device)
    : experts_(std::move(experts)),
      expert_flops_(std::move(expert_flops)),
      router_(std::move(router)),
      router_flops_(router_flops),
      path_(sampling_path),
      num_classes_(num_classes),
      routing_(std::move(routing)),
      seed_(seed),
      device_(device) {
  const int64_t K = k();
  DDM_CHECK(K >= 1 && static_cast<int64_t>(expert_flops_.size()) == K, "ensemble: one FLOP count per expert");
  present_ = torch::zeros({K});
  for (int64_t e = 0; e < K; ++e)
    if (experts_[e]) present_[e] = 1.0;
  DDM_CHECK(present_.sum().item<double>() > 0, "ensemble: no expert is present");
  // Experts that share a network do not run side by side: a network may fill caches of its own (autocast's
  // weight casts) on one stream that another would then read unordered.
  for (int64_t a = 0; a < K; ++a)
    for (int64_t b = a + 1; b < K; ++b)
      if (experts_[a] && experts_[b] && experts_[a]->network() != nullptr &&
          experts_[a]->network() == experts_[b]->network())
        shared_network_ = true;
  present_ = present_.to(device_);
  reset_usage();
}

void Ensemble::reset_usage() {
  usage_ = EnsembleUsage();
  usage_.expert_evals.assign(experts_.size(), 0);
  usage_.group_sizes.assign(experts_.size(), {});
}

void Ensemble::set_group_quantum(int64_t rows) {
  DDM_CHECK(rows >= 0, "ensemble: a group quantum of " << rows << " rows");
  quantum_ = rows;
}

Denoiser::Estimate Ensemble::estimate(const torch::Tensor& x, const torch::Tensor& t, const Cond& y,
                                      double w, const torch::Tensor& keys) const {
  const int64_t b = x.size(0);
  // The router sees the class label, or the null label when the whole sample is unconditional.
  const auto longs = torch::TensorOptions().dtype(torch::kLong).device(x.device());
  Cond route(num_classes_ == 0 ? torch::zeros({b}, longs) : (w == 0.0 ? torch::full({b}, num_classes_, longs) : y.y));
  if (y.pooled.defined()) {  // text: the prompt's pooled embedding, or the null prompt's when unconditional
    DDM_CHECK(w != 0.0 || null_text_.pooled.defined(), "ensemble: guidance of text experts needs the empty prompt's "
                                                      "encoding (Ensemble::set_null_text)");
    route.pooled = w == 0.0 ? null_text_.pooled.to(x.device()).expand({b, -1}) : y.pooled;  // [B, P]
  }
  auto probs = router_(x, t, route);                  // [B, K]
  const auto present = present_.to(probs.scalar_type()).unsqueeze(0);  // [1, K]
  probs = probs * present;
  auto mass = probs.sum(1, true);                       // [B, 1]
  probs = torch::where(mass > 0, probs / mass.clamp_min(1e-30), present.expand_as(probs) / present.sum());
  torch::Tensor uniforms;  // [B]: each sample's draw for `sample` routing
  if (routing_.kind == Routing::Kind::kSample) {
    DDM_CHECK(!keys.defined() || keys.numel() == b, "ensemble: " << keys.numel() << " sample keys for " << b << " samples");
    const auto k = keys.defined() ? keys.to(torch::kCPU, torch::kLong).contiguous() : torch::Tensor();
    uniforms = torch::empty({b}, torch::kDouble);
    double* u = uniforms.data_ptr<double>();
    for (int64_t j = 0; j < b; ++j) {
      const uint64_t key = k.defined() ? static_cast<uint64_t>(k.data_ptr<int64_t>()[j])
                                       : derive_seed({static_cast<uint64_t>(usage_.calls), static_cast<uint64_t>(j)});
      u[j] = uniform_from_key(derive_seed({seed_, static_cast<uint64_t>(RngPurpose::kSample), 0x0e7e11ULL, key}));
    }
    uniforms = uniforms.to(x.device());  // drawn on the host: the same draws on every device
  }
  usage_.router_flops += static_cast<double>(b) * router_flops_;
  return combine(x, t, y, w, routing_weights(probs, routing_, uniforms));
}

Denoiser::Estimate Ensemble::estimate_assigned(const torch::Tensor& x, const torch::Tensor& t, const Cond& y,
                                               const torch::Tensor& experts) const {
  DDM_CHECK(experts.numel() == x.size(0) && experts.min().item<int64_t>() >= 0 && experts.max().item<int64_t>() < k(),
            "ensemble: expert indices must be 0.." << k() - 1);
  for (int64_t e = 0; e < k(); ++e)
    DDM_CHECK(experts_[e] || !experts.eq(e).any().item<bool>(), "ensemble: expert " << e << " is missing");
  const auto weights = torch::zeros({x.size(0), k()}, x.options()).scatter_(1, experts.to(x.device()).view({-1, 1}), 1.0);  // [B, K]
  return combine(x, t, y, 1.0, weights);
}

void Ensemble::set_null_text(const Cond& null_text) {
  null_text_ = null_text;
  for (auto& e : experts_)
    if (e) e->set_null_text(null_text);
}

Denoiser::Estimate Ensemble::combine(const torch::Tensor& x, const torch::Tensor& t, const Cond& y, double w,
                                     const torch::Tensor& weights) const {
  const int64_t b = x.size(0);
  const int branches = (num_classes_ > 0 || y.context.defined()) && w != 0.0 && w != 1.0 ? 2 : 1;

  Denoiser::Estimate out{torch::zeros_like(x), torch::zeros_like(x)};
  // Each expert's group: its rows in order, found with one read back for all experts (the group
  // sizes); padded with row 0 to a multiple of the quantum when one is set (its outputs are dropped).
  const auto chosen = weights.gt(0).t().contiguous();                                      // [K, B]
  const auto counts = chosen.sum(1).to(torch::kCPU, torch::kLong).contiguous();            // [K]
  struct Part {
    torch::Tensor idx, x0, eps;  // the expert's rows [B_e] and its weighted estimates there [B_e,C,H,W]
  };
  std::vector<Part> parts(static_cast<size_t>(k()));
  auto run = [&](int64_t e, int64_t n) {
    const int64_t rows = quantum_ > 0 ? (n + quantum_ - 1) / quantum_ * quantum_ : n;
    const auto group = torch::nonzero_static(chosen[e], rows, /*fill_value=*/0).flatten();  // [rows]
    const auto idx = group.narrow(0, 0, n);                                                          // [B_e]
    const Denoiser& den = *experts_[e];  // weights are 0 for missing experts
    auto te = t.index_select(0, group);
    const PathMatch m = match_path(path_, te, den.path());
    auto est = den.estimate(x.index_select(0, group) * col(m.scale), m.t, y.select(group), w);  // [rows,C,H,W]
    auto we = col(weights.index_select(0, idx).select(1, e));                                     // [B_e,1,1,1]
    parts[static_cast<size_t>(e)] = {idx, we * est.x0.narrow(0, 0, n), we * est.eps.narrow(0, 0, n)};
    usage_.expert_evals[e] += n;
    usage_.padding_evals += rows - n;
    usage_.group_sizes[static_cast<size_t>(e)].insert(rows);
    usage_.expert_flops += static_cast<double>(rows) * branches * expert_flops_[e];
  };
  // Side by side (set_side_by_side): each group forked onto its expert's stream, all of them queued
  // before any is joined. Every fork is joined before this returns, also when an expert throws: the
  // experts' work reads the caller's tensors.
  auto side_by_side = [&] {
    if (streams_.size() != static_cast<size_t>(k()) || streams_device_ != x.device()) {
      streams_.assign(static_cast<size_t>(k()), nullptr);
      streams_device_ = x.device();
    }
    std::vector<GraphStream*> unjoined(static_cast<size_t>(k()), nullptr);
    struct JoinAll {
      std::vector<GraphStream*>& streams;
      ~JoinAll() {
        for (GraphStream* s : streams) {
          if (s == nullptr) continue;
          try {
            s->join({});
          } catch (const std::exception&) {  // already failing: the first error is the one reported
          }
        }
      }
    } join_all{unjoined};
    for (int64_t e = 0; e < k(); ++e) {
      const int64_t n = counts.data_ptr<int64_t>()[e];
      if (n == 0) continue;
      auto& stream = streams_[static_cast<size_t>(e)];
      if (!stream) stream = std::make_shared<GraphStream>(x.device());
      unjoined[static_cast<size_t>(e)] = stream.get();
      stream->fork([&] { run(e, n); });
    }
    for (int64_t e = 0; e < k(); ++e) {
      const Part& p = parts[static_cast<size_t>(e)];
      if (GraphStream*& s = unjoined[static_cast<size_t>(e)]) {
        s->join({p.idx, p.x0, p.eps});
        s = nullptr;
      }
    }
  };
  auto in_turn = [&] {
    for (int64_t e = 0; e < k(); ++e)
      if (const int64_t n = counts.data_ptr<int64_t>()[e]; n > 0) run(e, n);
  };
  if (side_by_side_ && !side_by_side_failed_ && !shared_network_ && x.is_cuda() && !torch::GradMode::is_enabled()) {
    const EnsembleUsage before = usage_;
    try {
      side_by_side();
    } catch (const c10::OutOfMemoryError& e) {
      // All the experts' forward passes at once did not fit: from here on one at a time, which gives the
      // same bits (this step's experts run again from the start).
      std::string why = e.what();
      why.resize(std::min(why.find('\n'), why.size()));
      std::cerr << "ensemble: out of GPU memory with the experts side by side (" << why
                << "); going on with one expert at a time, the same images (`ddm sample --one-expert-at-a-time` "
                   "starts so)"
                << std::endl;
      side_by_side_failed_ = true;
      usage_ = before;
      parts.assign(static_cast<size_t>(k()), Part{});
      // Autocast's weight casts made on the experts' streams are dropped (cast again on this one): read
      // here and freed later into a stream that another user of the stream pool may share, their memory
      // could be reused before this stream is done with it.
      at::autocast::clear_cache();
      cuda_module().empty_cache();
      in_turn();
    }
  } else {
    in_turn();
  }
  // The mixture, on the caller's stream, in the experts' order.
  for (int64_t e = 0; e < k(); ++e) {
    const Part& p = parts[static_cast<size_t>(e)];
    if (!p.idx.defined()) continue;
    out.x0.index_add_(0, p.idx, p.x0);
    out.eps.index_add_(0, p.idx, p.eps);
  }
  usage_.calls += 1;
  usage_.sample_evals += b;
  return out;
}

Denoiser Ensemble::denoiser() const {
  return Denoiser([this](const torch::Tensor& x, const torch::Tensor& t, const Cond& c, double w,
                         const torch::Tensor& keys) {
                    DDM_CHECK(!c.control.defined(), "an ensemble of experts takes no control map");
                    Cond y(c.y);  // the labels and the prompts' encodings: what experts and router read
                    y.context = c.context;
                    y.context_mask = c.context_mask;
                    y.pooled = c.pooled;
                    return estimate(x, t, y, w, keys);
                  },
                  path_, num_classes_, device_);
}

std::string Ensemble::usage_report(int64_t n_images) const {
  std::ostringstream s;
  const double evals = static_cast<double>(std::max<int64_t>(1, usage_.sample_evals));
  s << "expert usage (share of sample-steps):";
  int64_t total = 0;
  for (size_t e = 0; e < usage_.expert_evals.size(); ++e) {
    char buf[48];
    std::snprintf(buf, sizeof buf, " %zu: %.1f%%", e, 100.0 * usage_.expert_evals[e] / evals);
    s << buf << (experts_[e] ? "" : " (missing)");
    total += usage_.expert_evals[e];
  }
  const double n = static_cast<double>(std::max<int64_t>(1, n_images));
  if (quantum_ > 0) {
    char pad[120];
    std::snprintf(pad, sizeof pad, "\nexpert batches padded to multiples of %lld rows: %.1f%% more expert rows",
                  static_cast<long long>(quantum_), 100.0 * usage_.padding_evals / std::max<int64_t>(1, total));
    s << pad;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "\nexperts per sample-step %.2f; forward GFLOP per image %.3f (experts %.3f + router %.3f, %.1f%%)\n",
                total / evals, (usage_.expert_flops + usage_.router_flops) / n / 1e9, usage_.expert_flops / n / 1e9,
                usage_.router_flops / n / 1e9,
                100.0 * usage_.router_flops / std::max(1.0, usage_.expert_flops + usage_.router_flops));
  s << buf;
  return s.str();
}

}  // namespace ddm
