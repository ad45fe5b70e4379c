// Streaming tar shards (data/shard_stream.h, data/shard_loader.h, data/shard_write.h): a dataset
// written as shards reads back bit for bit in order with shuffling off; the replicas' epochs
// together draw every sample exactly once; a stream or loader started at a saved position continues
// with exactly the samples (and crops and flips) of an uninterrupted one; bad samples stop the run
// naming shard and key, or with skip_bad are skipped and counted; bad shard sets are clear errors;
// latent shards read back as their posteriors, with the class names encode.json records.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "data/latent_shards.h"
#include "data/scan_cache.h"
#include "data/shard_loader.h"
#include "data/shard_stream.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "test_util.h"

using namespace ddm;
namespace fs = std::filesystem;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// n random colour (or grey) images [n, c, h, w], labels i % 10.
Dataset random_data(int64_t n, int64_t c, int64_t h, int64_t w) {
  torch::manual_seed(5);
  Dataset d;
  d.images = torch::randint(0, 256, {n, c, h, w}, torch::kUInt8);
  d.labels = torch::arange(n, torch::kInt64).remainder(10);
  d.num_classes = 10;
  d.description = "random";
  return d;
}

// A shard of the images of `data` as samples img0, img1, ... (a PNG and its label), each given to
// `edit` before it is written.
void write_labelled_tar(const std::string& path, const Dataset& data, const std::function<void(int64_t, ShardSample&)>& edit) {
  TarShardWriter w(path);
  for (int64_t i = 0; i < data.images.size(0); ++i) {
    ShardSample s;
    s.key = "img" + std::to_string(i);
    s.files["png"] = png_of(data.images[i]);
    s.files["cls"] = std::to_string(i);
    edit(i, s);
    w.add(s);
  }
  w.finish();
}

std::shared_ptr<const ShardIndex> index_of(const std::string& pattern, bool skip_bad = false) {
  return std::make_shared<const ShardIndex>(scan_shards(expand_shards(pattern, "data.root"), skip_bad, 2, "data.root"));
}

ShardLoaderOptions options(int64_t batch, int64_t resolution, int channels) {
  ShardLoaderOptions o;
  o.batch = batch, o.resolution = resolution, o.channels = channels, o.threads = 2;
  return o;
}

TEST(ShardLoader, AWrittenDatasetReadsBackBitForBitInOrderWithoutShuffling) {
  test::TempDir dir;
  for (int64_t c : {1, 3}) {
    const Dataset data = random_data(23, c, 8, 8);
    const ShardsWritten w = write_shards(data, dir.path + "/c" + std::to_string(c), 5, "train");
    EXPECT_EQ(w.shards, 5);
    EXPECT_EQ(w.samples, 23);
    const auto index = index_of(w.pattern);
    EXPECT_EQ(index->counts, (std::vector<int64_t>{5, 5, 5, 5, 3}));
    EXPECT_EQ(index->num_classes, 10);
    ShardOrder order;
    order.shuffle = false;
    ShardLoader loader(index, order, options(4, 8, static_cast<int>(c)));
    for (int64_t at = 0; at < 40; at += 4) {  // past the epoch's end: it wraps, batches stay full
      const Batch b = loader.next(0, 4);
      ASSERT_EQ(b.x.sizes(), (std::vector<int64_t>{4, c, 8, 8}));
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t k = (at + i) % 23;
        EXPECT_TRUE(torch::equal(b.x[i], to_unit_range(data.images[k]))) << "channels " << c << ", sample " << k;
        EXPECT_EQ(b.y[i].item<int64_t>(), k % 10);
      }
    }
    EXPECT_EQ(loader.cursor().epoch, 1);
    EXPECT_EQ(loader.cursor().index, 40 - 23);
  }
}

