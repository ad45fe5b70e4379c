// Fuzz target: a TOML run config -> parse_config. The input is the TOML text up to the first NUL
// byte; the lines after it are `--set section.key=value` overrides. A config that parses must
// survive a round trip: its resolved TOML (to_toml) parses again to the same TOML.
#include "core/config.h"
#include "fuzz_util.h"

#include <sstream>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input = ddm::fuzz::as_string(data, size);
  const size_t nul = input.find('\0');
  const std::string text = input.substr(0, nul);
  std::vector<std::string> overrides;
  if (nul != std::string::npos) {
    std::istringstream rest(input.substr(nul + 1));
    for (std::string line; std::getline(rest, line);) overrides.push_back(line);
  }
  ddm::fuzz::expect_errors([&] {
    const ddm::RunConfig cfg = ddm::parse_config(text, "fuzz.toml", overrides);
    const std::string resolved = ddm::to_toml(cfg);
    if (ddm::to_toml(ddm::parse_config(resolved, "resolved.toml")) != resolved) std::abort();
  });
  return 0;
}
