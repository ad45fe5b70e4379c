// Reader for IDX files (the MNIST / Fashion-MNIST container), gzip-compressed or plain: a
// big-endian header (magic 0x000008NN with NN = number of dimensions, then one u32 per dimension)
// followed by unsigned bytes. Images are magic 0x00000803 [N, H, W], labels 0x00000801 [N].
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

namespace ddm {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;

struct IdxArray {
  std::vector<int64_t> dims;  // from the header
  torch::Tensor data;         // uint8, shaped as dims
};

// Reads an IDX file whose magic must equal `expected_magic` (unsigned-byte data only). Works on
// .gz files and on uncompressed files alike (zlib reads plain files transparently). Throws
// ddm::Error naming the file on a missing file, wrong magic, a corrupt or truncated gzip stream,
// truncated data, or bytes left over after the data.
IdxArray read_idx(const std::string& path, uint32_t expected_magic);

// Images as uint8 [N, 1, H, W].
torch::Tensor read_idx_images(const std::string& path);
// Labels as int64 [N].
torch::Tensor read_idx_labels(const std::string& path);

}  // namespace ddm
