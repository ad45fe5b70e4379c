// The launcher's store and the workers' torchrun environment (see rendezvous.h).
#include "launch/rendezvous.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>

#include "core/error.h"

namespace ddm {

StoreHost::StoreHost(int port) {
  DDM_CHECK(port >= 0 && port <= 65535, "--master-port " << port << " is not a TCP port (0..65535; 0 picks a free one)");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = true;
  opts.numWorkers = c10::nullopt;  // clients come and go across restarts
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(30);  // the launcher's own client, connecting to its own server
  try {
    store_ = std::make_unique<c10d::TCPStore>("127.0.0.1", opts);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    // LibTorch 2.11 says "... name: EADDRINUSE, message: address already in use" (1.13: "errno: 98").
    DDM_CHECK(what.find("EADDRINUSE") == std::string::npos && what.find("ddress already in use") == std::string::npos &&
                  what.find("errno: 98") == std::string::npos,
              "cannot host the rendezvous store: port " << port << " is already in use; pass --master-port with a "
              "free port, or --master-port 0 to let the system pick one");
    DDM_FAIL("cannot host the rendezvous store on port " << port << ": " << what.substr(0, what.find('\n')));
  }
  port_ = store_->getPort();
}

StoreHost::~StoreHost() = default;

std::vector<std::pair<std::string, std::string>> torchrun_environment(const RankInfo& r) {
  const std::string rank = std::to_string(r.rank), world = std::to_string(r.world_size);
  return {{"RANK", rank},
          {"LOCAL_RANK", rank},
          {"WORLD_SIZE", world},
          {"LOCAL_WORLD_SIZE", world},
          {"GROUP_RANK", "0"},
          {"GROUP_WORLD_SIZE", "1"},
          {"ROLE_NAME", "default"},
          {"ROLE_RANK", rank},
          {"ROLE_WORLD_SIZE", world},
          {"MASTER_ADDR", r.master_addr},
          {"MASTER_PORT", std::to_string(r.master_port)},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(r.restart_count)},
          {"TORCHELASTIC_MAX_RESTARTS", std::to_string(r.max_restarts)},
          {"TORCHELASTIC_RUN_ID", r.run_id},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"DDM_LAUNCHER", "ddm"}};
}

std::vector<std::string> stale_launcher_variables() { return {"TORCHELASTIC_ERROR_FILE"}; }

}  // namespace ddm
