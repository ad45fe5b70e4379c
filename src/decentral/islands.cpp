// The islands runner, status and Slurm script (see islands.h). Islands are child processes of
// src/launch/process.h (own process group, output appended to the island's log, tied to the runner's
// life); an island of N processes is `ddm launch`, which supervises its ranks.
#include "decentral/islands.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "core/config.h"
#include "core/error.h"
#include "core/input_check.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/run_dir.h"
#include "decentral/ensemble_dir.h"
#include "decentral/partition.h"
#include "decentral/train_run.h"
#include "launch/process.h"
#include "run/setup.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace ddm {

namespace {

std::atomic<int> g_stop{0};
void on_stop(int sig) { g_stop = sig; }

// ---- the islands file ----

// The sbatch options ddm derives itself (slurm_script), with the islands key that sets each.
const std::map<std::string, std::string>& derived_sbatch_options() {
  static const std::map<std::string, std::string> m = {
      {"--array", "one array task per island, from partition.k"},
      {"-a", "one array task per island, from partition.k"},
      {"--ntasks", "run.nproc (the processes of each island)"},
      {"-n", "run.nproc (the processes of each island)"},
      {"--cpus-per-task", "run.threads"},
      {"-c", "run.threads"},
      {"--output", "OUT/logs/slurm-%A_%a.log, where `ddm islands status` and the docs look"},
      {"-o", "OUT/logs/slurm-%A_%a.log, where `ddm islands status` and the docs look"}};
  return m;
}

// "--time=1:00:00" -> "--time", "-t 60" -> "-t", "-t60" -> "-t".
std::string sbatch_option_name(const std::string& line) {
  if (line.rfind("--", 0) == 0) return line.substr(0, line.find_first_of("= \t"));
  return line.substr(0, 2);
}

// One `#SBATCH` line of slurm.sbatch: an option on one line, not one that ddm writes itself.
void check_sbatch_option(const std::string& line, const std::string& origin) {
  DDM_CHECK(line.size() >= 2 && line[0] == '-' && line != "--",
            origin << ": slurm.sbatch holds sbatch options, each starting with '-' (\"--time=24:00:00\", "
                      "\"--gpus-per-node=8\"); got '" << line << "'");
  DDM_CHECK(line.find_first_of("\n\r") == std::string::npos,
            origin << ": slurm.sbatch holds one option per string; this one has a line break: '" << line << "'");
  const std::string name = sbatch_option_name(line);
  const auto derived = derived_sbatch_options().find(name);
  DDM_CHECK(derived == derived_sbatch_options().end(),
            origin << ": slurm.sbatch: '" << line << "' sets " << name << ", which ddm writes itself from "
                   << derived->second << "; remove it from slurm.sbatch");
}

IslandsConfig parse(const toml::table& t, const std::string& origin) {
  IslandsConfig c;
  c.origin = origin;
  const std::map<std::string, std::set<std::string>> known = {
      {"", {"out", "config", "partition", "experts", "router", "run", "slurm"}},
      {"partition", {"path", "k", "features"}},
      {"experts", {"budget", "set"}},
      {"router", {"preset", "holdout", "set"}},
      {"run", {"concurrency", "nproc", "retries", "threads", "routing"}},
      {"slurm", {"sbatch", "setup"}}};
  for (auto&& [k, v] : t) {
    const std::string key(k.str());
    DDM_CHECK(known.at("").count(key), origin << ": unknown key '" << key << "'; valid: out, config, [partition], "
                                              "[experts], [router], [run], [slurm]");
    if (const auto* sub = v.as_table())
      for (auto&& [k2, v2] : *sub) {
        (void)v2;
        DDM_CHECK(known.count(key) && known.at(key).count(std::string(k2.str())),
                  origin << ": unknown key '" << key << "." << k2.str() << "'");
      }
  }
  auto str = [&](const char* path, std::string& out, bool required) {
    auto node = t.at_path(path);
    if (!node) {
      DDM_CHECK(!required, origin << ": '" << path << "' is required");
      return;
    }
    DDM_CHECK(node.is_string(), origin << ": '" << path << "' must be a string");
    out = node.as_string()->get();
    DDM_CHECK(!out.empty(), origin << ": '" << path << "' must not be empty");
  };
  auto num = [&](const char* path, int64_t& out, int64_t min) {
    auto node = t.at_path(path);
    if (!node) return;
    DDM_CHECK(node.is_integer(), origin << ": '" << path << "' must be an integer");
    out = node.as_integer()->get();
    DDM_CHECK(out >= min, origin << ": '" << path << "' must be >= " << min << ", got " << out);
  };
  auto list = [&](const char* path, std::vector<std::string>& out, const char* example = "\"train.steps=600\"") {
    auto node = t.at_path(path);
    if (!node) return;
    DDM_CHECK(node.is_array(), origin << ": '" << path << "' must be an array of strings like " << example);
    for (const auto& e : *node.as_array()) {
      DDM_CHECK(e.is_string(), origin << ": '" << path << "' must hold strings like " << example);
      out.push_back(e.as_string()->get());
    }
  };
  str("out", c.out, true);
  str("config", c.config, true);
  str("partition.path", c.partition, true);
  num("partition.k", c.k, 2);
  str("partition.features", c.features, false);
  str("experts.budget", c.budget, false);
  list("experts.set", c.expert_set);
  str("router.preset", c.router_preset, false);
  num("router.holdout", c.holdout, 0);
  list("router.set", c.router_set);
  // Which images the islands see is the config's: the partition is made from it, and every expert and the
  // router must see the data it was made on (each would otherwise refuse the partition, one by one).
  const std::map<std::string, const char*> data_keys = {
      {"data.source", "set it there (a copy of the config for these islands)"},
      {"data.root", "set it there (a copy of the config for these islands)"},
      {"data.split", "set it there (a copy of the config for these islands)"},
      {"data.limit", "set it there (a copy of the config for these islands)"},
      {"data.holdout", "the router's is router.holdout"},
      {"data.partition", "the islands set it themselves"},
      {"data.expert", "the islands set it themselves"}};
  for (const auto* sets : {&c.expert_set, &c.router_set})
    for (const std::string& s : *sets) {
      const auto hit = data_keys.find(s.substr(0, s.find('=')));  // the key as --set reads it
      DDM_CHECK(hit == data_keys.end(),
                origin << ": " << (sets == &c.expert_set ? "experts.set" : "router.set") << " sets " << hit->first
                       << ", but which images the islands train on is the config's (" << c.config
                       << "): the partition is made from it and every island must see the same data; " << hit->second);
    }
  num("run.concurrency", c.concurrency, 1);
  num("run.nproc", c.nproc, std::numeric_limits<int64_t>::min());
  DDM_CHECK(c.nproc >= 1, origin << ": run.nproc = " << c.nproc << " is not a number of processes: each island needs at "
                                    "least 1; set run.nproc = 1 (one process per island, the default) or more to "
                                    "train each island data-parallel over that many processes");
  num("run.retries", c.retries, 0);
  num("run.threads", c.threads, 0);
  str("run.routing", c.routing, false);
  list("slurm.sbatch", c.sbatch, "\"--partition=gpu\"");
  list("slurm.setup", c.setup, "\"module load cuda\"");
  for (const auto& line : c.sbatch) check_sbatch_option(line, origin);
  for (const auto& line : c.setup)
    DDM_CHECK(line.find_first_of("\n\r") == std::string::npos,
              origin << ": slurm.setup holds one shell line per string; this one has a line break: '" << line << "'");
  DDM_CHECK(c.budget == "full" || c.budget == "split-batch" || c.budget == "split-steps",
            origin << ": experts.budget = '" << c.budget << "' is not one of full, split-batch, split-steps");
  DDM_CHECK(fs::exists(c.config), origin << ": config = '" << c.config << "' does not exist");
  parse_routing(c.routing);
  return c;
}

// ---- a finished island against the file's settings ----

// The config an island's command makes before its data is read (what `ddm train` / `ddm
// train-router` builds from the same arguments).
RunConfig planned_config(const IslandsConfig& c, const Island& is) {
  if (is.expert < 0) return router_run_config(c.config, c.partition, c.router_preset, c.holdout, c.router_set);
  std::vector<std::string> sets = c.expert_set;
  sets.insert(sets.end(), {"data.partition='" + fs::absolute(c.partition).string() + "'",
                           "data.expert=" + std::to_string(is.expert), "train.expert_budget=" + c.budget});
  return load_config(c.config, sets);  // (a run records the budget's batch and steps before its split)
}

// What a run trains as, for comparing a finished island with the file: its [model], [diffusion] and
// [train] keys, less those a resume may change (normalized_for_resume), the frozen parts' folders and
// files (resolved and pinned by sha256 when the run started: moved folders compare alike), and what a
// diffusers UNet, ControlNet base or scheduler file sets.
RunConfig trained_as(const RunConfig& r) {
  const RunConfig n = normalized_for_resume(r);
  RunConfig t, d;
  t.model = n.model, t.diffusion = n.diffusion, t.train = n.train;
  ModelConfig& m = t.model;
  for (std::string* s : {&m.text_encoder, &m.latent, &m.embed, &m.controlnet, &m.unet, &m.text_sha256, &m.latent_sha256,
                         &m.embed_sha256, &m.controlnet_sha256, &m.unet_sha256})
    s->clear();
  if (r.model.arch == "sd-unet" || !r.model.controlnet.empty()) t.model = d.model;
  if (!r.diffusion.scheduler.empty()) t.diffusion = d.diffusion;
  t.train.teacher.clear();
  return t;
}

// A finished island as the file asks for it: "" when it is, else the first key that differs (or the
// partition it trained on, when not the one of sha256 `partition_sha` there now). More steps than it
// trained sets `more_steps` (it trains on).
std::string finished_differs(const IslandsConfig& c, const Island& is, const std::string& partition_sha,
                             bool& more_steps) {
  const std::string stored_path = RunDir(is.dir).config();
  RunConfig stored, planned;
  try {
    stored = load_config(stored_path);
  } catch (const Error& e) {
    throw InputError(is.name + " in " + is.dir + " is finished, but its " + stored_path + " cannot be read (" + e.what() +
                     "): restore it, or move the directory away to train the island again");
  }
  try {
    planned = planned_config(c, is);
  } catch (const Error& e) {
    throw InputError(c.origin + ": " + is.name + "'s settings: " + e.what());
  }
  // The partition it trained on (its expert.json / router.json): the file's, as it is now.
  const fs::path record = RunDir(is.dir) / (is.expert >= 0 ? RunDir::kExpert : RunDir::kRouter);
  try {
    const std::string was = nlohmann::json::parse(read_file(record.string())).at("partition_sha256").get<std::string>();
    if (was != partition_sha)
      return "it trained on another partition (sha256 " + was.substr(0, 12) + ") than " + c.partition + " holds now (" +
             partition_sha.substr(0, 12) + ")";
  } catch (const nlohmann::json::exception& e) {
    throw InputError(is.name + " in " + is.dir + " is finished, but its " + record.string() + " is damaged (" + e.what() +
                     "): restore it, or move the directory away to train the island again");
  }
  more_steps = planned.train.steps > stored.train.steps;
  // What the run filled in from its data and frozen parts where the settings leave it to them.
  ModelConfig& p = planned.model;
  const ModelConfig& s = stored.model;
  for (auto [key, auto_value] : {std::pair{&ModelConfig::in_channels, int64_t{0}}, {&ModelConfig::image_size, int64_t{0}},
                                 {&ModelConfig::num_classes, int64_t{-1}}, {&ModelConfig::num_experts, int64_t{0}},
                                 {&ModelConfig::text_dim, int64_t{0}}, {&ModelConfig::text_pooled_dim, int64_t{0}},
                                 {&ModelConfig::text_tokens, int64_t{0}}, {&ModelConfig::embed_dim, int64_t{0}}})
    if (p.*key == auto_value) p.*key = s.*key;
  if (p.latent_scale == 0 && p.latent_shift == 0) p.latent_scale = s.latent_scale, p.latent_shift = s.latent_shift;
  p.self_cond = s.self_cond;  // derived from train.self_cond, which is compared
  if (is.expert < 0 || p.arch == "router-dit") p.patch = s.patch;  // fitted to the image size (fit_patch)
  return first_difference(to_toml(trained_as(stored)), to_toml(trained_as(planned)), is.dir, c.origin);
}

// ---- islands on disk ----

struct IslandProgress {
  int64_t step = 0, steps = 0;  // steps = 0: not started (target unknown)
  bool done = false;
};

IslandProgress progress_of(const Island& is) {
  IslandProgress p;
  if (auto latest = latest_checkpoint(is.dir)) {
    const std::string name = fs::path(*latest).filename().string();  // step-XXXXXXXX
    p.step = std::stoll(name.substr(name.find('-') + 1));
  }
  try {
    if (is.expert >= 0 && fs::exists(RunDir(is.dir) / RunDir::kExpert)) {
      const std::string record = RunDir(is.dir) / RunDir::kExpert;
      p.steps = json_int(nlohmann::json::parse(read_file(record)).at("steps"), record + ": key \"steps\"", 0);
    } else if (is.expert < 0 && fs::exists(RunDir(is.dir).config())) {
      p.steps = load_config(RunDir(is.dir).config()).train.steps;
    }
  } catch (const std::exception&) {
    p.steps = 0;  // a half-written run: not finished
  }
  p.done = p.steps > 0 && p.step >= p.steps && (is.expert >= 0 || fs::exists(RunDir(is.dir) / RunDir::kRouterEval));
  return p;
}

// The step of the last line of a run's metrics.jsonl (0 if none yet): the live step, which runs
// ahead of the last checkpoint. Reads only the file's tail.
int64_t logged_step(const Island& is) {
  std::ifstream f(RunDir(is.dir).metrics(), std::ios::binary | std::ios::ate);
  if (!f) return 0;
  const std::streamoff size = f.tellg();
  f.seekg(std::max<std::streamoff>(0, size - 4096));
  std::string tail((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  while (!tail.empty() && tail.back() == '\n') tail.pop_back();
  const size_t newline = tail.find_last_of('\n');
  const std::string line = newline == std::string::npos ? tail : tail.substr(newline + 1);
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<int64_t>() : 0;
}

// Why an island failed, from its log after byte `from` (where this attempt's output starts; "" if it
// says nothing): the last line that reports an error.
// An island of N processes runs under `ddm launch`, whose log lines are "[rank R] ..." from the
// ranks and "[launch] ..." from the launcher: there the cause is the launcher's last "rank R (pid P)
// exited with status S" / "was killed by signal 9 (SIGKILL)", followed by that rank's own last error.
std::string last_error(const std::string& log, std::uintmax_t from = 0) {
  std::ifstream f(log);
  f.seekg(static_cast<std::streamoff>(from));
  std::string line, err, cause, cause_rank;
  std::map<std::string, std::string> rank_err;  // "[rank R] " -> its last error line
  while (std::getline(f, line)) {
    if (line.rfind("error", 0) == 0) err = line;
    if (line.rfind("[rank ", 0) == 0) {
      const size_t end = line.find("] ");
      if (end != std::string::npos && line.compare(end + 2, 5, "error") == 0)
        rank_err[line.substr(0, end + 2)] = line.substr(end + 2);
    }
    if (line.rfind("[launch] rank ", 0) == 0) {
      cause = line.substr(9, line.find("; stopping") - 9);  // "rank 1 (pid 123) was killed by ..."
      cause_rank = "[" + cause.substr(0, cause.find(" (")) + "] ";
    }
  }
  if (cause.empty()) return err;
  return rank_err.count(cause_rank) ? cause + ": " + rank_err[cause_rank] : cause;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

// The size of a file (0 if it does not exist): where the next attempt's output will start in a log.
std::uintmax_t size_of(const std::string& path) {
  std::error_code ec;
  const std::uintmax_t n = fs::file_size(path, ec);
  return ec ? 0 : n;
}

// Starts `ddm ARGS`, its output appended to `log`. The island is in its own process group (the
// runner decides what a Ctrl-C does to it) and does not outlive the runner: if the runner dies,
// even by kill -9, the island gets SIGTERM, writes a checkpoint and stops (a launcher passes it on
// to its ranks), so the next runner resumes it with no second writer.
pid_t spawn(const std::string& binary, const std::vector<std::string>& args, const std::string& log) {
  fs::create_directories(fs::path(log).parent_path());
  ChildSpec spec;
  spec.program = binary;
  spec.argv = {binary};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env = environment_with({});
  spec.output_file = log;
  return spawn_child(spec).pid;
}

std::string describe_exit(const ExitStatus& s) {
  if (s.signal != 0) return "killed by signal " + std::to_string(s.signal);
  return "exit code " + std::to_string(s.code);
}

}  // namespace

// A missing, malformed or invalid islands file is bad input (exit 2): running again fails alike.
IslandsConfig load_islands_config(const std::string& path) {
  return as_input_error([&] {
    DDM_CHECK(fs::exists(path), "islands file '" << path << "' does not exist");
    toml::table t;
    try {
      t = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      DDM_FAIL(path << ":" << e.source().begin.line << ": " << e.description());
    }
    return parse(t, path);
  });
}

std::vector<Island> plan_islands(const IslandsConfig& c, int64_t k) {
  const std::string part = fs::absolute(c.partition).string(), threads = "train.threads=" + std::to_string(c.threads);
  std::vector<Island> out;
  for (int64_t e = 0; e <= k; ++e) {
    Island is;
    is.expert = e < k ? e : -1;
    is.name = e < k ? "expert " + std::to_string(e) : "router";
    is.dir = (fs::path(c.out) / (e < k ? "experts/" + std::to_string(e) : "router")).string();
    is.log = (fs::path(c.out) / "logs" / (e < k ? "expert" + std::to_string(e) + ".log" : "router.log")).string();
    if (e < k) {
      is.args = {"train", "--config", c.config, "--partition", part, "--expert", std::to_string(e), "--budget", c.budget};
    } else {
      is.args = {"train-router", "--config", c.config, "--partition", part, "--holdout", std::to_string(c.holdout)};
      if (!c.router_preset.empty()) is.args.insert(is.args.end(), {"--preset", c.router_preset});
    }
    is.args.insert(is.args.end(), {"--set", threads});
    for (const auto& s : e < k ? c.expert_set : c.router_set) is.args.insert(is.args.end(), {"--set", s});
    is.args.insert(is.args.end(), {"--out", is.dir, "--resume"});
    out.push_back(is);
  }
  return out;
}

std::vector<std::string> local_command(const Island& is, int64_t nproc) {
  if (nproc <= 1) return is.args;
  std::vector<std::string> args = {"launch", "--nproc", std::to_string(nproc), "--max-restarts", "0", "--run-id",
                                   "islands-" + fs::path(is.log).stem().string(), "--"};
  args.insert(args.end(), is.args.begin(), is.args.end());
  return args;
}

namespace {

// "1, 2, 4, 8" (the divisors of n, at most 12 of them).
std::string divisors(int64_t n) {
  std::string out;
  int shown = 0;
  for (int64_t d = 1; d <= n && shown < 12; ++d)
    if (n % d == 0) out += (shown++ ? ", " : "") + std::to_string(d);
  return out;
}

}  // namespace

void check_island_batches(const IslandsConfig& c) {
  // K before anything runs: the partition's, or partition.k for one still to be made.
  const int64_t k = fs::exists(c.partition) ? load_partition(c.partition).k : c.k;
  DDM_INPUT_CHECK(c.k == 0 || c.k == k, c.origin << ": partition.k = " << c.k << " but " << c.partition << " has K = "
                                                 << k << "; remove partition.k or use another partition.path");
  if (k < 2) return;  // no partition and no partition.k: ensure_partition says so
  // The expert's and the router's configs exactly as `ddm train` builds them from the islands'
  // arguments. Their errors said as the islands file's: its experts.set and router.* are what the islands pass
  // on as --set and --preset.
  const auto as_written = [&](const char* keys, const auto& f) {
    try {
      return f();
    } catch (const Error& e) {
      const std::string what = e.what();  // the file's own keys named as the islands pass them on
      if (what.rfind("--set ", 0) != 0 && what.rfind("--preset", 0) != 0) throw;
      throw InputError(c.origin + ": " + keys + " (passed to each island as its --set / --preset): " + what);
    }
  };
  Island first_expert, the_router;
  first_expert.expert = 0;
  const TrainConfig expert = as_written("experts.set", [&] { return planned_config(c, first_expert).train; });
  const TrainConfig router =
      as_written("router.preset, router.holdout or router.set", [&] { return planned_config(c, the_router).train; });
  int64_t expert_batch = expert.batch_size;
  std::string how = "train.batch_size = " + std::to_string(expert.batch_size);
  if (c.budget == "split-batch") {
    DDM_CHECK(expert.batch_size % k == 0,
              c.origin << ": experts.budget = split-batch divides the experts' train.batch_size = " << expert.batch_size
                       << " by K = " << k << ", which does not divide it; use a multiple of " << k
                       << " (in " << c.config << " or experts.set) or experts.budget = \"full\"");
    expert_batch /= k;
    how += " / K = " + std::to_string(k) + " (experts.budget = split-batch) = " + std::to_string(expert_batch);
  }
  if (c.nproc == 1) return;  // one process per island: the trainer's own checks
  // Every island runs on run.nproc processes, so the values that work divide both batches (per
  // micro-batch of train.grad_accum).
  const bool whole = expert_batch % expert.grad_accum == 0 && router.batch_size % router.grad_accum == 0;
  const int64_t both = whole ? std::gcd(expert_batch / expert.grad_accum, router.batch_size / router.grad_accum) : 1;
  auto check = [&](const char* whose, int64_t batch, int64_t accum, const std::string& whence, const char* set_key) {
    DDM_CHECK(batch % (c.nproc * accum) == 0,
              c.origin << ": run.nproc = " << c.nproc << " does not split the " << whose << " batch: " << whence
                       << (accum > 1 ? ", in train.grad_accum = " + std::to_string(accum) + " micro-batches," : "")
                       << " is not a multiple of " << c.nproc * accum << "; set run.nproc to one of "
                       << divisors(both) << ", or change train.batch_size (in " << c.config << " or " << set_key
                       << ")");
  };
  check("experts'", expert_batch, expert.grad_accum, how, "experts.set");
  check("router's", router.batch_size, router.grad_accum, "train.batch_size = " + std::to_string(router.batch_size),
        "router.set");
}

int64_t ensure_partition(const IslandsConfig& c, const std::string& ddm_binary) {
  if (!fs::exists(c.partition)) {
    DDM_CHECK(c.k >= 2, c.origin << ": the partition " << c.partition << " does not exist; set partition.k to make it");
    std::cout << "[islands] making the partition " << c.partition << " (K = " << c.k << ", "
              << (c.features.empty() ? "default features" : c.features) << ")" << std::endl;
    const std::string log = (fs::path(c.out) / "logs" / "partition.log").string();
    const std::uintmax_t from = size_of(log);
    std::vector<std::string> args = {"partition", "--config", c.config, "--k", std::to_string(c.k), "--out", c.partition};
    if (!c.features.empty()) args.insert(args.end(), {"--features", c.features});
    // Over tar shards (or latent shards) each expert's island reads its cluster's own shards, written
    // with the partition.
    const std::string source = load_config(c.config).data.source;
    if (source == "shards" || source == "latents") {
      args.push_back("--reshard");
      // An island of run.nproc processes gives each its own shards: each cluster needs that many.
      if (c.nproc > 1) args.insert(args.end(), {"--min-shards", std::to_string(c.nproc)});
    }
    const ExitStatus status = wait_exit(spawn(ddm_binary, args, log));
    if (!status.ok()) {
      std::ostringstream os;
      os << "making the partition failed (" << describe_exit(status) << "): " << last_error(log, from) << " (log " << log
         << ")";
      // Its input (the experts' config, the data it names) is this run's: bad input here is bad input.
      if (status.signal == 0 && status.code == kExitBadInput) throw InputError(os.str());
      DDM_FAIL(os.str());
    }
  }
  const Partition p = load_partition(c.partition);
  DDM_INPUT_CHECK(c.k == 0 || c.k == p.k, c.origin << ": partition.k = " << c.k << " but " << c.partition << " has K = "
                                             << p.k << "; remove partition.k or use another partition.path");
  return p.k;
}

int run_islands(const IslandsConfig& c, const std::string& ddm_binary) {
  check_island_batches(c);  // before anything is made or started: nothing runs on a bad run.nproc
  fs::create_directories(fs::path(c.out) / "logs");
  const FileLock lock = as_input_error([&] {
    return FileLock((fs::path(c.out) / "islands.lock").string(), "another `ddm islands run` is working in " + c.out);
  });
  const int64_t k = ensure_partition(c, ddm_binary);
  // run.threads = 0 shares the cores among the processes that run at once (concurrency islands of
  // nproc processes each, or fewer where fewer are left to run, as on a rerun): two OpenMP pools
  // that each take every core are many times slower than one, not twice.
  std::vector<IslandProgress> progress;  // each island's, read once
  // A finished island is what this file asks for, or it is not taken: trained with other settings
  // (the file changed since, or another run put in its directory) it is refused before anything
  // starts, naming the key; with more train.steps than it trained it trains on.
  {
    const std::vector<Island> planned = plan_islands(c, k);
    const std::string partition_sha = sha256_file(load_partition(c.partition).origin);
    for (size_t i = 0; i < planned.size(); ++i) {
      progress.push_back(progress_of(planned[i]));
      if (!progress[i].done) continue;
      bool more = false;
      const std::string diff = finished_differs(c, planned[i], partition_sha, more);
      DDM_INPUT_CHECK(diff.empty(), planned[i].name << " in " << planned[i].dir << " finished with other settings than "
                                                    << c.origin << " asks for: " << diff << ". Move its directory away "
                                                    << "to train it again with the file's settings, or restore the "
                                                    << "settings it was trained with (nothing was started)");
      if (more) progress[i].done = false;  // resumed: it trains on to the file's steps
    }
  }
  const int64_t left = std::count_if(progress.begin(), progress.end(), [](const IslandProgress& p) { return !p.done; });
  IslandsConfig shared = c;
  const int64_t processes = std::min(c.concurrency, left) * c.nproc;
  if (c.threads == 0 && processes > 1)
    shared.threads = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()) / processes);
  std::vector<Island> islands = plan_islands(shared, k);
  // An island that trained part of the way goes on with the threads it trained with: a run repeats
  // bit for bit only at the same thread count (docs/determinism.md).
  if (c.threads == 0)
    for (size_t i = 0; i < islands.size(); ++i) {
      Island& is = islands[i];
      if (progress[i].step == 0) continue;
      try {
        const int64_t was = load_config(RunDir(is.dir).config()).train.threads;
        for (std::string& arg : is.args)
          if (arg.rfind("train.threads=", 0) == 0) arg = "train.threads=" + std::to_string(was);
      } catch (const std::exception&) {
        // A run directory it cannot read: the island's own resume says why.
      }
    }
  const size_t n = islands.size();
  const std::string state_path = (fs::path(c.out) / "islands.json").string();
  nlohmann::json before;  // an earlier runner's record: a finished island keeps its attempts
  try {
    if (fs::exists(state_path)) before = nlohmann::json::parse(read_file(state_path));
  } catch (const std::exception&) {
  }
  nlohmann::json state = nlohmann::json::array();
  std::deque<size_t> queue;
  std::vector<std::uintmax_t> log_start(n, 0);  // where each island's current attempt starts in its log
  for (size_t i = 0; i < n; ++i) {
    const bool done = progress[i].done;
    state.push_back({{"name", islands[i].name}, {"dir", islands[i].dir}, {"log", islands[i].log},
                     {"state", done ? "done" : "pending"}, {"attempts", 0}, {"pid", 0}, {"nproc", c.nproc},
                     {"last_exit", ""}, {"last_error", ""}});
    if (done && before.is_array() && i < before.size() && before[i].is_object() &&
        before[i].value("name", "") == islands[i].name && before[i].value("state", "") == "done") {
      const auto attempts = before[i].find("attempts");
      if (attempts != before[i].end() && attempts->is_number_integer()) state[i]["attempts"] = *attempts;
    }
    if (!done) queue.push_back(i);
  }
  const size_t finished = n - queue.size();
  auto save = [&] { write_file_atomic(state_path, state.dump(2) + "\n"); };
  save();
  const std::string per = c.nproc > 1 ? " per process" : " each";
  std::cout << "[islands] " << k << " experts and a router in " << c.out << ": " << finished << " already done, "
            << n - finished << " to run, " << c.concurrency << " at a time"
            << (c.nproc > 1 ? ", " + std::to_string(c.nproc) + " processes each (ddm launch)" : std::string())
            << ", up to " << c.retries << " restarts each"
            << (shared.threads > 0 ? ", " + std::to_string(shared.threads) + (shared.threads == 1 ? " thread" : " threads") + per
                                   : ", all cores" + per)
            << std::endl;

  g_stop = 0;
  auto old_int = std::signal(SIGINT, on_stop), old_term = std::signal(SIGTERM, on_stop);
  std::map<pid_t, size_t> running;  // island pid (also its process group) -> island
  bool stopping = false;
  auto last_report = std::chrono::steady_clock::now();
  while (!running.empty() || (!stopping && !queue.empty())) {  // once stopping, pending islands stay pending
    while (!stopping && !queue.empty() && static_cast<int64_t>(running.size()) < c.concurrency) {
      const size_t i = queue.front();
      queue.pop_front();
      log_start[i] = size_of(islands[i].log);
      const pid_t pid = spawn(ddm_binary, local_command(islands[i], c.nproc), islands[i].log);
      running[pid] = i;
      state[i]["state"] = "running";
      state[i]["pid"] = pid;
      state[i]["attempts"] = state[i]["attempts"].get<int64_t>() + 1;
      save();
      std::cout << "[islands] " << islands[i].name << ": started (attempt " << state[i]["attempts"] << ", pid " << pid
                << (c.nproc > 1 ? ", " + std::to_string(c.nproc) + " processes" : std::string()) << ", log "
                << islands[i].log << ")" << std::endl;
    }
    if (g_stop != 0 && !stopping) {
      stopping = true;
      std::cout << "[islands] signal " << g_stop.load() << ": stopping the running islands (each writes a checkpoint)"
                << std::endl;
      for (const auto& r : running) signal_group(r.first, SIGTERM);
    }
    pid_t pid = 0;
    ExitStatus status;
    for (const auto& r : running)
      if (const auto s = peek_exit(r.first)) {
        pid = r.first;
        status = *s;
        break;
      }
    if (pid == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(30)) {
        last_report = std::chrono::steady_clock::now();
        std::cout << "[islands]";
        for (const auto& r : running) {
          const IslandProgress p = progress_of(islands[r.second]);
          const int64_t live = std::max(p.step, logged_step(islands[r.second]));
          std::cout << " " << islands[r.second].name << " step " << live << "/" << (p.steps > 0 ? std::to_string(p.steps) : "?")
                    << ";";
        }
        std::cout << std::endl;
      }
      continue;
    }
    // Not reaped yet, so its group id is still its own: end what it left in its group, then reap.
    signal_group(pid, SIGKILL);
    reap(pid);
    const size_t i = running[pid];
    running.erase(pid);
    const Island& is = islands[i];
    const IslandProgress p = progress_of(is);
    state[i]["pid"] = 0;
    state[i]["last_exit"] = describe_exit(status);
    if (status.ok() && p.done) {
      state[i]["state"] = "done";
      std::cout << "[islands] " << is.name << ": done (step " << p.step << ")" << std::endl;
    } else if (stopping) {
      state[i]["state"] = "stopped";
      std::cout << "[islands] " << is.name << ": stopped at step " << p.step << std::endl;
    } else {
      const std::string err = last_error(is.log, log_start[i]);
      // Where it was (its metrics' last step) and where it goes on from (its last checkpoint).
      const int64_t live = std::max(p.step, logged_step(is));
      const std::string at = " at step " + std::to_string(live) +
                             (live != p.step ? " (its last checkpoint: step " + std::to_string(p.step) + ")" : "");
      state[i]["last_error"] = describe_exit(status) + at + (err.empty() ? "" : ": " + err);
      const int64_t attempts = state[i]["attempts"].get<int64_t>();
      // Exit status 2 (kExitBadInput): ddm refused the island's config or input before it ran (its
      // launcher passes that on); a restart would fail the same way, so the island fails now.
      const bool refused = status.signal == 0 && status.code == kExitBadInput;
      if (refused) {
        state[i]["state"] = "failed";
        std::cout << "[islands] " << is.name << ": failed (" << describe_exit(status)
                  << ": its config or input was refused before it ran; not restarted, a restart would fail the same "
                     "way): " << (err.empty() ? "see its log" : err) << " (log " << is.log << ")" << std::endl;
      } else if (attempts <= c.retries) {
        state[i]["state"] = "retrying";
        queue.push_back(i);
        std::cout << "[islands] " << is.name << ": " << describe_exit(status) << at
                  << (err.empty() ? std::string() : " (" + err + ")")
                  << "; restarting from its last checkpoint (restart " << attempts << " of " << c.retries << ")"
                  << std::endl;
      } else {
        state[i]["state"] = "failed";
        std::cout << "[islands] " << is.name << ": failed (" << describe_exit(status) << ", " << attempts
                  << " attempts): " << state[i]["last_error"].get<std::string>() << " (log " << is.log << ")" << std::endl;
      }
    }
    save();
  }
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);
  std::vector<std::string> failed;
  for (size_t i = 0; i < n; ++i)
    if (state[i]["state"] != "done") failed.push_back(islands[i].name + " (" + state[i]["state"].get<std::string>() + ")");
  if (!failed.empty()) {
    std::cout << "[islands] not done:";
    for (const auto& f : failed) std::cout << " " << f << ";";
    if (stopping)  // asked to stop (Ctrl-C, SIGTERM): nothing to fix
      std::cout << " stopped as asked; run the same command again to go on: finished islands are kept, the "
                   "rest resume from their checkpoints" << std::endl;
    else
      std::cout << " the others are finished and kept. Fix the cause (see the logs), then run the same command "
                   "again: finished islands are kept, the rest resume from their checkpoints" << std::endl;
    return stopping ? 128 + g_stop.load() : 1;  // 130 for SIGINT, 143 for SIGTERM
  }
  EnsembleSpec spec;
  spec.partition = c.partition;
  spec.router = islands.back().dir;
  spec.routing = c.routing;
  for (int64_t e = 0; e < k; ++e) spec.experts.push_back(islands[e].dir);
  std::vector<std::string> notes;
  assemble_ensemble(c.out, spec, notes);  // parts that do not fit: bad input
  for (const auto& note : notes) std::cout << "note: " << note << std::endl;
  std::cout << "[islands] all " << n << " islands done; wrote " << c.out << "/ensemble.json\nnext: "
            << ensemble_sample_command(c.out) << std::endl;
  return 0;
}

