// Fuzz target: a checkpoint's state.json -> read_checkpoint. The checkpoint directory also holds
// small valid model/ema/optim.safetensors files; the placeholders @model@, @ema@ and @optim@ in the
// input are replaced by their sha256 so that the fuzzer gets past the checksum test.
#include <filesystem>

#include "core/fileio.h"
#include "core/safetensors.h"
#include "fuzz_util.h"
#include "train/checkpoint.h"

namespace {

std::string g_dir;
std::map<std::string, std::string> g_sha;  // placeholder -> sha256 of the file

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  g_dir = ddm::fuzz::scratch_dir() + "/ckpt/step-00000007";
  std::filesystem::create_directories(g_dir);
  for (const char* part : {"model", "ema", "optim"}) {
    ddm::SafetensorsFile f;
    f.tensors["w"] = torch::arange(6, torch::kFloat32).view({2, 3});
    f.metadata["format"] = "ddm-checkpoint-1";
    const std::string bytes = ddm::safetensors_bytes(f);
    ddm::write_file_atomic(g_dir + "/" + part + ".safetensors", bytes);
    g_sha["@" + std::string(part) + "@"] = ddm::sha256_hex(bytes);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text = ddm::fuzz::as_string(data, size);
  for (const auto& [placeholder, sha] : g_sha) replace_all(text, placeholder, sha);
  ddm::fuzz::write_bytes(g_dir + "/state.json", reinterpret_cast<const uint8_t*>(text.data()), text.size());
  ddm::fuzz::expect_errors([&] {
    const ddm::Checkpoint ck = ddm::read_checkpoint(g_dir);
    for (const auto& [name, t] : ck.model) ddm::fuzz::touch(t);
    // The fields the trainer and load_model read after read_checkpoint, through the same checks.
    ck.field<int64_t>("/optimizer_step");
    ck.field<int64_t>("/data_cursor/epoch");
    ck.field<int64_t>("/data_cursor/index");
    if (ck.state.contains("class_names")) ck.field<std::vector<std::string>>("/class_names");
    if (ck.state.contains("log_interval")) ck.field<double>("/log_interval/loss_sum");
  });
  return 0;
}
