// safetensors-backed datasets (see tensor_file.h for the layout rule).
#include "data/tensor_file.h"

#include <filesystem>

#include "core/error.h"
#include "core/safetensors.h"

namespace ddm {
namespace {
constexpr int64_t kMaxClasses = 1 << 16;  // a class-embedding row each; far beyond any real label set

bool is_channel_count(int64_t d) { return d == 1 || d == 3 || d == 4; }

bool is_integer_dtype(torch::ScalarType t) {
  return t == torch::kUInt8 || t == torch::kInt8 || t == torch::kInt16 || t == torch::kInt32 || t == torch::kInt64;
}

}  // namespace

bool images_look_nhwc(const std::vector<int64_t>& sizes) {
  return sizes.size() == 4 && is_channel_count(sizes[3]) && !is_channel_count(sizes[1]);
}

Dataset load_tensor_file(const std::string& path, bool every_class) {
  DDM_CHECK(!path.empty(), "data.root is empty: set it to a .safetensors file with an 'images' tensor");
  std::error_code ec;
  DDM_CHECK(std::filesystem::is_regular_file(path, ec),
            path << ": safetensors dataset file not found (set data.root to a .safetensors file with an "
                 << "'images' tensor)");
  SafetensorsFile file = load_safetensors(path);

  auto it = file.tensors.find("images");
  DDM_CHECK(it != file.tensors.end(), path << ": no tensor named 'images' (expected uint8 [N,C,H,W] or [N,H,W,C])");
  torch::Tensor images = it->second;
  DDM_CHECK(images.scalar_type() == torch::kUInt8,
            path << ": tensor 'images' has dtype " << images.scalar_type()
                 << ", expected uint8 (U8) pixels in 0..255; convert the images before saving");
  DDM_CHECK(images.dim() == 4, path << ": tensor 'images' has rank " << images.dim() << " (shape "
                                    << images.sizes() << "), expected rank 4: [N,C,H,W] or [N,H,W,C]");

  bool nhwc = images_look_nhwc(images.sizes().vec());
  auto layout = file.metadata.find("layout");
  if (layout != file.metadata.end()) {
    DDM_CHECK(layout->second == "NCHW" || layout->second == "NHWC",
              path << ": metadata 'layout' is '" << layout->second << "', expected NCHW or NHWC");
    nhwc = layout->second == "NHWC";
  }
  if (nhwc) images = images.permute({0, 3, 1, 2}).contiguous();  // [N, C, H, W]
  DDM_CHECK(images.size(1) >= 1 && images.size(1) <= 4,
            path << ": tensor 'images' " << it->second.sizes() << " read as " << (nhwc ? "NHWC" : "NCHW")
                 << " has " << images.size(1) << " channels, expected 1..4; store it as [N,C,H,W] or "
                 << "[N,H,W,C], or set __metadata__ layout to NCHW or NHWC");
  DDM_CHECK(images.size(0) > 0 && images.size(2) > 0 && images.size(3) > 0,
            path << ": tensor 'images' " << it->second.sizes() << " is empty");
  const int64_t n = images.size(0);

  Dataset ds;
  ds.images = images;
  auto lab = file.tensors.find("labels");
  if (lab == file.tensors.end()) {
    ds.labels = torch::zeros({n}, torch::TensorOptions().dtype(torch::kInt64));
  } else {
    const torch::Tensor& l = lab->second;
    DDM_CHECK(is_integer_dtype(l.scalar_type()),
              path << ": tensor 'labels' has dtype " << l.scalar_type() << ", expected an integer type");
    DDM_CHECK(l.dim() == 1, path << ": tensor 'labels' has shape " << l.sizes() << ", expected 1-D [N]");
    DDM_CHECK(l.size(0) == n, path << ": tensor 'labels' has " << l.size(0) << " entries but 'images' has " << n
                                   << " images; they must match one to one");
    ds.labels = l.to(torch::kInt64);
    const int64_t lo = ds.labels.min().item<int64_t>();
    const int64_t hi = ds.labels.max().item<int64_t>();
    DDM_CHECK(lo >= 0, path << ": tensor 'labels' contains the negative label " << lo);
    DDM_CHECK(hi < kMaxClasses, path << ": tensor 'labels' contains the label " << hi << "; ddm supports at most "
                                     << kMaxClasses << " classes, numbered 0..K-1");
    ds.num_classes = hi + 1;
    auto nc = file.metadata.find("num_classes");
    if (nc != file.metadata.end()) {
      int64_t v = 0;
      try {
        size_t used = 0;
        v = std::stoll(nc->second, &used);
        DDM_CHECK(used == nc->second.size(), "");
      } catch (const std::exception&) {
        DDM_FAIL(path << ": metadata 'num_classes' is '" << nc->second << "', expected an integer");
      }
      DDM_CHECK(v > hi, path << ": metadata 'num_classes' is " << v << " but the largest label is " << hi);
      DDM_CHECK(v <= kMaxClasses, path << ": metadata 'num_classes' is " << v << "; ddm supports at most "
                                       << kMaxClasses << " classes");
      ds.num_classes = v;
    } else if (every_class) {
      // Without metadata the class count is inferred as largest label + 1; a gap (labels 0, 1, 100000)
      // would silently make a model with thousands of classes that have no images.
      const torch::Tensor counts = torch::bincount(ds.labels, {}, ds.num_classes);
      const int64_t empty = counts.eq(0).sum().item<int64_t>();
      DDM_CHECK(empty == 0, path << ": labels imply " << ds.num_classes << " classes (largest label " << hi << "), but "
                                 << empty << " of them have no image (the first is class "
                                 << counts.eq(0).nonzero()[0][0].item<int64_t>()
                                 << "); number the classes 0..K-1, or set the metadata 'num_classes' if empty classes "
                                    "are intended");
    }
    for (int64_t k = 0; k < ds.num_classes; ++k) ds.class_names.push_back("class " + std::to_string(k));
  }
  ds.description = "safetensors " + path + ": " + std::to_string(n) + " x " + std::to_string(images.size(1)) +
                   "x" + std::to_string(images.size(2)) + "x" + std::to_string(images.size(3)) + ", " +
                   (ds.num_classes ? std::to_string(ds.num_classes) + " classes" : std::string("unlabeled"));
  return ds;
}

}  // namespace ddm
