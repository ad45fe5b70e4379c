// Two-stage balanced k-means partitions, random partitions, their files and summaries (see partition.h).
#include "decentral/partition.h"

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <numeric>
#include <random>
#include <sstream>

#include <unistd.h>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "data/shard_stream.h"
#include "decentral/kmeans.h"
#include "decentral/shard_partition.h"
#include "eval/grid.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

constexpr const char* kFormat = "ddm-partition-1";
constexpr int64_t kGridCols = 12, kGridRows = 64;  // clusters.png: images per cluster, clusters at most

std::function<void(int64_t, double, int64_t)> iter_printer(const char* stage, int64_t max_iter, bool quiet) {
  if (quiet) return nullptr;
  return [stage, max_iter](int64_t it, double inertia, int64_t changed) {
    if (it % 5 != 0 && changed != 0 && it != max_iter) return;
    std::printf("  %s iter %lld/%lld  inertia %.6g  moved %lld\n", stage, static_cast<long long>(it),
                static_cast<long long>(max_iter), inertia, static_cast<long long>(changed));
    std::fflush(stdout);
  };
}

// Balanced labels from a fine-to-coarse allocation: a fine cluster allocated wholly to one coarse
// cluster sends all its images there; a split one divides its images by their own distances to the
// coarse centroids, under the allocation's counts.
torch::Tensor labels_from_allocation(const torch::Tensor& x, const torch::Tensor& fine_labels,
                                     const torch::Tensor& allocation, const torch::Tensor& coarse) {
  auto labels = allocation.argmax(1).index_select(0, fine_labels);  // [N]
  const auto split = allocation.gt(0).sum(1).gt(1).nonzero().squeeze(1);
  for (int64_t i = 0; i < split.size(0); ++i) {
    const int64_t f = split[i].item<int64_t>();
    const auto rows = fine_labels.eq(f).nonzero().squeeze(1);  // ascending
    const auto cost = squared_distances(x.index_select(0, rows), coarse);
    const auto alloc = greedy_capacity_assign(cost, torch::ones({rows.size(0)}, torch::kInt64), allocation[f]);
    labels.index_put_({rows}, alloc.argmax(1));
  }
  return labels;
}

}  // namespace

void check_partition_config(const PartitionConfig& cfg) {
  DDM_CHECK(cfg.k >= 2, "--k " << cfg.k << ": a partition needs at least 2 clusters (a router chooses among >= 2 "
                                   "experts); for one model on all the data use `ddm train`");
  DDM_CHECK(cfg.method == "kmeans" || cfg.method == "random",
            "--method '" << cfg.method << "': use kmeans or random");
  DDM_CHECK(cfg.metric == "euclidean" || cfg.metric == "cosine",
            "--metric '" << cfg.metric << "': use euclidean or cosine");
  DDM_CHECK(cfg.method == "random" || cfg.fine >= cfg.k, "--fine " << cfg.fine << " must be at least --k " << cfg.k);
}

