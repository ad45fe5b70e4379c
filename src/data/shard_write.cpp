// Writing a Dataset as tar shards (see shard_write.h). PNG encoding is stb_image_write's (libstb).
#include "data/shard_write.h"

#include <stb_image_write.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "core/error.h"
#include "core/input_check.h"
#include "data/shard_stream.h"  // ends_as_a_tar
#include "data/shards.h"

namespace ddm {
namespace {
void append(void* ctx, void* data, int size) { static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<size_t>(size)); }
}  // namespace

std::string zero_padded(int64_t i, int width) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%0*lld", width, static_cast<long long>(i));
  return buf;
}

std::string png_of(const torch::Tensor& chw_u8) {
  DDM_CHECK(chw_u8.dim() == 3 && (chw_u8.size(0) == 1 || chw_u8.size(0) == 3) && chw_u8.scalar_type() == torch::kUInt8,
            "png_of takes a uint8 [1 or 3, H, W] image");
  const torch::Tensor hwc = chw_u8.permute({1, 2, 0}).contiguous();  // [H, W, C]
  const int h = static_cast<int>(hwc.size(0)), w = static_cast<int>(hwc.size(1)), c = static_cast<int>(hwc.size(2));
  std::string out;
  DDM_CHECK(stbi_write_png_to_func(append, &out, w, h, c, hwc.data_ptr<uint8_t>(), w * c) != 0, "PNG encoding failed");
  return out;
}

ShardsWritten write_shards(const Dataset& data, const std::string& dir, int64_t shard_size, const std::string& prefix,
                           const std::function<void(int64_t)>& progress) {
  DDM_CHECK(shard_size > 0, "--shard-size must be > 0, got " << shard_size);
  DDM_CHECK(!prefix.empty() && prefix.find('/') == std::string::npos && prefix.find('{') == std::string::npos,
            "--prefix '" << prefix << "' must be a plain file name start (no '/', no braces)");
  const int64_t n = data.images.size(0);
  DDM_CHECK(n > 0, data.description << " has no images to write");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  DDM_CHECK(!ec, "cannot create " << dir << ": " << ec.message());
  ShardsWritten out;
  out.shards = (n + shard_size - 1) / shard_size;
  for (int64_t s = 0; s < out.shards; ++s) {
    const std::string path = dir + "/" + prefix + "-" + zero_padded(s, 6) + ".tar";
    TarShardWriter w(path);
    for (int64_t i = s * shard_size; i < std::min(n, (s + 1) * shard_size); ++i) {
      ShardSample smp;
      smp.key = zero_padded(i, 8);
      smp.files["png"] = png_of(data.images[i]);
      if (data.num_classes > 0) smp.files["cls"] = std::to_string(data.labels[i].item<int64_t>());
      if (!data.captions.empty()) smp.files["txt"] = data.captions[static_cast<size_t>(i)];
      w.add(smp);
      ++out.samples;
    }
    w.finish();
    out.bytes += static_cast<int64_t>(std::filesystem::file_size(path));  // with tar's 512-byte blocks
    if (progress) progress(out.samples);
  }
  out.pattern = dir + "/" + prefix + "-{" + zero_padded(0, 6) + ".." + zero_padded(out.shards - 1, 6) + "}.tar";
  return out;
}

void check_whole_tars(const std::vector<std::string>& shards) {
  for (const std::string& in : shards)
    DDM_INPUT_CHECK(ends_as_a_tar(in), "shard " << in << " ends without a tar's end-of-archive blocks (two blocks of "
                                                   "zeros): it was cut short, e.g. by a copy that stopped, and re-sharding "
                                                   "it would lose the samples after the cut; copy it again");
}

ShardsWritten reshard(const std::vector<std::string>& shards, const std::string& dir, int64_t shard_size,
                      const std::string& prefix, const std::function<void(int64_t)>& progress) {
  DDM_CHECK(shard_size > 0, "--shard-size must be > 0, got " << shard_size);
  DDM_CHECK(!prefix.empty() && prefix.find('/') == std::string::npos && prefix.find('{') == std::string::npos,
            "--prefix '" << prefix << "' must be a plain file name start (no '/', no braces)");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  DDM_CHECK(!ec, "cannot create " << dir << ": " << ec.message());
  const auto out_path = [&](int64_t s) { return dir + "/" + prefix + "-" + zero_padded(s, 6) + ".tar"; };
  // An output name that is one of the inputs would be replaced while it is still to be read.
  const std::string first_out = std::filesystem::weakly_canonical(out_path(0)).parent_path().string() + "/" + prefix + "-";
  for (const std::string& in : shards) {
    const std::string canon = std::filesystem::weakly_canonical(in).string();
    DDM_CHECK(canon.rfind(first_out, 0) != 0,
              "--out " << dir << " with --prefix " << prefix << " would write over the input shard " << in
                       << "; use another --out or --prefix");
  }
  check_whole_tars(shards);
  ShardsWritten out;
  std::unique_ptr<TarShardWriter> w;
  std::string path;
  const auto close = [&] {
    w->finish();
    out.bytes += static_cast<int64_t>(std::filesystem::file_size(path));
    if (progress) progress(out.samples);
  };
  for (const std::string& in : shards) {
    // A shard that cannot be read is bad input (exit 2); a shard that cannot be written is not.
    std::optional<TarShardReader> r;
    as_input_error([&] { r.emplace(in); });
    ShardSample smp;
    while (as_input_error([&] { return r->next(smp); })) {
      if (out.samples % shard_size == 0) {
        if (w) close();
        path = out_path(out.shards++);
        w = std::make_unique<TarShardWriter>(path);
      }
      w->add(smp);
      ++out.samples;
    }
  }
  DDM_CHECK(w, "the shards to re-shard hold no sample");
  close();
  out.pattern = dir + "/" + prefix + "-{" + zero_padded(0, 6) + ".." + zero_padded(out.shards - 1, 6) + "}.tar";
  return out;
}

}  // namespace ddm