TEST(ShardLoader, TheReplicasEpochsTogetherDrawEverySampleExactlyOnce) {
  test::TempDir dir;
  const ShardsWritten w = write_shards(random_data(61, 1, 4, 4), dir.path, 4, "s");  // 16 shards
  const auto index = index_of(w.pattern);
  for (int replicas : {1, 3, 16}) {
    for (int64_t epoch : {0, 1}) {
      std::set<std::pair<int32_t, int64_t>> seen;
      int64_t drawn = 0;
      for (int r = 0; r < replicas; ++r) {
        ShardOrder o;
        o.seed = 9, o.replica = r, o.replicas = replicas, o.shuffle_buffer = 7;
        for (const SampleRef& ref : epoch_order(*index, o, epoch)) {
          seen.insert({ref.shard, ref.index});
          ++drawn;
        }
      }
      EXPECT_EQ(drawn, 61) << replicas << " replicas, epoch " << epoch;
      EXPECT_EQ(seen.size(), 61u) << replicas << " replicas, epoch " << epoch;
    }
  }
  // Shuffled: epochs differ from each other and from the written order.
  ShardOrder o;
  o.seed = 9, o.shuffle_buffer = 7;
  const auto e0 = epoch_order(*index, o, 0), e1 = epoch_order(*index, o, 1);
  auto keys = [](const std::vector<SampleRef>& v) {
    std::vector<int64_t> k;
    for (const SampleRef& r : v) k.push_back(r.shard * 4 + r.index);
    return k;
  };
  std::vector<int64_t> written(61);
  for (int64_t i = 0; i < 61; ++i) written[static_cast<size_t>(i)] = i;
  EXPECT_NE(keys(e0), keys(e1));
  EXPECT_NE(keys(e0), written);
  // The buffer mixes samples across shard boundaries: some sample leaves after one of a later shard.
  bool mixed = false;
  for (size_t i = 1; i < e0.size(); ++i) mixed = mixed || (e0[i].shard != e0[i - 1].shard);
  EXPECT_TRUE(mixed);
}

TEST(ShardLoader, AStreamStartedAtASavedPositionContinuesTheUninterruptedOne) {
  test::TempDir dir;
  const ShardsWritten w = write_shards(random_data(37, 3, 12, 10), dir.path, 5, "s");
  const auto index = index_of(w.pattern);
  ShardOrder o;
  o.seed = 3, o.replica = 1, o.replicas = 2, o.shuffle_buffer = 6;
  ShardStream whole(index, o, 0, 0);
  std::vector<std::pair<int64_t, int64_t>> positions;
  std::vector<ShardSample> samples;
  for (int i = 0; i < 60; ++i) {  // about three of this replica's epochs
    if (whole.drawn() == whole.epoch_size()) positions.push_back({whole.epoch() + 1, 0});
    else positions.push_back({whole.epoch(), whole.drawn()});
    samples.push_back(whole.next());
  }
  for (int start : {0, 1, 7, 18, 19, 20, 41}) {
    ShardStream resumed(index, o, positions[static_cast<size_t>(start)].first, positions[static_cast<size_t>(start)].second);
    for (int i = start; i < 60; ++i) {
      const ShardSample s = resumed.next();
      ASSERT_EQ(s.key, samples[static_cast<size_t>(i)].key) << "from draw " << start;
      ASSERT_EQ(s.files, samples[static_cast<size_t>(i)].files) << "from draw " << start;
    }
  }
  // The loader, with random crops and flips: batches after set_cursor are the uninterrupted ones.
  ShardLoaderOptions lo = options(3, 8, 3);
  lo.crop = CropMode::kRandom, lo.hflip = true;
  ShardLoader a(index, o, lo);
  std::vector<Batch> batches;
  std::vector<BatchSource::Cursor> at;
  for (int i = 0; i < 12; ++i) {
    at.push_back(a.cursor());
    batches.push_back(a.next(0, 3));
  }
  ShardLoader b(index, o, lo);
  b.set_cursor(at[5]);
  EXPECT_TRUE(torch::equal(b.peek(0, 3).x, batches[5].x));
  for (int i = 5; i < 12; ++i) EXPECT_TRUE(torch::equal(b.next(0, 3).x, batches[static_cast<size_t>(i)].x)) << i;
  // Random crops of a 12 x 10 image differ from the centre crop somewhere.
  ShardLoaderOptions centre = options(3, 8, 3);
  ShardLoader c(index, o, centre);
  bool differs = false;
  for (int i = 0; i < 12; ++i) differs = differs || !torch::equal(c.next(0, 3).x, batches[static_cast<size_t>(i)].x);
  EXPECT_TRUE(differs);
  EXPECT_TRUE(has(test::error_message([&] { b.set_cursor({0, 999}); }), "out of range for replica 1"));
}

