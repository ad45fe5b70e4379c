// load_dataset (Fashion-MNIST IDX files, image folders, safetensors files), pixel-range
// conversions, and BatchLoader, the seeded epoch-wise shuffling loader whose batches are a pure
// function of (seed, cursor).
#include "data/dataset.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/shard_stream.h"
#include "data/tensor_file.h"

namespace ddm {
namespace {

const char* kFashionClasses[] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                 "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

const char* kInstallHint =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or set data.root";

// "<root>/<stem>.gz", or the unpacked "<root>/<stem>" when only that exists.
std::string fashion_file(const std::string& root, const std::string& stem) {
  const std::string gz = root + "/" + stem + ".gz";
  std::error_code ec;
  if (std::filesystem::exists(gz, ec)) return gz;
  if (std::filesystem::exists(root + "/" + stem, ec)) return root + "/" + stem;
  DDM_FAIL("Fashion-MNIST file " << gz << " not found: " << kInstallHint);
}

Dataset load_fashion_mnist(const DataConfig& cfg) {
  const std::string root = cfg.root.empty() ? kFashionMnistRoot : cfg.root;
  DDM_CHECK(cfg.split == "train" || cfg.split == "test",
            "data.split is '" << cfg.split << "'; Fashion-MNIST has the splits train and test");
  std::error_code ec;
  DDM_CHECK(std::filesystem::is_directory(root, ec),
            "Fashion-MNIST directory " << root << " not found: " << kInstallHint);
  const std::string prefix = cfg.split == "train" ? "train" : "t10k";
  const std::string img_path = fashion_file(root, prefix + "-images-idx3-ubyte");
  const std::string lab_path = fashion_file(root, prefix + "-labels-idx1-ubyte");

  Dataset ds;
  ds.images = read_idx_images(img_path);
  ds.labels = read_idx_labels(lab_path);
  DDM_CHECK(ds.images.size(0) == ds.labels.size(0),
            img_path << " has " << ds.images.size(0) << " images but " << lab_path << " has "
                     << ds.labels.size(0) << " labels; the files do not belong together");
  DDM_CHECK(ds.labels.numel() == 0 || ds.labels.max().item<int64_t>() < 10,
            lab_path << ": label " << ds.labels.max().item<int64_t>() << " is out of range 0..9");
  ds.num_classes = 10;
  ds.class_names.assign(std::begin(kFashionClasses), std::end(kFashionClasses));
  ds.description = "fashion-mnist " + cfg.split;
  return ds;
}

std::string shape_text(const torch::Tensor& images) {
  return std::to_string(images.size(1)) + "x" + std::to_string(images.size(2)) + "x" +
         std::to_string(images.size(3));
}

}  // namespace

int64_t training_samples(const Dataset& data) {
  if (data.shard_keep) return std::count(data.shard_keep->begin(), data.shard_keep->end(), true);
  return data.shards ? data.shards->samples : data.images.size(0);
}

Dataset load_dataset(const DataConfig& cfg) {
  DDM_CHECK(cfg.limit >= 0, "data.limit is " << cfg.limit << "; it must be >= 0 (0 = all images)");
  Dataset ds;
  if (cfg.source == "fashion-mnist") {
    ds = load_fashion_mnist(cfg);
  } else if (cfg.source == "folder") {
    ds = load_image_folder(cfg.root);
  } else if (cfg.source == "safetensors") {
    ds = load_tensor_file(cfg.root);
  } else if (cfg.source == "shards") {
    DDM_FAIL("data.source = shards: this command reads its data whole, in memory, and shards are only streamed "
             "(by `ddm train`) so far; give it the data the shards were written from, or a safetensors file");
  } else if (cfg.source == "latents") {
    DDM_FAIL("data.source = latents: latent shards (`ddm encode`) are read only by the training of a latent model "
             "(`ddm train` with model.latent); this command needs images: give it the data they were encoded from");
  } else {
    DDM_FAIL("data.source is '" << cfg.source << "'; choose fashion-mnist, folder, safetensors, shards or latents");
  }
  DDM_CHECK(ds.images.dim() == 4 && ds.images.size(0) > 0, ds.description << ": the dataset has no images");
  DDM_CHECK(ds.labels.dim() == 1 && ds.labels.size(0) == ds.images.size(0),
            ds.description << ": " << ds.images.size(0) << " images but " << ds.labels.size(0) << " labels");
  if (cfg.limit > 0 && cfg.limit < ds.images.size(0)) {
    ds.images = ds.images.slice(0, 0, cfg.limit).contiguous();
    ds.labels = ds.labels.slice(0, 0, cfg.limit).contiguous();
    if (!ds.captions.empty()) ds.captions.resize(static_cast<size_t>(cfg.limit));
  }
  if (cfg.source == "fashion-mnist") {
    ds.description += ": " + std::to_string(ds.images.size(0)) + " x " + shape_text(ds.images) + ", 10 classes";
  } else if (cfg.limit > 0) {
    ds.description += " (first " + std::to_string(ds.images.size(0)) + ")";
  }
  return ds;
}

torch::Tensor to_unit_range(const torch::Tensor& images_u8) {
  DDM_CHECK(images_u8.scalar_type() == torch::kUInt8,
            "to_unit_range expects uint8 images, got " << images_u8.scalar_type());
  return images_u8.to(torch::kFloat32).div_(127.5).sub_(1.0);  // 0 -> -1, 255 -> 1 exactly
}

torch::Tensor to_uint8(const torch::Tensor& images) {
  return images.detach().to(torch::kFloat32).add(1.0).mul_(127.5).round_().clamp_(0, 255).to(torch::kUInt8);
}

Batch Batch::rows(int64_t from, int64_t n) const {
  DDM_CHECK(from >= 0 && n >= 0 && from + n <= x.size(0),
            "Batch::rows: rows [" << from << ", " << from + n << ") are not inside a batch of " << x.size(0));
  Batch b;
  b.x = x.narrow(0, from, n);  // [n, C, H, W]
  b.y = y.narrow(0, from, n);  // [n]
  if (k.defined()) b.k = k.narrow(0, from, n);
  if (index.defined()) b.index = index.narrow(0, from, n);
  if (!captions.empty()) b.captions.assign(captions.begin() + from, captions.begin() + from + n);
  if (context.defined()) {
    b.context = context.narrow(0, from, n);            // [n, T, D]
    b.context_mask = context_mask.narrow(0, from, n);  // [n, T]
    b.pooled = pooled.narrow(0, from, n);              // [n, P]
  }
  b.first = first + from;
  return b;
}

Batch Batch::to(torch::Device device) const {
  if (x.device() == device) return *this;
  // From the CPU through pinned memory, so the copy runs asynchronously on the device's stream and
  // the host goes on preparing; the caching host allocator keeps the pinned buffer until it is done.
  auto move = [&](const torch::Tensor& t) { return to_device_async(t, device); };
  Batch b = *this;
  b.x = move(x);
  b.y = move(y);
  b.k = move(k);
  b.context = move(context);
  b.context_mask = move(context_mask);
  b.pooled = move(pooled);
  return b;
}

BatchLoader::BatchLoader(const Dataset& data, int64_t batch_size, uint64_t seed, bool hflip)
    : data_(data), batch_size_(batch_size), seed_(seed), hflip_(hflip) {
  DDM_CHECK(batch_size > 0, "batch size must be > 0, got " << batch_size);
  DDM_CHECK(data.images.defined() && data.images.dim() == 4 && data.images.size(0) > 0 &&
                data.images.scalar_type() == (data.latents ? torch::kFloat32 : torch::kUInt8),
            "BatchLoader needs a non-empty dataset of uint8 [N,C,H,W] images (or float posteriors)");
  DDM_CHECK(!(hflip && data.latents), "BatchLoader: latents are not flipped (a flipped image's latent is not the "
                                      "flip of its latent)");
  DDM_CHECK(data.labels.defined() && data.labels.dim() == 1 && data.labels.size(0) == data.images.size(0),
            "BatchLoader: the dataset has " << data.images.size(0) << " images but "
                                            << (data.labels.defined() ? data.labels.numel() : 0) << " labels");
  DDM_CHECK(data.captions.empty() || static_cast<int64_t>(data.captions.size()) == data.images.size(0),
            "BatchLoader: the dataset has " << data.images.size(0) << " images but " << data.captions.size() << " captions");
}

std::pair<torch::Tensor, torch::Tensor> holdout_split(int64_t n, int64_t holdout, uint64_t seed) {
  DDM_CHECK(holdout >= 0 && holdout < n, "data.holdout = " << holdout << " must be in 0.." << n - 1
                                                          << " (the data has " << n << " images)");
  at::Generator gen = make_generator(derive_seed({seed, static_cast<uint64_t>(RngPurpose::kHoldout)}));
  const torch::Tensor perm = torch::randperm(n, gen, torch::TensorOptions().dtype(torch::kInt64));
  return {std::get<0>(perm.narrow(0, holdout, n - holdout).sort()), std::get<0>(perm.narrow(0, 0, holdout).sort())};
}

void BatchLoader::set_cursor(const Cursor& c) {
  const int64_t n = data_.images.size(0);
  DDM_CHECK(c.epoch >= 0 && c.index >= 0 && c.index < n,
            "data cursor (epoch " << c.epoch << ", index " << c.index << ") is out of range for a dataset of "
                                  << n << " images; the checkpoint belongs to a different dataset or data.limit");
  cursor_ = c;
}

Batch BatchLoader::peek(int64_t begin, int64_t count) {
  const Cursor at = cursor_;
  Batch b = next(begin, count);
  cursor_ = at;
  return b;
}

void BatchLoader::ensure_perm() {
  if (perm_epoch_ == cursor_.epoch) return;
  at::Generator gen = make_generator(
      derive_seed({seed_, static_cast<uint64_t>(RngPurpose::kDataOrder), static_cast<uint64_t>(cursor_.epoch)}));
  perm_ = torch::randperm(data_.images.size(0), gen, torch::TensorOptions().dtype(torch::kInt64));
  perm_epoch_ = cursor_.epoch;
}

Batch BatchLoader::next(int64_t begin, int64_t count) {
  if (count < 0) count = batch_size_ - begin;
  DDM_CHECK(begin >= 0 && count > 0 && begin + count <= batch_size_,
            "BatchLoader::next: shard [" << begin << ", " << begin + count << ") is not inside the batch of "
                                         << batch_size_);
  const int64_t n = data_.images.size(0);
  std::vector<torch::Tensor> pieces;
  std::vector<uint8_t> flip;
  if (hflip_) flip.reserve(static_cast<size_t>(batch_size_));
  int64_t need = batch_size_;
  while (need > 0) {
    ensure_perm();
    const int64_t take = std::min(need, n - cursor_.index);
    pieces.push_back(perm_.slice(0, cursor_.index, cursor_.index + take));
    if (hflip_) {
      // One fair coin per (seed, epoch, position), from the same SplitMix hash that seeds generators.
      for (int64_t i = cursor_.index; i < cursor_.index + take; ++i) {
        const uint64_t h = derive_seed({seed_, static_cast<uint64_t>(RngPurpose::kFlip),
                                        static_cast<uint64_t>(cursor_.epoch), static_cast<uint64_t>(i)});
        flip.push_back(static_cast<uint8_t>(h >> 63));
      }
    }
    need -= take;
    cursor_.index += take;
    if (cursor_.index == n) {
      cursor_.epoch += 1;
      cursor_.index = 0;
    }
  }
  const torch::Tensor idx = (pieces.size() == 1 ? pieces[0] : torch::cat(pieces)).slice(0, begin, begin + count);
  torch::Tensor x = data_.images.index_select(0, idx);  // uint8 [b, C, H, W] (latents: float [b, 2z, h, w])
  if (hflip_) {
    // from_blob wraps `flip` (alive until return); .to(kBool) copies it out in any case.
    const torch::Tensor mask = torch::from_blob(flip.data() + begin, {count}, torch::TensorOptions().dtype(torch::kUInt8))
                                   .to(torch::kBool)
                                   .view({count, 1, 1, 1});
    x = torch::where(mask, x.flip({3}), x);
  }
  Batch b;
  b.first = begin;
  b.x = data_.latents ? x : to_unit_range(x);    // float [B, C, H, W] in [-1, 1] (latents: as they are)
  b.y = data_.labels.index_select(0, idx);       // int64 [B]
  if (data_.clusters.defined()) b.k = data_.clusters.index_select(0, idx);  // int64 [B]
  b.index = idx;                                                              // int64 [B]
  if (!data_.captions.empty()) {
    const int64_t* p = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) b.captions.push_back(data_.captions[static_cast<size_t>(p[i])]);
  }
  return b;
}

}  // namespace ddm
