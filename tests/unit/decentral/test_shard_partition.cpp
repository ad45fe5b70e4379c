// Partitioning tar shards (decentral/shard_partition.h): the partition of a dataset written as
// shards equals the in-memory partition of that dataset, label for label; re-reading the shards for
// each PCA pass gives what keeping the pixels gives; every sample is listed in exactly one cluster
// and, with reshard, copied member for member into its cluster's shards; an expert's data.root is
// its cluster's shards, and partitions made on other shards or without reshard are clear errors.
#include <gtest/gtest.h>

#include <archive.h>
#include <archive_entry.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/error.h"
#include "core/safetensors.h"
#include "data/shard_write.h"
#include "data/shards.h"
#include "decentral/features.h"
#include "decentral/features_file.h"
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

// n random grey side x side images (labels 0) written as shards of shard_size into dir/shards.
ShardsWritten random_shards(const test::TempDir& dir, uint64_t seed, int64_t n, int64_t side, int64_t shard_size,
                            const std::string& prefix) {
  torch::manual_seed(seed);
  Dataset d;
  d.images = torch::randint(0, 256, {n, 1, side, side}, torch::kUInt8);
  d.labels = torch::zeros({n}, torch::kInt64);
  return write_shards(d, dir / "shards", shard_size, prefix);
}

// numpy.savez(path, features=rows, keys=keys) as numpy lays it out: a zip (here deflated, by
// libarchive) of features.npy ('<f4' [M, D]) and keys.npy ('<U' [M], ASCII keys).
void write_keyed_npz(const std::string& path, const torch::Tensor& rows, const std::vector<std::string>& keys) {
  const auto npy = [](const std::string& descr, const std::string& shape, const std::string& data) {
    std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + shape + "), }";
    header += std::string(63 - (10 + header.size()) % 64, ' ') + "\n";
    std::string out("\x93NUMPY\x01\x00", 8);
    out += static_cast<char>(header.size() & 0xff);
    out += static_cast<char>(header.size() >> 8);
    return out + header + data;
  };
  size_t width = 1;
  for (const std::string& k : keys) width = std::max(width, k.size());
  std::string utf32;
  for (const std::string& k : keys)
    for (size_t c = 0; c < width; ++c) {  // UTF-32LE, NUL-padded to the width
      utf32 += c < k.size() ? k[c] : '\0';
      utf32 += std::string(3, '\0');
    }
  const auto f = rows.to(torch::kFloat32).contiguous();
  const std::map<std::string, std::string> members{
      {"features.npy", npy("<f4", std::to_string(f.size(0)) + ", " + std::to_string(f.size(1)),
                           std::string(static_cast<const char*>(f.data_ptr()), f.numel() * 4))},
      {"keys.npy", npy("<U" + std::to_string(width), std::to_string(keys.size()) + ",", utf32)}};
  archive* a = archive_write_new();
  ASSERT_EQ(archive_write_set_format_zip(a), ARCHIVE_OK);
  ASSERT_EQ(archive_write_open_filename(a, path.c_str()), ARCHIVE_OK);
  for (const auto& [name, bytes] : members) {
    archive_entry* e = archive_entry_new();
    archive_entry_set_pathname(e, name.c_str());
    archive_entry_set_size(e, static_cast<la_int64_t>(bytes.size()));
    archive_entry_set_filetype(e, AE_IFREG);
    archive_entry_set_perm(e, 0644);
    ASSERT_EQ(archive_write_header(a, e), ARCHIVE_OK);
    ASSERT_EQ(archive_write_data(a, bytes.data(), bytes.size()), static_cast<la_ssize_t>(bytes.size()));
    archive_entry_free(e);
  }
  ASSERT_EQ(archive_write_close(a), ARCHIVE_OK);
  archive_write_free(a);
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
  // Larger than kMaxPixelSide: the pixels are downsampled to 32 x 32.
  const ShardsWritten w = random_shards(dir, 11, 300, 40, 64, "c");
  ShardPartitionOptions o = options(w.pattern, 40, "pixels:8");
  partition_shards(o, dir / "kept");
  o.keep_pixel_bytes = 0;
  partition_shards(o, dir / "read");
  const Partition a = load_partition(dir / "kept"), b = load_partition(dir / "read");
  EXPECT_TRUE(a.labels.equal(b.labels));
  EXPECT_TRUE(a.centroids.equal(b.centroids));
  EXPECT_TRUE(has(a.features, "downsampled to 32x32")) << a.features;
}