Partition make_partition(const torch::Tensor& features, int64_t n, const PartitionConfig& cfg) {
  check_partition_config(cfg);
  DDM_CHECK(cfg.k <= n, "--k " << cfg.k << " is larger than the data (" << n << " images); use at most " << n);
  Partition p;
  p.k = cfg.k;
  p.n = n;
  p.settings = {{"k", cfg.k},         {"method", cfg.method}, {"fine", cfg.fine},         {"balanced", cfg.balanced},
                {"metric", cfg.metric}, {"max_iter", cfg.max_iter}, {"seed", cfg.seed}};
  if (cfg.method == "random") {  // a seeded shuffle dealt round-robin: sizes differ by at most one
    std::vector<int64_t> perm(static_cast<size_t>(n));
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 gen(derive_seed({cfg.seed, 0x7a4d0aULL}));
    for (int64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[gen() % static_cast<uint64_t>(i + 1)]);
    p.labels = torch::empty({n}, torch::kInt64);
    auto lab = p.labels.accessor<int64_t, 1>();
    for (int64_t i = 0; i < n; ++i) lab[perm[i]] = i % cfg.k;
    p.settings.erase("fine");
    p.settings.erase("metric");
    p.settings.erase("max_iter");
    p.settings.erase("balanced");
  } else {
    DDM_CHECK(features.defined() && features.dim() == 2 && features.size(0) == n,
              "partition: expected features [" << n << ", D], got " << features.sizes());
    int64_t fine = std::min(cfg.fine, n);
    DDM_CHECK(fine >= cfg.k, "--fine " << cfg.fine << " must be at least --k " << cfg.k);
    auto x = features.to(torch::kFloat32).contiguous();
    if (cfg.metric == "cosine") x = x / x.norm(2, 1, true).clamp_min(1e-12);
    const auto t0 = std::chrono::steady_clock::now();
    KMeansConfig fc;
    fc.k = fine;
    fc.max_iter = cfg.max_iter;
    fc.cosine = cfg.metric == "cosine";
    fc.seed = derive_seed({cfg.seed, 1});
    fc.on_iter = iter_printer("fine", cfg.max_iter, cfg.quiet);
    const KMeansResult f = kmeans(x, torch::Tensor(), fc);
    if (!cfg.quiet)
      std::printf("fine k-means: %lld centroids, %lld iterations, %.1f s\n", static_cast<long long>(fine),
                  static_cast<long long>(f.iterations), seconds_since(t0));

    const auto t1 = std::chrono::steady_clock::now();
    KMeansConfig cc = fc;
    cc.k = cfg.k;
    cc.seed = derive_seed({cfg.seed, 2});
    cc.init_sample = fine;
    cc.on_iter = iter_printer("coarse", cfg.max_iter, cfg.quiet);
    const auto counts = torch::bincount(f.labels, {}, fine).to(torch::kInt64);  // [F]
    if (cfg.balanced) cc.capacity = equal_capacities(n, cfg.k);
    const KMeansResult c = kmeans(f.centroids, counts, cc);
    p.labels = cfg.balanced ? labels_from_allocation(x, f.labels, c.allocation, c.centroids)
                            : c.labels.index_select(0, f.labels);
    if (!cfg.quiet)
      std::printf("coarse k-means: %lld clusters of the fine centroids, %lld iterations, %.1f s\n",
                  static_cast<long long>(cfg.k), static_cast<long long>(c.iterations), seconds_since(t1));
    p.centroids = c.centroids;
    p.fine_labels = f.labels;
    p.fine_centroids = f.centroids;
    p.settings["fine"] = fine;
  }
  p.sizes = torch::bincount(p.labels, {}, cfg.k).to(torch::kInt64);
  return p;
}

std::string dataset_sha256(const Dataset& data) {
  const auto img = data.images.contiguous();
  return sha256_hex(std::string(static_cast<const char*>(img.data_ptr()), static_cast<size_t>(img.nbytes())));
}

