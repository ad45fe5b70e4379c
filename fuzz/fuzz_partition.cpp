// Fuzz target: a partition file (partition.safetensors made by `ddm partition`) -> load_partition.
#include "decentral/partition.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = ddm::fuzz::scratch_dir() + "/partition.safetensors";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::Partition p = ddm::load_partition(path);
    ddm::fuzz::touch(p.labels);
    ddm::fuzz::touch(p.sizes);
  });
  return 0;
}