// A router's held-out samples (ShardOrder::keep) are never drawn: each replica's epochs together
// draw every kept sample once and no other. Each row's cluster (ShardLoaderOptions::clusters, by
// position in shard order) is its own sample's, as are its image and label; a resumed loader goes on
// with the same rows.
TEST(ShardLoader, SamplesLeftOutAreNeverDrawnAndEachRowCarriesItsOwnCluster) {
  test::TempDir dir;
  const Dataset data = random_data(37, 1, 4, 4);
  const ShardsWritten w = write_shards(data, dir.path, 5, "s");  // 8 shards, the last of 2
  const auto index = index_of(w.pattern);
  const std::vector<int64_t> first = shard_offsets(*index);
  EXPECT_EQ(first, (std::vector<int64_t>{0, 5, 10, 15, 20, 25, 30, 35}));
  auto keep = std::make_shared<std::vector<bool>>(37, true);
  for (const int64_t held : {0, 3, 7, 12, 20, 21, 36}) (*keep)[static_cast<size_t>(held)] = false;  // 30 kept
  ShardOrder o;
  o.seed = 9, o.shuffle_buffer = 6, o.keep = keep;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int> drawn(37, 0);
    for (int r = 0; r < 2; ++r) {
      ShardOrder mine = o;
      mine.replica = r, mine.replicas = 2;
      for (const SampleRef& s : epoch_order(*index, mine, epoch)) ++drawn[static_cast<size_t>(first[s.shard] + s.index)];
    }
    for (size_t i = 0; i < 37; ++i) EXPECT_EQ(drawn[i], (*keep)[i] ? 1 : 0) << "sample " << i << ", epoch " << epoch;
  }
  // One replica, batches of 10: each epoch (30 kept samples) is three batches.
  auto clusters = std::make_shared<std::vector<int64_t>>();
  for (int64_t i = 0; i < 37; ++i) clusters->push_back(i);  // each sample's "cluster" is its position
  ShardLoaderOptions lo = options(10, 4, 1);
  lo.clusters = clusters;
  ShardLoader loader(index, o, lo);
  std::vector<Batch> batches;
  std::vector<BatchSource::Cursor> at;
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> seen(37, 0);
    for (int b = 0; b < 3; ++b) {
      at.push_back(loader.cursor());
      batches.push_back(loader.next());
      const Batch& batch = batches.back();
      ASSERT_TRUE(batch.k.defined());
      for (int64_t row = 0; row < 10; ++row) {
        const int64_t k = batch.k[row].item<int64_t>();
        ++seen[static_cast<size_t>(k)];
        EXPECT_EQ(batch.y[row].item<int64_t>(), data.labels[k].item<int64_t>()) << "row " << row;
        EXPECT_TRUE(torch::equal(batch.x[row], to_unit_range(data.images[k]))) << "row " << row;
      }
    }
    for (size_t i = 0; i < 37; ++i) EXPECT_EQ(seen[i], (*keep)[i] ? 1 : 0) << "sample " << i << ", epoch " << epoch;
  }
  ShardLoader resumed(index, o, lo);
  resumed.set_cursor(at[4]);
  for (size_t b = 4; b < batches.size(); ++b) {
    const Batch again = resumed.next();
    EXPECT_TRUE(torch::equal(again.k, batches[b].k)) << "batch " << b;
    EXPECT_TRUE(torch::equal(again.x, batches[b].x)) << "batch " << b;
  }
  // Keeping nothing of a replica's shards is a clear error.
  auto none = std::make_shared<std::vector<bool>>(37, false);
  ShardOrder empty = o;
  empty.keep = none;
  EXPECT_TRUE(has(test::error_message([&] { ShardLoader l(index, empty, lo); }), "hold out fewer samples"));
}

