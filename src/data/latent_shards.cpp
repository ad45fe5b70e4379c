// Latent shards' record and samples (see latent_shards.h).
#include "data/latent_shards.h"

#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"
#include "core/safetensors.h"
#include "data/shard_write.h"
#include "data/shards.h"

namespace fs = std::filesystem;

namespace ddm {

nlohmann::json latent_shards_json(const LatentShardsInfo& i) {
  return {{"format", "ddm latent shards"},
          {"version", 1},
          {"autoencoder", i.autoencoder},
          {"autoencoder_sha256", i.autoencoder_sha256},
          {"latent_scale", i.latent_scale},
          {"latent_shift", i.latent_shift},
          {"latent_shape", i.holds_images() ? nlohmann::json(nullptr)
                                            : nlohmann::json{i.latent_channels, i.latent_size, i.latent_size}},
          {"image_shape", {i.image_channels, i.image_size, i.image_size}},
          {"samples", i.samples},
          {"shards", i.shards},
          {"num_classes", i.num_classes},
          {"class_names", i.class_names},
          {"bytes", i.bytes},
          {"data", i.data},
          {"origin", i.origin},
          {"pattern", i.pattern},
          {"captioned", i.captioned},
          {"text", i.text.encoder.empty() ? nlohmann::json(nullptr)
                                          : nlohmann::json{{"encoder", i.text.encoder},
                                                           {"sha256", i.text.sha256},
                                                           {"skip", i.text.skip},
                                                           {"tokens", i.text.tokens},
                                                           {"dim", i.text.dim},
                                                           {"pooled_dim", i.text.pooled_dim}}}};
}

LatentShardsInfo read_latent_shards_info(const std::string& dir) {
  const std::string file = (fs::path(dir) / kLatentShardsInfo).string();
  DDM_CHECK(fs::is_regular_file(file), file << " does not exist: " << dir << " is not a `ddm encode` output "
                                            << "(write one with: ddm encode --ae AUTOENCODER_RUN --config CONFIG --out "
                                            << dir << ")");
  try {
    const auto j = nlohmann::json::parse(read_file(file));
    DDM_CHECK(j.value("format", std::string()) == "ddm latent shards" && j.value("version", 0) == 1,
              file << " is not a ddm latent shards record of version 1 (format '" << j.value("format", std::string())
                   << "'); encode again with `ddm encode`");
    LatentShardsInfo i;
    i.autoencoder = j.at("autoencoder").get<std::string>();
    i.autoencoder_sha256 = j.at("autoencoder_sha256").get<std::string>();
    i.latent_scale = j.at("latent_scale").get<double>();
    i.latent_shift = j.at("latent_shift").get<double>();
    const auto& ls = j.at("latent_shape");
    const auto& is = j.at("image_shape");
    DDM_CHECK((i.holds_images() ? ls.is_null() : ls.is_array() && ls.size() == 3) && is.is_array() && is.size() == 3,
              file << ": latent_shape and image_shape must be [channels, size, size] (latent_shape null where "
                      "autoencoder is \"\")");
    if (!i.holds_images()) {
      i.latent_channels = json_int(ls[0], file + ": latent_shape[0]", 1, 1 << 16);
      i.latent_size = json_int(ls[1], file + ": latent_shape[1]", 1, 1 << 16);
      DDM_CHECK(json_int(ls[2], file + ": latent_shape[2]", 1, 1 << 16) == i.latent_size,
                file << ": latent_shape must be square, got " << ls.dump());
    }
    i.image_channels = json_int(is[0], file + ": image_shape[0]", 1, 4);
    i.image_size = json_int(is[1], file + ": image_shape[1]", 1, 1 << 16);
    i.samples = json_int(j.at("samples"), file + ": samples", 1);
    i.shards = json_int(j.at("shards"), file + ": shards", 1, 1000000);
    i.num_classes = json_int(j.at("num_classes"), file + ": num_classes", 0);
    if (j.contains("class_names")) {  // absent in records written before it
      i.class_names = j.at("class_names").get<std::vector<std::string>>();
      DDM_CHECK(i.class_names.empty() || static_cast<int64_t>(i.class_names.size()) == i.num_classes,
                file << ": class_names has " << i.class_names.size() << " names, but num_classes is " << i.num_classes
                     << "; remove class_names from it, or encode again with `ddm encode`");
    }
    i.bytes = json_int(j.at("bytes"), file + ": bytes", 0);
    i.data = j.at("data").get<std::string>();
    i.origin = j.value("origin", std::string());
    i.pattern = j.at("pattern").get<std::string>();
    i.captioned = j.value("captioned", false);  // absent in records written before captions were carried
    if (j.contains("text") && !j.at("text").is_null()) {
      const auto& t = j.at("text");
      i.text.encoder = t.at("encoder").get<std::string>();
      i.text.sha256 = t.at("sha256").get<std::string>();
      i.text.skip = json_int(t.at("skip"), file + ": text.skip", 0, 64);
      i.text.tokens = json_int(t.at("tokens"), file + ": text.tokens", 1, 1 << 16);
      i.text.dim = json_int(t.at("dim"), file + ": text.dim", 1, 1 << 16);
      i.text.pooled_dim = json_int(t.at("pooled_dim"), file + ": text.pooled_dim", 1, 1 << 16);
      DDM_CHECK(!i.text.encoder.empty() && i.captioned,
                file << ": text names an encoder, so it needs \"encoder\" and \"captioned\": true; encode again");
    }
    DDM_CHECK(!i.holds_images() || !i.text.encoder.empty(),
              file << ": names no autoencoder and no text encoder, so its shards hold nothing encoded; encode again");
    return i;
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(file << " is not a valid latent shards record (" << e.what() << "); encode again with `ddm encode`");
  }
}

std::string latent_shard_path(const std::string& dir, int64_t i, bool images) {
  return (fs::path(dir) / ((images ? "images-" : "latents-") + zero_padded(i, 6) + ".tar")).string();
}

std::vector<std::string> latent_shard_paths(const std::string& dir, const LatentShardsInfo& info) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < info.shards; ++i) {
    out.push_back(latent_shard_path(dir, i, info.holds_images()));
    DDM_CHECK(fs::is_regular_file(out.back()), "data.root = " << dir << ": " << kLatentShardsInfo << " records "
                                                              << info.shards << " shards, but " << out.back()
                                                              << " does not exist; copy the whole directory, or "
                                                                 "encode again with `ddm encode`");
  }
  return out;
}