nlohmann::json partition_summary(const Partition& p, const Dataset& data) {
  nlohmann::json s;
  const auto sizes = p.sizes.to(torch::kInt64);
  std::vector<int64_t> sz(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + p.k);
  s["k"] = p.k;
  s["n"] = p.n;
  s["items"] = data.latents ? "latents" : "images";  // what the n rows are (format_summary says it)
  s["sizes"] = sz;
  s["min_size"] = *std::min_element(sz.begin(), sz.end());
  s["max_size"] = *std::max_element(sz.begin(), sz.end());
  s["features"] = p.features;
  s["settings"] = p.settings;
  s["data"] = p.data_description;
  const int64_t nc = data.num_classes;
  if (nc >= 2 && data.labels.size(0) == p.n) {
    // Contingency table [K, classes], purity and normalized mutual information (arithmetic mean).
    const auto table = torch::zeros({p.k * nc}, torch::kFloat64)
                           .index_add_(0, p.labels * nc + data.labels, torch::ones({p.n}, torch::kFloat64))
                           .view({p.k, nc});
    const double n = static_cast<double>(p.n);
    const auto pk = table.sum(1) / n, pc = table.sum(0) / n, pj = table / n;
    auto entropy = [](const torch::Tensor& q) {
      const auto nz = q.masked_select(q.gt(0));
      return -(nz * nz.log()).sum().item<double>();
    };
    const auto outer = pk.unsqueeze(1) * pc.unsqueeze(0);
    const auto mask = pj.gt(0);
    const double mi = (pj.masked_select(mask) * (pj.masked_select(mask) / outer.masked_select(mask)).log()).sum().item<double>();
    const double hk = entropy(pk), hc = entropy(pc);
    s["purity"] = std::get<0>(table.max(1)).sum().item<double>() / n;
    s["nmi"] = hk + hc > 0 ? 2 * mi / (hk + hc) : 0.0;
    nlohmann::json clusters = nlohmann::json::array();
    for (int64_t k = 0; k < p.k; ++k) {
      const auto row = table[k];
      const auto order = row.argsort(0, /*descending=*/true);
      nlohmann::json top = nlohmann::json::array();
      for (int64_t j = 0; j < std::min<int64_t>(3, nc); ++j) {
        const int64_t c = order[j].item<int64_t>();
        const double frac = sz[k] ? row[c].item<double>() / static_cast<double>(sz[k]) : 0.0;
        if (frac <= 0) break;
        top.push_back({{"class", c < static_cast<int64_t>(data.class_names.size()) ? data.class_names[c] : std::to_string(c)},
                       {"fraction", frac}});
      }
      clusters.push_back({{"cluster", k}, {"size", sz[k]}, {"top_classes", top}});
    }
    s["clusters"] = clusters;
  }
  return s;
}

std::string format_summary(const nlohmann::json& s) {
  std::ostringstream o;
  const auto sizes = s.at("sizes").get<std::vector<int64_t>>();
  const int64_t mx = s.at("max_size").get<int64_t>();
  o << "partition of " << s.at("n").get<int64_t>() << " " << s.value("items", std::string("images")) << " into "
    << s.at("k").get<int64_t>() << " clusters: sizes " << s.at("min_size").get<int64_t>() << " to " << mx << "\n";
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int bar = mx ? static_cast<int>(std::lround(30.0 * static_cast<double>(sizes[k]) / static_cast<double>(mx))) : 0;
    o << "  " << std::setw(3) << k << " " << std::setw(8) << sizes[k] << " " << std::string(static_cast<size_t>(bar), '#');
    if (s.contains("clusters")) {
      o << std::string(static_cast<size_t>(31 - bar), ' ');
      for (const auto& t : s["clusters"][k]["top_classes"])
        o << " " << t["class"].get<std::string>() << " " << std::fixed << std::setprecision(0)
          << 100 * t["fraction"].get<double>() << "%";
    }
    o << "\n";
  }
  if (s.contains("purity"))
    o << std::fixed << std::setprecision(3) << "agreement with the class labels (for information): purity "
      << s["purity"].get<double>() << ", NMI " << s["nmi"].get<double>() << "\n";
  return o.str();
}

torch::Tensor cluster_grid_rows(const Partition& p) {
  std::vector<torch::Tensor> rows;
  for (int64_t k = 0; k < std::min(p.k, kGridRows); ++k)
    rows.push_back(p.labels.eq(k).nonzero().flatten().narrow(0, 0, std::min<int64_t>(kGridCols, p.sizes[k].item<int64_t>())));
  return std::get<0>(torch::cat(rows).sort());
}

void save_cluster_grid(const std::string& path, const torch::Tensor& images, const torch::Tensor& rows,
                       const Partition& p) {
  const auto labels = p.labels.index_select(0, rows);  // [M]
  std::vector<torch::Tensor> grid;
  std::vector<std::string> names;
  for (int64_t k = 0; k < std::min(p.k, kGridRows); ++k) {
    auto imgs = to_unit_range(images.index_select(0, labels.eq(k).nonzero().flatten()));  // [<=12, C, H, W]
    if (imgs.size(0) < kGridCols)  // pad short clusters with blank (black) cells
      imgs = torch::cat({imgs, -torch::ones({kGridCols - imgs.size(0), imgs.size(1), imgs.size(2), imgs.size(3)})});
    grid.push_back(imgs);
    names.push_back("cluster " + std::to_string(k));
  }
  save_image_grid(path, torch::cat(grid), kGridCols, names);
}