TEST(ShardLoader, ABadSampleStopsTheRunNamingShardAndKeyOrWithSkipBadIsSkippedAndCounted) {
  test::TempDir dir;
  const Dataset data = random_data(6, 3, 8, 8);
  write_labelled_tar(dir.path + "/bad.tar", data, [](int64_t i, ShardSample& s) {
    if (i == 2) s.files["png"] = "not a png at all";
    if (i == 4) s.files["cls"] = "four";
  });
  const std::string path = dir.path + "/bad.tar";
  ShardOrder o;
  o.shuffle = false;
  // The scan already refuses the bad label; the damaged image is found when it is decoded.
  EXPECT_TRUE(has(test::error_message([&] { index_of(path); }), "sample 'img4': its .cls is \"four\""));
  const auto index = index_of(path, /*skip_bad=*/true);
  {
    ShardLoaderOptions lo = options(3, 8, 3);
    ShardLoader strict(index, o, lo);
    const std::string e = test::error_message([&] { strict.next(0, 3); });
    EXPECT_TRUE(has(e, "shard " + path + ", sample 'img2'")) << e;
    EXPECT_TRUE(has(e, "not a PNG")) << e;
    EXPECT_TRUE(has(e, "or set data.skip_bad = true to skip such samples")) << e;
  }
  ShardLoaderOptions lo = options(4, 8, 3);
  lo.skip_bad = true;
  ShardLoader lenient(index, o, lo);
  const Batch b = lenient.next(0, 4);
  EXPECT_EQ(b.y.sizes(), (std::vector<int64_t>{4}));
  EXPECT_EQ(b.y[0].item<int64_t>(), 0);
  EXPECT_EQ(b.y[1].item<int64_t>(), 1);
  EXPECT_EQ(b.y[2].item<int64_t>(), 3);  // img2 skipped
  EXPECT_EQ(b.y[3].item<int64_t>(), 5);  // img4 skipped
  EXPECT_EQ(lenient.skipped(), 2);
  EXPECT_TRUE(has(lenient.last_skip(), "img4")) << lenient.last_skip();
}

// Two images of one name (img1.jpg beside img1.png: one sample by WebDataset's rule) are refused by
// the scan, naming both, and with skip_bad skipped like any bad sample: which one was meant is unknown.
TEST(ShardLoader, TwoImagesOfOneNameAreNamedOrWithSkipBadSkipped) {
  test::TempDir dir;
  const Dataset data = random_data(3, 3, 8, 8);
  write_labelled_tar(dir.path + "/twins.tar", data, [&](int64_t i, ShardSample& s) {
    if (i == 1) s.files["jpg"] = png_of(data.images[0]);
  });
  const std::string path = dir.path + "/twins.tar";
  const std::string e = test::error_message([&] { index_of(path); });
  EXPECT_TRUE(has(e, "sample 'img1' has 2 images (.jpg and .png)")) << e;
  EXPECT_TRUE(has(e, "Rename all but one (or set data.skip_bad = true")) << e;
  ShardOrder o;
  o.shuffle = false;
  ShardLoaderOptions lo = options(2, 8, 3);
  lo.skip_bad = true;
  ShardLoader lenient(index_of(path, /*skip_bad=*/true), o, lo);
  const Batch b = lenient.next(0, 2);
  EXPECT_EQ(b.y[0].item<int64_t>(), 0);
  EXPECT_EQ(b.y[1].item<int64_t>(), 2);  // img1 skipped
  EXPECT_EQ(lenient.skipped(), 1);
}

