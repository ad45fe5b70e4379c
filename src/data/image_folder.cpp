// Image-folder datasets (see image_folder.h). stb_image's implementation lives in libstb.so, so
// this file only includes the declarations (no STB_IMAGE_IMPLEMENTATION).
#include "data/image_folder.h"

#include <stb_image.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/fileio.h"
#include "data/captions.h"
#include "data/decode.h"

namespace ddm {
namespace fs = std::filesystem;
namespace {

struct StbFree {
  void operator()(unsigned char* p) const { stbi_image_free(p); }
};

// Sorted names of entries in `dir` that are directories (want_dirs) or regular files, skipping
// hidden entries.
std::vector<std::string> list_sorted(const std::string& dir, bool want_dirs) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    std::error_code ec2;
    const bool is_dir = it->is_directory(ec2);
    if (want_dirs ? is_dir : (!is_dir && it->is_regular_file(ec2))) names.push_back(name);
  }
  DDM_CHECK(!ec, dir << ": cannot list directory: " << ec.message());
  std::sort(names.begin(), names.end());
  return names;
}

// `dir` and every folder below it (hidden ones skipped), as paths.
void folders_below(const std::string& dir, std::vector<std::string>& out, int depth = 0) {
  DDM_CHECK(depth < 32, dir << ": folders nested more than 32 deep (a symbolic link to a folder above it?)");
  out.push_back(dir);
  for (const auto& sub : list_sorted(dir, true)) folders_below(dir + "/" + sub, out, depth + 1);
}

// The image files anywhere below `dir` (sub-folders included), in torchvision's ImageFolder order:
// the folders sorted by their paths, each folder's files by name.
std::vector<std::string> images_below(const std::string& dir) {
  std::vector<std::string> folders, out;
  folders_below(dir, folders);
  std::sort(folders.begin(), folders.end());
  for (const auto& folder : folders)
    for (const auto& f : list_sorted(folder, false))
      if (is_image_file_name(f)) out.push_back(folder + "/" + f);
  return out;
}

// Files named as images of formats ddm does not decode (a phone's HEIC, a scanner's TIFF, a camera's
// raw): in `dir` alone, or below it too. A folder dataset leaves them out, which a note says.
std::vector<std::string> other_image_formats(const std::string& dir, bool below) {
  static const char* kExt[] = {".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl", ".jp2",
                               ".dng", ".cr2",  ".cr3",  ".nef",  ".arw",  ".raf", ".svg"};
  std::vector<std::string> folders{dir}, out;
  if (below) {
    folders.clear();
    folders_below(dir, folders);
  }
  for (const auto& folder : folders)
    for (const auto& f : list_sorted(folder, false)) {
      std::string lower = f;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
      for (const char* e : kExt)
        if (lower.size() > std::strlen(e) && lower.compare(lower.size() - std::strlen(e), std::strlen(e), e) == 0)
          out.push_back(folder + "/" + f);
    }
  return out;
}

// For a PNG, the first chunk whose length field runs past the end of the file, as an error text
// ("" if none, or if the bytes are not a PNG). stb allocates a chunk's stated length (up to 1 GB)
// before it reads the chunk, so an 80-byte file could make it allocate 300 MB.
std::string png_chunk_past_end(const std::string& bytes) {
  static const char kMagic[] = "\x89PNG\r\n\x1a\n";
  if (bytes.compare(0, 8, kMagic, 8) != 0) return "";
  for (size_t at = 8; at + 8 <= bytes.size();) {
    uint64_t len = 0;
    for (size_t i = 0; i < 4; ++i) len = (len << 8) | static_cast<unsigned char>(bytes[at + i]);
    if (len + 12 > bytes.size() - at) {
      return "PNG chunk at byte " + std::to_string(at) + " claims " + std::to_string(len) + " bytes, more than the " +
             std::to_string(bytes.size() - at) + " left in the file (truncated or corrupt)";
    }
    if (bytes.compare(at + 4, 4, "IEND") == 0) break;
    at += 12 + len;
  }
  return "";
}