namespace {

// Whether an ensemble.json holds island `expert`'s (-1: the router's) checkpoint `ckpt`: the weights'
// sha256 it records against those the checkpoint's state.json recorded when it was written (nothing
// is hashed again, so a status of large experts is immediate).
bool holds_checkpoint(const nlohmann::json& ensemble, int64_t expert, const std::string& ckpt) {
  try {
    const nlohmann::json& entry = expert >= 0 ? ensemble.at("experts").at(static_cast<size_t>(expert)) : ensemble.at("router");
    const nlohmann::json state = nlohmann::json::parse(read_file((RunDir(ckpt) / RunDir::kState)));
    const nlohmann::json& now = state.at("sha256");
    const nlohmann::json& then = entry.at("weights_sha256");
    return now.at(RunDir::kEma) == then.at("ema") && now.at(RunDir::kModel) == then.at("model");
  } catch (const std::exception&) {
    return false;  // unreadable, or from another layout: not known to be the same
  }
}

}  // namespace

std::string islands_status(const IslandsConfig& c) {
  DDM_CHECK(fs::exists(c.partition), "the partition " << c.partition << " does not exist yet: nothing has run");
  const Partition partition = load_partition(c.partition);
  const std::vector<Island> islands = plan_islands(c, partition.k);
  nlohmann::json state;
  const std::string state_path = (fs::path(c.out) / "islands.json").string();
  std::ostringstream s;
  if (fs::exists(state_path)) try {
      state = nlohmann::json::parse(read_file(state_path));
    } catch (const nlohmann::json::exception& e) {
      s << "note: " << state_path << " is damaged (" << e.what() << "): no attempts or failures to show; the next "
        << "`ddm islands run " << c.origin << "` writes it again\n";
    }
  char line[256];
  std::snprintf(line, sizeof line, "%-10s %-12s %-15s %-9s %s\n", "island", "state", "step", "attempts", "last failure");
  s << line;
  const fs::path ensemble = fs::path(c.out) / "ensemble.json";
  const bool has_ensemble = fs::exists(ensemble);
  std::vector<std::string> not_done, changed;  // islands the ensemble does not hold as they are now
  nlohmann::json assembled;
  std::string unreadable;  // why ensemble.json cannot be read
  if (has_ensemble) try {
      assembled = nlohmann::json::parse(read_file(ensemble.string()));
      (void)assembled.at("partition").at("sha256").get<std::string>();
      (void)assembled.at("experts").size();
    } catch (const std::exception& e) {
      unreadable = e.what();
    }
  std::vector<std::string> refused;  // finished islands that `islands run` refuses with this file
  const std::string partition_sha = sha256_file(partition.origin);
  for (size_t i = 0; i < islands.size(); ++i) {
    IslandProgress p = progress_of(islands[i]);
    std::string differs;  // a finished island against the file's settings, as `islands run` checks it
    if (p.done) try {
        bool more = false;
        differs = finished_differs(c, islands[i], partition_sha, more);
        if (differs.empty() && more) p.done = false, differs = "the file asks for more train.steps: it trains on";
        else if (!differs.empty()) refused.push_back(islands[i].name);
      } catch (const Error& e) {
        differs = e.what();
        refused.push_back(islands[i].name);
      }
    if (!p.done) not_done.push_back(islands[i].name);
    if (const auto latest = latest_checkpoint(islands[i].dir); p.done && has_ensemble && latest)
      if (!holds_checkpoint(assembled, islands[i].expert, *latest)) changed.push_back(islands[i].name);
    std::string st = p.done ? "done" : (p.step > 0 || p.steps > 0 ? "partial" : "not started");
    int64_t attempts = 0;
    std::string err;
    if (state.is_array() && i < state.size()) {
      const auto& e = state[i];
      attempts = e.value("attempts", int64_t{0});
      err = e.value("last_error", "");
      const std::string recorded = e.value("state", "");
      const pid_t pid = static_cast<pid_t>(e.value("pid", int64_t{0}));
      if (!p.done && recorded == "running") st = pid > 0 && kill(pid, 0) == 0 ? "running" : "interrupted";
      if (!p.done && (recorded == "failed" || recorded == "stopped" || recorded == "retrying")) st = recorded;
    }
    // A running island's live step (its metrics run ahead of its last checkpoint).
    const int64_t at = st == "running" ? std::max(p.step, logged_step(islands[i])) : p.step;
    const std::string step = std::to_string(at) + "/" + (p.steps > 0 ? std::to_string(p.steps) : "?");
    std::snprintf(line, sizeof line, "%-10s %-12s %-15s %-9lld ", islands[i].name.c_str(), st.c_str(), step.c_str(),
                  static_cast<long long>(attempts));
    s << line << (differs.empty() ? err : "not as " + c.origin + " asks: " + differs) << "\n";  // says what to do
  }
  const auto names = [](const std::vector<std::string>& v) {
    std::string out;
    for (const auto& n : v) out += (out.empty() ? "" : ", ") + n;
    return out;
  };
  const std::string again = "`ddm islands run " + c.origin + "` ";
  if (!refused.empty())
    s << "ensemble: " << again << "refuses " << names(refused) << " (trained with other settings than the file's, "
      << "above): move " << (refused.size() > 1 ? "their directories" : "its directory") << " away to train "
      << (refused.size() > 1 ? "them" : "it") << " again, or restore the settings\n";
  else if (has_ensemble && !unreadable.empty())
    s << "ensemble: " << ensemble.string() << " is damaged (" << unreadable << "); " << again << "assembles it again\n";
  else if (has_ensemble && assembled["partition"]["sha256"] != partition_sha)
    s << "ensemble: " << ensemble.string() << " is out of date: the partition " << c.partition << " changed since it "
      << "was assembled (its experts and router trained on the old one refuse it; restore it, or train them again)\n";
  else if (!has_ensemble)
    s << "ensemble: not assembled yet" << (not_done.empty() ? " (every island is done: " + again + "assembles it)" : "")
      << "\n";
  else if (!not_done.empty())
    s << "ensemble: " << ensemble.string() << " is out of date: " << names(not_done) << " not done; " << again
      << "trains " << (not_done.size() > 1 ? "them" : "it") << " and assembles it again\n";
  else if (!changed.empty())
    s << "ensemble: " << ensemble.string() << " is out of date: " << names(changed) << " changed since it was "
      << "assembled; " << again << "assembles it again\n";
  else
    s << "ensemble: " << ensemble.string() << "\n";
  return s.str();
}