// The scan cache (data/scan_cache.h): a second scan of unchanged shards reads the cache, not the
// tars; a shard whose modification time changed is scanned again; a shard with a bad sample is never
// cached, so its fault is found again; a malformed cache file is ignored and replaced; the directory
// keeps its newest files.
TEST(ShardLoader, TheScanCacheServesUnchangedShardsOnly) {
  test::TempDir dir;
  const ShardsWritten w = write_shards(random_data(23, 1, 8, 8), dir / "s", 5, "train");
  const std::vector<std::string> shards = expand_shards(w.pattern, "data.root");
  const std::string cache = dir / "cache";
  const auto scan = [&](const std::vector<std::string>& list, bool skip_bad = false) {
    return scan_shards(list, skip_bad, 2, "data.root", SampleContent::kImage, cache);
  };
  EXPECT_EQ(scan(shards).counts, (std::vector<int64_t>{5, 5, 5, 5, 3}));
  const std::string file = ScanCache(cache, shards, "image").path();
  ASSERT_TRUE(fs::exists(file));
  EXPECT_TRUE(scan_shards(shards, false, 2, "data.root").counts == scan(shards).counts);
  // The second scan takes the counts from the file: one edited there is what it reports.
  auto j = nlohmann::json::parse(test::read_text(file));
  j["shards"][1]["count"] = 7;
  test::write_text(file, j.dump());
  EXPECT_EQ(scan(shards).counts, (std::vector<int64_t>{5, 7, 5, 5, 3}));
  // A shard touched since is scanned again, and the file corrected.
  fs::last_write_time(shards[1], fs::last_write_time(shards[1]) + std::chrono::seconds(5));
  EXPECT_EQ(scan(shards).counts, (std::vector<int64_t>{5, 5, 5, 5, 3}));
  EXPECT_EQ(nlohmann::json::parse(test::read_text(file))["shards"][1]["count"], 5);
  // A malformed file is no cache, and is replaced.
  test::write_text(file, "{not json");
  EXPECT_EQ(scan(shards).samples, 23);
  EXPECT_EQ(nlohmann::json::parse(test::read_text(file))["format"], "ddm-shard-scan-2");

  // A shard with a bad label: with skip_bad it is scanned (the loader skips the sample) but not
  // cached, so a strict scan still names the sample.
  {
    TarShardWriter t(dir / "bad.tar");
    for (int64_t i = 0; i < 3; ++i) {
      ShardSample smp;
      smp.key = "img" + std::to_string(i);
      smp.files["png"] = png_of(random_data(1, 1, 8, 8).images[0]);
      smp.files["cls"] = i == 1 ? "one" : std::to_string(i);
      t.add(smp);
    }
    t.finish();
  }
  const std::vector<std::string> with_bad{shards[0], dir / "bad.tar"};
  EXPECT_EQ(scan(with_bad, /*skip_bad=*/true).counts, (std::vector<int64_t>{5, 3}));
  const auto kept = nlohmann::json::parse(test::read_text(ScanCache(cache, with_bad, "image").path()));
  EXPECT_FALSE(kept["shards"][0].is_null());
  EXPECT_TRUE(kept["shards"][1].is_null());
  EXPECT_TRUE(has(test::error_message([&] { scan(with_bad); }), "sample 'img1': its .cls is \"one\""));

  // Without a directory nothing is written; with one, only the newest kMaxFiles stay.
  const size_t before = std::distance(fs::directory_iterator(cache + "/shard-scans"), fs::directory_iterator{});
  scan_shards({shards[2]}, false, 1, "data.root", SampleContent::kImage, "");
  EXPECT_EQ(static_cast<size_t>(std::distance(fs::directory_iterator(cache + "/shard-scans"), fs::directory_iterator{})),
            before);
  for (size_t k = 0; k < ScanCache::kMaxFiles + 5; ++k) {
    const std::string old = cache + "/shard-scans/old-" + std::to_string(k) + ".json";
    test::write_text(old, "{}");
    fs::last_write_time(old, fs::file_time_type::clock::now() - std::chrono::hours(2));
  }
  scan({shards[3]});
  EXPECT_EQ(static_cast<size_t>(std::distance(fs::directory_iterator(cache + "/shard-scans"), fs::directory_iterator{})),
            ScanCache::kMaxFiles);
  EXPECT_TRUE(fs::exists(ScanCache(cache, {shards[3]}, "image").path()));
  EXPECT_TRUE(fs::exists(file));
}

