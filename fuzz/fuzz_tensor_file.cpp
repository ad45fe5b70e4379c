// Fuzz target: a safetensors dataset file (`images`, optional `labels`, metadata) -> load_tensor_file.
#include "data/tensor_file.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = ddm::fuzz::scratch_dir() + "/data.safetensors";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::Dataset ds = ddm::load_tensor_file(path);
    ddm::fuzz::touch(ds.images);
    ddm::fuzz::touch(ds.labels);
  });
  return 0;
}
