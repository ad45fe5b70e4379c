// Fuzz target: the launcher's environment (torchrun, ddm launch, Slurm, Open MPI variables) ->
// detect_dist_env, including Slurm hostlist expansion. Input: lines NAME=VALUE.
#include <map>
#include <sstream>

#include "comm/env.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, std::string> vars;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) vars[line.substr(0, eq)] = line.substr(eq + 1);
  }
  ddm::fuzz::expect_errors([&] {
    const ddm::DistEnv e = ddm::detect_dist_env([&](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
    (void)e.describe();
  });
  if (auto it = vars.find("HOSTLIST"); it != vars.end())
    ddm::fuzz::expect_errors([&] { (void)ddm::expand_slurm_hostlist(it->second, "HOSTLIST", 4096); });
  return 0;
}
