// detect_dist_env and the Slurm hostlist parser (see env.h).
#include "comm/env.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <optional>
#include <sstream>

#include "core/error.h"

namespace ddm {
namespace {

// Default rendezvous port when nothing names one (torchrun's and c10d's default too).
constexpr int kDefaultMasterPort = 29500;

using Getenv = std::function<const char*(const char*)>;

// A variable's value; unset and empty are the same (`RANK= cmd` unsets it for most tools).
std::optional<std::string> get(const Getenv& getenv, const char* name) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// Parses the whole of `value` as a decimal integer in [lo, hi]; errors name the variable and say what
// to do (`hint`).
int parse_int(const char* name, const std::string& value, long lo, long hi, const std::string& hint) {
  long out = 0;
  const char* first = value.data();
  const char* last = value.data() + value.size();
  auto [end, ec] = std::from_chars(first, last, out);
  DDM_CHECK(ec != std::errc::result_out_of_range && !(ec == std::errc() && (out < lo || out > hi)),
            name << "=" << value << " is out of range: it must be in " << lo << ".." << hi << "; " << hint);
  DDM_CHECK(ec == std::errc() && end == last,
            name << "='" << value << "' is not an integer; " << hint);
  return static_cast<int>(out);
}

int parse_port(const char* name, const std::string& value) {
  return parse_int(name, value, 1, 65535, "set it to a free TCP port on the master host (e.g. 29500)");
}

bool parse_bool(const char* name, const std::string& value) {
  if (value == "True" || value == "true" || value == "1") return true;
  DDM_CHECK(value == "False" || value == "false" || value == "0",
            name << "='" << value << "' is not a boolean: use True or False (torchrun sets it)");
  return false;
}

void check_rank(const char* rank_name, int rank, const char* world_name, int world) {
  DDM_CHECK(rank < world, rank_name << "=" << rank << " is not below " << world_name << "=" << world
                                    << ": ranks run from 0 to " << world_name << "-1; the launcher's "
                                    << "variables disagree (check how the job was started)");
}

// The number of tasks on node `node` from SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
// three nodes, then 1), or nullopt if it does not parse.
std::optional<int> slurm_tasks_on_node(const std::string& spec, int node) {
  std::istringstream in(spec);
  std::string item;
  int first_node = 0;
  while (std::getline(in, item, ',')) {
    int count = 0, repeat = 1;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), count);
    if (ec != std::errc() || count < 1) return std::nullopt;
    const std::string rest(p, static_cast<size_t>(item.data() + item.size() - p));
    if (!rest.empty()) {
      if (rest.size() < 4 || rest.compare(0, 2, "(x") != 0 || rest.back() != ')') return std::nullopt;
      auto [q, ec2] = std::from_chars(rest.data() + 2, rest.data() + rest.size() - 1, repeat);
      if (ec2 != std::errc() || q != rest.data() + rest.size() - 1 || repeat < 1) return std::nullopt;
    }
    if (node < first_node + repeat) return count;
    first_node += repeat;
  }
  return std::nullopt;
}

