// Compute islands: the K experts and the router of a decentralized ensemble trained as independent
// jobs (`ddm train --partition ... --expert k`, `ddm train-router`), with no communication between
// them. An island is one process, or with `run.nproc = N` a data-parallel job of N processes
// supervised by ddm's own launcher (`ddm launch --nproc N -- train ...`: its own rendezvous store on
// a port the kernel picks, so concurrent islands never share one). The runner keeps at most
// `concurrency` islands alive, restarts a failed island (a crash, or any of its N processes killed)
// from its last checkpoint (at most `retries` times) while the others go on, records every island's
// state in OUT/islands.json, and assembles OUT/ensemble.json when all are done. An island that exits
// with status 2 (kExitBadInput, core/error.h: ddm refused its config or input, e.g. a bad value or
// data that does not fit it, before it ran) is not restarted: it would fail the same way every
// time, so it is reported failed at once, with its error. The same islands can run as a Slurm job
// array instead (slurm_script), one array task of N Slurm tasks per island.
//
// Islands file (TOML; relative paths are relative to the working directory):
//   out = "runs/k4"                       # experts/0..K-1, router/, logs/, islands.json, ensemble.json
//   config = "configs/quickstart.toml"    # the experts' training config
//   [partition]  path = "parts/k4", k = 4, features = "pixels:64"   (made first if path is missing;
//                features default: ddm partition's, pixels:64, or latent for latent shards)
//   [experts]    budget = "split-batch", set = ["train.steps=1200"]
//   [router]     preset = "router-dit-tiny", holdout = 1000, set = ["train.steps=600"]
//                (preset default: ddm train-router's, router-dit-tiny, or latent-router-dit for latent experts)
//   [run]        concurrency = 1, nproc = 1, retries = 2, threads = 0, routing = "top1"
//   [slurm]      sbatch = ["--gpus-per-node=8", "--time=24:00:00"]  (extra #SBATCH lines of the
//                `ddm islands slurm` script; the ones ddm derives itself are refused),
//                setup = ["module load cuda"]  (shell lines each array task runs first)
// run.nproc (processes per island, data parallel; each island's batch must split into them) and
// run.threads (per process; 0 = cores / (concurrency x nproc), at least 1) share the cores:
// concurrency x nproc x threads should be about the machine's cores.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ddm {

struct IslandsConfig {
  std::string origin;  // the islands file
  std::string out, config, partition, features, budget = "split-batch";
  std::string router_preset, routing = "top1";  // router_preset "": ddm train-router's default
  int64_t k = 0, holdout = 1000, concurrency = 1, nproc = 1, retries = 2, threads = 0;
  std::vector<std::string> expert_set, router_set;
  std::vector<std::string> sbatch, setup;  // [slurm]: extra #SBATCH options, shell lines run first
};

// Parses and checks an islands file; errors name the file and the key.
IslandsConfig load_islands_config(const std::string& path);
// Checks that every island's batch splits into run.nproc processes (the experts' batch after the
// experts.budget split over K, and the router's), before anything starts; the error names the
// islands file, the key, the value and the values that would work.
void check_island_batches(const IslandsConfig& c);

struct Island {
  std::string name;  // "expert 3" or "router"
  int64_t expert = -1;
  std::string dir, log;
  std::vector<std::string> args;  // the island's ddm command (train / train-router ...), without the program
};
// The ddm arguments that run an island locally: its command, or with nproc > 1 that command under
// `ddm launch --nproc N --max-restarts 0` (the runner itself restarts a failed island).
std::vector<std::string> local_command(const Island& is, int64_t nproc);
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
