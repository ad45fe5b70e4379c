// Decoding a sample's image bytes and fitting them to the model's resolution, with
// Debian's libraries: JPEG with libturbojpeg, PNG with libspng, WebP with libwebp; resizing with
// LibTorch's antialiased uint8 kernel. Every decoder checks the header's size before it allocates, so a file
// claiming a huge image is an error, not an allocation.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include <torch/types.h>

namespace ddm {

// The largest image decoded, in pixels (2^25: 6000 x 5500 fits; a lossless WebP of that size takes
// 134 MB while it decodes).
inline constexpr int64_t kMaxDecodedPixels = int64_t(1) << 25;

// True for the extensions decode_image reads: jpg, jpeg, png, webp.
bool is_decodable(const std::string& ext);

// The one image among a sample's files (extension -> bytes): nullptr where there is none. Two or
// more (a.jpg and a.png in one tar are one sample, the files of one name up to its first dot) are an
// error naming `what` and their extensions: which one the sample meant is unknown.
const std::pair<const std::string, std::string>* sample_image(const std::map<std::string, std::string>& files,
                                                              const std::string& what);

// Decodes `bytes` (a file of type `ext`) to uint8 [channels, H, W]: channels 1 (luma, BT.601
// weights, for a colour source) or 3 (grey replicated, for a grey source); alpha is dropped. The
// result is a view of the decoder's channels-last buffer (.contiguous() gives planar storage).
// Throws ddm::Error naming `what` and the decoder's reason for bytes it cannot decode.
torch::Tensor decode_image(std::string_view bytes, const std::string& ext, int channels, const std::string& what);

// The channels `bytes` hold by their header: 1 for a grey JPEG or PNG (with or without alpha), else 3.
// Throws like decode_image for bytes that are not an image of type `ext`.
int image_channels(std::string_view bytes, const std::string& ext, const std::string& what);

// How a decoded image becomes size x size: `center` takes the centred square of the shorter side,
// `random` a square of the shorter side at an offset drawn from `u` in [0, 1) (the caller's keyed
// draw), then either is resized: LibTorch's antialiased bilinear for uint8 (a triangle filter as
// wide as the scale when shrinking, plain bilinear when growing; vectorized for channels-last
// images), Pillow's BILINEAR. The result is uint8 [C, size, size], channels last (a view).
enum class CropMode { kCenter, kRandom };
torch::Tensor crop_resize(const torch::Tensor& image, int64_t size, CropMode mode, double u = 0.5);

}  // namespace ddm
