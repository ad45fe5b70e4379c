// PNG image grids with optional row labels (class names), written atomically.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

namespace ddm {

// images: float [N, C, H, W] in [-1, 1] (C = 1 or 3), laid out row-major with `cols` per row.
// row_labels (optional) are drawn in a left margin, one per row. Each pixel is scaled `scale` x.
void save_image_grid(const std::string& path, const torch::Tensor& images, int64_t cols,
                     const std::vector<std::string>& row_labels = {}, int scale = 2);

// A text (a prompt) as a row label: stb_easy_font draws printable ASCII only, so every other code
// point shows as '?', and a text longer than 40 characters is cut, ending in "...". The empty
// prompt (unconditional samples) is "(empty prompt)".
std::string grid_row_label(const std::string& text);

// Throws ddm::Error unless `path` ends in .png (any case): grids are PNG, and PNG bytes under another
// name (.jpg) mislead every viewer. Call it before long work that ends in a grid.
void check_png_path(const std::string& path, const std::string& what = "--out");

// Text rasterized with stb_easy_font at `scale` pixels per font unit, top-left corner at (0, 0): the
// filled rectangles [x0, x1) x [y0, y1) of its strokes, and its width in pixels.
struct TextRect {
  int x0, y0, x1, y1;
};
std::vector<TextRect> text_rects(const std::string& text, int scale, int* width = nullptr);

// Encodes an RGB uint8 image [H, W, 3] as PNG bytes.
std::string encode_png(const torch::Tensor& rgb_u8);

// A white RGB canvas for charts (timelines): filled rectangles, frames and text, saved as PNG.
struct Rgb {
  uint8_t r, g, b;
};
struct Canvas {
  int w, h;
  std::vector<uint8_t> px;  // [h, w, 3]
  Canvas(int w_, int h_);
  void fill(int x0, int y0, int x1, int y1, Rgb c);  // [x0, x1) x [y0, y1), clipped to the canvas
  void frame(int x0, int y0, int x1, int y1, Rgb c);
  // Text with its top-left corner at (x0, y0); returns its width in pixels.
  int text(int x0, int y0, const std::string& s, int scale = 2, Rgb c = {25, 25, 25});
  void save(const std::string& path);  // PNG, atomically
};

// For charts' axes: a tick spacing of 1, 2 or 5 x a power of ten giving about `target` ticks over
// `span`; a number printed with a printf format ("%.0f ms").
double nice_tick(double span, int target);
std::string format_number(const char* format, double v);

}  // namespace ddm
