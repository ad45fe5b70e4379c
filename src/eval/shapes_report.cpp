// Prompt accuracy on the shapes dataset (see shapes_report.h).
#include "eval/shapes_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// A pixel is foreground when its RGB distance to the measured background exceeds this (the palette's
// colours are all farther than 100 from both backgrounds; the backgrounds are 165 apart).
constexpr double kForeground = 60;

std::array<double, 3> rgb_of(const nlohmann::json& j, const std::string& what) {
  DDM_CHECK(j.is_array() && j.size() == 3, what << " must be [r, g, b]");
  std::array<double, 3> c{};
  for (size_t i = 0; i < 3; ++i) {
    DDM_CHECK(j[i].is_number() && j[i].get<double>() >= 0 && j[i].get<double>() <= 255,
              what << " must be [r, g, b] in 0..255, got " << j.dump());
    c[i] = j[i].get<double>();
  }
  return c;
}

double distance(const std::array<double, 3>& a, const std::array<double, 3>& b) {
  return std::sqrt((a[0] - b[0]) * (a[0] - b[0]) + (a[1] - b[1]) * (a[1] - b[1]) + (a[2] - b[2]) * (a[2] - b[2]));
}

template <class Palette>
std::string nearest(const Palette& palette, const std::array<double, 3>& c) {
  std::string best;
  double d = INFINITY;
  for (const auto& [name, rgb] : palette)
    if (distance(rgb, c) < d) d = distance(rgb, c), best = name;
  return best;
}

size_t nearest_index(const std::vector<double>& values, double v) {
  size_t best = 0;
  for (size_t i = 1; i < values.size(); ++i)
    if (std::abs(values[i] - v) < std::abs(values[best] - v)) best = i;
  return best;
}

}  // namespace

ShapesDataset read_shapes_dataset(const std::string& dir) {
  ShapesDataset d;
  d.dir = dir;
  const std::string file = (fs::path(dir) / "shapes.json").string();
  DDM_CHECK(fs::is_regular_file(file), file << " does not exist: " << dir << " is not a shapes dataset (write one with "
                                            << "scripts/make_shapes.py --out " << dir << ")");
  try {
    const auto j = nlohmann::json::parse(read_file(file));
    DDM_CHECK(j.value("format", std::string()) == "ddm shapes" && j.value("version", 0) == 1,
              file << " is not a shapes dataset record of version 1; write it again with scripts/make_shapes.py");
    d.size = j.at("size").get<int64_t>();
    d.shapes = j.at("shapes").get<std::vector<std::string>>();
    for (const auto& [name, rgb] : j.at("colours").items()) d.colours.emplace_back(name, rgb_of(rgb, file + ": colours." + name));
    for (const auto& [name, rgb] : j.at("backgrounds").items())
      d.backgrounds.emplace_back(name, rgb_of(rgb, file + ": backgrounds." + name));
    for (const auto& [name, r] : j.at("sizes").items()) d.sizes.emplace_back(name, r.get<double>());
    d.positions = j.at("positions").get<std::vector<std::string>>();
    d.centres = j.at("centres").get<std::vector<double>>();
    d.held_out = j.at("held_out").get<std::vector<std::string>>();
    DDM_CHECK(d.size >= 8 && d.shapes.size() >= 2 && !d.colours.empty() && !d.backgrounds.empty() &&
                  !d.sizes.empty() && d.positions.size() == 9 && d.centres.size() == 3,
              file << ": expected a side of at least 8, 2 or more shapes, colours, backgrounds, sizes, 9 positions "
                      "and 3 centres");
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(file << " is not a valid shapes dataset record (" << e.what() << ")");
  }
  const std::string prompts = (fs::path(dir) / "prompts.jsonl").string();
  std::ifstream in(prompts, std::ios::binary);
  DDM_CHECK(in, prompts << ": cannot read it (scripts/make_shapes.py writes it)");
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = prompts + " line " + std::to_string(n);
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    DDM_CHECK(!j.is_discarded() && j.is_object(), where << " is not a JSON object");
    ShapesPrompt p;
    try {
      p.caption = j.at("caption").get<std::string>();
      for (int a = 0; a < kNumShapeAttributes; ++a) p.want[a] = j.at(kShapeAttributes[a]).get<std::string>();
      p.heldout = j.at("heldout").get<bool>();
    } catch (const nlohmann::json::exception& e) {
      DDM_FAIL(where << ": needs \"caption\", \"shape\", \"colour\", \"size\", \"position\", \"background\" (strings) "
                        "and \"heldout\" (true or false): "
                     << e.what());
    }
    DDM_CHECK(std::count(d.shapes.begin(), d.shapes.end(), p.want[0]) == 1,
              where << ": shape '" << p.want[0] << "' is not among shapes.json's");
    d.prompts.push_back(std::move(p));
  }
  DDM_CHECK(!d.prompts.empty(), prompts << " holds no prompts");
  return d;
}

