// Fuzz target: an image file (PNG, JPEG, BMP, GIF, ... whatever stb_image decodes) read through the
// image-folder dataset reader, and through read_image on its own.
#include <filesystem>

#include "data/image_folder.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  std::filesystem::create_directories(ddm::fuzz::scratch_dir() + "/images/class-a");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string root = ddm::fuzz::scratch_dir() + "/images";
  const std::string path = root + "/class-a/image.png";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] { ddm::fuzz::touch(ddm::read_image(path)); });
  ddm::fuzz::expect_errors([&] {
    const ddm::Dataset ds = ddm::load_image_folder(root);
    ddm::fuzz::touch(ds.images);
    ddm::fuzz::touch(ds.labels);
  });
  return 0;
}
