// Captions in the data (data/captions.h): shards with .txt or img2dataset's .json, folders with a
// .txt beside each image or one captions.jsonl / metadata.jsonl; `ddm shards write` carries them
// and re-sharding keeps them; every batch row carries its own sample's caption, from memory and from
// shards alike; a partly captioned set, bytes that are not UTF-8 and malformed captions files are
// errors naming the file (shard and key, or file and line).
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "data/captions.h"
#include "data/dataset.h"
#include "data/image_folder.h"
#include "data/shard_loader.h"
#include "data/shard_stream.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "test_util.h"

using namespace ddm;
namespace fs = std::filesystem;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::shared_ptr<const ShardIndex> index_of(const std::string& pattern, bool skip_bad = false) {
  return std::make_shared<const ShardIndex>(scan_shards(expand_shards(pattern, "data.root"), skip_bad, 2, "data.root"));
}

// Shard samples "s0".."s{n-1}" of 4x4 RGB images; `caption(i)` gives each one's files beyond the image.
void write_shard(const std::string& path, int n, const std::function<void(int, ShardSample&)>& extra) {
  TarShardWriter w(path);
  for (int i = 0; i < n; ++i) {
    ShardSample s;
    s.key = "s" + std::to_string(i);
    s.files["png"] = png_of(torch::full({3, 4, 4}, i * 10, torch::kUInt8));
    extra(i, s);
    w.add(s);
  }
  w.finish();
}

}  // namespace

TEST(Captions, ShardCaptionsFromTxtOrImg2datasetJsonReachEveryBatchRow) {
  test::TempDir dir;
  // .txt with a final line break (taken off), img2dataset's .json (a caption, no label), and both
  // (.txt wins); one empty caption, meant.
  write_shard(dir / "a.tar", 5, [](int i, ShardSample& s) {
    if (i % 2 == 0) s.files["txt"] = "caption " + std::to_string(i) + " café\n";
    else s.files["json"] = R"({"caption": "json caption )" + std::to_string(i) + R"(", "url": "http://x", "width": 4})";
    if (i == 3) s.files["txt"] = "";
  });
  const auto index = index_of(dir / "a.tar");
  EXPECT_EQ(index->captioned, 5);
  EXPECT_EQ(index->num_classes, 0);  // img2dataset's .json holds no label: the set is unlabelled
  ShardOrder order;
  order.shuffle = false;
  ShardLoaderOptions o;
  o.batch = 5, o.resolution = 4, o.channels = 3;
  ShardLoader loader(index, order, o);
  const Batch b = loader.next(0, 5);
  EXPECT_EQ(b.captions, (std::vector<std::string>{"caption 0 café", "json caption 1", "caption 2 café", "", "caption 4 café"}));
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(b.x[i][0][0][0].item<float>(), i * 10 / 127.5 - 1, 1e-6);  // its own image
  EXPECT_EQ(b.rows(1, 2).captions, (std::vector<std::string>{"json caption 1", "caption 2 café"}));
  // Shards without captions give batches without them.
  write_shard(dir / "plain.tar", 2, [](int, ShardSample&) {});
  EXPECT_EQ(index_of(dir / "plain.tar")->captioned, 0);
  ShardLoader plain(index_of(dir / "plain.tar"), order, [&] { auto p = o; p.batch = 2; return p; }());
  EXPECT_TRUE(plain.next(0, 2).captions.empty());
}

TEST(Captions, PartlyCaptionedOrBrokenShardsAreNamedBySampleAndSkipBadSkipsThem) {
  test::TempDir dir;
  write_shard(dir / "part.tar", 4, [](int i, ShardSample& s) {
    if (i != 2) s.files["txt"] = "a caption";
  });
  std::string e = test::error_message([&] { index_of(dir / "part.tar"); });
  EXPECT_TRUE(has(e, "sample 's2' of shard " + (dir / "part.tar") + " has no caption")) << e;
  EXPECT_TRUE(has(e, "caption every sample or none")) << e;
  // With skip_bad the uncaptioned sample is skipped and counted when batches are made.
  ShardOrder order;
  order.shuffle = false;
  ShardLoaderOptions o;
  o.batch = 3, o.resolution = 4, o.channels = 3, o.skip_bad = true;
  ShardLoader lenient(index_of(dir / "part.tar", true), order, o);
  EXPECT_EQ(lenient.next(0, 3).captions.size(), 3u);
  EXPECT_EQ(lenient.skipped(), 1);
  EXPECT_TRUE(has(lenient.last_skip(), "'s2' has no caption")) << lenient.last_skip();
  // Not UTF-8; a .json whose caption is not a string; a .json that is not an object.
  write_shard(dir / "bytes.tar", 2, [](int i, ShardSample& s) { s.files["txt"] = i ? "caf\xe9" : "fine"; });
  e = test::error_message([&] { index_of(dir / "bytes.tar"); });
  EXPECT_TRUE(has(e, "sample 's1': its .txt (its caption): not UTF-8 at byte 3")) << e;
  write_shard(dir / "json.tar", 1, [](int, ShardSample& s) { s.files["json"] = R"({"caption": 7})"; });
  e = test::error_message([&] { index_of(dir / "json.tar"); });
  EXPECT_TRUE(has(e, "its .json: its \"caption\" is number, not a string")) << e;
  write_shard(dir / "label.tar", 1, [](int, ShardSample& s) { s.files["json"] = R"({"label": "cat"})"; });
  e = test::error_message([&] { index_of(dir / "label.tar"); });
  EXPECT_TRUE(has(e, "its .json's \"label\" is \"cat\", not a non-negative integer")) << e;
}

