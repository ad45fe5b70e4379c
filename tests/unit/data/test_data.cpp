// Tests for the data layer: real Fashion-MNIST, hand-made IDX/gzip, PNG-folder and safetensors
// fixtures (good and broken, each error message checked), and BatchLoader's determinism, resume,
// epoch coverage, epoch-boundary behaviour and flips.
#include <gtest/gtest.h>

#include <stb_image_write.h>
#include <zlib.h>

#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/fileio.h"
#include "core/safetensors.h"
#include "data/dataset.h"
#include "data/image_folder.h"
#include "data/tensor_file.h"
#include "test_util.h"

namespace {

using ddm::DataConfig;
using ddm::Dataset;
namespace fs = std::filesystem;

// ---- fixtures ---------------------------------------------------------------------------------

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

void put_be32(std::string& s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, const std::string& payload) {
  std::string s;
  put_be32(s, magic);
  for (uint32_t d : dims) put_be32(s, d);
  return s + payload;
}

// n images of 4x4 with pixel value (17 * i + j) % 256, and labels i % 10.
std::string image_payload(uint32_t n) {
  std::string p;
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t j = 0; j < 16; ++j) p.push_back(static_cast<char>((17 * i + j) % 256));
  return p;
}
std::string label_payload(uint32_t n) {
  std::string p;
  for (uint32_t i = 0; i < n; ++i) p.push_back(static_cast<char>(i % 10));
  return p;
}

// A Fashion-MNIST-shaped directory with n images and m labels.
void write_fmnist(const std::string& dir, uint32_t n, uint32_t m) {
  fs::create_directories(dir);
  write_gz(dir + "/train-images-idx3-ubyte.gz", idx_bytes(0x803, {n, 4, 4}, image_payload(n)));
  write_gz(dir + "/train-labels-idx1-ubyte.gz", idx_bytes(0x801, {m}, label_payload(m)));
}

DataConfig fmnist_cfg(const std::string& root) {
  DataConfig c;
  c.source = "fashion-mnist";
  c.root = root;
  return c;
}

// Runs load_dataset and returns the error message ("" if it did not throw).
std::string load_error(const DataConfig& cfg) {
  try {
    ddm::load_dataset(cfg);
  } catch (const ddm::Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (msg)

void write_png(const std::string& path, int w, int h, int c, uint8_t base) {
  std::vector<uint8_t> px(static_cast<size_t>(w * h * c));
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(base + 3 * i);
  ASSERT_NE(stbi_write_png(path.c_str(), w, h, c, px.data(), w * c), 0) << path;
}

// data.source = "folder" at `root`.
DataConfig folder_source(const std::string& root) {
  DataConfig c;
  c.source = "folder";
  c.root = root;
  return c;
}

// ---- Fashion-MNIST (real files from the Debian package) ---------------------------------------

TEST(FashionMnist, RealTrainAndTestSplits) {
  Dataset train = ddm::load_dataset(fmnist_cfg(""));  // default root
  ASSERT_EQ(train.images.sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(train.images.scalar_type(), torch::kUInt8);
  EXPECT_EQ(train.labels.scalar_type(), torch::kInt64);
  EXPECT_EQ(train.labels.size(0), 60000);
  EXPECT_EQ(train.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(train.labels.max().item<int64_t>(), 9);
  EXPECT_EQ(train.num_classes, 10);
  ASSERT_EQ(train.class_names.size(), 10u);
  EXPECT_EQ(train.class_names[0], "T-shirt/top");
  EXPECT_EQ(train.class_names[9], "Ankle boot");
  // Checked independently with Python's gzip module: first labels 9 0 0 3, first image sums to 76247.
  EXPECT_EQ(train.labels[0].item<int64_t>(), 9);
  EXPECT_EQ(train.labels[3].item<int64_t>(), 3);
  EXPECT_EQ(train.images[0].sum().item<int64_t>(), 76247);
  EXPECT_EQ(torch::bincount(train.labels).min().item<int64_t>(), 6000);  // balanced classes
  EXPECT_NE(train.description.find("60000"), std::string::npos) << train.description;

  DataConfig c = fmnist_cfg(ddm::kFashionMnistRoot);
  c.split = "test";
  c.limit = 100;
  Dataset test = ddm::load_dataset(c);
  ASSERT_EQ(test.images.sizes(), (std::vector<int64_t>{100, 1, 28, 28}));
  EXPECT_TRUE(torch::equal(test.labels.slice(0, 0, 4), torch::tensor({9, 2, 1, 1}, torch::kInt64)));
  c.limit = 0;
  EXPECT_EQ(ddm::load_dataset(c).images.size(0), 10000);
}

// ---- IDX / gzip errors ------------------------------------------------------------------------

TEST(Idx, SmallFixtureLoads) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 5);
  Dataset d = ddm::load_dataset(fmnist_cfg(dir / "fm"));
  ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{5, 1, 4, 4}));
  EXPECT_EQ(d.images[2][0][1][3].item<int>(), 17 * 2 + 7);
  EXPECT_TRUE(torch::equal(d.labels, torch::arange(5, torch::kInt64)));
}

