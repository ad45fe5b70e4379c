// PNG image grids: tiles on a light background, row labels rasterized with stb_easy_font (quads
// filled here, since that library only emits vertex quads), PNG encoding with stb_image_write.
#include "eval/grid.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include <stb_easy_font.h>
#pragma GCC diagnostic pop
#include <stb_image_write.h>

#include "core/error.h"
#include "core/fileio.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

void draw_text(std::vector<uint8_t>& rgb, int width, int height, int x0, int y0, const std::string& text, int scale) {
  for (const TextRect& r : text_rects(text, scale))
    for (int y = r.y0; y < r.y1; ++y)
      for (int x = r.x0; x < r.x1; ++x) {
        const int px = x0 + x, py = y0 + y;
        if (px < 0 || py < 0 || px >= width || py >= height) continue;
        uint8_t* p = &rgb[(static_cast<size_t>(py) * width + px) * 3];
        p[0] = p[1] = p[2] = 20;
      }
}

void append_bytes(void* ctx, void* data, int size) {
  static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<size_t>(size));
}

}  // namespace

std::vector<TextRect> text_rects(const std::string& text, int scale, int* width) {
  struct Vertex {
    float x, y, z;
    unsigned char color[4];
  };
  std::vector<char> str(text.begin(), text.end());
  str.push_back('\0');
  // stb_easy_font truncates silently when the buffer is full (its "~270 bytes per character" is an
  // average): grow the buffer until a whole spare quad is left over.
  std::vector<char> buf(text.size() * 300 + 64 * sizeof(Vertex));
  int quads = 0;
  while (true) {
    quads = stb_easy_font_print(0, 0, str.data(), nullptr, buf.data(), static_cast<int>(buf.size()));
    if ((static_cast<size_t>(quads) + 1) * 4 * sizeof(Vertex) <= buf.size()) break;
    buf.resize(buf.size() * 2);
  }
  const Vertex* v = reinterpret_cast<const Vertex*>(buf.data());
  std::vector<TextRect> out;
  for (int q = 0; q < quads; ++q) {
    const Vertex* quad = v + 4 * q;
    float xmin = quad[0].x, xmax = quad[0].x, ymin = quad[0].y, ymax = quad[0].y;
    for (int k = 1; k < 4; ++k) {
      xmin = std::min(xmin, quad[k].x);
      xmax = std::max(xmax, quad[k].x);
      ymin = std::min(ymin, quad[k].y);
      ymax = std::max(ymax, quad[k].y);
    }
    out.push_back({static_cast<int>(xmin * scale), static_cast<int>(ymin * scale), static_cast<int>(xmax * scale),
                   static_cast<int>(ymax * scale)});
  }
  if (width) *width = stb_easy_font_width(str.data()) * scale;
  return out;
}

std::string grid_row_label(const std::string& text) {
  if (text.empty()) return "(empty prompt)";  // the null condition: unconditional samples
  std::string out;
  int chars = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) == 0x80) continue;  // a UTF-8 continuation byte: its code point is counted already
    if (++chars > 40) return out + "...";
    out += c >= 0x20 && c < 0x7F ? static_cast<char>(c) : '?';
  }
  return out;
}

void check_png_path(const std::string& path, const std::string& what) {
  DDM_CHECK(fs::path(path).has_filename() && !fs::is_directory(path),
            what << " " << path << ": a directory; name the PNG file to write (e.g. "
                 << (fs::path(path).lexically_normal() / "grid.png").string() << ")");
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  DDM_CHECK(ext == ".png", what << " " << path << ": ddm writes image grids as PNG; name the file with a .png "
                                << "extension (e.g. " << fs::path(path).replace_extension(".png").string() << ")");
}

std::string encode_png(const torch::Tensor& rgb_u8) {
  DDM_CHECK(rgb_u8.dim() == 3 && rgb_u8.size(2) == 3 && rgb_u8.scalar_type() == torch::kUInt8,
            "encode_png expects uint8 [H, W, 3]");
  auto img = rgb_u8.contiguous();
  std::string out;
  const int w = static_cast<int>(img.size(1)), h = static_cast<int>(img.size(0));
  DDM_CHECK(stbi_write_png_to_func(append_bytes, &out, w, h, 3, img.data_ptr<uint8_t>(), w * 3),
            "PNG encoding failed");
  return out;
}

