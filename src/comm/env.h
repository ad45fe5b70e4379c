// DistEnv: who this process is in a distributed job (rank, world size, where the rendezvous store
// lives), detected from the variables that torchrun, `ddm launch`, Slurm's srun or OpenMPI's mpirun
// set; and a small parser for Slurm hostlists (`node[01-04,07],gpu7`).
#pragma once
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace ddm {

struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1, node_rank = 0;
  std::string master_addr;  // host of the rendezvous store ("" for a single process)
  int master_port = 0;      // its port, 1..65535 (0 for a single process)
  // "none" (single process), "env" (bare RANK / WORLD_SIZE), "torchrun", "ddm", "slurm", "mpi".
  std::string launcher = "none";
  // The store is hosted by the launcher's agent (TORCHELASTIC_USE_AGENT_STORE=True): every rank,
  // rank 0 included, is a client. Otherwise rank 0 hosts it.
  bool agent_store = false;
  // Key prefix of this attempt in the store: "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>" under
  // torchrun / `ddm launch`, as PyTorch's env:// rendezvous uses; "" otherwise.
  std::string store_prefix;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: how many times the job was restarted
  int max_restarts = 0;   // TORCHELASTIC_MAX_RESTARTS
  std::string run_id;     // TORCHELASTIC_RUN_ID, SLURM_JOB_ID, or ""
  // DDM_REJOIN=1: this process was restarted alone (`ddm launch --restart failed`) into a job whose
  // other processes still run; it must rejoin them (DiLoCo) rather than start or resume the job.
  bool rejoin = false;

  bool distributed() const { return world_size > 1; }
  // One line for logs, e.g. "rank 1/4 (local 1/2, node 0) via torchrun, store 10.0.0.1:29500 (agent)".
  std::string describe() const;
};

// Reads the environment through `getenv` (tests pass a map lookup). Precedence: RANK (torchrun,
// `ddm launch`, bare env) > OMPI_COMM_WORLD_RANK (mpirun, also when mpirun runs inside a Slurm
// allocation) > SLURM_PROCID (srun) > a single process. Throws ddm::Error naming the variable, its
// value and the fix for every malformed or missing value.
DistEnv detect_dist_env(std::function<const char*(const char*)> getenv = ::getenv);

// Expands a Slurm hostlist: "node[01-03,07],gpu7" -> node01 node02 node03 node07 gpu7; zero padding
// is kept ("x[008-010]" -> x008 x009 x010); several bracket groups in one name multiply
// ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). Stops after max_hosts names. Throws ddm::Error on syntax
// errors, naming `what` (the variable it came from).
std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist, const std::string& what = "hostlist",
                                               size_t max_hosts = 1u << 16);
// The first host of a Slurm hostlist (where rank 0 runs under srun's block distribution).
std::string first_slurm_host(const std::string& hostlist, const std::string& what = "hostlist");

}  // namespace ddm
