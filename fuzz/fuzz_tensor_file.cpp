// Fuzz target: a safetensors dataset file (`images`, optional `labels`, metadata) -> load_tensor_file.
#include "core/safetensors.h"
#include "data/tensor_file.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

// TODO(issue 16 item 10): a label as large as 10^12 makes load_tensor_file name 10^12 classes
// (std::bad_alloc, or the fuzzer's memory limit); that fix is under way in src/data/tensor_file.cpp.
// Until it lands, such inputs are skipped so that the fuzzer looks further.
bool has_huge_label(const std::string& bytes) {
  try {
    const ddm::SafetensorsFile f = ddm::parse_safetensors(bytes, "fuzz.safetensors");
    const auto it = f.tensors.find("labels");
    if (it == f.tensors.end() || it->second.numel() == 0 || it->second.is_floating_point() ||
        it->second.scalar_type() == torch::kBool)
      return false;
    return it->second.max().item<double>() > 1e6;
  } catch (const ddm::Error&) {
    return false;
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes = ddm::fuzz::as_string(data, size);
  if (has_huge_label(bytes)) return 0;
  const std::string path = ddm::fuzz::scratch_dir() + "/data.safetensors";
  ddm::fuzz::write_bytes(path, data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::Dataset ds = ddm::load_tensor_file(path);
    ddm::fuzz::touch(ds.images);
    ddm::fuzz::touch(ds.labels);
  });
  return 0;
}