torch::Tensor normalized_means(const torch::Tensor& posteriors, double scale, double shift) {
  DDM_CHECK(posteriors.dim() == 4 && posteriors.size(1) % 2 == 0,
            "latent shards: a batch of posteriors must be [B, 2z, h, w] (mean and logvar), got " << posteriors.sizes());
  return (posteriors.narrow(1, 0, posteriors.size(1) / 2) - shift) * scale;  // [B, z, h, w]
}

LatentShardsWriter::LatentShardsWriter(std::string dir, std::vector<int64_t> sizes, bool images)
    : dir_(std::move(dir)), sizes_(std::move(sizes)), images_(images) {}
LatentShardsWriter::~LatentShardsWriter() = default;

void LatentShardsWriter::add(const ShardSample& s) {
  DDM_CHECK(shard_ < sizes_.size(), "writing latent shards: more samples than the shards hold (" << dir_ << ")");
  const std::string path = latent_shard_path(dir_, static_cast<int64_t>(shard_), images_);
  if (!w_) w_ = std::make_unique<TarShardWriter>(path);
  w_->add(s);
  if (++in_shard_ == sizes_[shard_]) {
    w_->finish();
    bytes_ += static_cast<int64_t>(fs::file_size(path));
    w_.reset();
    in_shard_ = 0;
    ++shard_;
  }
}

namespace {

// f's tensor `name`, which must be of `dtype` and `shape`.
torch::Tensor expect_tensor(const SafetensorsFile& f, const char* name, torch::ScalarType dtype,
                            const std::vector<int64_t>& shape, const std::string& what) {
  const auto it = f.tensors.find(name);
  DDM_CHECK(it != f.tensors.end(), what << ": its .safetensors has no '" << name << "' tensor");
  const torch::Tensor& t = it->second;
  DDM_CHECK(t.scalar_type() == dtype && t.sizes() == shape,
            what << ": '" << name << "' is " << t.scalar_type() << " " << t.sizes() << ", but " << kLatentShardsInfo
                 << " says it is " << dtype << " " << torch::IntArrayRef(shape));
  return t;
}

}  // namespace

EncodedSample read_encoded(const std::string& bytes, const LatentShardsInfo& info, const std::string& what) {
  const SafetensorsFile f = parse_safetensors(bytes, what);
  EncodedSample s;
  if (!info.holds_images()) {
    const std::vector<int64_t> shape{info.latent_channels, info.latent_size, info.latent_size};
    s.posterior = torch::cat({expect_tensor(f, "mean", torch::kFloat32, shape, what),
                              expect_tensor(f, "logvar", torch::kFloat32, shape, what)});  // float [2z, h, w]
  }
  if (!info.text.encoder.empty()) {
    const auto& t = info.text;
    s.context = expect_tensor(f, "context", torch::kFloat32, {t.tokens, t.dim}, what);   // [T, D]
    s.context_mask = expect_tensor(f, "context_mask", torch::kBool, {t.tokens}, what);    // [T]
    s.pooled = expect_tensor(f, "pooled", torch::kFloat32, {t.pooled_dim}, what);         // [P]
  }
  return s;
}

}  // namespace ddm