TEST(ShardLoader, BadShardSetsAreClearErrors) {
  test::TempDir dir;
  const ShardsWritten w = write_shards(random_data(9, 1, 4, 4), dir.path, 3, "s");
  const auto index = index_of(w.pattern);
  ShardOrder o;
  o.replicas = 4;
  EXPECT_TRUE(has(test::error_message([&] { ShardStream(index, o, 0, 0); }), "3 shards for 4 data-parallel replicas"));
  EXPECT_THROW(ShardStream(index, o, 0, 0), InputError);  // exit 2: a supervisor does not restart it
  // Some samples labelled, some not.
  {
    TarShardWriter t(dir.path + "/mixed.tar");
    ShardSample a, b;
    a.key = "a", a.files = {{"png", png_of(torch::zeros({1, 4, 4}, torch::kUInt8))}, {"cls", "1"}};
    b.key = "b", b.files = {{"png", png_of(torch::zeros({1, 4, 4}, torch::kUInt8))}};
    t.add(a), t.add(b), t.finish();
  }
  EXPECT_TRUE(has(test::error_message([&] { index_of(dir.path + "/mixed.tar"); }),
                  "sample 'b' of shard " + dir.path + "/mixed.tar has no label"));
  // A sample without an image.
  {
    TarShardWriter t(dir.path + "/noimg.tar");
    ShardSample a;
    a.key = "a", a.files = {{"txt", "a caption"}, {"cls", "1"}};
    t.add(a), t.finish();
  }
  EXPECT_TRUE(has(test::error_message([&] { index_of(dir.path + "/noimg.tar"); }), "sample 'a' has no image"));
  // Each says what to do: a label apart from its picture (a tar made unsorted), a stray file, a name
  // with inner dots.
  EXPECT_TRUE(has(test::error_message([&] { index_of(dir.path + "/noimg.tar"); }), "make it with `tar --sort=name`"));
  {
    TarShardWriter t(dir.path + "/stray.tar");
    ShardSample a, b;
    a.key = "Thumbs", a.files = {{"db", "x"}};
    b.key = "IMG_1234", b.files = {{"edited.png", png_of(torch::zeros({1, 4, 4}, torch::kUInt8))}};
    t.add(a), t.finish();
    TarShardWriter u(dir.path + "/dots.tar");
    u.add(b), u.finish();
  }
  EXPECT_TRUE(has(test::error_message([&] { index_of(dir.path + "/stray.tar"); }),
                  "A stray file? Remove it from the tar, or set data.skip_bad = true"));
  EXPECT_TRUE(has(test::error_message([&] { index_of(dir.path + "/dots.tar"); }),
                  "rename it without the inner dots (e.g. IMG_1234_edited.png)"));
  // A truncated shard: an error, or with skip_bad cut where it breaks (the samples before it kept).
  const std::string whole = dir.path + "/s-000001.tar", cut = dir.path + "/cut.tar";
  {
    std::ifstream in(whole, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // A sample is 4 tar blocks of 512 bytes (cls header and data, png header and data): cut inside the
    // third sample, after its label.
    std::ofstream(cut, std::ios::binary) << bytes.substr(0, 2 * 2048 + 600);
  }
  EXPECT_TRUE(has(test::error_message([&] { index_of(cut); }), "shard " + cut));
  const auto lenient = index_of(cut, true);
  EXPECT_EQ(lenient->bad_shards, 1);
  // The two whole samples before the break are kept, the broken one is not.
  EXPECT_EQ(lenient->counts, std::vector<int64_t>{2});
  ASSERT_EQ(lenient->notes.size(), 1u);
  EXPECT_TRUE(has(lenient->notes[0], "shard " + cut)) << lenient->notes[0];
  // Cut exactly between two samples (no end-of-archive blocks): said too, not read as a shorter tar.
  const std::string between = dir.path + "/between.tar";
  {
    std::ifstream in(whole, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(between, std::ios::binary) << bytes.substr(0, 2 * 2048);
  }
  const std::string e = test::error_message([&] { index_of(between); });
  EXPECT_TRUE(has(e, "shard " + between + " ends without a tar's end-of-archive blocks")) << e;
  const auto used = index_of(between, true);
  EXPECT_EQ(used->counts, std::vector<int64_t>{2});
  ASSERT_EQ(used->notes.size(), 1u);
  EXPECT_TRUE(has(used->notes[0], "its first 2 samples are used")) << used->notes[0];
}

TEST(ShardLoader, ReshardingCopiesEverySampleInOrderAndCommandsThatLoadWholeRefuseShards) {
  test::TempDir dir;
  const Dataset data = random_data(23, 3, 6, 6);
  const ShardsWritten w = write_shards(data, dir.path + "/in", 5, "train");
  const ShardsWritten r = reshard(expand_shards(w.pattern, "test"), dir.path + "/out", 7, "again");
  EXPECT_EQ(r.shards, 4);
  EXPECT_EQ(r.samples, 23);
  std::vector<ShardSample> a, b;
  for (const auto& [pattern, into] : {std::make_pair(w.pattern, &a), std::make_pair(r.pattern, &b)})
    for (const std::string& shard : expand_shards(pattern, "test")) {
      TarShardReader reader(shard);
      ShardSample s;
      while (reader.next(s)) into->push_back(s);
    }
  ASSERT_EQ(a.size(), 23u);
  ASSERT_EQ(b.size(), 23u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key, b[i].key);
    EXPECT_EQ(a[i].files, b[i].files) << a[i].key;
  }
  EXPECT_TRUE(has(test::error_message([&] { reshard(expand_shards(w.pattern, "test"), dir.path + "/in", 7, "train"); }),
                  "would write over the input shard"));
  DataConfig dc;
  dc.source = "shards";
  dc.root = w.pattern;
  dc.resolution = 6;
  EXPECT_TRUE(has(test::error_message([&] { load_dataset(dc); }), "shards are only streamed"));
}

}  // namespace