std::vector<ShapeAttributes> measure_shapes(const ShapesDataset& data, const torch::Tensor& images,
                                            const torch::Tensor& shape_classes) {
  DDM_CHECK(images.dim() == 4 && images.size(1) == 3 && images.scalar_type() == torch::kUInt8,
            "shapes: the samples must be uint8 RGB [N, 3, S, S], got " << images.scalar_type() << " " << images.sizes());
  DDM_CHECK(shape_classes.dim() == 1 && shape_classes.size(0) == images.size(0), "shapes: one shape class per image");
  const int64_t n = images.size(0), h = images.size(2), w = images.size(3);
  const torch::Tensor x = images.to(torch::kCPU, torch::kFloat64).contiguous();  // [N, 3, H, W]
  const torch::Tensor cls = shape_classes.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<ShapeAttributes> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    ShapeAttributes& a = out[static_cast<size_t>(i)];
    const int64_t k = cls[i].item<int64_t>();
    a[0] = k >= 0 && k < static_cast<int64_t>(data.shapes.size()) ? data.shapes[static_cast<size_t>(k)] : "";
    const torch::Tensor px = x[i].reshape({3, -1});                                   // [3, H*W]
    const torch::Tensor med = std::get<0>(px.median(1));                             // [3]
    const std::array<double, 3> bg{med[0].item<double>(), med[1].item<double>(), med[2].item<double>()};
    a[4] = nearest(data.backgrounds, bg);
    const torch::Tensor bgt = torch::tensor({bg[0], bg[1], bg[2]}, torch::kFloat64).view({3, 1});
    const torch::Tensor fg = (px - bgt).pow(2).sum(0).sqrt() > kForeground;           // [H*W]
    const int64_t count = fg.sum().item<int64_t>();
    if (count == 0) continue;  // nothing drawn: colour, size and position all wrong
    const torch::Tensor mean = px.index({torch::indexing::Slice(), fg}).mean(1);      // [3]
    a[1] = nearest(data.colours, {mean[0].item<double>(), mean[1].item<double>(), mean[2].item<double>()});
    const torch::Tensor where = fg.view({h, w}).nonzero().to(torch::kFloat64);        // [count, 2]: (y, x)
    const auto lo = std::get<0>(where.min(0)), hi = std::get<0>(where.max(0));        // [2]
    const double extent = std::max((hi[0] - lo[0]).item<double>(), (hi[1] - lo[1]).item<double>()) + 1;
    double best = INFINITY;
    for (const auto& [name, r] : data.sizes)
      if (std::abs(2 * r * static_cast<double>(data.size) - extent) < best)
        best = std::abs(2 * r * static_cast<double>(data.size) - extent), a[2] = name;
    const torch::Tensor c = (where + 0.5).mean(0);                                    // [2]
    const size_t row = nearest_index(data.centres, c[0].item<double>() / static_cast<double>(h));
    const size_t col = nearest_index(data.centres, c[1].item<double>() / static_cast<double>(w));
    a[3] = data.positions[row * 3 + col];
  }
  return out;
}

ShapesReport shapes_report(const ShapesDataset& data, const std::vector<int64_t>& prompt_of,
                           const std::vector<ShapeAttributes>& measured) {
  DDM_CHECK(prompt_of.size() == measured.size(), "shapes: one prompt per measured sample");
  ShapesReport r;
  for (size_t i = 0; i < measured.size(); ++i) {
    const ShapesPrompt& p = data.prompts.at(static_cast<size_t>(prompt_of[i]));
    ShapesReport::Group& g = p.heldout ? r.heldout : r.seen;
    ++g.n;
    bool all = true;
    for (int a = 0; a < kNumShapeAttributes; ++a) {
      const bool ok = measured[i][a] == p.want[a];
      g.right[a] += ok;
      all = all && ok;
    }
    g.all_right += all;
  }
  return r;
}

std::pair<double, double> wilson95(int64_t k, int64_t n) {
  if (n == 0) return {0, 1};
  const double z = 1.959963984540054, p = static_cast<double>(k) / static_cast<double>(n), nn = static_cast<double>(n);
  const double centre = (p + z * z / (2 * nn)) / (1 + z * z / nn);
  const double half = z * std::sqrt(p * (1 - p) / nn + z * z / (4 * nn * nn)) / (1 + z * z / nn);
  return {std::max(0.0, centre - half), std::min(1.0, centre + half)};
}

std::string ShapesReport::table() const {
  std::ostringstream s;
  char buf[64];
  s << "compositions  samples";
  for (const char* a : kShapeAttributes) {
    std::snprintf(buf, sizeof buf, "  %-17s", a);
    s << buf;
  }
  s << "  all five\n";
  for (const auto& named : {std::pair<const char*, const Group&>{"seen", seen}, {"held-out", heldout}}) {
    const Group& g = named.second;
    std::snprintf(buf, sizeof buf, "%-12s  %7lld", named.first, static_cast<long long>(g.n));
    s << buf;
    auto cell = [&](int64_t k) {
      const auto [lo, hi] = wilson95(k, g.n);
      std::snprintf(buf, sizeof buf, "  %.2f [%.2f, %.2f]",
                    g.n ? static_cast<double>(k) / static_cast<double>(g.n) : 0.0, lo, hi);
      s << buf;
    };
    for (int a = 0; a < kNumShapeAttributes; ++a) cell(g.right[static_cast<size_t>(a)]);
    cell(g.all_right);
    s << "\n";
  }
  s << "(accuracy [Wilson 95% interval]; shape by the shape classifier, the rest measured from pixels)\n";
  return s.str();
}

std::string ShapesReport::json() const {
  nlohmann::json j;
  for (const auto& named : {std::pair<const char*, const Group&>{"seen", seen}, {"heldout", heldout}}) {
    const Group& g = named.second;
    nlohmann::json gj{{"samples", g.n}};
    auto put = [&](const std::string& key, int64_t k) {
      const auto [lo, hi] = wilson95(k, g.n);
      gj[key] = {{"right", k}, {"accuracy", g.n ? static_cast<double>(k) / static_cast<double>(g.n) : 0.0},
                 {"wilson95", {lo, hi}}};
    };
    for (int a = 0; a < kNumShapeAttributes; ++a) put(kShapeAttributes[a], g.right[static_cast<size_t>(a)]);
    put("all", g.all_right);
    j[named.first] = gj;
  }
  return j.dump(2);
}

}  // namespace ddm