// The decoder of data/decode.h for bytes that begin as a JPEG or a WebP file does ("jpg", "webp"), or
// "" for the rest, which stb decodes. By content, not by name, as stb does.
std::string shard_decoder_type(const std::string& bytes) {
  if (bytes.size() >= 3 && bytes.compare(0, 3, "\xff\xd8\xff", 3) == 0) return "jpg";
  if (bytes.size() >= 12 && bytes.compare(0, 4, "RIFF") == 0 && bytes.compare(8, 4, "WEBP") == 0) return "webp";
  return "";
}

std::string shape_str(const torch::Tensor& chw) {
  return std::to_string(chw.size(0)) + "x" + std::to_string(chw.size(1)) + "x" + std::to_string(chw.size(2));
}

// uint8 [..., C, H, W] -> [..., wanted, H, W]: an alpha channel dropped (as tar shards drop it),
// grey repeated into RGB. `wanted` is 1 or 3, and at least C's colour (no RGB to grey here).
torch::Tensor folder_channels(const torch::Tensor& img, int64_t wanted) {
  const int64_t d = img.dim() - 3, c = img.size(d);
  torch::Tensor x = c == 2 || c == 4 ? img.narrow(d, 0, c - 1) : img;
  if (x.size(d) == 1 && wanted == 3) {
    std::vector<int64_t> times(static_cast<size_t>(x.dim()), 1);
    times[static_cast<size_t>(d)] = 3;
    x = x.repeat(times);
  }
  return x.contiguous();
}

// "12 RGB and 3 RGBA images": how many of each channel count a folder mixes (counts[c], c = 1..4).
std::string channel_mix(const std::vector<int64_t>& counts) {
  static const char* const kNames[] = {"", "grey", "grey+alpha", "RGB", "RGBA"};
  std::vector<std::string> parts;
  for (int c = 1; c <= 4; ++c)
    if (counts[static_cast<size_t>(c)] > 0) parts.push_back(std::to_string(counts[static_cast<size_t>(c)]) + " " + kNames[c]);
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : i + 1 == parts.size() ? " and " : ", ") + parts[i];
  return out + " images";
}

}  // namespace

bool is_image_file_name(const std::string& name) {
  static const char* kExt[] = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tga", ".gif",
                               ".psd", ".pnm", ".ppm", ".pgm", ".hdr", ".pic"};
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* e : kExt) {
    const size_t n = std::strlen(e);
    if (lower.size() > n && lower.compare(lower.size() - n, n, e) == 0) return true;
  }
  return false;
}

