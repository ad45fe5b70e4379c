// Tests of k-means, balanced assignment, partitions (files, checks, subsets) and feature sources.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "core/error.h"
#include "core/safetensors.h"
#include "data/latent_shards.h"
#include "decentral/features.h"
#include "decentral/features_file.h"
#include "decentral/kmeans.h"
#include "decentral/partition.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {

// Blobs of the given sizes around centres 20 apart (std 1) in d dimensions; labels [N] in blob order.
std::pair<torch::Tensor, torch::Tensor> blobs(const std::vector<int64_t>& sizes, int64_t d, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<torch::Tensor> xs, ys;
  for (size_t b = 0; b < sizes.size(); ++b) {
    auto centre = torch::randn({1, d}, gen) * 20.0;
    xs.push_back(centre + torch::randn({sizes[b], d}, gen));
    ys.push_back(torch::full({sizes[b]}, static_cast<int64_t>(b), torch::kInt64));
  }
  return {torch::cat(xs), torch::cat(ys)};
}

std::vector<int64_t> ints(const torch::Tensor& t) {
  const auto c = t.to(torch::kInt64).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// True when `found` equals `truth` up to a renaming of the clusters.
bool same_clustering(const torch::Tensor& found, const torch::Tensor& truth, int64_t k) {
  const auto table = torch::zeros({k * k}, torch::kInt64).index_add_(0, found * k + truth, torch::ones_like(found)).view({k, k});
  return table.gt(0).sum(0).eq(1).all().item<bool>() && table.gt(0).sum(1).eq(1).all().item<bool>();
}

Dataset tiny_dataset(int64_t n, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Dataset d;
  d.images = torch::randint(0, 256, {n, 1, 8, 8}, gen).to(torch::kUInt8);
  d.labels = torch::randint(0, 3, {n}, gen);
  d.num_classes = 3;
  d.class_names = {"a", "b", "c"};
  d.description = "tiny random images";
  return d;
}

}  // namespace

TEST(KMeans, RecoversWellSeparatedClustersDeterministically) {
  auto [x, y] = blobs({120, 80, 200, 50, 150}, 6, 1);
  KMeansConfig cfg;
  cfg.k = 5;
  cfg.seed = 3;
  const auto a = kmeans(x, torch::Tensor(), cfg);
  EXPECT_TRUE(same_clustering(a.labels, y, 5));
  const auto b = kmeans(x, torch::Tensor(), cfg);
  EXPECT_TRUE(a.labels.equal(b.labels));
  EXPECT_TRUE(a.centroids.equal(b.centroids));
  // Sizes are the blob sizes; inertia is about N * d (unit variance per dimension).
  EXPECT_EQ(ints(std::get<0>(a.sizes.sort())), (std::vector<int64_t>{50, 80, 120, 150, 200}));
  EXPECT_NEAR(a.inertia / (600.0 * 6), 1.0, 0.15);
}

TEST(KMeans, WeightsActLikeRepeatedRows) {
  auto [x, y] = blobs({30, 30, 30}, 4, 2);
  const auto w = torch::randint(1, 5, {90}, at::make_generator<at::CPUGeneratorImpl>(9)).to(torch::kFloat64);
  KMeansConfig cfg;
  cfg.k = 3;
  const auto weighted = kmeans(x, w, cfg);
  EXPECT_TRUE(same_clustering(weighted.labels, y, 3));
  // Each centroid is the weighted mean of its blob.
  for (int64_t j = 0; j < 3; ++j) {
    const auto m = weighted.labels.eq(j);
    const auto rows = x.index({m}).to(torch::kFloat64), ws = w.index({m}).unsqueeze(1);
    const auto mean = ((rows * ws).sum(0) / ws.sum()).to(torch::kFloat32);
    EXPECT_TRUE(torch::allclose(weighted.centroids[j], mean, 1e-4, 1e-4)) << j;
  }
}

