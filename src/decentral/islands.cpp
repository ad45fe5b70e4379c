// The islands runner, status and Slurm script (see islands.h). Process supervision is written by
// hand on POSIX fork/exec/waitpid: no Debian C++ package supervises child processes.
#include "decentral/islands.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "core/config.h"
#include "core/error.h"
#include "core/run_dir.h"
#include "core/fileio.h"
#include "decentral/ensemble_dir.h"
#include "decentral/partition.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace ddm {

namespace {

std::atomic<int> g_stop{0};
void on_stop(int sig) { g_stop = sig; }

// ---- the islands file ----

IslandsConfig parse(const toml::table& t, const std::string& origin) {
  IslandsConfig c;
  c.origin = origin;
  const std::map<std::string, std::set<std::string>> known = {
      {"", {"out", "config", "partition", "experts", "router", "run"}},
      {"partition", {"path", "k", "features"}},
      {"experts", {"budget", "set"}},
      {"router", {"preset", "holdout", "set"}},
      {"run", {"concurrency", "retries", "threads", "routing"}}};
  for (auto&& [k, v] : t) {
    const std::string key(k.str());
    DDM_CHECK(known.at("").count(key), origin << ": unknown key '" << key << "'; valid: out, config, [partition], "
                                              "[experts], [router], [run]");
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
  auto list = [&](const char* path, std::vector<std::string>& out) {
    auto node = t.at_path(path);
    if (!node) return;
    DDM_CHECK(node.is_array(), origin << ": '" << path << "' must be an array of \"section.key=value\" strings");
    for (const auto& e : *node.as_array()) {
      DDM_CHECK(e.is_string(), origin << ": '" << path << "' must hold strings like \"train.steps=600\"");
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
  num("run.concurrency", c.concurrency, 1);
  num("run.retries", c.retries, 0);
  num("run.threads", c.threads, 0);
  str("run.routing", c.routing, false);
  DDM_CHECK(c.budget == "full" || c.budget == "split-batch" || c.budget == "split-steps",
            origin << ": experts.budget = '" << c.budget << "' is not one of full, split-batch, split-steps");
  DDM_CHECK(fs::exists(c.config), origin << ": config = '" << c.config << "' does not exist");
  parse_routing(c.routing);
  return c;
}

// ---- islands on disk ----

struct Progress {
  int64_t step = 0, steps = 0;  // steps = 0: not started (target unknown)
  bool done = false;
};

Progress progress_of(const Island& is) {
  Progress p;
  if (auto latest = latest_checkpoint(is.dir)) {
    const std::string name = fs::path(*latest).filename().string();  // step-XXXXXXXX
    p.step = std::stoll(name.substr(name.find('-') + 1));
  }
  try {
    if (is.expert >= 0 && fs::exists(RunDir(is.dir) / RunDir::kExpert)) {
      p.steps = nlohmann::json::parse(read_file(RunDir(is.dir) / RunDir::kExpert)).at("steps").get<int64_t>();
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

// The last line of a log that reports an error ("" if none).
std::string last_error(const std::string& log) {
  std::ifstream f(log);
  std::string line, err;
  while (std::getline(f, line))
    if (line.rfind("error", 0) == 0) err = line;
  return err;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

pid_t spawn(const std::string& binary, const Island& is) {
  fs::create_directories(fs::path(is.log).parent_path());
  std::vector<char*> argv;  // built before fork: the child only calls open, dup2 and execv
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const auto& a : is.args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t runner = getpid();
  const pid_t pid = fork();
  DDM_CHECK(pid >= 0, "cannot start " << is.name << ": fork failed (" << std::strerror(errno) << ")");
  if (pid == 0) {
    // An island does not outlive its runner: if the runner dies, even by kill -9, the island gets
    // SIGTERM, writes a checkpoint and stops, so the next runner resumes it with no second writer.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != runner) _exit(1);  // the runner died before prctl
    const int fd = open(is.log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(binary.c_str(), argv.data());
    std::fprintf(stderr, "error: cannot run %s: %s\n", binary.c_str(), std::strerror(errno));
    _exit(127);
  }
  return pid;
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + std::to_string(WTERMSIG(status));
  return "stopped";
}

}  // namespace

IslandsConfig load_islands_config(const std::string& path) {
  DDM_CHECK(fs::exists(path), "islands file '" << path << "' does not exist");
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    DDM_FAIL(path << ":" << e.source().begin.line << ": " << e.description());
  }
  return parse(t, path);
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
      is.args = {"train-router", "--config", c.config, "--partition", part, "--preset", c.router_preset, "--holdout",
                 std::to_string(c.holdout)};
    }
    is.args.insert(is.args.end(), {"--set", threads});
    for (const auto& s : e < k ? c.expert_set : c.router_set) is.args.insert(is.args.end(), {"--set", s});
    is.args.insert(is.args.end(), {"--out", is.dir, "--resume"});
    out.push_back(is);
  }
  return out;
}

int64_t ensure_partition(const IslandsConfig& c, const std::string& ddm_binary) {
  if (!fs::exists(c.partition)) {
    DDM_CHECK(c.k >= 2, c.origin << ": the partition " << c.partition << " does not exist; set partition.k to make it");
    std::cout << "[islands] making the partition " << c.partition << " (K = " << c.k << ", " << c.features << ")"
              << std::endl;
    Island p;
    p.name = "partition";
    p.log = (fs::path(c.out) / "logs" / "partition.log").string();
    p.args = {"partition", "--config", c.config, "--k", std::to_string(c.k), "--features", c.features, "--out", c.partition};
    int status = 0;
    waitpid(spawn(ddm_binary, p), &status, 0);
    DDM_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "making the partition failed (" << describe_exit(status) << "): " << last_error(p.log) << " (log " << p.log
                                              << ")");
  }
  const Partition p = load_partition(c.partition);
  DDM_CHECK(c.k == 0 || c.k == p.k, c.origin << ": partition.k = " << c.k << " but " << c.partition << " has K = "
                                             << p.k << "; remove partition.k or use another partition.path");
  return p.k;
}

int run_islands(const IslandsConfig& c, const std::string& ddm_binary) {
  fs::create_directories(fs::path(c.out) / "logs");
  const FileLock lock((fs::path(c.out) / "islands.lock").string(),
                      "another `ddm islands run` is working in " + c.out);
  const int64_t k = ensure_partition(c, ddm_binary);
  // run.threads = 0 shares the cores among the islands that run at once: two OpenMP pools that each
  // take every core are many times slower than one, not twice.
  IslandsConfig shared = c;
  if (c.threads == 0 && c.concurrency > 1)
    shared.threads = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()) / c.concurrency);
  std::vector<Island> islands = plan_islands(shared, k);
  const size_t n = islands.size();
  nlohmann::json state = nlohmann::json::array();
  std::deque<size_t> queue;
  for (size_t i = 0; i < n; ++i) {
    const bool done = progress_of(islands[i]).done;
    state.push_back({{"name", islands[i].name}, {"dir", islands[i].dir}, {"log", islands[i].log},
                     {"state", done ? "done" : "pending"}, {"attempts", 0}, {"pid", 0}, {"last_exit", ""},
                     {"last_error", ""}});
    if (!done) queue.push_back(i);
  }
  const std::string state_path = (fs::path(c.out) / "islands.json").string();
  auto save = [&] { write_file_atomic(state_path, state.dump(2) + "\n"); };
  save();
  std::cout << "[islands] " << k << " experts and a router in " << c.out << ": " << n - queue.size()
            << " already done, " << queue.size() << " to run, " << c.concurrency << " at a time, up to " << c.retries
            << " restarts each"
            << (shared.threads > 0 ? ", " + std::to_string(shared.threads) + " threads each" : std::string(", all cores each"))
            << std::endl;

  g_stop = 0;
  auto old_int = std::signal(SIGINT, on_stop), old_term = std::signal(SIGTERM, on_stop);
  std::map<pid_t, size_t> running;
  bool stopping = false;
  auto last_report = std::chrono::steady_clock::now();
  while (!running.empty() || (!stopping && !queue.empty())) {  // once stopping, pending islands stay pending
    while (!stopping && !queue.empty() && static_cast<int64_t>(running.size()) < c.concurrency) {
      const size_t i = queue.front();
      queue.pop_front();
      const pid_t pid = spawn(ddm_binary, islands[i]);
      running[pid] = i;
      state[i]["state"] = "running";
      state[i]["pid"] = pid;
      state[i]["attempts"] = state[i]["attempts"].get<int64_t>() + 1;
      save();
      std::cout << "[islands] " << islands[i].name << ": started (attempt " << state[i]["attempts"] << ", pid " << pid
                << ", log " << islands[i].log << ")" << std::endl;
    }
    if (g_stop != 0 && !stopping) {
      stopping = true;
      std::cout << "[islands] signal " << g_stop.load() << ": stopping the running islands (each writes a checkpoint)"
                << std::endl;
      for (const auto& r : running) kill(r.first, SIGTERM);
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(30)) {
        last_report = std::chrono::steady_clock::now();
        std::cout << "[islands]";
        for (const auto& r : running) {
          const Progress p = progress_of(islands[r.second]);
          const int64_t live = std::max(p.step, logged_step(islands[r.second]));
          std::cout << " " << islands[r.second].name << " step " << live << "/" << (p.steps > 0 ? std::to_string(p.steps) : "?")
                    << ";";
        }
        std::cout << std::endl;
      }
      continue;
    }
    if (!running.count(pid)) continue;
    const size_t i = running[pid];
    running.erase(pid);
    const Island& is = islands[i];
    const Progress p = progress_of(is);
    state[i]["pid"] = 0;
    state[i]["last_exit"] = describe_exit(status);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && p.done) {
      state[i]["state"] = "done";
      std::cout << "[islands] " << is.name << ": done (step " << p.step << ")" << std::endl;
    } else if (stopping) {
      state[i]["state"] = "stopped";
      std::cout << "[islands] " << is.name << ": stopped at step " << p.step << std::endl;
    } else {
      const std::string err = last_error(is.log);
      state[i]["last_error"] = describe_exit(status) + " at step " + std::to_string(p.step) + (err.empty() ? "" : ": " + err);
      const int64_t attempts = state[i]["attempts"].get<int64_t>();
      if (attempts <= c.retries) {
        state[i]["state"] = "retrying";
        queue.push_back(i);
        std::cout << "[islands] " << is.name << ": " << describe_exit(status) << " at step " << p.step
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
    std::cout << " the others are finished and kept. Fix the cause (see the logs), then run the same command again: "
                 "finished islands are skipped, the rest resume from their checkpoints" << std::endl;
    return stopping ? 128 + g_stop.load() : 1;  // 130 for SIGINT, 143 for SIGTERM
  }
  EnsembleSpec spec;
  spec.partition = c.partition;
  spec.router = islands.back().dir;
  spec.routing = c.routing;
  for (int64_t e = 0; e < k; ++e) spec.experts.push_back(islands[e].dir);
  std::vector<std::string> notes;
  assemble_ensemble(c.out, spec, notes);
  for (const auto& note : notes) std::cout << "note: " << note << std::endl;
  std::cout << "[islands] all " << n << " islands done; wrote " << c.out << "/ensemble.json\nnext: ddm sample --ensemble "
            << c.out << " --out grid.png" << std::endl;
  return 0;
}

std::string islands_status(const IslandsConfig& c) {
  DDM_CHECK(fs::exists(c.partition), "the partition " << c.partition << " does not exist yet: nothing has run");
  const std::vector<Island> islands = plan_islands(c, load_partition(c.partition).k);
  nlohmann::json state;
  const std::string state_path = (fs::path(c.out) / "islands.json").string();
  if (fs::exists(state_path)) state = nlohmann::json::parse(read_file(state_path));
  std::ostringstream s;
  char line[256];
  std::snprintf(line, sizeof line, "%-10s %-12s %-15s %-9s %s\n", "island", "state", "step", "attempts", "last failure");
  s << line;
  for (size_t i = 0; i < islands.size(); ++i) {
    const Progress p = progress_of(islands[i]);
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
    const std::string step = std::to_string(p.step) + "/" + (p.steps > 0 ? std::to_string(p.steps) : "?");
    std::snprintf(line, sizeof line, "%-10s %-12s %-15s %-9lld %s\n", islands[i].name.c_str(), st.c_str(),
                  step.c_str(), static_cast<long long>(attempts), err.substr(0, 120).c_str());
    s << line;
  }
  s << (fs::exists(fs::path(c.out) / "ensemble.json") ? "ensemble: " + c.out + "/ensemble.json\n"
                                                       : std::string("ensemble: not assembled yet\n"));
  return s.str();
}

std::string slurm_script(const IslandsConfig& c, int64_t k, const std::string& ddm_binary) {
  const std::vector<Island> islands = plan_islands(c, k);
  std::ostringstream s;
  s << "#!/bin/bash\n"
    << "# ddm islands as a Slurm job array: tasks 0.." << k - 1 << " train the experts, task " << k
    << " the router.\n# Written by `ddm islands slurm " << c.origin << "`. Submit with: sbatch THIS_FILE\n"
    << "# Each task resumes from its own checkpoints, so a requeued or resubmitted task loses nothing.\n"
    << "# When all tasks are done, `ddm islands run " << c.origin << "` assembles " << c.out << "/ensemble.json.\n"
    << "#SBATCH --job-name=ddm-islands\n"
    << "#SBATCH --array=0-" << k << "\n"
    << "#SBATCH --cpus-per-task=" << (c.threads > 0 ? c.threads : 2) << "\n"
    << "#SBATCH --output=" << fs::absolute(fs::path(c.out) / "logs").string() << "/slurm-%A_%a.log\n"
    << "#SBATCH --requeue\n"
    << "set -euo pipefail\n"
    << "task=${SLURM_ARRAY_TASK_ID:?run this script with sbatch, or set SLURM_ARRAY_TASK_ID to 0.." << k << "}\n"
    << "cd " << quote(fs::current_path().string()) << "\n"
    << "case \"$task\" in\n";
  for (size_t i = 0; i < islands.size(); ++i) {
    s << "  " << i << ")  # " << islands[i].name << "\n    exec " << quote(ddm_binary);
    for (const auto& a : islands[i].args) s << " " << quote(a);
    s << " ;;\n";
  }
  s << "  *) echo \"no island for array task $task (valid: 0.." << k << ")\" >&2; exit 2 ;;\nesac\n";
  return s.str();
}

}  // namespace ddm