void check_partition_out(const std::string& dir, bool force) {
  if (!fs::exists(dir)) return;
  DDM_CHECK(force, "'" << dir << "' already exists; use --force to replace it or another --out");
  DDM_CHECK(fs::is_directory(dir) && (fs::is_regular_file(fs::path(dir) / "partition.safetensors") || fs::is_empty(dir)),
            "--force: '" << dir << "' holds no partition.safetensors, and --force replaces a partition only, never "
                         << "another directory (its files would be lost): name another --out, or remove it yourself");
}

// The partition's files, written into the temporary directory `tmp` that save_partition moves in place.
static void write_partition_into(const fs::path& tmp, const Partition& p, const nlohmann::json& summary,
                          const std::function<void(const std::string&)>& extra) {
  SafetensorsFile f;
  f.tensors["labels"] = p.labels;
  f.tensors["sizes"] = p.sizes;
  if (p.centroids.defined()) {
    f.tensors["centroids"] = p.centroids;
    f.tensors["fine_labels"] = p.fine_labels;
    f.tensors["fine_centroids"] = p.fine_centroids;
  }
  f.metadata = {{"format", kFormat},
                {"k", std::to_string(p.k)},
                {"n", std::to_string(p.n)},
                {"data_sha256", p.data_sha256},
                {"data", p.data_description},
                {"features", p.features},
                {"settings", p.settings.dump()}};
  if (!p.shards.is_null()) f.metadata["shards"] = p.shards.dump();
  save_safetensors((tmp / "partition.safetensors").string(), f);
  write_file_atomic((tmp / "summary.json").string(), summary.dump(2) + "\n");
  if (extra) extra(tmp.string());
  fsync_dir(tmp.string());
}

