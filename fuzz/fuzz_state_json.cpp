// Fuzz target: a checkpoint's state.json -> read_checkpoint. The checkpoint directory also holds
// small valid model/ema/optim.safetensors files; the placeholders @model@, @ema@ and @optim@ in the
// input are replaced by their sha256 so that the fuzzer gets past the checksum test.
#include <nlohmann/json.hpp>

#include <filesystem>

#include "core/fileio.h"
#include "core/safetensors.h"
#include "train/checkpoint.h"
#include "fuzz_util.h"

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
  // TODO(issue 16 item 9): read_checkpoint takes state.json's fields without checking their types:
  // a float "step" is cast to int64 (undefined behaviour for 1e300), and missing or ill-typed
  // fields escape as nlohmann::json exceptions instead of a ddm::Error. That fix is under way in
  // src/train/checkpoint.cpp; until it lands, these inputs are skipped or their exceptions ignored
  // so that the fuzzer looks further.
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("step") && j["step"].is_number_float()) return 0;
  ddm::fuzz::write_bytes(g_dir + "/state.json", reinterpret_cast<const uint8_t*>(text.data()), text.size());
  try {
    ddm::fuzz::expect_errors([&] {
      const ddm::Checkpoint ck = ddm::read_checkpoint(g_dir);
      for (const auto& [name, t] : ck.model) ddm::fuzz::touch(t);
    });
  } catch (const nlohmann::json::exception&) {
    // TODO(issue 16 item 9): see above.
  }
  return 0;
}
