// Assembling, verifying and loading ensemble directories (see ensemble_dir.h).
#include "decentral/ensemble_dir.h"

#include <filesystem>
#include <sstream>

#include "core/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/run_dir.h"
#include "core/version.h"
#include "data/dataset.h"
#include "decentral/partition.h"
#include "diffusion/path.h"
#include "model/net.h"
#include "model/router.h"
#include "train/checkpoint.h"
#include "train/network.h"
#include "train/text.h"

namespace fs = std::filesystem;

namespace ddm {

namespace {

// Relative to dir when inside it, else absolute.
std::string stored_path(const fs::path& dir, const std::string& p) {
  const fs::path abs = fs::weakly_canonical(fs::absolute(p)), base = fs::weakly_canonical(fs::absolute(dir));
  const fs::path rel = abs.lexically_relative(base);
  if (!rel.empty() && *rel.begin() != "..") return rel.string();
  return abs.string();
}

std::string resolved_path(const std::string& dir, const std::string& p) {
  return fs::path(p).is_absolute() ? p : (fs::path(dir) / p).string();
}

nlohmann::json weights_hashes(const std::string& ckpt) {
  return {{"model", sha256_file(RunDir(ckpt) / RunDir::kModel)}, {"ema", sha256_file(RunDir(ckpt) / RunDir::kEma)}};
}

nlohmann::json read_record(const std::string& run, const char* name, const std::string& what) {
  const fs::path p = fs::path(run) / name;
  DDM_CHECK(fs::exists(p), what << " " << run << " has no " << name << ": it was not trained on a partition ("
                                << (std::string(name) == RunDir::kRouter ? "use ddm train-router" : "use ddm train --partition P --expert k")
                                << ")");
  try {
    return nlohmann::json::parse(read_file(p.string()));
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(p.string() << " is not valid JSON (" << e.what() << ")");
  }
}

// topk:K needs K <= the number of experts (topk:K with K = experts is full routing).
void check_routing_fits(const Routing& r, int64_t experts) {
  DDM_CHECK(r.kind != Routing::Kind::kTopK || r.k <= experts,
            "routing " << r.spec << ": the ensemble has only K = " << experts << " experts; use topk:1 to topk:"
                       << experts << " (topk:" << experts << " is the same as full)");
}

// The manifest of the runs in `spec`, checked (assemble_ensemble's first half).
nlohmann::json checked_manifest(const std::string& dir, const EnsembleSpec& spec, std::vector<std::string>& notes) {
  const Routing routing = parse_routing(spec.routing);  // a bad default fails before any work
  const Partition p = load_partition(spec.partition);
  check_routing_fits(routing, p.k);
  const std::string part_sha = sha256_file(p.origin);
  DDM_CHECK(static_cast<int64_t>(spec.experts.size()) == p.k,
            spec.experts.size() << " experts given, but the partition " << spec.partition << " has K = " << p.k
                                << " clusters: give one expert run per cluster, in order 0.." << p.k - 1);
  nlohmann::json m = {{"format", kEnsembleFormat},
                      {"k", p.k},
                      {"routing", spec.routing},
                      {"partition", {{"path", stored_path(dir, spec.partition)}, {"sha256", part_sha}}},
                      {"created_by", std::string("ddm ") + version()}};
  int64_t channels = -1, size = -1, classes = -1;
  std::string latent_sha;  // latent models: every member must share the frozen autoencoder and its scaling
  double latent_scale = 0, latent_shift = 0;
  auto same_shape = [&](const LoadedModel& lm, const std::string& what) {
    const ModelConfig& mc = lm.cfg.model;
    if (channels < 0) {
      channels = mc.in_channels;
      size = mc.image_size;
      classes = mc.num_classes;
      latent_sha = mc.latent_sha256;
      latent_scale = mc.latent_scale;
      latent_shift = mc.latent_shift;
    }
    DDM_CHECK(mc.latent_sha256 == latent_sha && mc.latent_scale == latent_scale && mc.latent_shift == latent_shift,
              what << (mc.latent.empty() ? " works on pixels" : " works on the latents of " + mc.latent + " (sha256 " +
                                                                  mc.latent_sha256.substr(0, 12) + ")")
                   << ", but the first expert "
                   << (latent_sha.empty() ? "on pixels" : "on latents with sha256 " + latent_sha.substr(0, 12))
                   << " (or another latent scale); every model of an ensemble must share one frozen autoencoder");
    DDM_CHECK(mc.in_channels == channels && mc.image_size == size && mc.num_classes == classes,
              what << " works on " << mc.in_channels << "x" << mc.image_size << "x" << mc.image_size << " images with "
                   << mc.num_classes << " classes, but the first expert on " << channels << "x" << size << "x" << size
                   << " with " << classes << "; every model of an ensemble must share the data shape");
  };
  auto check_partition = [&](const nlohmann::json& rec, const std::string& what) {
    DDM_CHECK(rec.value("partition_sha256", "") == part_sha,
              what << " was trained on another partition (" << rec.value("partition", "?") << ", sha256 "
                   << rec.value("partition_sha256", "?").substr(0, 12) << ") than " << spec.partition << " (sha256 "
                   << part_sha.substr(0, 12) << ")");
  };
  ModelConfig expert_text;  // expert 0's text keys
  for (int64_t i = 0; i < p.k; ++i) {
    const std::string& run = spec.experts[i];
    const std::string what = "expert " + std::to_string(i) + " (" + run + ")";
    const nlohmann::json rec = read_record(run, RunDir::kExpert, what);
    check_partition(rec, what);
    DDM_CHECK(rec.value("expert", int64_t{-1}) == i,
              what << " was trained on cluster " << rec.value("expert", int64_t{-1}) << ", not " << i
                   << "; list the experts in cluster order");
    const LoadedModel lm = load_model(run, /*use_ema=*/false);
    same_shape(lm, what);
    // Text experts: one frozen encoder for all, so a prompt is encoded once for every expert.
    const ModelConfig& first = i == 0 ? lm.cfg.model : expert_text;
    if (i == 0) expert_text = lm.cfg.model;
    DDM_CHECK(lm.cfg.model.text_sha256 == first.text_sha256 && lm.cfg.model.text_skip == first.text_skip &&
                  lm.cfg.model.text_tokens == first.text_tokens,
              what << (lm.cfg.model.text_encoder.empty() ? " is not conditioned on text"
                                                         : " is conditioned on the text encoder " + lm.cfg.model.text_encoder +
                                                               " (sha256 " + lm.cfg.model.text_sha256.substr(0, 12) + ")")
                   << ", expert 0 " << (first.text_encoder.empty() ? "not on text" : "on " + first.text_encoder + " (sha256 " +
                                                                                       first.text_sha256.substr(0, 12) + ")")
                   << " (or another text_skip / text_tokens); every expert of an ensemble must share one text encoder");
    const int64_t steps = rec.contains("steps") ? json_int(rec["steps"], what + ": key \"steps\"", 0) : 0;
    if (lm.step < steps)
      notes.push_back(what + " stopped at step " + std::to_string(lm.step) + " of " + std::to_string(steps) +
                      " (finish it with ddm train --resume, then re-assemble)");
    m["experts"].push_back({{"index", i},
                            {"path", stored_path(dir, run)},
                            {"checkpoint", stored_path(dir, lm.checkpoint)},
                            {"step", lm.step},
                            {"preset", lm.cfg.model.preset},
                            {"objective", lm.cfg.diffusion.objective},
                            {"weights_sha256", weights_hashes(lm.checkpoint)}});
  }
  const std::string what = "the router (" + spec.router + ")";
  const nlohmann::json rec = read_record(spec.router, RunDir::kRouter, what);
  check_partition(rec, what);
  const LoadedModel r = load_model(spec.router, /*use_ema=*/false);
  DDM_CHECK(is_router_arch(r.cfg.model.arch), what << " is not a router (model.arch = " << r.cfg.model.arch << ")");
  same_shape(r, what);
  DDM_CHECK(r.cfg.model.text_sha256 == expert_text.text_sha256 && r.cfg.model.text_skip == expert_text.text_skip &&
                r.cfg.model.text_tokens == expert_text.text_tokens,
            what << (r.cfg.model.text_encoder.empty() ? " is not conditioned on text" : " is conditioned on the text encoder " +
                                                                                          r.cfg.model.text_encoder)
                 << ", the experts " << (expert_text.text_encoder.empty() ? "not on text" : "on " + expert_text.text_encoder)
                 << "; the router must see the experts' condition (train it with the experts' config)");
  if (r.step < r.cfg.train.steps)
    notes.push_back(what + " stopped at step " + std::to_string(r.step) + " of " + std::to_string(r.cfg.train.steps));
  m["router"] = {{"path", stored_path(dir, spec.router)},
                 {"checkpoint", stored_path(dir, r.checkpoint)},
                 {"step", r.step},
                 {"preset", r.cfg.model.preset},
                 {"forward_flops", network_flops_per_image(r.cfg.model)},
                 {"weights_sha256", weights_hashes(r.checkpoint)}};
  m["image"] = {{"channels", channels}, {"size", size}, {"num_classes", classes}};
  return m;
}

}  // namespace

nlohmann::json assemble_ensemble(const std::string& dir, const EnsembleSpec& spec, std::vector<std::string>& notes) {
  // Parts that do not belong together (or a damaged one) are bad input; writing the manifest is not.
  const nlohmann::json m = as_input_error([&] { return checked_manifest(dir, spec, notes); });
  fs::create_directories(dir);
  // An ensemble assembled again lets go of the checkpoints it held (those it still holds are pinned
  // again below).
  const fs::path manifest = fs::path(dir) / "ensemble.json";
  try {
    if (fs::exists(manifest)) {
      const nlohmann::json before = nlohmann::json::parse(read_file(manifest.string()));
      for (const auto& e : before.at("experts")) unpin_checkpoint(resolved_path(dir, e.at("checkpoint").get<std::string>()), dir);
      unpin_checkpoint(resolved_path(dir, before.at("router").at("checkpoint").get<std::string>()), dir);
    }
  } catch (const std::exception&) {
    // A damaged manifest being replaced: its pins stay (deleting pinned.txt releases them).
  }
  write_file_atomic(manifest.string(), m.dump(2) + "\n");
  // The experts' and the router's runs may train on; their rotation keeps what the ensemble names.
  for (const auto& e : m["experts"]) pin_checkpoint(resolved_path(dir, e.at("checkpoint").get<std::string>()), dir);
  pin_checkpoint(resolved_path(dir, m["router"].at("checkpoint").get<std::string>()), dir);
  return m;
}

const LoadedModel& LoadedEnsemble::first_expert() const {
  for (const auto& e : experts)
    if (e) return *e;
  DDM_FAIL("the ensemble " << dir << " has no expert");
}

std::vector<int64_t> LoadedEnsemble::missing() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < experts.size(); ++i)
    if (!experts[i]) out.push_back(static_cast<int64_t>(i));
  return out;
}