TEST(KMeans, CosineIgnoresRowScale) {
  auto [x, y] = blobs({60, 60, 60}, 5, 4);
  x = x / x.norm(2, 1, true);
  KMeansConfig cfg;
  cfg.k = 3;
  cfg.cosine = true;
  const auto a = kmeans(x, torch::Tensor(), cfg);
  EXPECT_TRUE(torch::allclose(a.centroids.norm(2, 1), torch::ones({3}), 1e-5, 1e-5));
  PartitionConfig pc;
  pc.k = 3;
  pc.fine = 12;
  pc.metric = "cosine";
  pc.balanced = false;
  pc.quiet = true;
  const auto scale = torch::rand({180, 1}, at::make_generator<at::CPUGeneratorImpl>(5)) * 10 + 0.1;
  const auto p1 = make_partition(x, 180, pc), p2 = make_partition(x * scale, 180, pc);
  EXPECT_TRUE(p1.labels.equal(p2.labels));
  EXPECT_TRUE(same_clustering(p1.labels, y, 3));
}

TEST(KMeans, BadInputsAreClear) {
  KMeansConfig cfg;
  cfg.k = 11;
  EXPECT_NE(test::error_message([&] { kmeans(torch::randn({10, 2}), torch::Tensor(), cfg); }).find("k = 11"),
            std::string::npos);
  cfg.k = 2;
  auto bad = torch::randn({10, 2});
  bad[3][1] = NAN;
  EXPECT_NE(test::error_message([&] { kmeans(bad, torch::Tensor(), cfg); }).find("NaN"), std::string::npos);
  EXPECT_NE(test::error_message([&] { kmeans(torch::randn({10}), torch::Tensor(), cfg); }).find("[N, D]"),
            std::string::npos);
}