// Features computed elsewhere and saved with each sample's key (an .npz) give the partition that the
// same rows in shard order give, whatever the file's order and with rows for samples not in the shards.
TEST(ShardPartition, FeaturesByKeyGiveWhatTheSameRowsInShardOrderGive) {
  test::TempDir dir;
  const ShardsWritten w = random_shards(dir, 13, 120, 8, 50, "k");
  const auto rows = torch::randn({130, 5});  // sample i's features for i < 120, then 10 of no sample
  SafetensorsFile ordered;
  ordered.tensors["features"] = rows.narrow(0, 0, 120);
  save_safetensors(dir / "ordered.safetensors", ordered);
  std::vector<std::string> keys;
  for (int64_t i = 0; i < 130; ++i) keys.push_back(i < 120 ? zero_padded(i, 8) : "extra-" + std::to_string(i));
  const auto perm = torch::randperm(130, torch::kLong);
  std::vector<std::string> shuffled;
  for (int64_t i = 0; i < 130; ++i) shuffled.push_back(keys[static_cast<size_t>(perm[i].item<int64_t>())]);
  write_keyed_npz(dir / "keyed.npz", rows.index_select(0, perm), shuffled);

  partition_shards(options(w.pattern, 8, "file:" + (dir / "ordered.safetensors")), dir / "a");
  partition_shards(options(w.pattern, 8, "file:" + (dir / "keyed.npz")), dir / "b");
  const Partition a = load_partition(dir / "a"), b = load_partition(dir / "b");
  EXPECT_TRUE(a.labels.equal(b.labels));
  EXPECT_TRUE(a.centroids.equal(b.centroids));
  EXPECT_TRUE(has(b.features, "rows by key: 120 of 130")) << b.features;

  // Rows that deflate far below their size (more bytes than the archive) are read in pieces, as they arrive.
  write_keyed_npz(dir / "zeros.npz", torch::zeros({2000, 8}), std::vector<std::string>(2000, "k"));
  ASSERT_LT(fs::file_size(dir / "zeros.npz"), 2000u * 8 * 4);
  EXPECT_TRUE(has(test::error_message([&] { read_features_file(dir / "zeros.npz"); }), "the key 'k' names rows 0 and 1"));
  std::vector<std::string> distinct;
  for (int i = 0; i < 2000; ++i) distinct.push_back(std::to_string(i % 10));
  for (int i = 10; i < 2000; ++i) distinct[static_cast<size_t>(i)] = "s" + std::to_string(i);
  write_keyed_npz(dir / "zeros.npz", torch::zeros({2000, 8}), distinct);
  EXPECT_TRUE(read_features_file(dir / "zeros.npz").rows.equal(torch::zeros({2000, 8})));

  // A sample without a row is named, and nothing is written.
  write_keyed_npz(dir / "short.npz", rows.narrow(0, 0, 119), std::vector<std::string>(keys.begin(), keys.begin() + 119));
  try {
    partition_shards(options(w.pattern, 8, "file:" + (dir / "short.npz")), dir / "c");
    ADD_FAILURE() << "no error for a sample without a row";
  } catch (const Error& e) {
    EXPECT_TRUE(has(e.what(), "has no row for 1 of the 120 samples")) << e.what();
    EXPECT_TRUE(has(e.what(), "'" + zero_padded(119, 8) + "'")) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "c"));
}

TEST(ShardPartition, BadInputsAreClearErrors) {
  test::TempDir dir;
  const ShardsWritten w = random_shards(dir, 12, 40, 8, 20, "s");
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