LoadedEnsemble load_ensemble(const std::string& given, bool use_ema, bool allow_missing, torch::Device device) {
  // The ensemble's folder, or its ensemble.json.
  const fs::path named(given);
  const std::string dir = named.filename() == "ensemble.json" && fs::is_regular_file(named)
                              ? (named.has_parent_path() ? named.parent_path().string() : std::string("."))
                              : given;
  const fs::path manifest = fs::path(dir) / "ensemble.json";
  DDM_CHECK(fs::exists(manifest), "'" << dir << "' is not an ensemble directory (no ensemble.json); make one with "
                                  "ddm ensemble --out DIR --partition P --router R --expert E0 ...");
  LoadedEnsemble e;
  e.dir = dir;
  try {
    e.manifest = nlohmann::json::parse(read_file(manifest.string()));
    DDM_CHECK(e.manifest.value("format", "") == kEnsembleFormat,
              manifest.string() << " has format '" << e.manifest.value("format", "") << "', expected " << kEnsembleFormat);
    e.k = json_int(e.manifest.at("k"), manifest.string() + ": key \"k\"");
    DDM_CHECK(e.k >= 1 && static_cast<int64_t>(e.manifest.at("experts").size()) == e.k,
              manifest.string() << " lists " << e.manifest.at("experts").size() << " experts for k = " << e.k);
    e.partition_dir = resolved_path(dir, e.manifest.at("partition").at("path").get<std::string>());
  } catch (const nlohmann::json::exception& err) {
    DDM_FAIL(manifest.string() << " is not a valid ensemble manifest (" << err.what()
                               << "); re-create it with ddm ensemble");
  }
  // is_expert: a missing expert may be left out with allow_missing; the router never.
  auto verified = [&](const nlohmann::json& entry, const std::string& what, bool is_expert) -> std::optional<LoadedModel> {
    const std::string ckpt = resolved_path(dir, entry.at("checkpoint").get<std::string>());
    if (!fs::exists(ckpt)) {
      DDM_CHECK(is_expert && allow_missing,
                what << " is missing: its checkpoint " << ckpt << " does not exist. Restore it or re-assemble the "
                     << "ensemble" << (is_expert ? "; or, to sample or evaluate without it, pass --allow-missing to "
                                                   "ddm sample or ddm eval (the router's probabilities are then "
                                                   "renormalized over the other experts)"
                                                 : ""));
      return std::nullopt;
    }
    const nlohmann::json now = weights_hashes(ckpt);
    if (now != entry.at("weights_sha256")) {
      // Damaged (its files no longer match the sha256 its own state.json recorded when it was written),
      // or replaced by another checkpoint (training it further): two causes, two remedies.
      nlohmann::json recorded;
      try {
        recorded = nlohmann::json::parse(read_file((RunDir(ckpt) / RunDir::kState))).at("sha256");
      } catch (const std::exception&) {
      }
      for (const char* file : {RunDir::kModel, RunDir::kEma}) {
        const std::string key = std::string(file) == RunDir::kModel ? "model" : "ema";
        DDM_CHECK(!recorded.is_object() || !recorded.contains(file) || recorded.at(file) == now.at(key),
                  what << "'s checkpoint " << ckpt << " is damaged: its " << file << " no longer matches the sha256 "
                       << "its state.json recorded when it was written. Restore the file (a copy of the run), or "
                       << "train that expert again and re-assemble with ddm ensemble");
      }
      DDM_FAIL(what << " changed since the ensemble was assembled: the weights in " << ckpt
                    << " no longer match ensemble.json's sha256. Re-assemble with ddm ensemble");
    }
    return load_model(ckpt, use_ema, device);
  };
  for (int64_t i = 0; i < e.k; ++i) {
    e.experts.push_back(verified(e.manifest["experts"][i], "expert " + std::to_string(i), /*is_expert=*/true));
    // The router's output i weighs entry i: an expert of another cluster there would be weighed wrongly.
    if (e.experts.back())
      DDM_CHECK(e.experts.back()->cfg.data.expert == i,
                manifest.string() << ": expert " << i << " is " << e.experts.back()->checkpoint << ", trained on cluster "
                                  << e.experts.back()->cfg.data.expert << ": the experts are listed out of cluster "
                                  << "order; re-assemble the ensemble with ddm ensemble");
  }
  DDM_CHECK(static_cast<int64_t>(e.missing().size()) < e.k, "every expert of the ensemble " << dir << " is missing");
  e.router = *verified(e.manifest.at("router"), "the router", /*is_expert=*/false);
  return e;
}