TEST(Idx, MissingDirectoryNamesThePackage) {
  ddm::test::TempDir dir;
  const std::string msg = load_error(fmnist_cfg(dir / "nope"));
  EXPECT_HAS(msg, dir / "nope");
  EXPECT_HAS(msg, "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist)");
  EXPECT_HAS(msg, "data.root");
  fs::create_directories(dir / "empty");
  EXPECT_HAS(load_error(fmnist_cfg(dir / "empty")), "train-images-idx3-ubyte.gz not found");
}

TEST(Idx, WrongMagic) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 5);
  write_gz(dir / "fm/train-images-idx3-ubyte.gz", idx_bytes(0x801, {80}, image_payload(5)));
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "train-images-idx3-ubyte.gz");
  EXPECT_HAS(msg, "wrong IDX magic 0x00000801, expected 0x00000803");
}

TEST(Idx, TruncatedGzipPayload) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 200, 200);
  const std::string path = dir / "fm/train-images-idx3-ubyte.gz";
  const std::string gz = ddm::read_file(path);
  ddm::test::write_text(path, gz.substr(0, gz.size() / 2));
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "train-images-idx3-ubyte.gz");
  EXPECT_HAS(msg, "truncated");
  EXPECT_HAS(msg, "unexpected end of file");
}

TEST(Idx, CorruptGzipStream) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 200, 200);
  const std::string path = dir / "fm/train-images-idx3-ubyte.gz";
  std::string gz = ddm::read_file(path);
  for (size_t i = 20; i < 60; ++i) gz[i] = static_cast<char>(gz[i] ^ 0x5a);
  ddm::test::write_text(path, gz);
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "train-images-idx3-ubyte.gz");
  EXPECT_HAS(msg, "corrupt");
}

TEST(Idx, TruncatedIdxData) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 5);
  write_gz(dir / "fm/train-images-idx3-ubyte.gz", idx_bytes(0x803, {5, 4, 4}, image_payload(3)));
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "train-images-idx3-ubyte.gz");
  EXPECT_HAS(msg, "IDX data truncated: header promises 80 bytes, file has 48");
  // Header cut inside the dimensions.
  write_gz(dir / "fm/train-images-idx3-ubyte.gz", idx_bytes(0x803, {5}, ""));
  EXPECT_HAS(load_error(fmnist_cfg(dir / "fm")), "IDX header truncated");
}

TEST(Idx, HugeDimensionsInAShortFileAreTruncationNotAnAllocation) {
  // Found by fuzzing: a 20-byte file whose header promised 52 GB made the reader allocate it all
  // before reading (std::bad_alloc / c10::Error, or an out-of-memory abort under ASan).
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 5);
  write_gz(dir / "fm/train-images-idx3-ubyte.gz", idx_bytes(0x803, {1u << 24, 1u << 8, 1u << 8}, "\x01\x02"));
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "train-images-idx3-ubyte.gz");
  EXPECT_HAS(msg, "IDX data truncated: header promises 1099511627776 bytes, file has 2");
}

TEST(Idx, ZeroImagesOfAnAbsurdSizeAreCorrupt) {
  // Found by fuzzing: 0 images of 4294967295 x 4284219391 pixels passed the size check (0 bytes),
  // and the strides of that tensor overflowed in LibTorch (c10::Error, not a ddm::Error).
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 5);
  write_gz(dir / "fm/train-images-idx3-ubyte.gz", idx_bytes(0x803, {0, 0xffffffffu, 0xff5bffffu}, ""));
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "train-images-idx3-ubyte.gz: IDX dimensions are implausibly large; the file is corrupt");
}

TEST(Idx, TrailingBytesAndUncompressedFiles) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 5);
  write_gz(dir / "fm/train-labels-idx1-ubyte.gz", idx_bytes(0x801, {5}, label_payload(6)));
  EXPECT_HAS(load_error(fmnist_cfg(dir / "fm")), "unexpected bytes after the 5 bytes of IDX data");
  // An unpacked copy (no .gz) is read as well.
  fs::remove(dir / "fm/train-labels-idx1-ubyte.gz");
  ddm::test::write_text(dir / "fm/train-labels-idx1-ubyte", idx_bytes(0x801, {5}, label_payload(5)));
  EXPECT_EQ(ddm::load_dataset(fmnist_cfg(dir / "fm")).labels.size(0), 5);
}

TEST(Idx, ImageLabelCountMismatch) {
  ddm::test::TempDir dir;
  write_fmnist(dir / "fm", 5, 4);
  const std::string msg = load_error(fmnist_cfg(dir / "fm"));
  EXPECT_HAS(msg, "has 5 images but");
  EXPECT_HAS(msg, "train-labels-idx1-ubyte.gz has 4 labels");
}