TEST(BalancedAssign, RespectsCapacitiesAndIsOptimalWhenLoose) {
  const auto cost = torch::rand({50, 4}, at::make_generator<at::CPUGeneratorImpl>(1)).to(torch::kFloat64);
  const auto w = torch::randint(1, 6, {50}, at::make_generator<at::CPUGeneratorImpl>(2));
  // Loose capacities: every row goes wholly to its cheapest cluster.
  const auto loose = greedy_capacity_assign(cost, w, torch::full({4}, 1000, torch::kInt64));
  EXPECT_TRUE(loose.argmax(1).equal(cost.argmin(1)));
  EXPECT_TRUE(loose.sum(1).equal(w));
  // Tight capacities: exactly met, each row's weight fully placed.
  const auto cap = equal_capacities(w.sum().item<int64_t>(), 4);
  const auto tight = greedy_capacity_assign(cost, w, cap);
  EXPECT_TRUE(tight.sum(0).equal(cap));
  EXPECT_TRUE(tight.sum(1).equal(w));
  EXPECT_TRUE(tight.ge(0).all().item<bool>());
  EXPECT_EQ(ints(equal_capacities(10, 4)), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_NE(test::error_message([&] { greedy_capacity_assign(cost, w, torch::ones({4}, torch::kInt64)); })
                .find("below the total weight"),
            std::string::npos);
}

TEST(Partition, TwoStageRecoversClustersAndBalancedModeGivesEqualSizes) {
  PartitionConfig pc;
  pc.k = 4;
  pc.fine = 40;
  pc.quiet = true;
  {  // equal blobs: balanced two-stage k-means finds them exactly
    auto [x, y] = blobs({100, 100, 100, 100}, 8, 7);
    const auto p = make_partition(x, 400, pc);
    EXPECT_TRUE(same_clustering(p.labels, y, 4));
    EXPECT_EQ(ints(p.sizes), (std::vector<int64_t>{100, 100, 100, 100}));
  }
  auto [x, y] = blobs({40, 90, 170, 303}, 8, 8);  // 603 rows of very unequal blobs
  pc.balanced = false;
  const auto plain = make_partition(x, 603, pc);
  EXPECT_TRUE(same_clustering(plain.labels, y, 4));
  pc.balanced = true;
  const auto bal = make_partition(x, 603, pc);
  EXPECT_EQ(ints(std::get<0>(bal.sizes.sort())), (std::vector<int64_t>{150, 151, 151, 151}));
  EXPECT_TRUE(bal.sizes.equal(torch::bincount(bal.labels, {}, 4).to(torch::kInt64)));
  EXPECT_TRUE(bal.labels.equal(make_partition(x, 603, pc).labels));  // deterministic
  pc.seed = 1;
  EXPECT_EQ(make_partition(x, 603, pc).sizes.max().item<int64_t>(), 151);
  // The smallest blob stays whole: balancing moves rows only where it must.
  const auto small = bal.labels.masked_select(y.eq(0));
  EXPECT_TRUE(small.eq(small[0]).all().item<bool>());
}

TEST(Partition, RandomIsBalancedAndSeeded) {
  PartitionConfig pc;
  pc.k = 3;
  pc.method = "random";
  const auto a = make_partition(torch::Tensor(), 100, pc);
  EXPECT_EQ(ints(a.sizes), (std::vector<int64_t>{34, 33, 33}));
  EXPECT_TRUE(a.labels.equal(make_partition(torch::Tensor(), 100, pc).labels));
  pc.seed = 1;
  EXPECT_FALSE(a.labels.equal(make_partition(torch::Tensor(), 100, pc).labels));
  pc.k = 101;
  EXPECT_NE(test::error_message([&] { make_partition(torch::Tensor(), 100, pc); }).find("larger than the data"),
            std::string::npos);
  pc.k = 3;
  pc.method = "spectral";
  EXPECT_NE(test::error_message([&] { make_partition(torch::Tensor(), 100, pc); }).find("spectral"), std::string::npos);
}

TEST(Partition, FilesRoundTripAndMustMatchTheirData) {
  const test::TempDir tmp;
  const Dataset data = tiny_dataset(90, 1);
  PartitionConfig pc;
  pc.k = 3;
  pc.fine = 9;
  pc.quiet = true;
  Partition p = make_partition(to_unit_range(data.images).flatten(1), 90, pc);
  p.data_sha256 = dataset_sha256(data);
  p.data_description = data.description;
  p.features = "pixels";
  const auto summary = partition_summary(p, data);
  EXPECT_EQ(summary["sizes"].get<std::vector<int64_t>>(), (std::vector<int64_t>{30, 30, 30}));
  EXPECT_GE(summary["purity"].get<double>(), 1.0 / 3);
  EXPECT_NE(format_summary(summary).find("purity"), std::string::npos);
  const std::string dir = tmp / "part";
  save_partition(dir, p, summary, false);
  EXPECT_NE(test::error_message([&] { save_partition(dir, p, summary, false); }).find("already exists"),
            std::string::npos);
  const Partition q = load_partition(dir);
  EXPECT_TRUE(q.labels.equal(p.labels));
  EXPECT_TRUE(q.centroids.equal(p.centroids));
  EXPECT_EQ(q.settings, p.settings);
  check_partition_matches(q, data);
  const Dataset sub = cluster_subset(data, q, 1);
  EXPECT_EQ(sub.images.size(0), 30);
  EXPECT_TRUE(sub.images.equal(data.images.index_select(0, q.labels.eq(1).nonzero().squeeze(1))));
  EXPECT_NE(test::error_message([&] { cluster_subset(data, q, 3); }).find("clusters 0..2"), std::string::npos);

  // Other data: fewer rows, or same count but other images.
  EXPECT_NE(test::error_message([&] { check_partition_matches(q, tiny_dataset(80, 1)); }).find("80 images"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] { check_partition_matches(q, tiny_dataset(90, 2)); }).find("other images"),
            std::string::npos);
  // Damaged or foreign files.
  EXPECT_NE(test::error_message([&] { load_partition(tmp / "nope"); }).find("not found"), std::string::npos);
  SafetensorsFile f = load_safetensors(dir + "/partition.safetensors");
  f.tensors["labels"][0] = 7;
  save_safetensors(tmp / "bad.safetensors", f);
  EXPECT_NE(test::error_message([&] { load_partition(tmp / "bad.safetensors"); }).find("damaged"), std::string::npos);
  f.metadata.erase("format");
  save_safetensors(tmp / "foreign.safetensors", f);
  EXPECT_NE(test::error_message([&] { load_partition(tmp / "foreign.safetensors"); }).find("not a ddm partition"),
            std::string::npos);
  // --force replaces the directory; the old one stays intact until the new one is complete.
  const torch::Tensor before = p.labels;
  p.labels = p.labels.roll(1);
  // A write that fails half-way (a full disk) leaves the old partition as it was and no temporary
  // directory beside it.
  const auto failed = test::error_message([&] {
    save_partition(dir, p, summary, true, [](const std::string&) { DDM_FAIL("no space left (the test's)"); });
  });
  EXPECT_NE(failed.find("no space left (the test's)"), std::string::npos) << failed;
  EXPECT_TRUE(load_partition(dir).labels.equal(before));
  for (const auto& e : fs::directory_iterator(tmp.path))
    EXPECT_EQ(e.path().filename().string().find("part.tmp-"), std::string::npos) << e.path();
  save_partition(dir, p, summary, true);
  EXPECT_TRUE(load_partition(dir).labels.equal(p.labels));
}