void save_partition(const std::string& dir, const Partition& p, const nlohmann::json& summary, bool force,
                    const std::function<void(const std::string&)>& extra) {
  check_partition_out(dir, force);
  const fs::path target = absolute_dir(dir);
  const fs::path tmp = target.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {  // a failed write (a full disk) leaves neither half a partition nor its temporary directory
    write_partition_into(tmp, p, summary, extra);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  const fs::path old = target.string() + ".old-" + std::to_string(::getpid());
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(tmp, target);
  fsync_dir(target.parent_path().string());
  fs::remove_all(old);
}

Partition load_partition(const std::string& path) {
  fs::path file = path;
  if (fs::is_directory(file)) file /= "partition.safetensors";
  DDM_CHECK(fs::is_regular_file(file),
            "partition '" << path << "' not found (expected a directory made by ddm partition, holding "
                          << "partition.safetensors" << (fs::is_regular_file(fs::path(path) / "config.toml")
                                                             ? "; this is a run directory" : "") << ")");
  SafetensorsFile f;
  try {
    f = load_safetensors(file.string());
  } catch (const Error& e) {
    DDM_FAIL("partition '" << path << "': not a ddm partition (" << e.what() << "); give a directory made by ddm "
                           << "partition");
  }
  auto meta = [&](const char* key) -> std::string {
    const auto it = f.metadata.find(key);
    DDM_CHECK(it != f.metadata.end(), file.string() << ": not a ddm partition (metadata lacks '" << key << "')");
    return it->second;
  };
  DDM_CHECK(meta("format") == kFormat, file.string() << ": format '" << meta("format") << "', expected " << kFormat);
  auto meta_count = [&](const char* key, int64_t min) {
    const std::string text = meta(key);
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    DDM_CHECK(ec == std::errc() && end == text.data() + text.size() && v >= min,
              file.string() << ": metadata '" << key << "' is '" << text << "', expected an integer >= " << min
                            << "; the file is damaged (make it again with ddm partition)");
    return v;
  };
  Partition p;
  p.origin = file.string();
  p.k = meta_count("k", 1);
  p.n = meta_count("n", 0);
  p.data_sha256 = meta("data_sha256");
  p.data_description = meta("data");
  p.features = meta("features");
  if (f.metadata.count("shards")) {
    p.shards = nlohmann::json::parse(f.metadata.at("shards"), nullptr, /*allow_exceptions=*/false);
    DDM_CHECK(p.shards.is_object(), file.string() << ": metadata 'shards' is not a JSON object");
  }
  p.settings = nlohmann::json::parse(meta("settings"), nullptr, /*allow_exceptions=*/false);
  DDM_CHECK(p.settings.is_object(), file.string() << ": metadata 'settings' is not a JSON object: '" << meta("settings")
                                                  << "'; the file is damaged (make it again with ddm partition)");
  auto tensor = [&](const char* name) {
    const auto it = f.tensors.find(name);
    DDM_CHECK(it != f.tensors.end(), file.string() << ": lacks the tensor '" << name << "'");
    return it->second;
  };
  p.labels = tensor("labels").to(torch::kInt64);
  p.sizes = tensor("sizes").to(torch::kInt64);
  DDM_CHECK(p.labels.dim() == 1 && p.labels.size(0) == p.n && p.sizes.dim() == 1 && p.sizes.size(0) == p.k,
            file.string() << ": labels " << p.labels.sizes() << " / sizes " << p.sizes.sizes()
                          << " do not match n = " << p.n << ", k = " << p.k);
  DDM_CHECK(p.labels.ge(0).all().item<bool>() && p.labels.lt(p.k).all().item<bool>() &&
                torch::bincount(p.labels, {}, p.k).to(torch::kInt64).equal(p.sizes),
            file.string() << ": labels out of range 0.." << p.k - 1 << " or inconsistent with sizes; the file is damaged");
  if (f.tensors.count("centroids")) {
    p.centroids = tensor("centroids");
    p.fine_labels = tensor("fine_labels");
    p.fine_centroids = tensor("fine_centroids");
  }
  return p;
}

void check_partition_matches(const Partition& p, const Dataset& data) {
  if (data.shards) {
    check_partition_of_shards(p, data.shards->shards, data.latents != nullptr, "the data (" + data.description + ")");
    return;
  }
  DDM_CHECK(!p.shards.is_object(), "partition " << p.origin << " was made on tar shards (" << p.data_description
                                                << ") but the data (" << data.description << ") is held in memory; "
                                                << "use the partition with data.source = \"shards\" and those shards");
  DDM_CHECK(p.n == data.images.size(0), "partition " << p.origin << " has " << p.n << " rows but the data ("
                                                     << data.description << ") has " << data.images.size(0)
                                                     << " images; partition this dataset with ddm partition");
  const std::string sha = dataset_sha256(data);
  DDM_CHECK(sha == p.data_sha256, "partition " << p.origin << " was made on other images (sha256 "
                                               << p.data_sha256.substr(0, 12) << ", this data " << sha.substr(0, 12)
                                               << ", " << data.description
                                               << "); partition this dataset with ddm partition");
}

Dataset cluster_subset(const Dataset& data, const Partition& p, int64_t cluster) {
  DDM_CHECK(cluster >= 0 && cluster < p.k,
            "expert " << cluster << " does not exist: partition " << p.origin << " has clusters 0.." << p.k - 1);
  const auto rows = p.labels.eq(cluster).nonzero().squeeze(1);
  Dataset d;
  d.images = data.images.index_select(0, rows);
  d.labels = data.labels.index_select(0, rows);
  if (!data.captions.empty()) {
    const auto at = rows.accessor<int64_t, 1>();
    for (int64_t i = 0; i < rows.size(0); ++i) d.captions.push_back(data.captions[static_cast<size_t>(at[i])]);
  }
  d.num_classes = data.num_classes;
  d.class_names = data.class_names;
  d.description = data.description + ", cluster " + std::to_string(cluster) + " of " + std::to_string(p.k) + " (" +
                  std::to_string(rows.size(0)) + " images)";
  return d;
}

}  // namespace ddm