TEST(DataConfigErrors, BadSourceSplitAndLimit) {
  DataConfig c;
  c.source = "imagenet";
  EXPECT_HAS(load_error(c), "data.source is 'imagenet'");
  c = fmnist_cfg("");
  c.split = "val";
  EXPECT_HAS(load_error(c), "data.split is 'val'");
  c = fmnist_cfg("");
  c.limit = -1;
  EXPECT_HAS(load_error(c), "data.limit is -1");
}

// ---- image folders ----------------------------------------------------------------------------

TEST(ImageFolder, LoadsClassesInSortedOrder) {
  ddm::test::TempDir dir;
  for (const char* cls : {"zebra", "ant", "moth"}) fs::create_directories(dir / ("imgs/" + std::string(cls)));
  write_png(dir / "imgs/zebra/b.png", 5, 4, 3, 10);
  write_png(dir / "imgs/zebra/a.png", 5, 4, 3, 20);
  write_png(dir / "imgs/ant/x.png", 5, 4, 3, 30);
  write_png(dir / "imgs/moth/y.PNG", 5, 4, 3, 40);
  ddm::test::write_text(dir / "imgs/moth/notes.txt", "not an image");
  DataConfig c;
  c.source = "folder";
  c.root = dir / "imgs";
  Dataset d = ddm::load_dataset(c);
  ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{4, 3, 4, 5}));
  EXPECT_EQ(d.class_names, (std::vector<std::string>{"ant", "moth", "zebra"}));
  EXPECT_EQ(d.num_classes, 3);
  EXPECT_TRUE(torch::equal(d.labels, torch::tensor({0, 1, 2, 2}, torch::kInt64)));
  // zebra/a.png (base 20) precedes zebra/b.png; pixel (c=1, y=0, x=0) is HWC index 1.
  EXPECT_EQ(d.images[2][1][0][0].item<int>(), 20 + 3);
  EXPECT_EQ(d.images[3][0][1][0].item<int>(), 10 + 3 * 15);
}

// A class's pictures in sub-folders of its folder are the class's (torchvision's ImageFolder reads
// them so): once they were skipped without a word, and a class folder holding only sub-folders was
// "empty".
TEST(ImageFolder, PicturesInSubFoldersOfAClassFolderAreThatClasss) {
  ddm::test::TempDir dir;
  fs::create_directories(dir / "imgs/cat/indoor/sofa");
  fs::create_directories(dir / "imgs/dog/park");
  fs::create_directories(dir / "imgs/dog/.thumbs");
  write_png(dir / "imgs/cat/indoor/sofa/a.png", 5, 4, 3, 10);
  write_png(dir / "imgs/cat/b.png", 5, 4, 3, 20);
  write_png(dir / "imgs/dog/park/c.png", 5, 4, 3, 30);
  write_png(dir / "imgs/dog/.thumbs/hidden.png", 5, 4, 3, 40);
  fs::create_directories(dir / "imgs/cat/x/z");
  fs::create_directories(dir / "imgs/cat/x-y");
  write_png(dir / "imgs/cat/x/z/f.png", 5, 4, 3, 60);
  write_png(dir / "imgs/cat/x-y/e.png", 5, 4, 3, 50);
  const DataConfig c = folder_source(dir / "imgs");
  Dataset d = ddm::load_dataset(c);
  EXPECT_EQ(d.class_names, (std::vector<std::string>{"cat", "dog"}));
  ASSERT_EQ(d.images.size(0), 5);  // not the hidden folder's
  EXPECT_TRUE(torch::equal(d.labels, torch::tensor({0, 0, 0, 0, 1}, torch::kInt64)));
  // torchvision's order (sorted(os.walk(...)): folders by path, "cat/x-y" before "cat/x/z").
  std::vector<int> first;
  for (int64_t i = 0; i < 4; ++i) first.push_back(d.images[i][0][0][0].item<int>());
  EXPECT_EQ(first, (std::vector<int>{20, 10, 50, 60}));
  fs::remove(dir / "imgs/dog/park/c.png");
  EXPECT_HAS(load_error(c), "class folder 'dog' contains no images, nor do its sub-folders");
}

