// A private single-node Slurm for one test (scripts/slurm-local.sh), and what it needs: a free TCP
// port and the check that says why a local Slurm cannot run here (tests then skip with that reason).
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "test_util.h"

namespace ddm::test {

// A TCP port that was free a moment ago (for launchers that need one given).
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

inline bool executable(const std::string& path) { return access(path.c_str(), X_OK) == 0; }

// "" when a local Slurm can run here; else what is missing.
inline std::string slurm_missing() {
  if (geteuid() != 0) return "root (slurmd runs job steps as their users)";
  for (const char* p : {"/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/srun", "/usr/sbin/munged"})
    if (!executable(p)) return std::string(p) + " (apt-get install -y slurm-wlm munge)";
  return "";
}

// Started in DIR/slurm (DIR must be searchable by all, for munged), stopped and removed at scope
// exit. Prefix Slurm commands with `env` so they reach this cluster.
struct LocalSlurm {
  std::string script = test::source_dir() + "/scripts/slurm-local.sh", state, env;
  CommandResult started;
  explicit LocalSlurm(const std::string& dir) : state(dir + "/slurm") {
    env = "SLURM_CONF=" + state + "/slurm.conf DDM_SLURM_CTLD_PORT=" + std::to_string(free_port()) +
          " DDM_SLURM_D_PORT=" + std::to_string(free_port()) + " ";
    started = run_command(env + "timeout 120 " + script + " start " + state);
  }
  ~LocalSlurm() { run_command(env + "timeout 120 " + script + " stop " + state); }
  LocalSlurm(const LocalSlurm&) = delete;
  LocalSlurm& operator=(const LocalSlurm&) = delete;
};

}  // namespace ddm::test
