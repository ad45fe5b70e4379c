// Fuzz target: an islands file (TOML, `ddm islands run FILE`) -> load_islands_config, then the plan
// of islands it describes and the Slurm script it writes (with its [slurm] lines).
#include "decentral/islands.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = ddm::fuzz::scratch_dir() + "/islands.toml";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::IslandsConfig c = ddm::load_islands_config(path);
    const int64_t k = c.k > 0 && c.k <= 64 ? c.k : 2;
    ddm::plan_islands(c, k);
    ddm::slurm_script(c, k, "ddm");
  });
  return 0;
}