// The summary's first line says what was partitioned: images, or the posteriors of latent shards
// (`ddm partition` over data.source = "latents"); a summary written before it said images.
TEST(Partition, TheSummaryCountsLatentsForLatentShardsAndImagesOtherwise) {
  PartitionConfig pc;
  pc.k = 3;
  pc.method = "random";
  const Partition p = make_partition(torch::Tensor(), 90, pc);
  Dataset data = tiny_dataset(90, 1);
  auto summary = partition_summary(p, data);
  EXPECT_EQ(summary["items"], "images");
  EXPECT_EQ(format_summary(summary).rfind("partition of 90 images into 3 clusters: sizes 30 to 30\n", 0), 0u)
      << format_summary(summary);
  data.latents = std::make_shared<const LatentShardsInfo>();
  summary = partition_summary(p, data);
  EXPECT_EQ(summary["items"], "latents");
  const std::string text = format_summary(summary);
  EXPECT_EQ(text.rfind("partition of 90 latents into 3 clusters: sizes 30 to 30\n", 0), 0u) << text;
  EXPECT_EQ(text.find("images"), std::string::npos) << text;
  summary.erase("items");
  EXPECT_EQ(format_summary(summary).rfind("partition of 90 images into 3 clusters", 0), 0u);
}

TEST(Partition, DamagedMetadataIsAClearError) {
  // Found by fuzzing: metadata that is not a number (k) or not JSON (settings) escaped as
  // std::invalid_argument / nlohmann::json::parse_error instead of an error naming the file.
  const test::TempDir tmp;
  PartitionConfig pc;
  pc.k = 2;
  pc.method = "random";
  pc.quiet = true;
  Partition p = make_partition(torch::Tensor(), 6, pc);
  save_partition(tmp / "part", p, nlohmann::json::object(), false);
  const SafetensorsFile good = load_safetensors(tmp / "part/partition.safetensors");
  auto error_with = [&](const std::string& key, const std::string& value) {
    SafetensorsFile f = good;
    f.metadata[key] = value;
    save_safetensors(tmp / "bad.safetensors", f);
    return test::error_message([&] { load_partition(tmp / "bad.safetensors"); });
  };
  for (const char* k : {"two", "", "2x", "-1", "0", "99999999999999999999"}) {
    const std::string msg = error_with("k", k);
    EXPECT_NE(msg.find("bad.safetensors: metadata 'k' is '" + std::string(k) + "', expected an integer >= 1"),
              std::string::npos) << msg;
  }
  EXPECT_NE(error_with("n", "-3").find("metadata 'n' is '-3', expected an integer >= 0"), std::string::npos);
  for (const char* settings : {"{no", "[1, 2]", ""})
    EXPECT_NE(error_with("settings", settings).find("metadata 'settings' is not a JSON object"), std::string::npos)
        << settings;
}