// Latent shards (data.source = "latents"): each batch row is the sample's [mean; logvar] exactly,
// in order with shuffling off; the record and each sample are checked, errors naming shard and key.
TEST(ShardLoader, LatentShardsReadBackAsPosteriorsAndBadOnesAreNamed) {
  test::TempDir dir;
  torch::manual_seed(9);
  const int64_t n = 11, z = 2, s = 3;
  const torch::Tensor mean = torch::randn({n, z, s, s}), logvar = torch::randn({n, z, s, s});
  LatentShardsInfo info;
  info.autoencoder = "/nowhere/ae", info.autoencoder_sha256 = std::string(64, 'a');
  info.latent_channels = z, info.latent_size = s, info.image_channels = 1, info.image_size = 12;
  info.samples = n, info.shards = 3, info.num_classes = 10, info.data = "random";
  // The posterior member of sample i (tensors by name; `shape` overrides the logvar's).
  auto member = [&](int64_t i, std::vector<int64_t> shape = {}) {
    SafetensorsFile f;
    f.tensors["mean"] = mean[i].clone();
    f.tensors["logvar"] = shape.empty() ? logvar[i].clone() : torch::zeros(shape);
    return safetensors_bytes(f);
  };
  auto write = [&](const std::string& root, int64_t bad, const std::string& bytes) {
    fs::create_directories(root);
    for (int64_t k = 0, i = 0; k < info.shards; ++k) {
      TarShardWriter w(latent_shard_path(root, k));
      for (int64_t j = 0; j < 4 && i < n; ++j, ++i) {
        ShardSample smp;
        smp.key = zero_padded(i, 8);
        smp.files["safetensors"] = i == bad ? bytes : member(i);
        smp.files["cls"] = std::to_string(i % 10);
        w.add(smp);
      }
      w.finish();
    }
    test::write_text(root + "/encode.json", latent_shards_json(info).dump());
  };
  DataConfig cfg;
  cfg.source = "latents", cfg.root = dir.path + "/good";
  write(cfg.root, -1, "");
  const Dataset d = open_shards(cfg, 2, /*quiet=*/true);
  ASSERT_TRUE(d.latents);
  EXPECT_EQ(d.num_classes, 10);
  EXPECT_EQ(d.images.sizes(), (std::vector<int64_t>{8, 2 * z, s, s}));
  EXPECT_TRUE(torch::equal(d.images, torch::cat({mean, logvar}, 1).narrow(0, 0, 8)));
  ShardOrder order;
  order.shuffle = false;
  ShardLoader loader(d.shards, order, shard_loader_options(cfg, d, 3, 1));
  for (int64_t at = 0; at < 2 * n; at += 3) {  // past the epoch's end: it wraps
    const Batch b = loader.next();
    for (int64_t r = 0; r < 3; ++r) {
      const int64_t i = (at + r) % n;
      EXPECT_TRUE(torch::equal(b.x[r], torch::cat({mean[i], logvar[i]}))) << "sample " << i;
      EXPECT_EQ(b.y[r].item<int64_t>(), i % 10);
    }
  }
  // In order (a partition's pass, a router's held-out samples): the posteriors as written.
  int64_t seen = 0;
  for_each_in_order(d, cfg, 5, 1, [&](const torch::Tensor& x, const torch::Tensor&, int64_t first) {
    for (int64_t r = 0; r < x.size(0); ++r, ++seen)
      EXPECT_TRUE(torch::equal(x[r], torch::cat({mean[first + r], logvar[first + r]}))) << "sample " << first + r;
  });
  EXPECT_EQ(seen, 5);
  // Refused where a command needs images.
  EXPECT_TRUE(has(test::error_message([&] { require_images(d); }), "needs images"));
  // A posterior of another shape (among the first samples, which opening reads), a member that is
  // not safetensors (read by the loader): named by shard and key.
  cfg.root = dir.path + "/shape";
  write(cfg.root, 5, member(5, {z, s, s + 1}));
  const std::string e = test::error_message([&] { open_shards(cfg, 2, true); });
  EXPECT_TRUE(has(e, "latents-000001.tar, sample '00000005'") && has(e, "'logvar' is") && has(e, "[2, 3, 3]")) << e;
  cfg.root = dir.path + "/garbage";
  write(cfg.root, 9, "not safetensors");
  const Dataset garbage = open_shards(cfg, 2, true);
  cfg.skip_bad = true;
  ShardLoader l3(garbage.shards, order, shard_loader_options(cfg, garbage, 11, 1));
  l3.next();
  EXPECT_EQ(l3.skipped(), 1);
  EXPECT_TRUE(has(l3.last_skip(), "latents-000002.tar, sample '00000009'")) << l3.last_skip();
  // The record: another resolution, a missing shard, a missing record.
  cfg.skip_bad = false, cfg.root = dir.path + "/good", cfg.resolution = 28;
  EXPECT_TRUE(has(test::error_message([&] { open_shards(cfg, 1, true); }), "holds the latents of 1x12x12 images"));
  cfg.resolution = 0;
  fs::remove(latent_shard_path(cfg.root, 2));
  EXPECT_TRUE(has(test::error_message([&] { open_shards(cfg, 1, true); }), "latents-000002.tar does not exist"));
  fs::remove(cfg.root + "/encode.json");
  EXPECT_TRUE(has(test::error_message([&] { open_shards(cfg, 1, true); }), "is not a `ddm encode` output"));
}

