// Drawing pipeline timelines; see picture.h.
#include "pipeline/picture.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "eval/grid.h"

namespace ddm {
namespace {

const Rgb kForward{70, 130, 180}, kBackward{235, 140, 40}, kWeight{250, 205, 120}, kSerial{175, 45, 45},
    kFilled{70, 160, 80}, kOptimizer{165, 165, 165}, kInk{25, 25, 25}, kGrid{230, 230, 230}, kWhite{255, 255, 255};

}  // namespace

void save_pipe_picture(const std::string& path, const std::string& title, const std::vector<PipePanel>& panels) {
  check_png_path(path, "pipeline timeline");
  DDM_CHECK(!panels.empty(), "pipeline timeline: nothing to draw");
  double span = 0;
  for (const PipePanel& p : panels) {
    double opt = 0;
    for (double o : p.optimizer) opt = std::max(opt, o);
    span = std::max({span, p.timeline.makespan + opt, p.timeline.iteration});
  }
  span = std::max(span, 1e-9);
  const int W = 1400, left = 100, right = 30, row = 24, gap = 6, head = 40, panel_head = 26;
  int H = head;
  for (const PipePanel& p : panels) H += panel_head + static_cast<int>(p.timeline.ranks.size()) * (row + gap) + 10;
  H += 100;
  Canvas c(W, H);
  const double scale = (W - left - right) / span;
  auto X = [&](double t) { return left + static_cast<int>(std::lround(t * scale)); };
  c.text(10, 10, title, 2);
  const double tick = nice_tick(span, 10);
  int y = head;
  bool any_second = false;
  for (const PipePanel& p : panels) {
    c.text(10, y + 4, p.title, 2);
    y += panel_head;
    for (size_t r = 0; r < p.timeline.ranks.size(); ++r) {
      c.text(10, y + 5, "rank " + std::to_string(r), 2);
      for (double t = 0; t <= span + 1e-9; t += tick) c.fill(X(t), y, X(t) + 1, y + row, kGrid);
      for (const PipeSlot& s : p.timeline.ranks[r]) {
        const bool task = s.action.op == PipeOp::kTask;
        const Rgb col = task ? (s.action.serial ? kSerial : kFilled)
                        : s.action.op == PipeOp::kForward    ? kForward
                        : s.action.op == PipeOp::kWeightGrad ? kWeight
                                                             : kBackward;
        const int x0 = X(s.start), x1 = std::max(X(s.end), x0 + 1);
        c.fill(x0, y, x1, y + row, col);
        // A rank's second stage under V-shaped placement (stage >= the rank count): a dark lower edge.
        const bool second = !task && s.action.stage >= static_cast<int>(p.timeline.ranks.size());
        if (second) c.fill(x0, y + row - 4, x1, y + row, kInk), any_second = true;
        if (x1 - x0 >= 4) c.fill(x1 - 1, y, x1, y + row, kWhite);  // a hairline between neighbours
        const std::string label = task ? "" : std::to_string(s.action.micro);
        if (!label.empty() && x1 - x0 >= 8 * static_cast<int>(label.size()) + 4)
          c.text(x0 + 3, y + 8, label, 1, s.action.op == PipeOp::kWeightGrad ? kInk : kWhite);
      }
      if (r < p.optimizer.size() && p.optimizer[r] > 0)
        c.fill(X(p.timeline.makespan), y + 4, X(p.timeline.makespan + p.optimizer[r]), y + row - 4, kOptimizer);
      y += row + gap;
    }
    c.fill(X(p.timeline.iteration), y - (row + gap) * static_cast<int>(p.timeline.ranks.size()) - 4,
           X(p.timeline.iteration) + 2, y, kInk);  // the iteration's end
    y += 10;
  }
  // Time axis.
  c.fill(left, y, W - right, y + 1, kInk);
  for (double t = 0; t <= span + 1e-9; t += tick) {
    c.fill(X(t), y, X(t) + 1, y + 6, kInk);
    c.text(X(t) - 8, y + 9, format_number(tick < 1 ? "%.1f" : "%.0f", t), 1);
  }
  c.text(W - right - 60, y + 9, "ms", 1);
  // Legend.
  int lx = left, ly = y + 30;
  std::vector<std::pair<Rgb, std::string>> legend{{kForward, "forward"},          {kBackward, "backward / input grad"},
                                                  {kWeight, "weight grad"},        {kSerial, "frozen work, serial"},
                                                  {kFilled, "frozen work in bubbles"}, {kOptimizer, "optimizer + sync"}};
  if (any_second) legend.push_back({kInk, "(lower edge) the rank's second stage, V-shaped"});
  for (const auto& [col, name] : legend) {
    if (lx + 24 + 8 * static_cast<int>(name.size()) > W - right) lx = left, ly += 24;  // wrap
    c.fill(lx, ly, lx + 18, ly + 14, col);
    lx += 24 + c.text(lx + 24, ly + 1, name, 2) + 24;
  }
  c.save(path);
}

}  // namespace ddm