torch::Tensor read_image(const std::string& path) {
  int w = 0, h = 0, c = 0;
  const std::string bytes = read_file(path);  // read once; stb decodes from memory
  DDM_CHECK(bytes.size() <= static_cast<size_t>(std::numeric_limits<int>::max()),
            path << ": " << bytes.size() << " bytes is too large for an image file (replace or remove it)");
  const std::string type = shard_decoder_type(bytes);
  if (!type.empty()) {
    // JPEG and WebP decode as in tar shards: libturbojpeg reads what libjpeg (and so Pillow) reads,
    // CMYK and arithmetic-coded files among them, with its accurate IDCT, so that a folder and a
    // shard of the same files give the same pixels; stb reads no WebP. Neither keeps an alpha channel.
    torch::Tensor chw = decode_image(bytes, type, image_channels(bytes, type, path), path);  // [C, H, W], a view
    DDM_CHECK(chw.size(1) * chw.size(2) <= kMaxImagePixels,
              path << ": image is " << chw.size(2) << "x" << chw.size(1) << " pixels, more than the " << kMaxImagePixels
                   << " (4096x4096) that ddm reads; downscale it (or remove it)");
    return chw.contiguous();
  }
  const auto* data = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int len = static_cast<int>(bytes.size());
  // stb allocates what the header says before it reads any pixel: a 20-byte file can claim a
  // 30000 x 30000 image (and a truncated TGA then decodes to zeros). Check the size first.
  if (stbi_info_from_memory(data, len, &w, &h, &c) && static_cast<int64_t>(w) * h > kMaxImagePixels) {
    DDM_FAIL(path << ": image is " << w << "x" << h << " pixels, more than the " << kMaxImagePixels
                  << " (4096x4096) that ddm reads; downscale it (or remove it)");
  }
  const std::string bad_chunk = png_chunk_past_end(bytes);
  DDM_CHECK(bad_chunk.empty(), path << ": cannot decode image: " << bad_chunk << " (replace or remove it)");
  std::unique_ptr<unsigned char, StbFree> pixels(stbi_load_from_memory(data, len, &w, &h, &c, 0));
  if (!pixels) {
    const char* reason = stbi_failure_reason();
    DDM_FAIL(path << ": cannot decode image: " << (reason ? reason : "unknown reason")
                  << " (is it a valid PNG/JPEG/BMP/TGA/GIF file? replace or remove it)");
  }
  DDM_CHECK(w > 0 && h > 0 && c >= 1 && c <= 4, path << ": decoded to an unusable shape " << w << "x" << h
                                                      << " with " << c << " channels");
  // from_blob only wraps stb's buffer, which is freed on return: clone() always copies (contiguous() would
  // not for one channel, where [H, W, 1] -> [1, H, W] is already contiguous).
  auto hwc = torch::from_blob(pixels.get(), {h, w, c}, torch::TensorOptions().dtype(torch::kUInt8));
  return hwc.permute({2, 0, 1}).clone(torch::MemoryFormat::Contiguous);  // [C, H, W], owns its memory
}

torch::Tensor read_image_tiles(const std::string& path, int64_t size, const std::string& what) {
  torch::Tensor img = read_image(path);  // [C, H, W]
  const int64_t h = img.size(1), w = img.size(2);
  DDM_CHECK(size > 0 && h % size == 0 && w % size == 0, what << " " << path << ": the image is " << w << "x" << h
                                                             << " pixels; give one " << size << "x" << size
                                                             << " image, or a grid of them without margins");
  if (img.size(0) == 2 || img.size(0) == 4) img = img.narrow(0, 0, img.size(0) - 1);  // drop alpha
  const int64_t c = img.size(0);
  return img.reshape({c, h / size, size, w / size, size}).permute({1, 3, 0, 2, 4}).reshape({-1, c, size, size});  // [N, C, S, S]
}