TEST(Features, PcaFindsTheLargestVarianceDirections) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  // Standard deviations 5, 2, 0.1 along a random rotation of 3-d space.
  const auto q = std::get<0>(torch::linalg_qr(torch::randn({3, 3}, gen).to(torch::kFloat64)));
  const auto z = torch::randn({20000, 3}, gen).to(torch::kFloat64) * torch::tensor({5.0, 2.0, 0.1}, torch::kFloat64);
  const auto x = (z.mm(q.t()) + 3.0).to(torch::kFloat32);
  double kept = 0;
  const auto proj = pca_project(x, 2, &kept);
  EXPECT_NEAR(kept, 29.0 / 29.01, 2e-3);
  EXPECT_NEAR(proj.select(1, 0).std().item<double>(), 5.0, 0.1);
  EXPECT_NEAR(proj.select(1, 1).std().item<double>(), 2.0, 0.05);
  EXPECT_NEAR(proj.mean(0).abs().max().item<double>(), 0.0, 1e-3);
  EXPECT_TRUE(proj.equal(pca_project(x, 2)));
}

TEST(Features, FilesInNpyAndSafetensors) {
  const test::TempDir tmp;
  const auto load_features_file = [](const std::string& path) { return read_features_file(path).rows; };
  const auto rows = torch::randn({5, 3});
  auto write_npy = [&](const std::string& path, const std::string& descr, const std::string& shape,
                       const void* data, size_t bytes, bool fortran = false) {
    std::string header = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                         ", 'shape': (" + shape + "), }";
    header += std::string(63 - (10 + header.size()) % 64, ' ') + "\n";
    std::ofstream o(path, std::ios::binary);
    o.write("\x93NUMPY\x01\x00", 8);
    const uint16_t len = static_cast<uint16_t>(header.size());
    o.write(reinterpret_cast<const char*>(&len), 2);
    o << header;
    o.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  };
  write_npy(tmp / "f4.npy", "<f4", "5, 3", rows.data_ptr(), 60);
  EXPECT_TRUE(load_features_file(tmp / "f4.npy").equal(rows));
  const auto r64 = rows.to(torch::kFloat64);
  write_npy(tmp / "f8.npy", "<f8", "5, 3", r64.data_ptr(), 120);
  EXPECT_TRUE(load_features_file(tmp / "f8.npy").equal(rows));
  write_npy(tmp / "short.npy", "<f4", "5, 3", rows.data_ptr(), 56);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "short.npy"); }).find("truncated"), std::string::npos);
  write_npy(tmp / "int.npy", "<i8", "5, 3", r64.data_ptr(), 120);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "int.npy"); }).find("'<i8'"), std::string::npos);
  write_npy(tmp / "1d.npy", "<f4", "15,", rows.data_ptr(), 60);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "1d.npy"); }).find("2-D"), std::string::npos);
  write_npy(tmp / "fortran.npy", "<f4", "5, 3", rows.data_ptr(), 60, true);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "fortran.npy"); }).find("Fortran"), std::string::npos);
  // Found by fuzzing: a shape that is not a list of integers escaped as std::invalid_argument
  // (std::stoll), and negative or huge ones overflowed the byte count.
  for (const char* shape : {"3; x, 2", "-1, 3", "5, 3a", "4611686018427387904, 4", "99999999999999999999, 1"}) {
    write_npy(tmp / "shape.npy", "<f4", shape, rows.data_ptr(), 60);
    const std::string msg = test::error_message([&] { load_features_file(tmp / "shape.npy"); });
    EXPECT_TRUE(msg.find("malformed .npy shape") != std::string::npos ||
                msg.find("implausibly large") != std::string::npos)
        << shape << ": " << msg;
  }
  test::write_text(tmp / "junk.npy", "not numpy");
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "junk.npy"); }).find("bad magic"), std::string::npos);

  SafetensorsFile f;
  f.tensors["features"] = rows;
  f.tensors["ids"] = torch::arange(5);
  save_safetensors(tmp / "f.safetensors", f);
  EXPECT_TRUE(load_features_file(tmp / "f.safetensors").equal(rows));
  f.tensors.erase("features");
  f.tensors["other"] = rows;
  save_safetensors(tmp / "g.safetensors", f);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "g.safetensors"); }).find("name the features tensor"),
            std::string::npos);
  // `ddm text encode`'s file (states, mask, pooled, ids and the encoder named): its pooled embeddings.
  SafetensorsFile encoded;
  encoded.tensors["states"] = torch::zeros({5, 4, 3});
  encoded.tensors["mask"] = torch::ones({5, 4}, torch::kBool);
  encoded.tensors["pooled"] = rows;
  encoded.tensors["ids"] = torch::zeros({5, 4}, torch::kLong);
  encoded.metadata["encoder"] = "BERT sentence encoder";
  save_safetensors(tmp / "encoded.safetensors", encoded);
  EXPECT_TRUE(load_features_file(tmp / "encoded.safetensors").equal(rows));
  encoded.tensors["pooled"] = torch::zeros({5});
  save_safetensors(tmp / "encoded.safetensors", encoded);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "encoded.safetensors"); })
                .find("tensor 'pooled' (ddm text encode's pooled embedding): features must be 2-D"),
            std::string::npos);
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "f.csv"); }).find("does not exist"), std::string::npos);
  test::write_text(tmp / "f.csv", "1,2\n");
  EXPECT_NE(test::error_message([&] { load_features_file(tmp / "f.csv"); }).find("use a .npy, .npz or .safetensors"),
            std::string::npos);

  // A file whose row count differs from the dataset's.
  const Dataset data = tiny_dataset(6, 1);
  EXPECT_NE(test::error_message([&] { compute_features(data, parse_feature_source("file:" + (tmp / "f4.npy")), 0, true); })
                .find("one row per image"),
            std::string::npos);
  EXPECT_EQ(compute_features(tiny_dataset(5, 1), parse_feature_source("file:" + (tmp / "f4.npy")), 0, true)
                .rows.size(1),
            3);
}

