// Preparing the runs of decentralized training for the generic trainer (run/trainer.h): an
// expert (one cluster of a partition, with its share of the budget), a router (every cluster, the
// cluster as its label, a random hold-out) and a distilled student (the ensemble as teacher). Each
// is a TrainJob whose records (expert.json, router.json, distill.json) pin what it was trained on.
#include "decentral/train_run.h"

#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/presets.h"
#include "core/run_dir.h"
#include "data/shard_stream.h"
#include "decentral/distill.h"
#include "decentral/partition.h"
#include "decentral/shard_partition.h"
#include "model/router.h"
#include "run/setup.h"  // absolute_data_root

namespace fs = std::filesystem;

namespace ddm {
namespace {

// An expert trains on one cluster of a partition: checks that the partition belongs to this data,
// keeps the cluster's images, and applies train.expert_budget. Returns a line for the run header.
// Over shards, data.root already names the cluster's own shards (expert_shard_root).
std::string select_expert_data(RunConfig& cfg, Dataset& data, const Partition& p) {
  int64_t size = 0;
  if (data.shards) {
    size = data.shards->samples;
    DDM_CHECK(size == p.sizes[cfg.data.expert].item<int64_t>(),
              "cluster " << cfg.data.expert << "'s shards (" << cfg.data.root << ") hold " << size << " samples, but "
                         << p.origin << " gave it " << p.sizes[cfg.data.expert].item<int64_t>()
                         << "; they changed since: make the partition again");
  } else {
    check_partition_matches(p, data);
    data = cluster_subset(data, p, cfg.data.expert);
    size = data.images.size(0);
  }
  DDM_CHECK(size > 0, "cluster " << cfg.data.expert << " of " << p.origin << " is empty");
  TrainConfig& t = cfg.train;
  std::ostringstream line;
  line << "expert: cluster " << cfg.data.expert << " of " << p.k << " (" << size
       << (data.shards ? " samples in its own shards" : " images") << "), budget " << t.expert_budget;
  if (t.expert_budget == "split-batch") {
    DDM_CHECK(t.batch_size % p.k == 0, "train.expert_budget = split-batch: train.batch_size = "
                                           << t.batch_size << " is not divisible by K = " << p.k
                                           << "; use a multiple of " << p.k << " so the experts add up to it");
    t.batch_size /= p.k;
    line << " (global batch / " << p.k << ")";
  } else if (t.expert_budget == "split-steps") {
    DDM_CHECK(t.steps % p.k == 0, "train.expert_budget = split-steps: train.steps = "
                                      << t.steps << " is not divisible by K = " << p.k << "; use a multiple of " << p.k);
    t.steps /= p.k;
    t.warmup = std::min(t.warmup, t.steps);
    line << " (global steps / " << p.k << ")";
  }
  return line.str() + "\n";
}

// A router trains on every cluster: checks the partition, fills model.num_experts, attaches each
// image's cluster and withholds data.holdout images chosen at random (holdout_split, seeded by
// train.seed; evaluate_router_run picks the same ones). Over shards the images are positions in shard
// order, withheld by the loader (Dataset::shard_keep). Returns a line for the run header.
std::string select_router_data(RunConfig& cfg, Dataset& data, const Partition& p) {
  check_partition_matches(p, data);
  ModelConfig& m = cfg.model;
  DDM_CHECK(m.num_experts == 0 || m.num_experts == p.k, "model.num_experts = " << m.num_experts << " but the partition "
                                                        << p.origin << " has K = " << p.k << "; remove the key");
  m.num_experts = p.k;
  data.clusters = p.labels;
  const int64_t n = data.shards ? data.shards->samples : data.images.size(0), h = cfg.data.holdout;
  DDM_CHECK(h < n, "data.holdout = " << h << " leaves no training images (the data has " << n << ")");
  if (h > 0 && data.shards) {
    auto keep = std::make_shared<std::vector<bool>>(static_cast<size_t>(n), true);
    const torch::Tensor held = holdout_split(n, h, static_cast<uint64_t>(cfg.train.seed)).second;
    const auto at = held.accessor<int64_t, 1>();
    for (int64_t i = 0; i < h; ++i) (*keep)[static_cast<size_t>(at[i])] = false;
    data.shard_keep = std::move(keep);
  } else if (h > 0) {
    const torch::Tensor keep = holdout_split(n, h, static_cast<uint64_t>(cfg.train.seed)).first;
    data.images = data.images.index_select(0, keep);
    data.labels = data.labels.index_select(0, keep);
    data.clusters = data.clusters.index_select(0, keep);
    if (!data.captions.empty()) {
      std::vector<std::string> kept;
      const auto at = keep.accessor<int64_t, 1>();
      for (int64_t i = 0; i < keep.size(0); ++i) kept.push_back(data.captions[static_cast<size_t>(at[i])]);
      data.captions = std::move(kept);
    }
  }
  std::ostringstream line;
  line << "router: " << p.k << " clusters of " << p.origin << "; trains on " << n - h << " images, " << h
       << " held out at random\n";
  return line.str();
}

// expert.json (router.json for a router) records the partition file's hash; a resumed run must see
// the same partition.
void check_partition_record(const RunDir& dir, bool resume, const RunConfig& cfg, const Partition& p) {
  const std::string sha = sha256_file(p.origin);
  const bool router = is_router_arch(cfg.model.arch);
  const fs::path record = dir / (router ? RunDir::kRouter : RunDir::kExpert);
  if (resume && fs::exists(record)) {
    nlohmann::json stored;
    try {
      stored = nlohmann::json::parse(read_file(record.string()));
      (void)stored.at("partition_sha256").get<std::string>();
      (void)stored.value("steps", int64_t{0});
    } catch (const nlohmann::json::exception& e) {
      throw InputError(record.string() + " is damaged (" + e.what() + "): it records the partition this run " +
                       "started on. Restore it, or start over with --force");
    }
    // More steps on resume (experts.set of an islands file, --set train.steps): the target recorded.
    if (!router && stored.value("steps", int64_t{0}) != cfg.train.steps && stored.at("partition_sha256") == sha) {
      stored["steps"] = cfg.train.steps;
      write_file_atomic(record.string(), stored.dump(2) + "\n");
    }
    DDM_INPUT_CHECK(stored.at("partition_sha256") == sha,
              "--resume: the partition " << p.origin << " changed since this run started (sha256 "
                                         << stored.at("partition_sha256").get<std::string>().substr(0, 12) << ", now "
                                         << sha.substr(0, 12)
                                         << "); an expert or router must finish on the partition it started with. Restore "
                                            "it, or start over with --force");
    return;
  }
  if (router) {
    const nlohmann::json j = {{"partition", p.origin}, {"partition_sha256", sha}, {"k", p.k},
                              {"holdout", cfg.data.holdout},
                              {"holdout_selection", "random, seeded by train.seed"}};
    write_file_atomic(record.string(), j.dump(2) + "\n");
    return;
  }
  const nlohmann::json j = {{"partition", p.origin},           {"partition_sha256", sha},
                            {"k", p.k},                        {"expert", cfg.data.expert},
                            {"images", p.sizes[cfg.data.expert].item<int64_t>()},
                            {"expert_budget", cfg.train.expert_budget},
                            {"batch_size", cfg.train.batch_size}, {"steps", cfg.train.steps}};
  write_file_atomic(record.string(), j.dump(2) + "\n");
}

TrainJob prepare_job(RunConfig cfg) {
  const bool router = is_router_arch(cfg.model.arch);
  Partition partition;
  if (!cfg.data.partition.empty()) partition = load_partition(cfg.data.partition);
  // An expert over shards reads its cluster's own shards; its config keeps data.root as written.
  const std::string root = cfg.data.root;
  const bool shard_expert =
      (cfg.data.source == "shards" || cfg.data.source == "latents") && !cfg.data.partition.empty() && !router;
  const int64_t classes = cfg.model.num_classes;
  if (shard_expert) cfg.data.root = expert_shard_root(partition, cfg.data.expert, cfg.data);
  TrainJob job = plain_job(std::move(cfg));
  RunConfig& c = job.cfg;
  // A cluster's shards may lack the highest classes; its expert still takes every class of the data,
  // as its siblings do (an ensemble's experts share their label space).
  const int64_t all_classes = shard_expert ? partition.shards.value("num_classes", int64_t(0)) : 0;
  if (all_classes > job.data.num_classes) {
    for (int64_t k = job.data.num_classes; k < all_classes; ++k) job.data.class_names.push_back("class " + std::to_string(k));
    job.data.num_classes = all_classes;
    job.data.description += " (the expert takes all " + std::to_string(all_classes) + " classes of the data)";
    if (classes == -1) c.model.num_classes = all_classes;
  }
  if (router) job.header = select_router_data(c, job.data, partition);
  std::shared_ptr<DistillTeacher> teacher;
  if (!c.train.teacher.empty()) {
    teacher = load_distill_teacher(c, job.data);
    job.header = describe(*teacher);
    job.objective = std::make_shared<DistillObjective>(c, teacher_fn(teacher, c));
  }
  job.recorded = c;  // an expert's config keeps the global budget; it runs on its share
  job.recorded.data.root = root;
  if (!c.data.partition.empty() && !router) job.header = select_expert_data(c, job.data, partition);
  if (!c.data.partition.empty()) {
    const RunConfig rc = c;
    job.records = [rc, partition](const RunDir& dir, bool resume) {
      check_partition_record(dir, resume, rc, partition);
    };
  } else if (teacher) {
    job.records = [teacher](const RunDir& dir, bool resume) { check_distill_record(dir.root, resume, *teacher); };
  }
  return job;
}

RunConfig router_config(const std::string& config, const std::string& partition, const std::string& preset,
                        int64_t holdout, const std::vector<std::string>& overrides) {
  RunConfig c = load_config(config);
  ModelConfig m = c.model;  // apply_preset keeps what the model learns (the data's shape, model.latent*)
  // No preset given: router-dit-tiny, or for latent experts latent-router-dit (router-dit-tiny's
  // patch 7 would make a 7x7 latent one token).
  bool latent = !c.model.latent.empty();
  for (const std::string& o : overrides)
    if (o.rfind("model.latent=", 0) == 0) latent = o.size() > std::string("model.latent=").size();
  m.preset = !preset.empty() ? preset : latent ? "latent-router-dit" : "router-dit-tiny";
  apply_preset(m.preset, m);
  DDM_CHECK(is_router_arch(m.arch), "--preset " << preset << " is not a router preset; use router-dit-tiny, "
                                                   "router-conv-tiny or latent-router-dit (see `ddm presets`)");
  m.num_classes = c.model.num_classes == 0 ? 0 : -1;  // conditioned like the experts
  m.num_experts = 0;                                   // from the partition
  c.model = m;  // latent experts: the router sees their x_t, in the same latent space
  c.data.partition = fs::absolute(partition).string();
  c.data.expert = -1;
  c.data.holdout = holdout;
  c.train.expert_budget = "full";
  c.train.self_cond = 0;  // the experts' self-conditioning is theirs: a router has no estimate to take
  c.train.sample_every = 0;  // the experts' grids are theirs: a router samples nothing
  return parse_config(to_toml(c), "the router config made from " + config, overrides);
}

}  // namespace

// Nothing has run yet: what fails here is the input (config, data, partition, model), so it fails
// as an InputError (core/error.h) and a supervisor does not restart it.
TrainJob prepare_train_job(RunConfig cfg) {
  cfg.data.root = absolute_data_root(cfg.data.root);  // recorded so: the run resumes from anywhere
  return as_input_error([&] { return prepare_job(std::move(cfg)); });
}

TrainSummary train_run(RunConfig cfg, const TrainOptions& opt) { return train(prepare_train_job(std::move(cfg)), opt); }

RunConfig router_run_config(const std::string& config, const std::string& partition, const std::string& preset,
                            int64_t holdout, const std::vector<std::string>& overrides) {
  return as_input_error([&] { return router_config(config, partition, preset, holdout, overrides); });
}

}  // namespace ddm