Partition load_ensemble_partition(const LoadedEnsemble& e) {
  Partition p = load_partition(e.partition_dir);
  const std::string was = e.manifest.at("partition").value("sha256", ""), now = sha256_file(p.origin);
  DDM_INPUT_CHECK(now == was, "the partition " << e.partition_dir << " changed since the ensemble " << e.dir
                                               << " was assembled (sha256 " << was.substr(0, 12) << ", now "
                                               << now.substr(0, 12) << "): its clusters are not the ones the experts "
                                               << "and the router were trained on. Restore it (`ddm partition` with "
                                               << "the same settings gives the same file), or train the experts and "
                                               << "the router on it and assemble again");
  return p;
}

std::string ensemble_sample_command(const std::string& dir) {
  std::string prompt;
  try {  // a text ensemble samples from prompts: the command without one would be refused
    const fs::path config = fs::path(ensemble_expert_run(dir, 0)) / "config.toml";
    if (!load_config(config.string()).model.text_encoder.empty()) prompt = " --prompt 'a prompt of yours'";
  } catch (const Error&) {
  }
  return "ddm sample --ensemble " + dir + prompt + " --out grid.png";
}

std::string ensemble_expert_run(const std::string& dir, int64_t k) {
  const fs::path manifest = fs::path(dir) / "ensemble.json";
  DDM_CHECK(fs::exists(manifest), "'" << dir << "' is not an ensemble directory (no ensemble.json); make one with "
                                  "ddm ensemble --out DIR --partition P --router R --expert E0 ...");
  try {
    const auto m = nlohmann::json::parse(read_file(manifest.string()));
    return resolved_path(dir, m.at("experts").at(k).at("path").get<std::string>());
  } catch (const nlohmann::json::exception& err) {
    DDM_FAIL(manifest.string() << " is not a valid ensemble manifest (" << err.what()
                               << "); re-create it with ddm ensemble");
  }
}