// Every pixel comes back as written, for 1 to 4 channels. A one-channel image once pointed into stb's
// buffer after it was freed (from_blob + an already-contiguous permute made no copy): the first bytes
// then read as the allocator's free-list pointers, and the same folder hashed differently per load.
TEST(ImageFolder, EveryChannelCountReadsBackExactly) {
  // 28x28 like Fashion-MNIST: stb's one-channel buffer (784 bytes) then lands in the allocator's small
  // free lists, whose pointers overwrite its first bytes.
  const int w = 28, h = 28, n = 6;
  for (int c = 1; c <= 4; ++c) {
    ddm::test::TempDir dir;
    fs::create_directories(dir / "imgs/a");
    for (int i = 0; i < n; ++i) write_png(dir / ("imgs/a/" + std::to_string(i) + ".png"), w, h, c, 40 * i);
    DataConfig cfg;
    cfg.source = "folder";
    cfg.root = dir / "imgs";
    const Dataset d = ddm::load_dataset(cfg);
    ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{n, c, h, w})) << c << " channels";
    for (int64_t i = 0; i < n; ++i) {
      // write_png's pixel at HWC index j is base + 3 j (mod 256).
      const auto expected = ((torch::arange(h * w * c, torch::kInt64) * 3 + 40 * i) % 256)
                                .to(torch::kUInt8)
                                .view({h, w, c})
                                .permute({2, 0, 1});
      EXPECT_TRUE(torch::equal(d.images[i], expected)) << c << " channels, image " << i << ": first row reads "
                                                       << d.images[i][0][0].slice(0, 0, 8);
    }
  }
}

TEST(ImageFolder, MalformedPngNamesFileAndReason) {
  ddm::test::TempDir dir;
  fs::create_directories(dir / "imgs/a");
  write_png(dir / "imgs/a/good.png", 4, 4, 1, 0);
  ddm::test::write_text(dir / "imgs/a/zbad.png", std::string("\x89PNG\r\n\x1a\n", 8) + "garbage that is no chunk");
  DataConfig c;
  c.source = "folder";
  c.root = dir / "imgs";
  const std::string msg = load_error(c);
  EXPECT_HAS(msg, "zbad.png");
  EXPECT_HAS(msg, "cannot decode image: ");
  EXPECT_GT(msg.size(), msg.find("cannot decode image: ") + 22) << "stb's reason is missing: " << msg;
}

TEST(ImageFolder, MixedSizesNameTheOddFile) {
  ddm::test::TempDir dir;
  fs::create_directories(dir / "imgs/a");
  write_png(dir / "imgs/a/1.png", 4, 4, 1, 0);
  write_png(dir / "imgs/a/2.png", 5, 4, 1, 0);
  DataConfig c;
  c.source = "folder";
  c.root = dir / "imgs";
  std::string msg = load_error(c);
  EXPECT_HAS(msg, "2.png: image is 1x4x5");
  EXPECT_HAS(msg, "1.png is 1x4x4");
  write_png(dir / "imgs/a/2.png", 5, 4, 3, 0);  // of another channel count too
  msg = load_error(c);
  EXPECT_HAS(msg, "2.png: image is 3x4x5");
}

TEST(ImageFolder, MixedChannelCountsReadAsRgbWithAlphaDroppedAndGreyRepeated) {
  // PNGs with and without alpha, and grey ones, side by side (what a folder of a user's icons holds):
  // each read as RGB, as tar shards read them, in whatever order they come.
  const int w = 6, h = 5;
  const auto pixels = [&](int c, uint8_t base) {  // what write_png writes, as [C, H, W]
    return ((torch::arange(h * w * c, torch::kInt64) * 3 + base) % 256).to(torch::kUInt8).view({h, w, c}).permute({2, 0, 1});
  };
  for (const std::vector<int>& order : {std::vector<int>{4, 3, 1}, std::vector<int>{1, 2, 3}, std::vector<int>{3, 4, 2}}) {
    ddm::test::TempDir dir;
    fs::create_directories(dir / "imgs/a");
    for (size_t i = 0; i < order.size(); ++i)
      write_png(dir / ("imgs/a/" + std::to_string(i) + ".png"), w, h, order[i], static_cast<uint8_t>(10 * i));
    testing::internal::CaptureStderr();
    const Dataset d = ddm::load_dataset(folder_source(dir / "imgs"));
    const std::string said = testing::internal::GetCapturedStderr();
    ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{3, 3, h, w})) << order[0] << order[1] << order[2];
    for (size_t i = 0; i < order.size(); ++i) {
      const int c = order[i];
      torch::Tensor want = pixels(c, static_cast<uint8_t>(10 * i));
      if (c == 2 || c == 4) want = want.narrow(0, 0, c - 1);
      if (want.size(0) == 1) want = want.repeat({3, 1, 1});
      EXPECT_TRUE(torch::equal(d.images[static_cast<int64_t>(i)], want)) << "image " << i << " of " << c << " channels";
    }
    EXPECT_HAS(said, "each is read as RGB");
    EXPECT_HAS(said, "its alpha dropped");
  }
  // Grey with and without alpha: grey.
  ddm::test::TempDir dir;
  fs::create_directories(dir / "imgs");
  write_png(dir / "imgs/0.png", w, h, 2, 0);
  write_png(dir / "imgs/1.png", w, h, 1, 7);
  testing::internal::CaptureStderr();
  const Dataset d = ddm::load_dataset(folder_source(dir / "imgs"));
  EXPECT_HAS(testing::internal::GetCapturedStderr(), "1 grey and 1 grey+alpha images: each is read as grey, its alpha dropped");
  ASSERT_EQ(d.images.sizes(), (std::vector<int64_t>{2, 1, h, w}));
  EXPECT_TRUE(torch::equal(d.images[0], pixels(2, 0).narrow(0, 0, 1)));
  EXPECT_TRUE(torch::equal(d.images[1], pixels(1, 7)));
}