// .npz files as numpy writes them (tests/data/README.md): the features with each row's sample key,
// stored or deflated, '<U' or '|S' keys; rows_by_key puts them in the data's order.
TEST(Features, NpzFilesAsNumpyWritesThem) {
  const auto fixture = [](const std::string& name) { return test::source_dir() + "/tests/data/" + name; };
  const auto rows = torch::tensor({1.5f, -2.0f, 0.25f, 4.0f, 3.0f, 0.5f}).view({3, 2});
  const std::vector<std::string> keys{"b/002", "a/001", "c\xc3\xa9\xe2\x98\x83"};  // "cé☃" in UTF-8
  for (const char* name : {"features-keyed.npz", "features-keyed-compressed.npz"}) {
    const FeaturesFile f = read_features_file(fixture(name));
    EXPECT_TRUE(f.rows.equal(rows)) << name;
    EXPECT_EQ(f.keys, keys) << name;
  }
  EXPECT_EQ(read_features_file(fixture("features-bytes-keys.npz")).keys,
            (std::vector<std::string>{"b/002", "a/001", "c"}));
  const FeaturesFile alone = read_features_file(fixture("features-alone.npz"));
  EXPECT_TRUE(alone.rows.equal(rows));
  EXPECT_TRUE(alone.keys.empty());

  // Rows by key, in the data's order; a sample without a row, or two samples of one key, are named.
  const FeaturesFile f = read_features_file(fixture("features-keyed.npz"));
  EXPECT_TRUE(rows_by_key(f, {"a/001", keys[2], "b/002"}, "f.npz", "the data").equal(rows.index_select(0, torch::tensor({1, 2, 0}))));
  EXPECT_TRUE(rows_by_key(f, {"b/002"}, "f.npz", "the data").equal(rows.narrow(0, 0, 1)));  // extra rows are fine
  std::string msg = test::error_message([&] { rows_by_key(f, {"a/001", "zz", "b/002"}, "f.npz", "the data"); });
  EXPECT_NE(msg.find("f.npz: has no row for 1 of the 3 samples of the data (keys 'zz')"), std::string::npos) << msg;
  msg = test::error_message([&] { rows_by_key(f, {"a/001", "b/002", "a/001"}, "f.npz", "the data"); });
  EXPECT_NE(msg.find("the key 'a/001' names samples 0 and 2"), std::string::npos) << msg;

  // Bad files: each error names the file and what is wrong.
  const auto error_of = [&](const std::string& path) { return test::error_message([&] { read_features_file(path); }); };
  const std::pair<const char*, const char*> bad[] = {
      {"features-object-keys.npz", "pickle"},
      {"features-short-keys.npz", "has 2 keys for 3 rows"},
      {"features-duplicate-keys.npz", "the key 'a' names rows 0 and 2"},
      {"features-extra-array.npz", "holds the arrays 'features', 'ids', 'keys'"},
  };
  for (const auto& [name, says] : bad) {
    msg = error_of(fixture(name));
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find(says), std::string::npos) << msg;
  }
  const test::TempDir tmp;
  const std::string whole = test::read_text(fixture("features-keyed.npz"));
  test::write_text(tmp / "cut.npz", whole.substr(0, whole.size() / 2));
  msg = error_of(tmp / "cut.npz");
  EXPECT_NE(msg.find("cut.npz"), std::string::npos) << msg;
  test::write_text(tmp / "text.npz", "not a zip archive");
  msg = error_of(tmp / "text.npz");
  EXPECT_NE(msg.find("text.npz"), std::string::npos) << msg;

  // In memory, samples have no keys: a keyed file is refused.
  msg = test::error_message([&] { compute_features(tiny_dataset(3, 1), parse_feature_source("file:" + fixture("features-keyed.npz")), 0, true); });
  EXPECT_NE(msg.find("only sharded data have"), std::string::npos) << msg;
  EXPECT_EQ(compute_features(tiny_dataset(3, 1), parse_feature_source("file:" + fixture("features-alone.npz")), 0, true)
                .rows.size(0),
            3);
}