TEST(Captions, FoldersTakeATxtBesideEachImageOrOneJsonlAndShardsWriteCarriesThem) {
  test::TempDir dir;
  const std::string root = dir / "imgs";
  fs::create_directories(root + "/cats");
  fs::create_directories(root + "/dogs");
  for (const char* f : {"cats/a.png", "cats/b.png", "dogs/c.png"})
    test::write_text(root + "/" + f, png_of(torch::zeros({3, 4, 4}, torch::kUInt8)));
  // .txt beside each image.
  test::write_text(root + "/cats/a.txt", "a grey cat\n");
  test::write_text(root + "/cats/b.txt", "");
  std::string e = test::error_message([&] { load_image_folder(root); });
  EXPECT_TRUE(has(e, root + "/dogs/c.png has no caption (no .txt beside it) but " + root + "/cats/a.png has one")) << e;
  test::write_text(root + "/dogs/c.txt", "  a dog  ");
  testing::internal::CaptureStderr();
  Dataset d = load_image_folder(root);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(d.captions, (std::vector<std::string>{"a grey cat", "", "a dog"}));
  // A .txt beside no image (its image renamed, or named "c.png.txt") is read by nothing: a note says so.
  test::write_text(root + "/dogs/c.png.txt", "a lost caption");
  testing::internal::CaptureStderr();
  EXPECT_EQ(load_image_folder(root).captions, d.captions);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(has(said, "note: " + root + ": 1 .txt file is beside no image and not read as a caption (" + root +
                            "/dogs/c.png.txt); a caption is IMAGE-NAME.txt")) << said;
  fs::remove(root + "/dogs/c.png.txt");
  {  // A folder without captions: a README.txt is no caption; "IMAGE.png.txt" is one, misnamed.
    const std::string plain = dir / "plain";
    fs::create_directories(plain);
    test::write_text(plain + "/x.png", png_of(torch::zeros({3, 4, 4}, torch::kUInt8)));
    test::write_text(plain + "/README.txt", "my photos");
    test::write_text(plain + "/.hidden.png.txt", "an editor's file");
    testing::internal::CaptureStderr();
    EXPECT_TRUE(load_image_folder(plain).captions.empty());
    EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
    test::write_text(plain + "/x.png.txt", "a caption under the wrong name");
    testing::internal::CaptureStderr();
    EXPECT_TRUE(load_image_folder(plain).captions.empty());
    const std::string misnamed = testing::internal::GetCapturedStderr();
    EXPECT_TRUE(has(misnamed, "1 .txt file is beside no image and not read as a caption (" + plain + "/x.png.txt)"))
        << misnamed;
  }
  EXPECT_TRUE(has(d.description, "captioned")) << d.description;
  // A captions.jsonl wins over the .txt files for the images it names.
  test::write_text(root + "/captions.jsonl", R"({"file_name": "dogs/c.png", "text": "a listed dog"})" "\n\n"
                                             R"({"file_name": "./cats/a.png", "caption": "a listed cat"})" "\n");
  d = load_image_folder(root);
  EXPECT_EQ(d.captions, (std::vector<std::string>{"a listed cat", "", "a listed dog"}));
  // Batches carry them, each row its own image's.
  BatchLoader loader(d, 3, 1, false);
  const Batch b = loader.next();
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(b.captions[static_cast<size_t>(i)], d.captions[static_cast<size_t>(b.index[i].item<int64_t>())]);
  // `ddm shards write` carries them as .txt, and the shards give them back.
  const ShardsWritten w = write_shards(d, dir / "shards", 2, "train");
  const auto index = index_of(w.pattern);
  EXPECT_EQ(index->captioned, 3);
  EXPECT_EQ(index->num_classes, 2);
  ShardOrder order;
  order.shuffle = false;
  ShardLoaderOptions o;
  o.batch = 3, o.resolution = 4, o.channels = 3;
  EXPECT_EQ(ShardLoader(index, order, o).next(0, 3).captions, d.captions);
  // Re-sharding keeps each sample's files, its caption among them.
  const ShardsWritten r = reshard(expand_shards(w.pattern, "test"), dir / "again", 3, "train");
  EXPECT_EQ(ShardLoader(index_of(r.pattern), order, o).next(0, 3).captions, d.captions);
  // Malformed captions files, named by file and line.
  test::write_text(root + "/captions.jsonl", "{\"file_name\": \"cats/a.png\", \"caption\": \"x\"}\nnot json\n");
  e = test::error_message([&] { load_image_folder(root); });
  EXPECT_TRUE(has(e, root + "/captions.jsonl line 2: not a JSON object")) << e;
  test::write_text(root + "/captions.jsonl", R"({"file_name": "cats/zebra.png", "caption": "x"})");
  e = test::error_message([&] { load_image_folder(root); });
  EXPECT_TRUE(has(e, "line 1: cats/zebra.png is not an image under")) << e;
  test::write_text(root + "/captions.jsonl", R"({"file_name": "cats/a.png"})");
  e = test::error_message([&] { load_image_folder(root); });
  EXPECT_TRUE(has(e, "line 1: no \"caption\" or \"text\"")) << e;
  test::write_text(root + "/metadata.jsonl", "");
  e = test::error_message([&] { load_image_folder(root); });
  EXPECT_TRUE(has(e, "both " + root + "/captions.jsonl and metadata.jsonl")) << e;
  fs::remove(root + "/captions.jsonl");
  test::write_text(root + "/cats/a.txt", "caf\xc3");
  e = test::error_message([&] { load_image_folder(root); });
  EXPECT_TRUE(has(e, root + "/cats/a.txt (its caption): not UTF-8 at byte 3")) << e;
}