TEST(ImageFolder, HugeImageHeaderIsRefusedBeforeDecoding) {
  // Found by fuzzing: a 22-byte TGA claiming 20000x20000 pixels made stb allocate 400 MB and decode
  // the missing pixels as zeros, so a tiny file became a huge "image" (a 1.6 GB malloc in the fuzzer).
  ddm::test::TempDir dir;
  fs::create_directories(dir / "imgs/a");
  std::string tga(18, '\0');
  tga[2] = 3;  // uncompressed grey
  tga[12] = static_cast<char>(20000 & 0xff), tga[13] = static_cast<char>(20000 >> 8);  // width
  tga[14] = static_cast<char>(20000 & 0xff), tga[15] = static_cast<char>(20000 >> 8);  // height
  tga[16] = 8;  // bits per pixel
  ddm::test::write_text(dir / "imgs/a/huge.tga", tga + "\x01\x02\x03\x04");
  DataConfig c;
  c.source = "folder";
  c.root = dir / "imgs";
  const std::string msg = load_error(c);
  EXPECT_HAS(msg, "huge.tga: image is 20000x20000 pixels, more than the 16777216 (4096x4096) that ddm reads");
}

TEST(ImageFolder, PngChunkLongerThanTheFileIsRefusedBeforeDecoding) {
  // Found by fuzzing: an 86-byte PNG whose IDAT length field said 338 MB made stb allocate that much
  // before noticing the file ends (it allows up to 1 GB per chunk).
  ddm::test::TempDir dir;
  fs::create_directories(dir / "imgs/a");
  write_png(dir / "imgs/a/good.png", 3, 3, 1, 0);
  std::string png = ddm::read_file(dir / "imgs/a/good.png");
  const size_t idat = png.find("IDAT") - 4;
  png[idat] = 0x14, png[idat + 1] = 0x28, png[idat + 2] = 0x00, png[idat + 3] = 0x1d;  // 338165789 bytes
  ddm::test::write_text(dir / "imgs/a/good.png", png);
  DataConfig c;
  c.source = "folder";
  c.root = dir / "imgs";
  const std::string msg = load_error(c);
  EXPECT_HAS(msg, "good.png: cannot decode image: PNG chunk at byte " + std::to_string(idat) +
                      " claims 338165789 bytes, more than the ");
  EXPECT_HAS(msg, "left in the file (truncated or corrupt)");
}

TEST(ImageFolder, MissingOrEmptyFolder) {
  ddm::test::TempDir dir;
  DataConfig c;
  c.source = "folder";
  c.root = dir / "none";
  EXPECT_HAS(load_error(c), "image folder not found");
  fs::create_directories(dir / "imgs/empty");
  c.root = dir / "imgs";
  EXPECT_HAS(load_error(c), "contains no images");
}

// ---- safetensors datasets ---------------------------------------------------------------------

std::string save_tensors(const ddm::test::TempDir& dir, const std::string& name,
                         std::map<std::string, torch::Tensor> tensors, std::map<std::string, std::string> meta = {}) {
  ddm::SafetensorsFile f;
  f.tensors = std::move(tensors);
  f.metadata = std::move(meta);
  ddm::save_safetensors(dir / name, f);
  return dir / name;
}

DataConfig st_cfg(const std::string& path) {
  DataConfig c;
  c.source = "safetensors";
  c.root = path;
  return c;
}

TEST(TensorFile, NhwcAndNchwBothLoadAsNchw) {
  ddm::test::TempDir dir;
  torch::Tensor nchw = torch::randint(0, 256, {6, 3, 8, 5}, torch::kUInt8);
  torch::Tensor labels = torch::tensor({0, 1, 2, 3, 1, 4}, torch::kInt32);
  Dataset a = ddm::load_dataset(st_cfg(save_tensors(dir, "a.safetensors", {{"images", nchw}, {"labels", labels}})));
  Dataset b = ddm::load_dataset(
      st_cfg(save_tensors(dir, "b.safetensors", {{"images", nchw.permute({0, 2, 3, 1}).contiguous()}})));
  EXPECT_TRUE(torch::equal(a.images, nchw));
  EXPECT_TRUE(torch::equal(b.images, nchw));
  EXPECT_TRUE(b.images.is_contiguous());
  EXPECT_EQ(a.num_classes, 5);
  EXPECT_TRUE(torch::equal(a.labels, labels.to(torch::kInt64)));
  EXPECT_EQ(b.num_classes, 0);
  EXPECT_TRUE(torch::equal(b.labels, torch::zeros({6}, torch::kInt64)));
  // Rule examples, and the metadata override for an ambiguous shape.
  EXPECT_TRUE(ddm::images_look_nhwc({10, 28, 28, 1}));
  EXPECT_FALSE(ddm::images_look_nhwc({10, 1, 28, 28}));
  EXPECT_FALSE(ddm::images_look_nhwc({10, 3, 4, 3}));
  torch::Tensor amb = torch::randint(0, 256, {2, 3, 4, 3}, torch::kUInt8);
  Dataset c = ddm::load_dataset(st_cfg(save_tensors(dir, "c.safetensors", {{"images", amb}}, {{"layout", "NHWC"}})));
  EXPECT_TRUE(torch::equal(c.images, amb.permute({0, 3, 1, 2})));
}