DistEnv from_torchrun_vars(const Getenv& getenv) {
  DistEnv e;
  const auto launcher = get(getenv, "DDM_LAUNCHER");
  DDM_CHECK(!launcher || *launcher == "ddm",
            "DDM_LAUNCHER='" << *launcher << "' is not known: `ddm launch` sets it to 'ddm'; unset it");
  e.launcher = launcher ? "ddm" : get(getenv, "TORCHELASTIC_RUN_ID") ? "torchrun" : "env";
  const auto rank = get(getenv, "RANK"), world = get(getenv, "WORLD_SIZE");
  DDM_CHECK(rank, "RANK is not set but " << (world ? "WORLD_SIZE" : "DDM_LAUNCHER / TORCHELASTIC_RUN_ID")
                                         << " is: set RANK (0..WORLD_SIZE-1) for every process, or "
                                            "start the job with torchrun or `ddm launch`");
  DDM_CHECK(world, "RANK=" << *rank << " is set but WORLD_SIZE is not: set WORLD_SIZE to the number of "
                              "processes, or start the job with torchrun or `ddm launch`");
  const std::string how = "set by torchrun / `ddm launch`; check the launch command";
  e.world_size = parse_int("WORLD_SIZE", *world, 1, 1 << 20, "it is the number of processes, " + how);
  e.rank = parse_int("RANK", *rank, 0, 1 << 20, "it is this process's rank, " + how);
  check_rank("RANK", e.rank, "WORLD_SIZE", e.world_size);
  // Bare RANK / WORLD_SIZE: assume one node unless told otherwise.
  e.local_rank = e.rank;
  e.local_world_size = e.world_size;
  if (auto v = get(getenv, "LOCAL_WORLD_SIZE"))
    e.local_world_size = parse_int("LOCAL_WORLD_SIZE", *v, 1, e.world_size, "it is the number of processes "
                                   "on this node (at most WORLD_SIZE), " + how);
  if (auto v = get(getenv, "LOCAL_RANK")) {
    e.local_rank = parse_int("LOCAL_RANK", *v, 0, 1 << 20, "it is this process's rank on its node, " + how);
    check_rank("LOCAL_RANK", e.local_rank, "LOCAL_WORLD_SIZE", e.local_world_size);
  }
  if (auto v = get(getenv, "GROUP_RANK"))
    e.node_rank = parse_int("GROUP_RANK", *v, 0, 1 << 20, "it is this node's index, " + how);

  const auto addr = get(getenv, "MASTER_ADDR"), port = get(getenv, "MASTER_PORT");
  if (e.world_size > 1) {
    DDM_CHECK(addr, "MASTER_ADDR is not set but WORLD_SIZE=" << e.world_size
                                                             << ": set it to the host of rank 0 (or of the "
                                                                "launcher's store), e.g. MASTER_ADDR=127.0.0.1");
    DDM_CHECK(port, "MASTER_PORT is not set but WORLD_SIZE=" << e.world_size
                                                             << ": set it to a free TCP port on MASTER_ADDR, "
                                                                "e.g. MASTER_PORT=29500");
  }
  if (addr) e.master_addr = *addr;
  if (port) e.master_port = parse_port("MASTER_PORT", *port);

  if (auto v = get(getenv, "TORCHELASTIC_RESTART_COUNT")) {
    e.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", *v, 0, 1 << 30, how);
    // PyTorch's env:// rendezvous keys each attempt apart; with the agent's store (which outlives
    // the workers) that keeps a restarted job from reading the keys of the failed attempt. With a
    // store hosted by rank 0 (a fresh one per attempt) the prefix is harmless.
    e.store_prefix = "/worker/attempt_" + std::to_string(e.restart_count);
  }
  if (auto v = get(getenv, "TORCHELASTIC_MAX_RESTARTS"))
    e.max_restarts = parse_int("TORCHELASTIC_MAX_RESTARTS", *v, 0, 1 << 30, how);
  if (auto v = get(getenv, "TORCHELASTIC_RUN_ID")) e.run_id = *v;
  if (auto v = get(getenv, "TORCHELASTIC_USE_AGENT_STORE")) e.agent_store = parse_bool("TORCHELASTIC_USE_AGENT_STORE", *v);
  return e;
}