Dataset load_image_folder(const std::string& root) {
  DDM_CHECK(!root.empty(), "data.root is empty: set it to a folder of images (one sub-folder per class, or the images "
                           "themselves)");
  std::error_code ec;
  DDM_CHECK(fs::is_directory(root, ec), root << ": image folder not found (set data.root to a directory "
                                             << "of images: one sub-folder per class, or the images themselves)");

  Dataset ds;
  std::vector<std::pair<std::string, int64_t>> files;  // (path, label)
  const std::vector<std::string> classes = list_sorted(root, /*want_dirs=*/true);
  if (classes.empty()) {
    for (const auto& f : list_sorted(root, false))
      if (is_image_file_name(f)) files.emplace_back(root + "/" + f, 0);
  } else {
    for (const auto& f : list_sorted(root, false)) {
      DDM_CHECK(!is_image_file_name(f), root << "/" << f << ": image next to class sub-folders; move it into "
                                             << "the sub-folder of its class (or remove it)");
    }
    for (size_t k = 0; k < classes.size(); ++k) {
      const std::string dir = root + "/" + classes[k];
      std::vector<std::string> images = images_below(dir);
      for (auto& f : images) files.emplace_back(std::move(f), static_cast<int64_t>(k));
      DDM_CHECK(!images.empty(), dir << ": class folder '" << classes[k] << "' contains no images, nor do its "
                                     << "sub-folders (add images or remove the folder)");
    }
    ds.num_classes = static_cast<int64_t>(classes.size());
    ds.class_names = classes;
  }
  std::vector<std::string> others;
  if (classes.empty()) {
    others = other_image_formats(root, false);
  } else {
    for (const auto& c : classes)
      for (auto& f : other_image_formats(root + "/" + c, true)) others.push_back(std::move(f));
  }
  if (!others.empty())
    std::cerr << "note: " << root << ": " << others.size() << (others.size() == 1 ? " file is an image" : " files are images")
              << " of a format ddm does not read, left out (" << others.front() << (others.size() > 1 ? ", ..." : "")
              << "): convert " << (others.size() == 1 ? "it" : "them") << " to PNG or JPEG to train on "
              << (others.size() == 1 ? "it" : "them") << std::endl;
  DDM_CHECK(!files.empty(), root << ": no images found (expected .png/.jpg/... files, in one sub-folder per "
                                 << "class or directly in the folder)");

  const int64_t n = static_cast<int64_t>(files.size());
  torch::Tensor first = read_image(files[0].first);
  // A folder of one channel count keeps it exactly; one that mixes them (some PNGs with alpha, some
  // grey) reads every image as RGB (or grey, if none has colour), alpha dropped, as tar shards do.
  int64_t channels = first.size(0);
  std::vector<int64_t> counts(5, 0);
  ++counts[static_cast<size_t>(channels)];
  ds.images = torch::empty({n, first.size(0), first.size(1), first.size(2)},
                           torch::TensorOptions().dtype(torch::kUInt8));
  ds.images[0].copy_(first);
  ds.labels = torch::empty({n}, torch::TensorOptions().dtype(torch::kInt64));
  auto lab = ds.labels.accessor<int64_t, 1>();
  lab[0] = files[0].second;
  for (int64_t i = 1; i < n; ++i) {
    torch::Tensor img = read_image(files[i].first);
    DDM_CHECK(img.size(1) == first.size(1) && img.size(2) == first.size(2),
              files[i].first << ": image is " << shape_str(img) << " (channels x height x width) but "
                             << files[0].first << " is " << shape_str(first)
                             << "; all images in a folder dataset must share their size. "
                             << (ds.num_classes > 0 || fs::exists(fs::path(root) / "captions.jsonl")
                                     // (a tar of class folders would lose its labels, one with captions.jsonl its captions)
                                     ? "Resize them to one size (e.g. mogrify -resize 64x64^ -gravity center -extent "
                                       "64x64 on a copy)"
                                     : "Images of mixed sizes train from a tar shard, which crops and "
                                       "resizes each: tar --sort=name -cf images-000000.tar -C " + root +
                                           " . and data.source = \"shards\", data.root = that tar, data.resolution = "
                                           "the side to train at (docs/data.md)"));
    ++counts[static_cast<size_t>(img.size(0))];
    if (img.size(0) != channels) {
      const int64_t wanted = channels >= 3 || img.size(0) >= 3 ? 3 : 1;
      if (wanted != channels) ds.images = folder_channels(ds.images, wanted);  // the rows read so far
      channels = wanted;
      img = folder_channels(img, wanted);
    }
    ds.images[i].copy_(img);
    lab[i] = files[i].second;
  }
  if (std::count_if(counts.begin(), counts.end(), [](int64_t k) { return k > 0; }) > 1)
    std::cerr << "note: " << root << ": " << channel_mix(counts) << ": each is read as " << (channels == 3 ? "RGB" : "grey")
              << (counts[2] + counts[4] > 0 ? ", its alpha dropped" : "")
              << (channels == 3 && counts[1] + counts[2] > 0 ? ", grey repeated in red, green and blue" : "")
              << " (as tar shards read them)" << std::endl;
  std::vector<std::string> paths;
  for (const auto& f : files) paths.push_back(f.first);
  ds.captions = folder_captions(root, paths);
  ds.description = "folder " + root + ": " + std::to_string(n) + " x " + shape_str(ds.images[0]) + ", " +
                   (ds.num_classes > 1 ? std::to_string(ds.num_classes) + " classes"
                    : ds.num_classes == 1 ? std::string("1 class")
                                          : std::string("unlabeled")) +
                   (ds.captions.empty() ? "" : ", captioned");
  return ds;
}

}  // namespace ddm
