// Image decoding and fitting (see decode.h).
#include "data/decode.h"

#include <spng.h>
#include <turbojpeg.h>
#include <webp/decode.h>

#include <memory>

#include <torch/torch.h>

#include "core/error.h"

namespace ddm {
namespace {

void check_size(int64_t w, int64_t h, const std::string& what) {
  DDM_CHECK(w > 0 && h > 0, what << ": the image's header is damaged (it gives " << w << " x " << h << " pixels)");
  DDM_CHECK(w * h <= kMaxDecodedPixels,
            what << ": the image claims " << w << " x " << h << " pixels, more than the " << kMaxDecodedPixels / 1000000
                 << " million ddm decodes (6000 x 5500 fits): scale it down first, e.g. `mogrify "
                 << "-resize 4096x4096\\> FILE` (ImageMagick), which keeps any smaller image as it is");
}

// uint8 [H, W, 3] RGB (contiguous) -> [channels, H, W]: channels 3 a view; channels 1 integer BT.601
// luma, exact for grey pixels, computed pixel by pixel so that the largest image allowed costs only
// its output beyond the decoded RGB (tensor arithmetic in int32 took 12 bytes per pixel, 400 MB).
torch::Tensor from_rgb(const torch::Tensor& hwc, int channels) {
  if (channels == 3) return hwc.permute({2, 0, 1});
  auto y = torch::empty({1, hwc.size(0), hwc.size(1)}, torch::kUInt8);  // [1, H, W]
  const uint8_t* p = hwc.data_ptr<uint8_t>();
  uint8_t* out = y.data_ptr<uint8_t>();
  for (int64_t i = 0, n = y.numel(); i < n; ++i, p += 3)
    out[i] = static_cast<uint8_t>((p[0] * 77 + p[1] * 150 + p[2] * 29 + 128) >> 8);
  return y;
}

struct TjFree {
  void operator()(void* h) const { tjDestroy(h); }
};

torch::Tensor decode_jpeg(std::string_view bytes, int channels, const std::string& what) {
  // One decompressor per thread: decoding runs on a pool of threads.
  thread_local std::unique_ptr<void, TjFree> handle(tjInitDecompress());
  DDM_CHECK(handle, what << ": libturbojpeg could not start a decompressor");
  const auto* buf = reinterpret_cast<const unsigned char*>(bytes.data());
  int w = 0, h = 0, subsamp = 0, colorspace = 0;
  DDM_CHECK(tjDecompressHeader3(handle.get(), buf, static_cast<unsigned long>(bytes.size()), &w, &h, &subsamp, &colorspace) == 0,
            what << ": not a JPEG libturbojpeg can read (" << tjGetErrorStr2(handle.get()) << ")");
  check_size(w, h, what);
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK) {
    // Print files (Photoshop's CMYK JPEGs). libjpeg gives the ink values as Adobe stores them,
    // inverted (255 = no ink), so RGB = C' K' / 255 per channel: what Pillow's CMYK-to-RGB gives.
    auto cmyk = torch::empty({h, w, 4}, torch::kUInt8);
    const int rc = tjDecompress2(handle.get(), buf, static_cast<unsigned long>(bytes.size()), cmyk.data_ptr<uint8_t>(), w,
                                 0, h, TJPF_CMYK, TJFLAG_STOPONWARNING | TJFLAG_ACCURATEDCT);
    DDM_CHECK(rc == 0, what << ": the JPEG is damaged (" << tjGetErrorStr2(handle.get()) << ")");
    auto hwc = torch::empty({h, w, 3}, torch::kUInt8);
    const uint8_t* in = cmyk.data_ptr<uint8_t>();
    uint8_t* rgb = hwc.data_ptr<uint8_t>();
    for (int64_t i = 0; i < static_cast<int64_t>(w) * h; ++i, in += 4, rgb += 3)
      for (int c = 0; c < 3; ++c) rgb[c] = static_cast<uint8_t>((in[c] * in[3] + 127) / 255);
    return from_rgb(hwc, channels);
  }
  auto out = torch::empty({h, w, channels}, torch::kUInt8);
  // A warning (a truncated or damaged stream, decoded with grey filling in) is an error here: a
  // damaged image must not be trained on unnoticed.
  const int rc = tjDecompress2(handle.get(), buf, static_cast<unsigned long>(bytes.size()), out.data_ptr<uint8_t>(), w, 0, h,
                               channels == 1 ? TJPF_GRAY : TJPF_RGB, TJFLAG_STOPONWARNING | TJFLAG_ACCURATEDCT);
  DDM_CHECK(rc == 0, what << ": the JPEG is damaged (" << tjGetErrorStr2(handle.get()) << ")");
  return out.permute({2, 0, 1});  // [C, H, W] view
}

struct SpngFree {
  void operator()(spng_ctx* c) const { spng_ctx_free(c); }
};

torch::Tensor decode_png(std::string_view bytes, int channels, const std::string& what) {
  std::unique_ptr<spng_ctx, SpngFree> ctx(spng_ctx_new(0));
  DDM_CHECK(ctx, what << ": libspng could not start a decoder");
  spng_set_crc_action(ctx.get(), SPNG_CRC_ERROR, SPNG_CRC_DISCARD);
  spng_set_chunk_limits(ctx.get(), size_t(1) << 26, size_t(1) << 26);  // no chunk may make it allocate more
  int rc = spng_set_png_buffer(ctx.get(), bytes.data(), bytes.size());
  spng_ihdr ihdr{};
  if (rc == 0) rc = spng_get_ihdr(ctx.get(), &ihdr);
  DDM_CHECK(rc == 0, what << ": not a PNG libspng can read (" << spng_strerror(rc) << ")");
  check_size(ihdr.width, ihdr.height, what);
  size_t size = 0;
  rc = spng_decoded_image_size(ctx.get(), SPNG_FMT_RGB8, &size);
  DDM_CHECK(rc == 0 && size == size_t(ihdr.width) * ihdr.height * 3, what << ": libspng cannot decode this PNG to RGB ("
                                                                           << spng_strerror(rc) << ")");
  auto hwc = torch::empty({static_cast<int64_t>(ihdr.height), static_cast<int64_t>(ihdr.width), 3}, torch::kUInt8);
  rc = spng_decode_image(ctx.get(), hwc.data_ptr<uint8_t>(), size, SPNG_FMT_RGB8, 0);
  DDM_CHECK(rc == 0, what << ": the PNG is damaged (" << spng_strerror(rc) << ")");
  return from_rgb(hwc, channels);
}

torch::Tensor decode_webp(std::string_view bytes, int channels, const std::string& what) {
  const auto* buf = reinterpret_cast<const uint8_t*>(bytes.data());
  int w = 0, h = 0;
  DDM_CHECK(WebPGetInfo(buf, bytes.size(), &w, &h), what << ": not a WebP image libwebp can read");
  check_size(w, h, what);
  auto hwc = torch::empty({h, w, 3}, torch::kUInt8);
  DDM_CHECK(WebPDecodeRGBInto(buf, bytes.size(), hwc.data_ptr<uint8_t>(), static_cast<size_t>(hwc.numel()), w * 3),
            what << ": the WebP image is damaged");
  return from_rgb(hwc, channels);
}

}  // namespace

