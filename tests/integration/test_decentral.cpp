// The decentralized pipeline through the ddm binary: partition, ... Each step on real Fashion-MNIST
// (a few thousand images), and each bad input exits non-zero with a clear message.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "decentral/partition.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace ddm;

namespace {
void expect_error(const test::CommandResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.output;
}
}  // namespace

TEST(DecentralCli, PartitionWritesBalancedClustersAndRefusesBadInput) {
  const test::TempDir dir;
  const std::string base = "partition --limit 2000 --k 4 --fine 64 --threads 2 ";
  auto r = test::run_ddm(base + "--out " + (dir / "p"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("pixels PCA 64 of 784"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sizes 500 to 500"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("NMI"), std::string::npos) << r.output;
  const Partition p = load_partition(dir / "p");
  EXPECT_EQ(p.n, 2000);
  EXPECT_EQ(p.k, 4);
  EXPECT_EQ(p.settings["features"], "pixels:64");
  const auto summary = nlohmann::json::parse(test::read_text(dir / "p/summary.json"));
  EXPECT_EQ(summary["sizes"].get<std::vector<int64_t>>(), (std::vector<int64_t>{500, 500, 500, 500}));
  EXPECT_GT(summary["nmi"].get<double>(), 0.2);  // pixel clusters follow the garment classes somewhat

  // The same command twice gives the same partition; an existing --out is kept without --force.
  const std::string before = test::read_text(dir / "p/partition.safetensors");
  expect_error(test::run_ddm(base + "--out " + (dir / "p")), "already exists");
  ASSERT_EQ(test::run_ddm(base + "--out " + (dir / "p") + " --force").exit_code, 0);
  EXPECT_EQ(test::read_text(dir / "p/partition.safetensors"), before);

  // Random and unbalanced modes.
  r = test::run_ddm("partition --limit 1000 --k 3 --method random --out " + (dir / "r"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("sizes 333 to 334"), std::string::npos) << r.output;
  r = test::run_ddm(base + "--unbalanced --features pixels:16 --out " + (dir / "u"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  expect_error(test::run_ddm("partition --limit 100 --k 101 --out " + (dir / "x")), "larger than the data");
  expect_error(test::run_ddm("partition --limit 100 --k 4 --features dino --out " + (dir / "x")),
               "is not a feature source");
  expect_error(test::run_ddm("partition --limit 100 --k 4 --features file:" + (dir / "none.npy") + " --out " +
                             (dir / "x")),
               "does not exist");
  expect_error(test::run_ddm("partition --limit 100 --k 8 --fine 4 --out " + (dir / "x")), "--fine 4 must be at least");
  expect_error(test::run_ddm("partition --k 4 --data-root " + (dir / "nowhere") + " --out " + (dir / "x")),
               "nowhere");
  EXPECT_FALSE(fs::exists(dir / "x"));
}
