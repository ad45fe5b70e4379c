// RUN/autoencoder.json as latent models read it back: the autoencoder's checkpoint, its pinned EMA
// weights and the latent statistics latent diffusion normalizes by, z' = (z - shift) * scale.
// `ddm train-autoencoder` writes the file (train/autoencoder_report.h measures what goes in it);
// train/latent.h reads it through here alone, so that the latent space does not depend on the
// report (which loads models, and so latent spaces, itself).
#pragma once
#include <cstdint>
#include <string>

namespace ddm {

struct LatentStats {
  double shift = 0;  // mean of every latent element
  double scale = 1;  // 1 / standard deviation of every latent element
  int64_t n = 0;     // images measured
};

// The latent statistics and pinned weights a latent model needs, read back from RUN/autoencoder.json
// of the run that holds `checkpoint`; errors name the file and say to run `ddm train-autoencoder`.
struct AutoencoderRecord {
  std::string checkpoint, weights, weights_sha256;
  LatentStats latent;
};
AutoencoderRecord read_autoencoder_record(const std::string& run_dir);

}  // namespace ddm
