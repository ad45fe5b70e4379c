// Features files for `ddm partition --features file:PATH`: rows computed elsewhere (DINOv2, CLIP, ...).
//   .npy          a 2-D float32/float64 C-order array [N, D]: one row per sample, in data order
//   .safetensors  one 2-D float tensor, or one named `features`: the same
//   .npz          numpy.savez(PATH, features=F, keys=K): F [M, D] float32/float64 and K [M] strings
//                 (numpy's '<U' or '|S' arrays), row i the features of the sample whose key is K[i], in
//                 any order, extra rows allowed (shards only: their samples have keys); an .npz of one
//                 array alone is read as that .npy
// .npy is parsed by hand (no Debian package offers a C++ .npy reader; the format is a short text
// header before raw little-endian data); .npz is a zip archive of .npy files, read with libarchive.
#pragma once

#include <string>
#include <vector>

#include <torch/types.h>

namespace ddm {

struct FeaturesFile {
  torch::Tensor rows;             // float32 [M, D], M, D >= 1, finite
  std::vector<std::string> keys;  // empty, or M sample keys (UTF-8), each once
};

// Reads any of the forms above. Throws ddm::Error naming the file and what is wrong with it.
FeaturesFile read_features_file(const std::string& path);

// The rows of `file` (which has keys) for the samples `keys`, in their order: float32 [N, D]. Every
// sample needs a row (the first missing keys are named) and the samples' keys must be unique (a key
// in two shards cannot say which sample a row is for: both are named). `path` and `data` name the
// file and the data in errors.
torch::Tensor rows_by_key(const FeaturesFile& file, const std::vector<std::string>& keys, const std::string& path,
                          const std::string& data);

}  // namespace ddm
