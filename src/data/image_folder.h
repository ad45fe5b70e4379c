// Loading a folder of images into a Dataset: one sub-folder per class (class names are the sorted
// sub-folder names, labels their index), or images directly in the folder for an unlabeled set; with
// their captions where the folder has them (data/captions.h).
// JPEG and WebP files decode as in tar shards (data/decode.h: libturbojpeg, libwebp), the others
// with stb_image (PNG, BMP, TGA, GIF, PSD, PNM, HDR) from Debian's libstb.
#pragma once
#include <string>
#include <vector>

#include "data/dataset.h"

namespace ddm {

// True for file names whose extension read_image decodes (case-insensitive).
bool is_image_file_name(const std::string& name);

// The largest image read_image decodes, in pixels (4096 x 4096).
inline constexpr int64_t kMaxImagePixels = int64_t(1) << 24;

// Decodes one image to uint8 [C, H, W] with its native channel count (1 gray, 2 gray+alpha, 3 RGB,
// 4 RGBA; a JPEG 1 or 3, CMYK ones as RGB; a WebP 3, its alpha dropped). The type is read from the
// bytes, not the name. Throws ddm::Error naming the file and the decoder's reason when it cannot be
// decoded, or when the image has more than kMaxImagePixels pixels.
torch::Tensor read_image(const std::string& path);

// The size x size tiles of an image whose sides are multiples of size (one tile, or a grid of them
// without margins), row by row: uint8 [N, C, size, size]; an alpha channel is dropped. `what` names
// the image in errors (e.g. a command-line flag).
torch::Tensor read_image_tiles(const std::string& path, int64_t size, const std::string& what);

// Loads every image under `root`. Images inside a class folder are taken in sorted file-name order;
// files without an image extension and hidden entries (".*") are skipped. All images must have the
// same size; the first one that differs is named in the error. A folder of one channel count keeps
// it exactly; one that mixes them reads every image as RGB (grey if none has colour), alpha
// dropped, and says so.
Dataset load_image_folder(const std::string& root);

}  // namespace ddm
