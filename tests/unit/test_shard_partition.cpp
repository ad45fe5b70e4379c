// Partitioning tar shards (decentral/shard_partition.h): the partition of a dataset written as
// shards equals the in-memory partition of that dataset, label for label; re-reading the shards for
// each PCA pass gives what keeping the pixels gives; every sample is listed in exactly one cluster
// and, with reshard, copied member for member into its cluster's shards; an expert's data.root is
// its cluster's shards, and partitions made on other shards or without reshard are clear errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/error.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "decentral/features.h"
#include "decentral/partition.h"
#include "decentral/shard_partition.h"
#include "test_util.h"

using namespace ddm;
namespace fs = std::filesystem;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

DataConfig shards_at(const std::string& root) {
  DataConfig d;
  d.source = "shards";
  d.root = root;
  return d;
}

// Every sample of the shards `pattern` names: key -> its files.
std::map<std::string, std::map<std::string, std::string>> samples_of(const std::string& pattern) {
  std::map<std::string, std::map<std::string, std::string>> out;
  for (const std::string& shard : expand_shards(pattern, "test")) {
    TarShardReader r(shard);
    ShardSample s;
    while (r.next(s)) EXPECT_TRUE(out.emplace(s.key, s.files).second) << "key " << s.key << " twice";
  }
  return out;
}

ShardPartitionOptions options(const std::string& root, int64_t resolution, const std::string& features) {
  ShardPartitionOptions o;
  o.data.source = "shards";
  o.data.root = root;
  o.data.resolution = resolution;
  o.features = parse_feature_source(features);
  o.cfg.k = 3;
  o.cfg.fine = 24;
  o.cfg.seed = 7;
  o.cfg.quiet = true;
  o.threads = 2;
  return o;
}

}  // namespace

TEST(ShardPartition, EqualsTheInMemoryPartitionAndReshardsEverySampleOnce) {
  test::TempDir dir;
  DataConfig dc;
  dc.limit = 1500;
  const Dataset data = load_dataset(dc);  // Fashion-MNIST, 1500 x 1x28x28
  const ShardsWritten w = write_shards(data, dir / "shards", 200, "train");
  ASSERT_EQ(w.shards, 8);

  ShardPartitionOptions o = options(w.pattern, 28, "pixels:16");
  o.reshard = true;
  o.shard_size = 170;
  partition_shards(o, dir / "p");
  const Partition p = load_partition(dir / "p");
  const Features f = compute_features(data, o.features, o.cfg.seed, /*quiet=*/true);
  const Partition mem = make_partition(f.rows, 1500, o.cfg);
  ASSERT_EQ(p.n, 1500);
  EXPECT_TRUE(p.labels.equal(mem.labels)) << "the partition of the shards differs from the in-memory one";
  EXPECT_TRUE(p.sizes.equal(mem.sizes));
  EXPECT_TRUE(fs::exists(dir / "p/clusters.png"));

  // Lists: every key once, in its cluster (keys are the dataset's row numbers); reshards: the same
  // samples with the same bytes.
  const auto original = samples_of(w.pattern);
  std::set<std::string> listed;
  for (int64_t k = 0; k < p.k; ++k) {
    std::ifstream in(dir / ("p/clusters/cluster-" + std::to_string(k) + ".tsv"));
    std::string line;
    int64_t lines = 0;
    while (std::getline(in, line)) {
      ++lines;
      const std::string key = line.substr(line.find('\t') + 1);
      EXPECT_TRUE(listed.insert(key).second) << key;
      EXPECT_EQ(p.labels[std::stoll(key)].item<int64_t>(), k) << key;
      EXPECT_TRUE(fs::exists(line.substr(0, line.find('\t')))) << line;
    }
    EXPECT_EQ(lines, p.sizes[k].item<int64_t>());
    const std::string root = expert_shard_root(p, k, shards_at(w.pattern));
    const auto own = samples_of(root);
    EXPECT_EQ(static_cast<int64_t>(own.size()), p.sizes[k].item<int64_t>());
    EXPECT_EQ(static_cast<int64_t>(expand_shards(root, "test").size()), (p.sizes[k].item<int64_t>() + 169) / 170);
    for (const auto& [key, files] : own) {
      EXPECT_EQ(p.labels[std::stoll(key)].item<int64_t>(), k) << key;
      EXPECT_EQ(files, original.at(key)) << key;
    }
  }
  EXPECT_EQ(listed.size(), 1500u);

  // Another shard list (fewer shards), or a partition without reshard: clear errors.
  try {
    expert_shard_root(p, 0, shards_at(dir / "shards/train-{000000..000006}.tar"));
    ADD_FAILURE() << "no error for other shards";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "made on other shards")) << e.what();
  }
  o.reshard = false;
  partition_shards(o, dir / "q");
  EXPECT_FALSE(fs::exists(dir / "q/shards"));
  try {
    expert_shard_root(load_partition(dir / "q"), 0, shards_at(w.pattern));
    ADD_FAILURE() << "no error without reshard";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "--reshard")) << e.what();
  }
  try {
    expert_shard_root(mem, 0, shards_at(w.pattern));
    ADD_FAILURE() << "no error for an in-memory partition";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "in-memory data")) << e.what();
  }
}