TEST(Features, SpecsAndLabelFreeSources) {
  EXPECT_EQ(parse_feature_source("pixels").dim, 64);
  EXPECT_EQ(parse_feature_source("pixels:16").dim, 16);
  EXPECT_EQ(parse_feature_source("autoencoder").dim, 32);
  EXPECT_EQ(parse_feature_source("file:x.npy").path, "x.npy");
  EXPECT_EQ(parse_feature_source("pixels:16").spec(), "pixels:16");
  EXPECT_NE(test::error_message([] { parse_feature_source("dino"); }).find("is not a feature source"),
            std::string::npos);
  EXPECT_NE(test::error_message([] { parse_feature_source("pixels:0"); }).find("positive dimension"),
            std::string::npos);
  EXPECT_NE(test::error_message([] { parse_feature_source("file:"); }).find("needs a path"), std::string::npos);
  // The autoencoder trains on images alone and is deterministic from the seed.
  const Dataset data = tiny_dataset(300, 4);
  const auto a = compute_features(data, parse_feature_source("autoencoder:6"), 1, true).rows;
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{300, 6}));
  EXPECT_TRUE(a.equal(compute_features(data, parse_feature_source("autoencoder:6"), 1, true).rows));
  EXPECT_TRUE(torch::isfinite(a).all().item<bool>());
}