std::unique_ptr<Ensemble> make_ensemble(const LoadedEnsemble& e, const Routing& routing, uint64_t seed,
                                        Precision precision) {
  check_routing_fits(routing, e.k);
  const LoadedModel& first = e.first_expert();
  const NoisePath path = make_path(first.cfg.diffusion);
  std::vector<std::optional<Denoiser>> dens;
  std::vector<double> flops;
  for (const auto& x : e.experts) {
    dens.push_back(x ? std::optional<Denoiser>(make_denoiser(*x)) : std::nullopt);
    if (dens.back()) dens.back()->set_precision(precision);
    flops.push_back(x ? network_flops_per_image(x->cfg.model) : 0.0);
  }
  torch::Device device = torch::kCPU;  // where load_ensemble put the networks: the first present expert's
  for (const auto& d : dens)
    if (d) {
      device = d->device();
      break;
    }
  RouterFn router;
  double router_flops = 0;
  if (routing.oracle) {
    const Partition p = load_ensemble_partition(e);
    DataConfig dc = e.router.cfg.data;
    DDM_CHECK(dc.source != "shards" && dc.source != "latents",
              "--routing oracle computes each step's exact posterior over every training image, held in memory, "
              "and this ensemble's data is streamed from shards (" << dc.root << "): use a learned routing "
                                                                   "(top1, topk:K, full, threshold:P or sample)");
    const Dataset data = load_dataset(dc);
    check_partition_matches(p, data);
    // Latent experts: the oracle knows the data as they learned it, encoded (posterior means).
    const torch::Tensor x0 = first.latent ? first.latent->encode_mean(data.images) : torch::Tensor();
    router = oracle_router(data, p.labels, e.k, path, x0, device);
    router_flops = 2.0 * static_cast<double>(x0.defined() ? x0.numel() : data.images.numel());  // [1, D] x [D, N] per image
  } else {
    // The router's forward runs under the experts' precision too (autocast keeps softmax in float32).
    RouterFn net = net_router(e.router.net, make_path(e.router.cfg.diffusion), path);
    router = [net, precision](const torch::Tensor& x, const torch::Tensor& t, const Cond& y) {
      Autocast autocast(x.device(), precision);
      return net(x, t, y);  // [B, K]
    };
    router_flops = network_flops_per_image(e.router.cfg.model);
  }
  auto ensemble = std::make_unique<Ensemble>(std::move(dens), std::move(flops), std::move(router), router_flops, path,
                                             first.cfg.model.num_classes, routing, seed, device);
  if (first.text) ensemble->set_null_text(encode_texts(*first.text, {""}, device));  // guidance's null prompt
  return ensemble;
}

}  // namespace ddm