TEST(TensorFile, BadInputsNameFileAndTensor) {
  ddm::test::TempDir dir;
  const torch::Tensor img = torch::zeros({4, 1, 6, 6}, torch::kUInt8);
  std::string msg = load_error(st_cfg(save_tensors(dir, "f.safetensors", {{"images", torch::zeros({4, 1, 6, 6})}})));
  EXPECT_HAS(msg, "f.safetensors: tensor 'images' has dtype Float, expected uint8");
  msg = load_error(st_cfg(save_tensors(dir, "r.safetensors", {{"images", torch::zeros({4, 6, 6}, torch::kUInt8)}})));
  EXPECT_HAS(msg, "r.safetensors: tensor 'images' has rank 3");
  msg = load_error(st_cfg(save_tensors(dir, "l.safetensors", {{"images", img}, {"labels", torch::zeros({3}, torch::kInt64)}})));
  EXPECT_HAS(msg, "l.safetensors: tensor 'labels' has 3 entries but 'images' has 4 images");
  msg = load_error(st_cfg(save_tensors(dir, "lf.safetensors", {{"images", img}, {"labels", torch::zeros({4})}})));
  EXPECT_HAS(msg, "tensor 'labels' has dtype Float, expected an integer type");
  msg = load_error(st_cfg(save_tensors(dir, "l2.safetensors", {{"images", img}, {"labels", torch::zeros({4, 1}, torch::kInt64)}})));
  EXPECT_HAS(msg, "expected 1-D");
  msg = load_error(st_cfg(save_tensors(dir, "n.safetensors", {{"pixels", img}})));
  EXPECT_HAS(msg, "n.safetensors: no tensor named 'images'");
  msg = load_error(st_cfg(save_tensors(dir, "c.safetensors", {{"images", torch::zeros({2, 28, 28, 28}, torch::kUInt8)}})));
  EXPECT_HAS(msg, "has 28 channels");
  msg = load_error(st_cfg(dir / "missing.safetensors"));
  EXPECT_HAS(msg, "missing.safetensors: safetensors dataset file not found (set data.root");
}

// A label of 10^12 once ended in std::bad_alloc, and one label of 100000 silently made a model of
// 100001 classes: labels are bounded, and gaps need the metadata 'num_classes' to say they are meant.
TEST(TensorFile, LabelsAreBoundedAndTheClassCountIsExplicit) {
  ddm::test::TempDir dir;
  const torch::Tensor img = torch::zeros({4, 1, 6, 6}, torch::kUInt8);
  auto with_labels = [&](const std::string& name, std::vector<int64_t> l, std::map<std::string, std::string> meta = {}) {
    return st_cfg(save_tensors(dir, name, {{"images", img}, {"labels", torch::tensor(l, torch::kInt64)}}, meta));
  };
  std::string msg = load_error(with_labels("huge.safetensors", {0, 1, 1000000000000LL, 2}));
  EXPECT_HAS(msg, "huge.safetensors: tensor 'labels' contains the label 1000000000000; ddm supports at most 65536");
  msg = load_error(with_labels("big.safetensors", {0, 1, 100000, 2}));
  EXPECT_HAS(msg, "big.safetensors: tensor 'labels' contains the label 100000; ddm supports at most 65536");
  msg = load_error(with_labels("gap.safetensors", {0, 1, 1000, 2}));
  EXPECT_HAS(msg, "gap.safetensors: labels imply 1001 classes (largest label 1000), but 997 of them have no "
                  "image (the first is class 3)");
  EXPECT_HAS(msg, "metadata 'num_classes'");
  msg = load_error(with_labels("meta.safetensors", {0, 1, 2, 2}, {{"num_classes", "100000000"}}));
  EXPECT_HAS(msg, "metadata 'num_classes' is 100000000; ddm supports at most 65536");
  // Empty classes declared on purpose, and the class count in the description.
  Dataset d = ddm::load_dataset(with_labels("ok.safetensors", {0, 1, 4, 2}, {{"num_classes", "6"}}));
  EXPECT_EQ(d.num_classes, 6);
  EXPECT_HAS(d.description, "6 classes");
  d = ddm::load_dataset(with_labels("dense.safetensors", {0, 1, 3, 2}));
  EXPECT_EQ(d.num_classes, 4);
}