DistEnv from_mpi_vars(const Getenv& getenv) {
  DistEnv e;
  e.launcher = "mpi";
  const std::string how = "mpirun sets it; check the mpirun command";
  const auto size = get(getenv, "OMPI_COMM_WORLD_SIZE");
  DDM_CHECK(size, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not: start the job with "
                  "OpenMPI's mpirun, or unset OMPI_COMM_WORLD_RANK");
  e.world_size = parse_int("OMPI_COMM_WORLD_SIZE", *size, 1, 1 << 20, how);
  e.rank = parse_int("OMPI_COMM_WORLD_RANK", *get(getenv, "OMPI_COMM_WORLD_RANK"), 0, 1 << 20, how);
  check_rank("OMPI_COMM_WORLD_RANK", e.rank, "OMPI_COMM_WORLD_SIZE", e.world_size);
  e.local_rank = e.rank;
  e.local_world_size = e.world_size;
  if (auto v = get(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE"))
    e.local_world_size = parse_int("OMPI_COMM_WORLD_LOCAL_SIZE", *v, 1, e.world_size, how);
  if (auto v = get(getenv, "OMPI_COMM_WORLD_LOCAL_RANK")) {
    e.local_rank = parse_int("OMPI_COMM_WORLD_LOCAL_RANK", *v, 0, 1 << 20, how);
    check_rank("OMPI_COMM_WORLD_LOCAL_RANK", e.local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE", e.local_world_size);
  }
  // mpirun's default by-slot mapping puts consecutive ranks on one node, equally many per node.
  e.node_rank = e.rank / e.local_world_size;
  const bool all_local = e.local_world_size == e.world_size;
  if (auto addr = get(getenv, "MASTER_ADDR")) {
    e.master_addr = *addr;
  } else {
    DDM_CHECK(all_local || e.world_size == 1,
              "MASTER_ADDR is not set and mpirun placed the " << e.world_size << " ranks on several nodes ("
                  << e.local_world_size << " on this one): set it to rank 0's host and pass it on, e.g. "
                  << "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=29500 ...");
    e.master_addr = "127.0.0.1";
  }
  // Communication stays on Gloo (this LibTorch has no MPI backend); mpirun only starts the processes.
  e.master_port = kDefaultMasterPort;
  if (auto v = get(getenv, "MASTER_PORT")) e.master_port = parse_port("MASTER_PORT", *v);
  return e;
}

DistEnv from_slurm_vars(const Getenv& getenv) {
  DistEnv e;
  e.launcher = "slurm";
  const std::string how = "srun sets it; start the job with srun";
  const auto ntasks = get(getenv, "SLURM_NTASKS");
  DDM_CHECK(ntasks, "SLURM_PROCID is set but SLURM_NTASKS is not: start every rank with srun -n <N>, "
                    "or set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT yourself");
  e.world_size = parse_int("SLURM_NTASKS", *ntasks, 1, 1 << 20, how);
  e.rank = parse_int("SLURM_PROCID", *get(getenv, "SLURM_PROCID"), 0, 1 << 20, how);
  check_rank("SLURM_PROCID", e.rank, "SLURM_NTASKS", e.world_size);
  if (auto v = get(getenv, "SLURM_NODEID")) e.node_rank = parse_int("SLURM_NODEID", *v, 0, 1 << 20, how);
  // Tasks on this node: SLURM_NTASKS_PER_NODE (set with --ntasks-per-node), else this node's entry
  // of SLURM_TASKS_PER_NODE ("2(x3),1"), else an even split over SLURM_NNODES.
  e.local_world_size = e.world_size;
  std::optional<int> local;
  if (auto v = get(getenv, "SLURM_NTASKS_PER_NODE")) {
    int n = 0;
    auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
    if (ec == std::errc() && p == v->data() + v->size() && n >= 1) local = n;
  }
  if (!local)
    if (auto v = get(getenv, "SLURM_TASKS_PER_NODE")) local = slurm_tasks_on_node(*v, e.node_rank);
  if (!local)
    if (auto v = get(getenv, "SLURM_NNODES")) {
      int n = 0;
      auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
      if (ec == std::errc() && p == v->data() + v->size() && n >= 1) local = (e.world_size + n - 1) / n;
    }
  if (local) e.local_world_size = std::min(*local, e.world_size);
  e.local_rank = e.rank % e.local_world_size;
  if (auto v = get(getenv, "SLURM_LOCALID")) e.local_rank = parse_int("SLURM_LOCALID", *v, 0, 1 << 20, how);
  e.local_world_size = std::max(e.local_world_size, e.local_rank + 1);

  if (auto v = get(getenv, "SLURM_JOB_ID")) e.run_id = *v;
  // A requeued job (sbatch --requeue, or a node failure) runs again with SLURM_RESTART_COUNT > 0: the
  // trainer then resumes from its last checkpoint, as after a torchrun restart.
  if (auto v = get(getenv, "SLURM_RESTART_COUNT"))
    e.restart_count = parse_int("SLURM_RESTART_COUNT", *v, 0, 1 << 30, how);
  if (auto addr = get(getenv, "MASTER_ADDR")) {
    e.master_addr = *addr;
  } else {
    const char* list_var = get(getenv, "SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    const auto list = get(getenv, list_var);
    DDM_CHECK(list || e.world_size == 1, "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set under Slurm: "
                                         "set MASTER_ADDR to the host of rank 0");
    if (list) e.master_addr = first_slurm_host(*list, list_var);
  }
  if (auto v = get(getenv, "MASTER_PORT")) {
    e.master_port = parse_port("MASTER_PORT", *v);
  } else if (e.run_id.empty()) {
    e.master_port = kDefaultMasterPort;
  } else {
    // A port per job, so that two jobs whose rank 0 lands on the same node do not collide.
    const int job = parse_int("SLURM_JOB_ID", e.run_id, 0, 0x7fffffff, "Slurm sets it to the job's number; "
                              "or set MASTER_PORT yourself");
    e.master_port = 20000 + job % 20000;
  }
  return e;
}

}  // namespace

DistEnv detect_dist_env(std::function<const char*(const char*)> getenv) {
  DistEnv e;
  if (get(getenv, "RANK") || get(getenv, "WORLD_SIZE") || get(getenv, "DDM_LAUNCHER") ||
      get(getenv, "TORCHELASTIC_RUN_ID")) {
    e = from_torchrun_vars(getenv);
  } else if (get(getenv, "OMPI_COMM_WORLD_RANK")) {
    e = from_mpi_vars(getenv);
  } else if (get(getenv, "SLURM_PROCID")) {
    e = from_slurm_vars(getenv);
  }
  if (auto v = get(getenv, "DDM_REJOIN")) e.rejoin = parse_bool("DDM_REJOIN", *v);
  return e;
}

std::string DistEnv::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << world_size << " (local " << local_rank << "/" << local_world_size << ", node "
     << node_rank << ") via " << launcher;
  if (distributed()) {
    os << ", store " << master_addr << ":" << master_port << (agent_store ? " (launcher's agent)" : " (rank 0)");
    if (!store_prefix.empty()) os << " prefix " << store_prefix;
  }
  if (restart_count > 0 || max_restarts > 0) os << ", restart " << restart_count << "/" << max_restarts;
  if (rejoin) os << ", rejoining";
  return os.str();
}

// Hand-written: no Debian C++ package parses Slurm hostlists (Slurm's own parser lives in libslurm,
// which is not meant for linking into applications), and `scontrol show hostnames` needs Slurm's
// tools on the compute node.
std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist, const std::string& what,
                                               size_t max_hosts) {
  auto fail = [&](const std::string& why) {
    DDM_FAIL(what << "='" << hostlist << "' is not a Slurm hostlist (" << why
                  << "); expected names like node[01-04,07],gpu7; set MASTER_ADDR to rank 0's host instead");
  };
  // Split at the commas outside brackets.
  std::vector<std::string> names;
  std::string cur;
  int depth = 0;
  for (char c : hostlist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0 || depth > 1) fail("unbalanced brackets");
    if (c == ',' && depth == 0) {
      names.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) fail("unbalanced brackets");
  names.push_back(cur);

  std::vector<std::string> out;
  for (const auto& name : names) {
    if (name.empty()) fail("an empty name");
    // Each name: literal parts and bracket groups, as alternatives for a cartesian product.
    std::vector<std::vector<std::string>> parts;
    size_t i = 0;
    while (i < name.size()) {
      const size_t open = name.find('[', i);
      if (open != i) {
        parts.push_back({name.substr(i, open == std::string::npos ? std::string::npos : open - i)});
        if (open == std::string::npos) break;
      }
      const size_t close = name.find(']', open);
      std::vector<std::string> alts;
      std::istringstream ranges(name.substr(open + 1, close - open - 1));
      std::string range;
      while (std::getline(ranges, range, ',')) {
        const size_t dash = range.find('-');
        const std::string lo_s = range.substr(0, dash);
        const std::string hi_s = dash == std::string::npos ? lo_s : range.substr(dash + 1);
        auto digits = [](const std::string& s) {
          return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
        };
        if (!digits(lo_s) || !digits(hi_s)) fail("'" + range + "' is not a number or a range a-b");
        const long lo = std::stol(lo_s), hi = std::stol(hi_s);
        if (hi < lo) fail("range '" + range + "' runs backwards");
        // Zero padding: the width of the lower bound ("008-010" -> 3 digits).
        for (long n = lo; n <= hi && alts.size() < max_hosts; ++n) {
          std::string s = std::to_string(n);
          if (s.size() < lo_s.size()) s.insert(0, lo_s.size() - s.size(), '0');
          alts.push_back(s);
        }
      }
      if (alts.empty()) fail("empty brackets");
      parts.push_back(alts);
      i = close + 1;
    }
    // Cartesian product, first group outermost, stopping at max_hosts.
    std::vector<size_t> idx(parts.size(), 0);
    while (out.size() < max_hosts) {
      std::string s;
      for (size_t k = 0; k < parts.size(); ++k) s += parts[k][idx[k]];
      out.push_back(s);
      size_t k = parts.size();
      while (k > 0 && ++idx[k - 1] == parts[k - 1].size()) idx[--k] = 0;
      if (k == 0) break;
    }
    if (out.size() >= max_hosts) break;
  }
  return out;
}

std::string first_slurm_host(const std::string& hostlist, const std::string& what) {
  return expand_slurm_hostlist(hostlist, what, 1).front();
}

}  // namespace ddm
