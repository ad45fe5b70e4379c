// `ddm encode`: a dataset's autoencoder posteriors, or its captions' text encodings beside its images,
// written once (see encode_shards.h).
#include "train/encode_shards.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/input_check.h"
#include "train/checkpoint.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/captions.h"
#include "data/dataset.h"
#include "data/origin.h"
#include "data/shard_loader.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "train/latent.h"
#include "train/text.h"

namespace fs = std::filesystem;

namespace ddm {

namespace {

// One sample's text encodings as KEY.safetensors holds them: row i of a batch's Cond.
void add_text(SafetensorsFile& f, const Cond& text, int64_t i) {
  f.tensors["context"] = text.context[i].clone();            // [T, D]
  f.tensors["context_mask"] = text.context_mask[i].clone();  // [T]
  f.tensors["pooled"] = text.pooled[i].clone();              // [P]
}

}  // namespace

LatentShardsInfo encode_latent_shards(const DataConfig& data, const std::string& autoencoder,
                                      const EncodeShardsOptions& o) {
  DDM_INPUT_CHECK(!o.out.empty(), "--out DIR is required");
  DDM_INPUT_CHECK(!fs::exists(o.out), "--out " << o.out << " already exists; remove it or choose another directory");
  {  // --out can be made (OUT.partial first, renamed when complete): checked before anything is read
    const std::string probe = o.out + ".partial";
    const bool was = fs::exists(probe);
    std::error_code ec;
    fs::create_directories(probe, ec);
    DDM_INPUT_CHECK(!ec, "--out " << o.out << ": cannot create it there (" << ec.message() << "); give another path");
    if (!was) fs::remove(probe, ec);
  }
  const bool keep_images = autoencoder.empty();  // a pixel model's shards: images kept, captions encoded
  DDM_INPUT_CHECK(!keep_images || o.text, "--ae is required: name the autoencoder whose latents to write, or, for a pixel "
                                    "model, give --text alone to cache the captions' text encodings beside the images");
  DDM_INPUT_CHECK(keep_images || !data.hflip,
            "data.hflip = true: latent shards hold each image's posterior as it is, and a flipped image's latent is "
            "not the flip of its latent; set data.hflip = false");
  DDM_CHECK(o.shard_size > 0 && o.batch > 0, "--shard-size and the batch must be > 0");
  const bool from_shards = data.source == "shards";
  DDM_INPUT_CHECK(data.source != "latents", "data.source = latents: the data is a `ddm encode` directory already; "
                                            "give the config of the data it was encoded from");
  // What is read before anything is written: a failure there is bad input (exit 2).
  const Dataset d = as_input_error([&] { return from_shards ? open_shards(data, o.threads, o.quiet) : load_dataset(data); });
  ModelConfig m;
  std::shared_ptr<const LatentSpace> latent;
  if (!keep_images) {
    m.latent = autoencoder;
    try {
      resolve_latent(m, d);  // the autoencoder's checkpoint and sha256; refuses images of another shape
      latent = LatentSpace::load(m, o.device);
    } catch (const Error& e) {  // named as the flag that gave it
      const std::string what = e.what(), key = "model.latent = " + autoencoder;
      throw InputError(what.rfind(key, 0) == 0 ? "--ae " + autoencoder + what.substr(key.size()) : "--ae " + autoencoder + ": " + what);
    }
  }

  LatentShardsInfo info;
  info.autoencoder = m.latent;
  info.autoencoder_sha256 = m.latent_sha256;
  info.latent_scale = m.latent_scale;
  info.latent_shift = m.latent_shift;
  info.latent_channels = keep_images ? 0 : m.in_channels;
  info.latent_size = keep_images ? 0 : m.image_size;
  info.image_channels = d.images.size(1);
  info.image_size = d.images.size(2);
  info.samples = from_shards ? d.shards->samples : d.images.size(0);
  info.num_classes = d.num_classes;
  if (static_cast<int64_t>(d.class_names.size()) == d.num_classes) info.class_names = d.class_names;
  info.data = d.description;
  info.origin = data_origin(data);
  DDM_INPUT_CHECK(info.samples > 0, d.description << " has no samples to encode");
  info.captioned = from_shards ? d.shards->captioned > 0 : !d.captions.empty();
  std::shared_ptr<const text::TextEncoder> encoder;
  ModelConfig tm = o.text_model;
  if (o.text) {
    DDM_INPUT_CHECK(!tm.text_encoder.empty(), "--text caches the captions' encodings by the config's model.text_encoder, "
                                        "and the config names none; set it (docs/text.md)");
    as_input_error([&] {
      resolve_text(tm, d);  // the encoder's directory, sha256 and sizes; refuses data without captions
      encoder = load_pinned_text_encoder(tm, o.device);
    });
    info.text = {tm.text_encoder, tm.text_sha256, tm.text_skip, tm.text_tokens, tm.text_dim, tm.text_pooled_dim};
  }
  std::vector<int64_t> sizes;
  if (from_shards) {
    for (int64_t c : d.shards->counts)
      if (c > 0) sizes.push_back(c);  // an empty source shard gives no latent shard
  } else {
    for (int64_t i = 0; i < info.samples; i += o.shard_size) sizes.push_back(std::min(o.shard_size, info.samples - i));
  }
  info.shards = static_cast<int64_t>(sizes.size());
  info.pattern = o.out + (keep_images ? "/images-{" : "/latents-{") + zero_padded(0, 6) + ".." +
                 zero_padded(info.shards - 1, 6) + "}.tar";

  const std::string partial = o.out + ".partial";
  std::error_code ec;
  fs::remove_all(partial, ec);  // what an interrupted encode left
  fs::create_directories(partial, ec);
  DDM_CHECK(!ec, "cannot create " << partial << ": " << ec.message());
  if (!o.quiet) {
    std::cout << "encoding " << d.description;
    if (keep_images)
      std::cout << ": its images kept as they are";
    else
      std::cout << " with the autoencoder " << m.latent << " (sha256 " << m.latent_sha256.substr(0, 12) << ", latents "
                << m.in_channels << "x" << m.image_size << "x" << m.image_size << ") on " << latent->device();
    std::cout << " into " << info.shards << " shard" << (info.shards > 1 ? "s" : "") << " in " << o.out
              << (encoder ? ", and each caption with the text encoder " + tm.text_encoder + " (" +
                                std::to_string(tm.text_tokens) + " tokens x " + std::to_string(tm.text_dim) + ")"
                          : info.captioned ? ", with the captions" : "")
              << std::endl;
  }
  LatentShardsWriter out(partial, sizes, keep_images);
  int64_t written = 0;
  auto last = std::chrono::steady_clock::now();
  const auto progress = [&] {
    if (!o.quiet && std::chrono::duration<double>(std::chrono::steady_clock::now() - last).count() >= 10) {
      std::cout << "  encoded " << written << "/" << info.samples << " samples" << std::endl;
      last = std::chrono::steady_clock::now();
    }
  };
  // The text encodings of `captions`, samples first.. of the data's order: float [b, T, D], bool [b, T], float [b, P].
  const auto encode_captions = [&](const std::vector<std::string>& captions, int64_t first) {
    std::vector<std::string> what;
    for (size_t i = 0; i < captions.size(); ++i) what.push_back("the caption of sample " + std::to_string(first + i));
    Cond text = encode_texts(*encoder, captions, torch::kCPU, what);  // [b, T, D], [b, T], [b, P]
    text.context = text.context.to(torch::kFloat32).contiguous();
    text.context_mask = text.context_mask.to(torch::kBool).contiguous();
    text.pooled = text.pooled.to(torch::kFloat32).contiguous();
    return text;
  };
  if (keep_images) {
    // Each sample as the source has it (from shards: its members' bytes; in memory: a PNG, its label and
    // caption), under the key of its position, with its caption's encoding as KEY.safetensors.
    std::vector<ShardSample> pending;
    std::vector<std::string> captions;
    const auto flush = [&] {
      const Cond text = encode_captions(captions, written);
      for (size_t i = 0; i < pending.size(); ++i) {
        ShardSample& s = pending[i];
        s.key = zero_padded(written + static_cast<int64_t>(i), 8);
        SafetensorsFile f;
        add_text(f, text, static_cast<int64_t>(i));
        s.files["safetensors"] = safetensors_bytes(f);
        out.add(s);
      }
      written += static_cast<int64_t>(pending.size());
      pending.clear(), captions.clear();
      progress();
    };
    if (from_shards) {
      const ShardIndex& index = *d.shards;
      for (size_t k = 0; k < index.shards.size(); ++k) {
        TarShardReader r(index.shards[k]);
        for (int64_t i = 0; i < index.counts[k]; ++i) {
          ShardSample s;
          DDM_CHECK(r.next(s), "shard " << index.shards[k] << " has fewer samples than when it was scanned");
          const std::string what = "shard " + index.shards[k] + ", sample '" + s.key + "'";
          DDM_CHECK(!s.files.count("safetensors"), what << " has a .safetensors member already, where the encodings "
                                                        << "would go; drop it from the shards (ddm shards) first");
          const auto caption = sample_caption(s, what);
          DDM_CHECK(caption, what << " has no caption (.txt, or .json with \"caption\" or \"text\"), as the others have");
          captions.push_back(*caption);
          pending.push_back(std::move(s));
          if (static_cast<int64_t>(pending.size()) == o.batch) flush();
        }
      }
    } else {
      for (int64_t i = 0; i < info.samples; ++i) {
        ShardSample s;
        s.files["png"] = png_of(d.images[i]);  // uint8 [C, H, W], lossless
        if (d.num_classes > 0) s.files["cls"] = std::to_string(d.labels[i].item<int64_t>());
        s.files["txt"] = d.captions[static_cast<size_t>(i)];
        captions.push_back(d.captions[static_cast<size_t>(i)]);
        pending.push_back(std::move(s));
        if (static_cast<int64_t>(pending.size()) == o.batch) flush();
      }
    }
    if (!pending.empty()) flush();
  } else {
    std::vector<std::string> shard_captions;  // for_each_in_order's, in order (shards)
    // x float [b, C, S, S] in [-1, 1], labels int64 [b], x[0]'s position in the data's order.
    const auto encode = [&](const torch::Tensor& x, const torch::Tensor& y, int64_t first) {
      DDM_CHECK(first == written, "encode: samples out of order (" << first << " after " << written << ")");
      Posterior q;
      {
        torch::NoGradGuard no_grad;
        q = latent->posterior(x.to(latent->device()));  // [b, z, h, w] each
      }
      const torch::Tensor mean = q.mean.to(torch::kCPU, torch::kFloat32).contiguous();
      const torch::Tensor logvar = q.logvar.to(torch::kCPU, torch::kFloat32).contiguous();
      const int64_t b = x.size(0);
      std::vector<std::string> captions;
      if (info.captioned) {
        const auto& all = from_shards ? shard_captions : d.captions;
        DDM_CHECK(static_cast<int64_t>(all.size()) >= first + b, "encode: fewer captions than samples");
        captions.assign(all.begin() + first, all.begin() + first + b);
      }
      Cond text;
      if (encoder) text = encode_captions(captions, first);
      for (int64_t i = 0; i < b; ++i) {
        ShardSample s;
        s.key = zero_padded(first + i, 8);
        SafetensorsFile f;
        f.tensors["mean"] = mean[i].clone();      // [z, h, w]
        f.tensors["logvar"] = logvar[i].clone();  // [z, h, w]
        if (encoder) add_text(f, text, i);
        s.files["safetensors"] = safetensors_bytes(f);
        if (d.num_classes > 0) s.files["cls"] = std::to_string(y[i].item<int64_t>());
        if (info.captioned) s.files["txt"] = captions[static_cast<size_t>(i)];
        out.add(s);
      }
      written += b;
      progress();
    };
    if (from_shards) {
      for_each_in_order(d, data, info.samples, o.threads, encode, nullptr, info.captioned ? &shard_captions : nullptr);
    } else {
      for (int64_t i = 0; i < info.samples; i += o.batch) {
        const int64_t b = std::min(o.batch, info.samples - i);
        encode(to_unit_range(d.images.narrow(0, i, b)), d.labels.narrow(0, i, b), i);
      }
    }
  }
  DDM_CHECK(written == info.samples && out.done() == sizes.size(),
            "encode: " << written << " of " << info.samples << " samples were read; the data changed while encoding?");
  info.bytes = out.bytes();
  write_file_atomic(partial + "/" + kLatentShardsInfo, latent_shards_json(info).dump(2) + "\n");
  fsync_dir(partial);
  fs::rename(partial, o.out, ec);
  DDM_CHECK(!ec, "cannot rename " << partial << " to " << o.out << ": " << ec.message());
  if (!keep_images) pin_checkpoint(info.autoencoder, o.out);  // the autoencoder run's rotation keeps it
  return info;
}

}  // namespace ddm
