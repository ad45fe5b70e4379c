// Fuzz target: a features file for `ddm partition --features file:F` -> read_features_file, the same
// bytes as an .npy (the hand-written reader) and as an .npz (libarchive's zip reader, then that .npy
// reader on each member).
#include "decentral/features_file.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* name : {"/features.npy", "/features.npz"}) {
    const std::string path = ddm::fuzz::scratch_dir() + name;
    ddm::fuzz::write_bytes(path, data, size);
    ddm::fuzz::expect_errors([&] { ddm::fuzz::touch(ddm::read_features_file(path).rows); });
  }
  return 0;
}