bool is_decodable(const std::string& ext) { return ext == "jpg" || ext == "jpeg" || ext == "png" || ext == "webp"; }

const std::pair<const std::string, std::string>* sample_image(const std::map<std::string, std::string>& files,
                                                              const std::string& what) {
  const std::pair<const std::string, std::string>* image = nullptr;
  std::string exts;
  int n = 0;
  for (const auto& f : files) {
    if (!is_decodable(f.first)) continue;
    if (image == nullptr) image = &f;
    exts += (n++ ? " and ." : ".") + f.first;
  }
  DDM_CHECK(n <= 1, what << " has " << n << " images (" << exts << "): the files of one name up to its first dot are "
                         << "one sample, which holds one image. Rename all but one (or set data.skip_bad = true to "
                         << "skip such samples)");
  return image;
}

torch::Tensor decode_image(std::string_view bytes, const std::string& ext, int channels, const std::string& what) {
  DDM_CHECK(channels == 1 || channels == 3, what << ": images decode to 1 or 3 channels, not " << channels);
  DDM_CHECK(!bytes.empty(), what << ": the ." << ext << " file is empty");
  if (ext == "jpg" || ext == "jpeg") return decode_jpeg(bytes, channels, what);
  if (ext == "png") return decode_png(bytes, channels, what);
  if (ext == "webp") return decode_webp(bytes, channels, what);
  DDM_FAIL(what << ": ." << ext << " is not an image type ddm decodes (jpg, jpeg, png, webp)");
}

