// Fuzz target: an IDX file (gzip-compressed or plain) -> read_idx_images and read_idx_labels, the
// Fashion-MNIST readers. The input is written to a scratch file because zlib's gz* reads paths.
#include "data/idx.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = ddm::fuzz::scratch_dir() + "/data-idx-ubyte.gz";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] { ddm::fuzz::touch(ddm::read_idx_images(path)); });
  ddm::fuzz::expect_errors([&] { ddm::fuzz::touch(ddm::read_idx_labels(path)); });
  return 0;
}