void save_image_grid(const std::string& path, const torch::Tensor& images, int64_t cols,
                     const std::vector<std::string>& row_labels, int scale) {
  DDM_CHECK(images.dim() == 4 && (images.size(1) == 1 || images.size(1) == 3),
            "image grid expects [N, 1 or 3, H, W], got " << images.sizes());
  DDM_CHECK(cols > 0 && scale > 0, "image grid needs cols > 0 and scale > 0");
  check_png_path(path, "image grid");
  const int64_t n = images.size(0), h = images.size(2) * scale, w = images.size(3) * scale;
  const int64_t rows = (n + cols - 1) / cols;
  const int pad = 2, label_scale = 2;
  int label_w = 0;
  for (const auto& l : row_labels) {
    std::vector<char> s(l.begin(), l.end());
    s.push_back('\0');
    label_w = std::max(label_w, stb_easy_font_width(s.data()) * label_scale + 8);
  }
  const int width = static_cast<int>(label_w + cols * (w + pad) + pad);
  const int height = static_cast<int>(rows * (h + pad) + pad);
  std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3, 235);

  // [N, 3, H*scale, W*scale] uint8
  auto x = ((images.detach().to(torch::kFloat).clamp(-1, 1) + 1) * 127.5).round().to(torch::kUInt8);
  if (x.size(1) == 1) x = x.expand({n, 3, images.size(2), images.size(3)});
  x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3).permute({0, 2, 3, 1}).contiguous();  // [N,h,w,3]
  const uint8_t* src = x.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / cols, c = i % cols;
    const int64_t ox = label_w + pad + c * (w + pad), oy = pad + r * (h + pad);
    for (int64_t yy = 0; yy < h; ++yy)
      std::copy_n(src + ((i * h + yy) * w) * 3, w * 3, &rgb[((oy + yy) * width + ox) * 3]);
  }
  for (size_t r = 0; r < row_labels.size() && static_cast<int64_t>(r) < rows; ++r)
    draw_text(rgb, width, height, 4, static_cast<int>(pad + r * (h + pad) + h / 2 - 5 * label_scale), row_labels[r],
              label_scale);
  auto t = torch::from_blob(rgb.data(), {height, width, 3}, torch::kUInt8);  // a view of `rgb`, used before it goes
  write_file_atomic(path, encode_png(t));
}

Canvas::Canvas(int w_, int h_) : w(w_), h(h_), px(static_cast<size_t>(w_) * h_ * 3, 255) {}

void Canvas::fill(int x0, int y0, int x1, int y1, Rgb c) {
  x0 = std::max(0, x0), y0 = std::max(0, y0), x1 = std::min(w, x1), y1 = std::min(h, y1);
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) {
      uint8_t* p = &px[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = c.r, p[1] = c.g, p[2] = c.b;
    }
}

void Canvas::frame(int x0, int y0, int x1, int y1, Rgb c) {
  fill(x0, y0, x1, y0 + 1, c), fill(x0, y1 - 1, x1, y1, c), fill(x0, y0, x0 + 1, y1, c), fill(x1 - 1, y0, x1, y1, c);
}

int Canvas::text(int x0, int y0, const std::string& s, int scale, Rgb c) {
  int width = 0;
  for (const TextRect& r : text_rects(s, scale, &width)) fill(x0 + r.x0, y0 + r.y0, x0 + r.x1, y0 + r.y1, c);
  return width;
}

void Canvas::save(const std::string& path) {
  write_file_atomic(path, encode_png(torch::from_blob(px.data(), {h, w, 3}, torch::kUInt8)));
}

double nice_tick(double span, int target) {
  const double raw = span / target, p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

std::string format_number(const char* format, double v) {
  char b[64];
  std::snprintf(b, sizeof b, format, v);
  return b;
}

}  // namespace ddm
