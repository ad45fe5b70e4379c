// Reading and writing the safetensors format (https://github.com/huggingface/safetensors):
// 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}, ...,
// "__metadata__": {str: str}}, then the raw little-endian tensor bytes. Written by hand because no
// Debian package provides a C++ implementation; the format is small and fully specified.
#pragma once
#include <functional>
#include <map>
#include <string>

#include <torch/types.h>

namespace ddm {

struct SafetensorsFile {
  std::map<std::string, torch::Tensor> tensors;       // contiguous CPU tensors
  std::map<std::string, std::string> metadata;        // the optional "__metadata__" table
  // Writing only: a tensor on the meta device is a placeholder (its shape and dtype go into the
  // header); its data is fetched by name just before it is written, and let go after, so a file
  // of tensors held elsewhere (another pipeline stage's) costs one tensor's memory.
  std::function<torch::Tensor(const std::string& name)> fetch;
};

// Serializes to bytes (tensors are moved to CPU and made contiguous). Supported dtypes:
// F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
std::string safetensors_bytes(const SafetensorsFile& file);
// Parses bytes; `origin` names the file in errors. Throws ddm::Error on a bad header, unknown dtype,
// offsets out of range or overlapping, or sizes that do not match dtype x shape.
SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& origin);

// File helpers. save_safetensors writes atomically (temporary name, fsync, rename), one tensor at
// a time (never the whole file in memory), and returns the sha256 of what it wrote.
std::string save_safetensors(const std::string& path, const SafetensorsFile& file);
SafetensorsFile load_safetensors(const std::string& path);
// Reads every tensor straight from the file into its tensor and sets `sha256` to the file's digest,
// taken on the way (a checkpoint is checked without a second copy of its bytes in memory).
SafetensorsFile load_safetensors(const std::string& path, std::string& sha256);
// Reads only the tensors `keep` accepts, each straight from the file into its tensor (the header is
// still checked whole): a 4 GB CLIP of which the text tower is wanted costs the text tower's memory.
SafetensorsFile load_safetensors(const std::string& path, const std::function<bool(const std::string&)>& keep);

}  // namespace ddm
