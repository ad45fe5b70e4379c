// Fuzz target: an islands file (TOML, `ddm islands run FILE`) -> load_islands_config, then the plan
// of islands it describes.
#include "decentral/islands.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = ddm::fuzz::scratch_dir() + "/islands.toml";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::IslandsConfig c = ddm::load_islands_config(path);
    ddm::plan_islands(c, c.k > 0 && c.k <= 64 ? c.k : 2);
  });
  return 0;
}
