// What `ddm launch` tells its workers about each other, as torchrun's agent does with a static
// rendezvous on one node: the environment of each rank (RANK, WORLD_SIZE, MASTER_ADDR, ...,
// TORCHELASTIC_*) and the TCPStore that the launcher itself hosts at MASTER_ADDR:MASTER_PORT for
// the whole launch (TORCHELASTIC_USE_AGENT_STORE=True: every rank connects to it as a client,
// under the key prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>; no rank hosts it).
//
// The store is c10d's TCPStore server with no fixed number of workers (ranks of one attempt come
// and go; the next attempt uses a fresh prefix) and waitWorkers = false. It listens on every
// interface; the workers are told 127.0.0.1.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class TCPStore;
}

namespace ddm {

class StoreHost {
 public:
  // Starts the store server on `port`; port 0 lets the kernel choose a free port while binding
  // (no window in which another process can take it). Throws ddm::Error when the port is taken:
  // "port P is already in use; pass --master-port ...".
  explicit StoreHost(int port);
  ~StoreHost();
  StoreHost(const StoreHost&) = delete;
  StoreHost& operator=(const StoreHost&) = delete;
  int port() const { return port_; }

 private:
  std::unique_ptr<c10d::TCPStore> store_;
  int port_ = 0;
};

struct RankInfo {
  int64_t rank = 0, world_size = 1;
  int64_t restart_count = 0, max_restarts = 0;
  std::string run_id = "none";
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
};

// The variables torchrun (1.13, one node) sets for a worker, with ddm launch's values, plus
// DDM_LAUNCHER=ddm. Checked against /usr/bin/torchrun --no_python: it also sets OMP_NUM_THREADS=1
// (when unset) and NCCL_ASYNC_ERROR_HANDLING=1, and a TORCHELASTIC_ERROR_FILE; ddm launch does not
// (ddm sets its threads from its config; no NCCL here; no error files).
std::vector<std::pair<std::string, std::string>> torchrun_environment(const RankInfo& r);
// Variables of an outer launcher that must not leak into ddm launch's workers.
std::vector<std::string> stale_launcher_variables();

}  // namespace ddm