// The router's hold-out is a seeded random subset, not "the last N" (in a class-ordered folder
// that is one class): disjoint, sorted, together everything, the same for the same seed.
TEST(Holdout, SeededRandomSubsetAcrossTheWholeDataset) {
  const auto [train, held] = ddm::holdout_split(1000, 100, 7);
  ASSERT_EQ(train.numel(), 900);
  ASSERT_EQ(held.numel(), 100);
  EXPECT_TRUE(torch::equal(std::get<0>(torch::cat({train, held}).sort()), torch::arange(1000, torch::kInt64)));
  EXPECT_TRUE(torch::equal(train, std::get<0>(train.sort())));
  EXPECT_TRUE(torch::equal(held, std::get<0>(held.sort())));
  // Spread over all ten "classes" of 100 consecutive images each.
  EXPECT_EQ(std::get<0>(torch::unique_consecutive(held.div(100, "floor"))).numel(), 10) << held;
  EXPECT_TRUE(torch::equal(ddm::holdout_split(1000, 100, 7).second, held));
  EXPECT_FALSE(torch::equal(ddm::holdout_split(1000, 100, 8).second, held));
  EXPECT_EQ(ddm::holdout_split(10, 0, 1).second.numel(), 0);
  EXPECT_HAS(ddm::test::error_message([] { ddm::holdout_split(10, 10, 1); }), "data.holdout = 10");
}

// ---- conversions ------------------------------------------------------------------------------

TEST(Convert, UnitRangeRoundTrip) {
  const torch::Tensor u = torch::arange(256, torch::kInt64).to(torch::kUInt8);
  const torch::Tensor f = ddm::to_unit_range(u);
  EXPECT_EQ(f.scalar_type(), torch::kFloat32);
  EXPECT_EQ(f[0].item<float>(), -1.0f);
  EXPECT_EQ(f[255].item<float>(), 1.0f);
  EXPECT_TRUE(torch::equal(ddm::to_uint8(f), u));
  EXPECT_TRUE(torch::equal(ddm::to_uint8(torch::tensor({-3.0f, 5.0f})), torch::tensor({0, 255}, torch::kUInt8)));
}

// ---- BatchLoader ------------------------------------------------------------------------------

// n images 1x2x3 whose pixels encode the index (left/right asymmetric), labels = index.
Dataset index_dataset(int64_t n) {
  Dataset d;
  d.images = (torch::arange(n, torch::kInt64).view({n, 1, 1, 1}) * 7 + torch::arange(6).view({1, 1, 2, 3})) % 251;
  d.images = d.images.to(torch::kUInt8);
  d.labels = torch::arange(n, torch::kInt64);
  d.num_classes = n;
  return d;
}

TEST(BatchLoader, SameSeedSameBatches) {
  const Dataset d = index_dataset(50);
  ddm::BatchLoader a(d, 8, 123, true), b(d, 8, 123, true), c(d, 8, 124, true);
  bool differs = false;
  for (int i = 0; i < 20; ++i) {
    ddm::Batch x = a.next(), y = b.next(), z = c.next();
    EXPECT_TRUE(torch::equal(x.x, y.x));
    EXPECT_TRUE(torch::equal(x.y, y.y));
    differs = differs || !torch::equal(x.y, z.y);
  }
  EXPECT_TRUE(differs) << "different seeds gave the same order";
}

TEST(BatchLoader, SetCursorReproducesContinuation) {
  const Dataset d = index_dataset(37);
  ddm::BatchLoader a(d, 10, 9, true);
  for (int i = 0; i < 5; ++i) a.next();  // crosses an epoch boundary
  const ddm::BatchLoader::Cursor saved = a.cursor();
  EXPECT_EQ(saved.epoch, 1);
  EXPECT_EQ(saved.index, 13);
  std::vector<ddm::Batch> expect;
  for (int i = 0; i < 6; ++i) expect.push_back(a.next());
  ddm::BatchLoader b(d, 10, 9, true);
  b.next();  // some unrelated state first
  b.set_cursor(saved);
  for (int i = 0; i < 6; ++i) {
    ddm::Batch got = b.next();
    EXPECT_TRUE(torch::equal(got.x, expect[i].x)) << i;
    EXPECT_TRUE(torch::equal(got.y, expect[i].y)) << i;
  }
  EXPECT_THROW(b.set_cursor({0, 37}), ddm::Error);
  EXPECT_THROW(b.set_cursor({-1, 0}), ddm::Error);
}