TEST(ShardPartition, ReadingTheShardsForEachPassGivesWhatKeepingThePixelsGives) {
  test::TempDir dir;
  torch::manual_seed(11);
  Dataset d;  // larger than kMaxPixelSide: the pixels are downsampled to 32 x 32
  d.images = torch::randint(0, 256, {300, 1, 40, 40}, torch::kUInt8);
  d.labels = torch::zeros({300}, torch::kInt64);
  const ShardsWritten w = write_shards(d, dir / "shards", 64, "c");
  ShardPartitionOptions o = options(w.pattern, 40, "pixels:8");
  partition_shards(o, dir / "kept");
  o.keep_pixel_bytes = 0;
  partition_shards(o, dir / "read");
  const Partition a = load_partition(dir / "kept"), b = load_partition(dir / "read");
  EXPECT_TRUE(a.labels.equal(b.labels));
  EXPECT_TRUE(a.centroids.equal(b.centroids));
  EXPECT_TRUE(has(a.features, "downsampled to 32x32")) << a.features;
}

TEST(ShardPartition, BadInputsAreClearErrors) {
  test::TempDir dir;
  torch::manual_seed(12);
  Dataset d;
  d.images = torch::randint(0, 256, {40, 1, 8, 8}, torch::kUInt8);
  d.labels = torch::zeros({40}, torch::kInt64);
  const ShardsWritten w = write_shards(d, dir / "shards", 20, "s");
  const auto error_of = [&](ShardPartitionOptions o, const std::string& out) {
    try {
      partition_shards(o, out);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  ShardPartitionOptions o = options(w.pattern, 8, "autoencoder");
  EXPECT_TRUE(has(error_of(o, dir / "a"), "not supported over shards yet")) << error_of(o, dir / "a");
  o = options(w.pattern, 8, "pixels");
  o.cfg.k = 41;
  EXPECT_TRUE(has(error_of(o, dir / "b"), "larger than the data")) << error_of(o, dir / "b");
  o = options(w.pattern, 8, "pixels");
  o.data.skip_bad = true;
  EXPECT_TRUE(has(error_of(o, dir / "c"), "skip_bad")) << error_of(o, dir / "c");
  // A missing features file is named.
  o = options(w.pattern, 8, "file:" + (dir / "nope.npy"));
  EXPECT_TRUE(has(error_of(o, dir / "d"), "nope.npy")) << error_of(o, dir / "d");
  for (const char* out : {"a", "b", "c", "d"}) EXPECT_FALSE(fs::exists(dir / out)) << out;
}
