// Compute islands: the K experts and the router of a decentralized ensemble trained as independent
// OS processes (`ddm train --partition ... --expert k`, `ddm train-router`), with no communication
// between them. The runner keeps at most `concurrency` islands alive, restarts a crashed island from
// its last checkpoint (at most `retries` times) while the others go on, records every island's
// state in OUT/islands.json, and assembles OUT/ensemble.json when all are done. The same islands
// can run as a Slurm job array instead (slurm_script), one array task per island.
//
// Islands file (TOML; relative paths are relative to the working directory):
//   out = "runs/k4"                       # experts/0..K-1, router/, logs/, islands.json, ensemble.json
//   config = "configs/quickstart.toml"    # the experts' training config
//   [partition]  path = "parts/k4", k = 4, features = "pixels:64"   (made first if path is missing)
//   [experts]    budget = "split-batch", set = ["train.steps=1200"]
//   [router]     preset = "router-dit-tiny", holdout = 1000, set = ["train.steps=600"]
//   [run]        concurrency = 1, retries = 2, threads = 0, routing = "top1"
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ddm {

struct IslandsConfig {
  std::string origin;  // the islands file
  std::string out, config, partition, features = "pixels:64", budget = "split-batch";
  std::string router_preset = "router-dit-tiny", routing = "top1";
  int64_t k = 0, holdout = 1000, concurrency = 1, retries = 2, threads = 0;
  std::vector<std::string> expert_set, router_set;
};

// Parses and checks an islands file; errors name the file and the key.
IslandsConfig load_islands_config(const std::string& path);

struct Island {
  std::string name;  // "expert 3" or "router"
  int64_t expert = -1;
  std::string dir, log;
  std::vector<std::string> args;  // ddm arguments (without the program)
};
// The K + 1 islands (experts 0..K-1, then the router) for a partition with k clusters.
std::vector<Island> plan_islands(const IslandsConfig& c, int64_t k);

// Makes the partition if its directory does not exist yet (a `ddm partition` child process, logged
// to OUT/logs/partition.log); returns K.
int64_t ensure_partition(const IslandsConfig& c, const std::string& ddm_binary);

// Runs every island that is not finished yet; returns the exit code (0: all done and assembled).
int run_islands(const IslandsConfig& c, const std::string& ddm_binary);
// A table of every island: state, step / steps, attempts, last error.
std::string islands_status(const IslandsConfig& c);
// An sbatch script with one array task per island (task K is the router).
std::string slurm_script(const IslandsConfig& c, int64_t k, const std::string& ddm_binary);

}  // namespace ddm