int image_channels(std::string_view bytes, const std::string& ext, const std::string& what) {
  DDM_CHECK(!bytes.empty(), what << ": the ." << ext << " file is empty");
  if (ext == "jpg" || ext == "jpeg") {
    tjhandle h = tjInitDecompress();
    DDM_CHECK(h, what << ": libturbojpeg could not start a decompressor");
    int w = 0, ht = 0, subsamp = 0, colorspace = 0;
    const int rc = tjDecompressHeader3(h, reinterpret_cast<const unsigned char*>(bytes.data()),
                                       static_cast<unsigned long>(bytes.size()), &w, &ht, &subsamp, &colorspace);
    const std::string why = rc == 0 ? std::string() : tjGetErrorStr2(h);
    tjDestroy(h);
    DDM_CHECK(rc == 0, what << ": not a JPEG libturbojpeg can read (" << why << ")");
    return colorspace == TJCS_GRAY ? 1 : 3;
  }
  if (ext == "png") {
    std::unique_ptr<spng_ctx, SpngFree> ctx(spng_ctx_new(0));
    DDM_CHECK(ctx, what << ": libspng could not start a decoder");
    spng_ihdr ihdr{};
    int rc = spng_set_png_buffer(ctx.get(), bytes.data(), bytes.size());
    if (rc == 0) rc = spng_get_ihdr(ctx.get(), &ihdr);
    DDM_CHECK(rc == 0, what << ": not a PNG libspng can read (" << spng_strerror(rc) << ")");
    return ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE || ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA ? 1 : 3;
  }
  if (ext == "webp") return 3;
  DDM_FAIL(what << ": ." << ext << " is not an image type ddm decodes (jpg, jpeg, png, webp)");
}

torch::Tensor crop_resize(const torch::Tensor& image, int64_t size, CropMode mode, double u) {
  DDM_CHECK(image.dim() == 3 && image.scalar_type() == torch::kUInt8, "crop_resize takes a uint8 [C, H, W] image");
  DDM_CHECK(size >= 1, "crop_resize: size must be >= 1, got " << size);
  const int64_t h = image.size(1), w = image.size(2), s = std::min(h, w);
  const double at = mode == CropMode::kCenter ? 0.5 : std::clamp(u, 0.0, 1.0 - 1e-12);
  const int64_t y0 = mode == CropMode::kCenter ? (h - s) / 2 : static_cast<int64_t>(at * static_cast<double>(h - s + 1));
  const int64_t x0 = mode == CropMode::kCenter ? (w - s) / 2 : static_cast<int64_t>(at * static_cast<double>(w - s + 1));
  const torch::Tensor square = image.slice(1, y0, y0 + s).slice(2, x0, x0 + s);  // [C, s, s] view
  if (s == size) return square;
  const auto in = square.unsqueeze(0).contiguous(torch::MemoryFormat::ChannelsLast);  // [1, C, s, s]
  return torch::_upsample_bilinear2d_aa(in, {size, size}, /*align_corners=*/false).squeeze(0);  // [C, size, size]
}

}  // namespace ddm