// Latent shards keep their source's class names (encode.json's class_names), so a latent model's
// grids name Fashion-MNIST's classes as a pixel model's do; a record written before them still
// opens, with generic names; names that do not match num_classes are a clear error.
TEST(ShardLoader, LatentShardsRestoreTheClassNamesTheirRecordKeeps) {
  test::TempDir dir;
  const int64_t n = 4, z = 2, s = 3;
  LatentShardsInfo info;
  info.autoencoder = "/nowhere/ae", info.autoencoder_sha256 = std::string(64, 'a');
  info.latent_channels = z, info.latent_size = s, info.image_channels = 1, info.image_size = 12;
  info.samples = n, info.shards = 1, info.num_classes = 3, info.data = "random";
  info.class_names = {"T-shirt/top", "Trouser", "Pullover"};
  DataConfig cfg;
  cfg.source = "latents", cfg.root = dir.path + "/lat";
  fs::create_directories(cfg.root);
  {
    TarShardWriter w(latent_shard_path(cfg.root, 0));
    for (int64_t i = 0; i < n; ++i) {
      ShardSample smp;
      smp.key = zero_padded(i, 8);
      SafetensorsFile f;
      f.tensors["mean"] = torch::zeros({z, s, s});
      f.tensors["logvar"] = torch::zeros({z, s, s});
      smp.files["safetensors"] = safetensors_bytes(f);
      smp.files["cls"] = std::to_string(i % 3);
      w.add(smp);
    }
    w.finish();
  }
  const std::string record = cfg.root + "/encode.json";
  test::write_text(record, latent_shards_json(info).dump());
  EXPECT_EQ(read_latent_shards_info(cfg.root).class_names, info.class_names);
  EXPECT_EQ(open_shards(cfg, 1, /*quiet=*/true).class_names, info.class_names);
  // A record from before class_names: it opens as before, each class named by its number.
  nlohmann::json old = latent_shards_json(info);
  old.erase("class_names");
  test::write_text(record, old.dump());
  EXPECT_EQ(open_shards(cfg, 1, true).class_names, (std::vector<std::string>{"class 0", "class 1", "class 2"}));
  // Names for another number of classes: named, with what to do.
  old["class_names"] = {"T-shirt/top", "Trouser"};
  test::write_text(record, old.dump());
  const std::string e = test::error_message([&] { open_shards(cfg, 1, true); });
  EXPECT_TRUE(has(e, "encode.json: class_names has 2 names, but num_classes is 3") && has(e, "ddm encode")) << e;
}