TEST(BatchLoader, EverySampleOncePerEpochAndBatchesStayFull) {
  const int64_t n = 23, bs = 5;
  const Dataset d = index_dataset(n);
  ddm::BatchLoader loader(d, bs, 77, false);
  std::vector<int64_t> seen;
  for (int i = 0; i < 14; ++i) {  // 70 samples: three epochs and one more
    ddm::Batch b = loader.next();
    ASSERT_EQ(b.x.sizes(), (std::vector<int64_t>{bs, 1, 2, 3}));
    ASSERT_EQ(b.y.size(0), bs);
    EXPECT_GE(b.x.min().item<float>(), -1.0f);
    EXPECT_LE(b.x.max().item<float>(), 1.0f);
    // Without flips each image is exactly its dataset image.
    EXPECT_TRUE(torch::equal(ddm::to_uint8(b.x), d.images.index_select(0, b.y)));
    for (int64_t j = 0; j < bs; ++j) seen.push_back(b.y[j].item<int64_t>());
  }
  std::vector<std::vector<int64_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    std::vector<int64_t> ep(seen.begin() + e * n, seen.begin() + (e + 1) * n);
    EXPECT_EQ(std::set<int64_t>(ep.begin(), ep.end()).size(), static_cast<size_t>(n)) << "epoch " << e;
    epochs.push_back(ep);
  }
  EXPECT_NE(epochs[0], epochs[1]) << "each epoch must get its own permutation";
  EXPECT_EQ(loader.cursor().epoch, 3);
  EXPECT_EQ(loader.cursor().index, 70 - 3 * n);
}

TEST(BatchLoader, BatchLargerThanDatasetSpansEpochs) {
  const Dataset d = index_dataset(4);
  ddm::BatchLoader loader(d, 10, 1, false);
  ddm::Batch b = loader.next();
  EXPECT_EQ(b.y.size(0), 10);
  EXPECT_EQ(loader.cursor().epoch, 2);
  EXPECT_EQ(loader.cursor().index, 2);
  EXPECT_EQ(torch::bincount(b.y.slice(0, 0, 8), {}, 4).min().item<int64_t>(), 2);
}

TEST(BatchLoader, HflipFlipsAboutHalf) {
  const int64_t n = 2000;
  const Dataset d = index_dataset(n);
  ddm::BatchLoader loader(d, 500, 5, true);
  int64_t flipped = 0;
  for (int i = 0; i < 4; ++i) {
    ddm::Batch b = loader.next();
    const torch::Tensor got = ddm::to_uint8(b.x);
    const torch::Tensor orig = d.images.index_select(0, b.y);
    const torch::Tensor same = (got == orig).flatten(1).all(1);
    const torch::Tensor mirrored = (got == orig.flip({3})).flatten(1).all(1);
    EXPECT_TRUE((same ^ mirrored).all().item<bool>()) << "every image is either itself or its mirror";
    flipped += mirrored.sum().item<int64_t>();
  }
  EXPECT_GT(flipped, n * 45 / 100);
  EXPECT_LT(flipped, n * 55 / 100);
  EXPECT_THROW(ddm::BatchLoader(d, 0, 1, false), ddm::Error);
}

TEST(ImageTiles, AGridIsReadRowByRowAndOtherSizesAreRefused) {
  ddm::test::TempDir dir;
  // A 2 x 3 grid of 4x4 tiles, tile k filled with 10 k (gray), plus alpha: rows of 3 tiles.
  const int s = 4, rows = 2, cols = 3;
  std::vector<uint8_t> px(static_cast<size_t>(rows * s * cols * s * 2));
  for (int y = 0; y < rows * s; ++y)
    for (int x = 0; x < cols * s; ++x) {
      const size_t i = static_cast<size_t>((y * cols * s + x) * 2);
      px[i] = static_cast<uint8_t>(10 * ((y / s) * cols + x / s) + (y % s) * s + x % s);  // tile k, pixel offset
      px[i + 1] = 255;
    }
  const std::string path = dir / "grid.png";
  ASSERT_NE(stbi_write_png(path.c_str(), cols * s, rows * s, 2, px.data(), cols * s * 2), 0);
  const torch::Tensor t = ddm::read_image_tiles(path, s, "--control");
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{6, 1, 4, 4}));
  for (int k = 0; k < 6; ++k)
    for (int y = 0; y < s; ++y)
      for (int x = 0; x < s; ++x) EXPECT_EQ(t[k][0][y][x].item<int>(), 10 * k + y * s + x) << k << " " << y << " " << x;
  try {
    ddm::read_image_tiles(path, 5, "--control");
    ADD_FAILURE() << "a 12x8 image was cut into 5x5 tiles";
  } catch (const ddm::Error& e) {
    EXPECT_HAS(std::string(e.what()), "--control");
    EXPECT_HAS(std::string(e.what()), "12x8 pixels");
  }
}

}  // namespace
