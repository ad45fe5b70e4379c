// Reading RUN/autoencoder.json back (see autoencoder_record.h).
#include "train/autoencoder_record.h"

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/run_dir.h"

namespace fs = std::filesystem;

namespace ddm {

AutoencoderRecord read_autoencoder_record(const std::string& run_dir) {
  const std::string file = RunDir(run_dir) / RunDir::kAutoencoder;
  DDM_CHECK(fs::is_regular_file(file), file << " does not exist: " << run_dir
                                            << " is not a finished `ddm train-autoencoder` run (run it, or "
                                               "finish it with --resume)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(file));
    AutoencoderRecord r;
    r.checkpoint = (fs::path(run_dir) / RunDir::kCheckpoints / j.at("checkpoint").get<std::string>()).string();
    DDM_CHECK(j.at("weights").get<std::string>() == RunDir::kEma,
              file << ": weights = " << j.at("weights") << ", but latent models use the EMA weights, "
                   << RunDir::kEma << "; re-run `ddm train-autoencoder --config " << run_dir << "/config.toml --out "
                   << run_dir << " --resume`");
    r.weights = (fs::path(r.checkpoint) / RunDir::kEma).string();
    r.weights_sha256 = j.at("weights_sha256").get<std::string>();
    r.latent.shift = j.at("latent_shift").get<double>();
    r.latent.scale = j.at("latent_scale").get<double>();
    r.latent.n = json_int(j.at("latent_stats_images"), file + ": key \"latent_stats_images\"", 1);
    DDM_CHECK(std::isfinite(r.latent.scale) && r.latent.scale > 0 && std::isfinite(r.latent.shift),
              file << ": latent_scale must be > 0 and latent_shift finite, got " << r.latent.scale << " and "
                   << r.latent.shift << "; re-run `ddm train-autoencoder --config " << run_dir
                   << "/config.toml --out " << run_dir << " --resume`");
    return r;
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(file << " is not a valid autoencoder record (" << e.what()
                  << "); rewrite it with `ddm train-autoencoder --config " << run_dir << "/config.toml --out " << run_dir
                  << " --resume`");
  }
}

}  // namespace ddm
