// Prompt accuracy on the shapes dataset (scripts/make_shapes.py, docs/text.md "The shapes dataset"):
// whether a text model draws what its prompt says. Each prompt of DIR/prompts.jsonl names five
// attributes; each sample drawn from it is measured:
//   shape       by a shape classifier ddm trained on the dataset (`ddm train-classifier --config`,
//               make_shapes.py --labels), its argmax;
//   background  the palette background nearest to the image's per-channel median;
//   colour      the palette colour nearest to the mean of the foreground (the pixels farther than
//               kForeground from the measured background);
//   size        the size whose diameter (2 x radius x side) is nearest to the foreground's extent;
//   position    the row and column centres nearest to the foreground's centroid.
// The report gives each attribute's accuracy and the share with all five right, on the seen and on
// the held-out compositions, with Wilson 95% intervals. The measurement is checked on the dataset's
// own images, whose attributes are known (tests/integration/test_shapes.cpp).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/types.h>

namespace ddm {

inline constexpr const char* kShapeAttributes[] = {"shape", "colour", "size", "position", "background"};
inline constexpr int kNumShapeAttributes = 5;
using ShapeAttributes = std::array<std::string, kNumShapeAttributes>;  // in kShapeAttributes' order

struct ShapesPrompt {
  std::string caption;
  ShapeAttributes want;
  bool heldout = false;
};

// DIR/shapes.json (the vocabulary) and DIR/prompts.jsonl (the prompts), as make_shapes.py writes them.
struct ShapesDataset {
  std::string dir;
  int64_t size = 0;  // image side
  std::vector<std::string> shapes;                             // in the classifier's class order
  std::vector<std::pair<std::string, std::array<double, 3>>> colours, backgrounds;  // name, RGB 0..255
  std::vector<std::pair<std::string, double>> sizes;           // name, radius as a share of the side
  std::vector<std::string> positions;                          // row-major over a 3 x 3 grid
  std::vector<double> centres;                                 // the rows' and columns' centres (shares)
  std::vector<std::string> held_out;                           // the held-out rules, in words
  std::vector<ShapesPrompt> prompts;
};
// Throws ddm::Error naming the file, the line and the key.
ShapesDataset read_shapes_dataset(const std::string& dir);

// The measured attributes of images uint8 [N, 3, S, S] whose shape classes (indices into
// data.shapes) are `shape_classes` int64 [N].
std::vector<ShapeAttributes> measure_shapes(const ShapesDataset& data, const torch::Tensor& images,
                                            const torch::Tensor& shape_classes);

struct ShapesReport {
  struct Group {
    int64_t n = 0;
    std::array<int64_t, kNumShapeAttributes> right{};
    int64_t all_right = 0;
  };
  Group seen, heldout;
  std::string table() const;  // a plain-text table with Wilson 95% intervals
  std::string json() const;
};
// Sample i was drawn from prompts[prompt_of[i]].
ShapesReport shapes_report(const ShapesDataset& data, const std::vector<int64_t>& prompt_of,
                           const std::vector<ShapeAttributes>& measured);

// The Wilson score interval (95%) of `k` successes in `n`.
std::pair<double, double> wilson95(int64_t k, int64_t n);

}  // namespace ddm
