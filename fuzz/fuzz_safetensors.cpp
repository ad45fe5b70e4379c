// Fuzz target: safetensors bytes -> parse_safetensors. A file that parses must survive a round trip:
// writing it and parsing the bytes again gives the same bytes once more. The same bytes as a latent
// shard's sample (read_encoded, with text encodings) must be read or refused with ddm::Error.
#include "core/safetensors.h"
#include "data/latent_shards.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes = ddm::fuzz::as_string(data, size);
  ddm::fuzz::expect_errors([&] {
    const ddm::SafetensorsFile f = ddm::parse_safetensors(bytes, "fuzz.safetensors");
    for (const auto& [name, t] : f.tensors) ddm::fuzz::touch(t);
    const std::string once = ddm::safetensors_bytes(f);
    const std::string twice = ddm::safetensors_bytes(ddm::parse_safetensors(once, "rewritten.safetensors"));
    if (once != twice) std::abort();  // the writer and the reader disagree
  });
  for (const char* autoencoder : {"ae", ""}) {  // latents with text encodings; images' text encodings alone
    ddm::fuzz::expect_errors([&] {
      ddm::LatentShardsInfo info;
      info.autoencoder = autoencoder;
      info.latent_channels = 2, info.latent_size = 2, info.captioned = true;
      info.text = {"encoder", "sha", 0, 3, 4, 4};
      const ddm::EncodedSample s = ddm::read_encoded(bytes, info, "fuzz sample");
      ddm::fuzz::touch(s.posterior);
      ddm::fuzz::touch(s.context);
      ddm::fuzz::touch(s.context_mask);
      ddm::fuzz::touch(s.pooled);
    });
  }
  return 0;
}
