// Fuzz target: image bytes through the shard loader's decoders (libturbojpeg, libspng, libwebp),
// then cropped and resized. The first byte picks the type and the channel count; the rest is the file.
#include "data/decode.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const char* kTypes[] = {"jpg", "png", "webp"};
  const std::string ext = kTypes[data[0] % 3];
  const int channels = (data[0] / 3) % 2 ? 3 : 1;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  ddm::fuzz::expect_errors([&] {
    const torch::Tensor img = ddm::decode_image(bytes, ext, channels, "fuzz." + ext);
    ddm::fuzz::touch(ddm::crop_resize(img, 8, ddm::CropMode::kRandom, 0.3));
  });
  return 0;
}
