// The ensemble directory: DIR/ensemble.json names the partition, the router and the K experts
// (each pinned to one checkpoint, with the sha256 of its weight files), the default routing and
// the image shape, so that `ddm sample --ensemble DIR` and `ddm eval --ensemble DIR` sample exactly
// the models that were assembled. Paths inside DIR are stored relative to it, so the directory can
// be moved or copied as a whole; paths outside it are stored absolute.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "decentral/ensemble.h"
#include "decentral/partition.h"
#include "train/loaded_model.h"

namespace ddm {

inline constexpr const char* kEnsembleFormat = "ddm-ensemble-1";

struct EnsembleSpec {
  std::string partition;             // `ddm partition` directory
  std::string router;                // `ddm train-router` run directory
  std::vector<std::string> experts;  // expert run directories, in cluster order 0..K-1
  std::string routing = "top1";      // the default routing strategy
};

// Checks that the runs belong together (the partition the experts and the router were trained on,
// one expert per cluster in order, equal image shapes and classes) and writes DIR/ensemble.json
// atomically. Returns the manifest. Notes (e.g. an unfinished expert) go to `notes`. A refusal of the
// runs is an InputError (exit 2); a manifest that cannot be written, an Error.
nlohmann::json assemble_ensemble(const std::string& dir, const EnsembleSpec& spec, std::vector<std::string>& notes);

struct LoadedEnsemble {
  std::string dir;
  nlohmann::json manifest;
  int64_t k = 0;
  std::vector<std::optional<LoadedModel>> experts;  // nullopt: missing (only with allow_missing)
  LoadedModel router;
  std::string partition_dir;
  const LoadedModel& first_expert() const;  // the first present expert (sampling defaults, shapes)
  std::vector<int64_t> missing() const;
};

// Loads DIR/ensemble.json (DIR may be given as that file) and the pinned checkpoints, verifying their
// hashes. A missing expert
// checkpoint is an error naming it, unless allow_missing (then that expert is left out and the
// router's probabilities are renormalized over the rest). A changed checkpoint is always an error.
// The networks (experts, router, a latent model's autoencoder) are loaded onto `device`.
LoadedEnsemble load_ensemble(const std::string& dir, bool use_ema, bool allow_missing,
                             torch::Device device = torch::kCPU);

// The partition the ensemble was assembled on, verified: the file must be the one ensemble.json
// records (sha256), else its clusters are not the experts' (a partition made again with other
// settings) and routing by them (--routing oracle, distillation) would be silently wrong.
Partition load_ensemble_partition(const LoadedEnsemble& e);

// The run directory of expert k as DIR/ensemble.json names it (nothing is loaded or verified).
std::string ensemble_expert_run(const std::string& dir, int64_t k);

// The `ddm sample` command that samples DIR, for a "next:" line (with a --prompt for text experts).
std::string ensemble_sample_command(const std::string& dir);

// The routed ensemble over the loaded models. Sampling happens on the first present expert's path;
// `oracle` routing loads the partition's data for the exact posterior. It computes where the networks
// were loaded; precision bf16 runs the experts' and the router's forward passes under bfloat16
// autocast (estimates and probabilities in float32).
std::unique_ptr<Ensemble> make_ensemble(const LoadedEnsemble& e, const Routing& routing, uint64_t seed,
                                        Precision precision = Precision::kFp32);

}  // namespace ddm