std::string slurm_script(const IslandsConfig& c, int64_t k, const std::string& ddm_binary) {
  const std::vector<Island> islands = plan_islands(c, k);
  const int64_t cpus = c.threads > 0 ? c.threads : 2, n = c.nproc, r = c.retries;
  bool user_job_name = false;
  for (const auto& line : c.sbatch) {
    const std::string name = sbatch_option_name(line);
    user_job_name = user_job_name || name == "--job-name" || name == "-J";
  }
  std::ostringstream s;
  s << "#!/bin/bash\n"
    << "# ddm islands as a Slurm job array: tasks 0.." << k - 1 << " train the experts, task " << k << " the router"
    << (n > 1 ? ",\n# each island data-parallel over " + std::to_string(n) + " Slurm tasks (ranks) started by srun" : "")
    << ".\n# Written by `ddm islands slurm " << c.origin << "`. Submit with: sbatch THIS_FILE\n"
    << "# Each task resumes from its own checkpoints, so a requeued or resubmitted task loses nothing.\n"
    << "# When all tasks are done, `ddm islands run " << c.origin << "` assembles " << c.out << "/ensemble.json.\n"
    << (user_job_name ? "" : "#SBATCH --job-name=ddm-islands\n")
    << "#SBATCH --array=0-" << k << "\n"
    << (n > 1 ? "#SBATCH --ntasks=" + std::to_string(n) + "\n" : "")
    << "#SBATCH --cpus-per-task=" << cpus << "\n"
    << "#SBATCH --output=" << fs::absolute(fs::path(c.out) / "logs").string() << "/slurm-%A_%a.log\n"
    << "#SBATCH --requeue\n";
  if (!c.sbatch.empty()) s << "# slurm.sbatch of " << c.origin << ":\n";
  for (const auto& line : c.sbatch) s << "#SBATCH " << line << "\n";
  s << "set -euo pipefail\n"
    << "task=${SLURM_ARRAY_TASK_ID:?run this script with sbatch, or set SLURM_ARRAY_TASK_ID to 0.." << k << "}\n"
    << "cd " << quote(fs::current_path().string()) << "\n";
  if (!c.setup.empty()) s << "# slurm.setup of " << c.origin << ":\n";
  for (const auto& line : c.setup) s << line << "\n";
  s << "case \"$task\" in\n";
  for (size_t i = 0; i < islands.size(); ++i) {
    s << "  " << i << ")  # " << islands[i].name << "\n    " << (n > 1 ? "island=(" : "exec ") << quote(ddm_binary);
    for (const auto& a : islands[i].args) s << " " << quote(a);
    s << (n > 1 ? ") ;;\n" : " ;;\n");
  }
  s << "  *) echo \"no island for array task $task (valid: 0.." << k << ")\" >&2; exit 2 ;;\nesac\n";
  if (n > 1) {
    // One job step of n tasks per attempt: SLURM_PROCID is the rank; rank 0 hosts the rendezvous
    // on port 20000 + SLURM_JOB_ID mod 20000 (each array task has its own job id) unless MASTER_PORT
    // is set. The step is not ended when one rank exits (--kill-on-bad-exit=0): the others end by
    // themselves (a lost peer is an error within seconds, a hung one after parallel.timeout), and
    // --wait ends the step 60 s after the first rank ended. So a refused input, which every rank
    // refuses alike, comes back as exit 2: with the others killed first, srun would return their
    // signal's code (143), and the script would restart what cannot start. A failed step restarts
    // the island whole.
    s << "# The island's " << n << " ranks are one job step; a failed step (a rank crashed or was killed) restarts\n"
      << "# the whole island from its last checkpoint, at most " << r << " times (run.retries).\n"
      << "for attempt in $(seq 0 " << r << "); do\n"
      << "  if [ \"$attempt\" -gt 0 ]; then\n"
      << "    echo \"[islands] array task $task: restarting the island from its last checkpoint (restart $attempt of "
      << r << ")\" >&2\n"
      << "  fi\n"
      << "  rc=0\n"
      << "  srun --ntasks=" << n << " --cpus-per-task=" << cpus << " --kill-on-bad-exit=0 --wait=60 \"${island[@]}\" || rc=$?\n"
      << "  if [ \"$rc\" -eq 0 ]; then exit 0; fi\n"
      << "  if [ \"$rc\" -eq 2 ]; then  # ddm refused its input (config, data): a restart would fail alike\n"
      << "    echo \"[islands] array task $task: the island refused its input (exit 2; the reason is above); not "
      << "restarting: fix it and submit again\" >&2\n"
      << "    exit 2\n"
      << "  fi\n"
      << "done\n"
      << "echo \"[islands] array task $task: failed " << r + 1 << " times; see this log, fix the cause and submit again "
      << "(it resumes)\" >&2\n"
      << "exit 1\n";
  }
  return s.str();
}

}  // namespace ddm
