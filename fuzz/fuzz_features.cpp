// Fuzz target: a features file for `ddm partition --features file:F.npy` -> load_features_file
// (the hand-written .npy reader).
#include "decentral/features.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = ddm::fuzz::scratch_dir() + "/features.npy";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] { ddm::fuzz::touch(ddm::load_features_file(path)); });
  return 0;
}
