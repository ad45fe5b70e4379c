// `ddm_bench timeline OUT.png RANK0.json [RANK1.json ...] [--step K] [--title TEXT] [--window FROM TO]`: draws one
// training step of every rank from the per-rank timelines `ddm_bench dp --timeline PREFIX` writes.
// Two rows per rank on one time axis (ms; the ranks share the machine's steady clock):
//   compute     prepare + forward + loss | backward compute | loss all-reduce + clip | AdamW + EMA
//   all-reduce  each gradient bucket: a tick at its launch, a light bar while it is queued behind the
//               buckets before it, a solid bar while it runs (estimated: from the later of its launch
//               and the previous bucket's completion to its own; Gloo runs one collective at a time
//               per thread), and in red the wait after backward ended (communication not hidden)
// Drawn into an RGB buffer, labelled and encoded with eval/grid.h (stb_easy_font, stb_image_write).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "eval/grid.h"

namespace {

using ddm::Canvas;
using ddm::Rgb;
using ddm::format_number;
using ddm::nice_tick;
const Rgb kForward{70, 130, 180}, kBackward{245, 150, 50}, kLossClip{160, 160, 160}, kUpdate{70, 160, 80},
    kBucketA{120, 70, 180}, kBucketB{175, 130, 225}, kQueued{228, 220, 240}, kWait{215, 35, 35},
    kInk{25, 25, 25}, kGrid{225, 225, 225}, kBg{255, 255, 255};

}  // namespace

int timeline_main(int argc, char** argv) {
  DDM_CHECK(argc >= 4, "usage: ddm_bench timeline OUT.png RANK0.json [RANK1.json ...] [--step K] [--title TEXT] [--window FROM_MS TO_MS]");
  const std::string out = argv[2];
  std::vector<nlohmann::json> ranks;
  int step = -1;
  double win_from = -1, win_to = -1;  // --window FROM TO: ms after the step's start (zoom)
  std::string title;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--step" && i + 1 < argc) step = std::atoi(argv[++i]);
    else if (a == "--title" && i + 1 < argc) title = argv[++i];
    else if (a == "--window" && i + 2 < argc) win_from = std::atof(argv[++i]), win_to = std::atof(argv[++i]);
    else {
      std::ifstream in(a);
      DDM_CHECK(in, "ddm_bench timeline: cannot read " << a);
      ranks.push_back(nlohmann::json::parse(in));
    }
  }
  DDM_CHECK(!ranks.empty(), "ddm_bench timeline: no timeline files given");
  std::sort(ranks.begin(), ranks.end(), [](const auto& x, const auto& y) { return x["rank"] < y["rank"]; });
  const auto& steps0 = ranks[0]["steps"];
  DDM_CHECK(!steps0.empty(), "ddm_bench timeline: rank 0 recorded no steps");
  if (step < 0) {  // the step of median duration on rank 0
    std::vector<std::pair<int64_t, int>> d;
    for (size_t k = 0; k < steps0.size(); ++k)
      d.emplace_back(steps0[k]["end_ns"].get<int64_t>() - steps0[k]["start_ns"].get<int64_t>(), static_cast<int>(k));
    std::sort(d.begin(), d.end());
    step = d[d.size() / 2].second;
  }
  for (const auto& r : ranks)
    DDM_CHECK(step < static_cast<int>(r["steps"].size()), "ddm_bench timeline: --step " << step << " is not recorded by every rank");
  int64_t t0 = INT64_MAX, t1 = INT64_MIN;
  for (const auto& r : ranks) {
    t0 = std::min(t0, r["steps"][step]["start_ns"].get<int64_t>());
    t1 = std::max(t1, r["steps"][step]["end_ns"].get<int64_t>());
    const auto& s = r["steps"][step];
    if (s.contains("origin_ns"))
      for (const auto& b : s["buckets"])
        if (b["done_ms"].get<double>() >= 0)
          t1 = std::max(t1, s["origin_ns"].get<int64_t>() + static_cast<int64_t>(b["done_ms"].get<double>() * 1e6));
  }
  if (win_to > win_from && win_from >= 0) {
    t1 = t0 + static_cast<int64_t>(win_to * 1e6);
    t0 += static_cast<int64_t>(win_from * 1e6);
  }
  const double span_ms = (t1 - t0) / 1e6;
  if (title.empty()) {
    const auto& r = ranks[0];
    std::ostringstream t;
    t << r["preset"].get<std::string>() << ", global batch " << r["global_batch"] << ", " << r["world"] << " rank(s) x "
      << r["threads"] << " thread(s), buckets " << r["bucket_mb"] << " MiB (first " << r["first_bucket_mb"] << " MiB), "
      << r["wire"].get<std::string>() << " wire: one step";
    title = t.str();
  }

  const int W = 1600, left = 170, right = 40, top = 100, row_h = 34, rank_gap = 34, axis_h = 60;
  const int n = static_cast<int>(ranks.size());
  const int H = top + n * (2 * row_h + 8 + rank_gap) + axis_h;
  Canvas c(W, H);
  const int plot_w = W - left - right;
  auto X = [&](double ms) {
    return left + static_cast<int>(std::lround(std::clamp(ms / span_ms, -0.001, 1.001) * plot_w));
  };
  auto Xns = [&](int64_t ns) { return X((ns - t0) / 1e6); };

  c.text(12, 10, title, 2);
  // Legend.
  struct Item {
    Rgb c;
    const char* label;
  };
  const Item legend[] = {{kForward, "prepare+forward"}, {kBackward, "backward"},
                         {kLossClip, "loss sync+clip"}, {kUpdate, "AdamW+EMA"},
                         {kQueued, "queued"},         {kBucketA, "bucket all-reduce"},
                         {kWait, "wait after backward"}};
  int lx = 12;
  for (const auto& it : legend) {
    c.fill(lx, 44, lx + 22, 60, it.c);
    c.frame(lx, 44, lx + 22, 60, kInk);
    lx += 28 + c.text(lx + 28, 46, it.label, 2) + 22;
  }
  c.text(12, 68, "tick = bucket launched (its gradients ready); solid = its all-reduce running (after the bucket "
                 "before it); red = wait after backward", 2);

  // Grid and axis.
  const double tick = nice_tick(span_ms, 12);
  const int plot_bottom = H - axis_h;
  for (double ms = 0; ms <= span_ms + 1e-9; ms += tick) {
    c.fill(X(ms), top - 4, X(ms) + 1, plot_bottom, kGrid);
    c.fill(X(ms), plot_bottom, X(ms) + 1, plot_bottom + 6, kInk);
    const double at = ms + (win_to > win_from && win_from >= 0 ? win_from : 0);
    const std::string lab = tick >= 1 ? format_number("%.0f", at) : format_number("%.1f", at);
    c.text(X(ms) - 4 * static_cast<int>(lab.size()), plot_bottom + 10, lab, 2);
  }
  c.fill(left, plot_bottom, left + plot_w, plot_bottom + 1, kInk);
  c.text(left + plot_w / 2 - 60, plot_bottom + 34, "time in the step (ms)", 2);

  int y = top;
  for (const auto& r : ranks) {
    const auto& s = r["steps"][step];
    const int yc = y, ya = y + row_h + 8;
    const double wait_ms = s["wait_ms"].get<double>();
    const int64_t bs = s["backward_start_ns"], be = s["backward_end_ns"], cl = s["clipped_ns"],
                  en = s["end_ns"], st = s["start_ns"];
    const int64_t compute_end = be - static_cast<int64_t>(wait_ms * 1e6);
    c.text(12, yc + 2, "rank " + std::to_string(r["rank"].get<int>()), 2);
    c.text(12, yc + 19, "compute", 2);
    c.text(12, ya + 10, "all-reduce", 2);
    c.fill(Xns(st), yc, Xns(bs), yc + row_h, kForward);
    c.fill(Xns(bs), yc, Xns(compute_end), yc + row_h, kBackward);
    c.fill(Xns(be), yc, Xns(cl), yc + row_h, kLossClip);
    c.fill(Xns(cl), yc, Xns(en), yc + row_h, kUpdate);
    c.frame(Xns(st), yc, Xns(en) + 1, yc + row_h, kInk);
    c.fill(left, ya + row_h / 2, left + plot_w, ya + row_h / 2 + 1, kGrid);
    if (s.contains("origin_ns")) {
      const int64_t o = s["origin_ns"];
      auto at = [&](double ms) { return o + static_cast<int64_t>(ms * 1e6); };
      double prev_done = -1e30;
      int64_t total_bytes = 0;
      const auto& bk = s["buckets"];
      for (size_t b = 0; b < bk.size(); ++b) {
        const double l = bk[b]["launch_ms"], d = bk[b]["done_ms"];
        total_bytes += bk[b]["bytes"].get<int64_t>();
        if (l < 0 || d < 0) continue;
        const double run_start = std::max(l, prev_done);
        prev_done = d;
        c.fill(Xns(at(l)), ya + 8, Xns(at(run_start)), ya + row_h - 8, kQueued);
        const int x0 = Xns(at(run_start)), x1 = std::max(x0 + 1, Xns(at(d)));
        c.fill(x0, ya + 4, x1, ya + row_h - 4, b % 2 ? kBucketB : kBucketA);
        c.fill(Xns(at(l)), ya, Xns(at(l)) + 2, ya + row_h, kInk);  // launch tick
        if (x1 - x0 > 70) c.text(x0 + 4, ya + 10, "#" + std::to_string(b) + format_number(" %.1f MB", bk[b]["bytes"].get<double>() / 1e6), 1, kBg);
      }
      // The exposed wait: from when backward's compute ended to when backward() returned.
      c.fill(Xns(compute_end), ya + row_h - 10, std::max(Xns(compute_end) + 2, Xns(be)), ya + row_h, kWait);
      std::ostringstream note;
      note << bk.size() << " buckets, " << format_number("%.1f", total_bytes / 1e6) << " MB; wait after backward " << format_number("%.1f", wait_ms)
           << " ms; step " << format_number("%.0f", (en - st) / 1e6) << " ms";
      c.text(left, ya + row_h + 5, note.str(), 2);
    } else {
      c.text(left + 8, ya + 10, "no gradient all-reduce (one process)", 2);
    }
    y += 2 * row_h + 8 + rank_gap;
  }
  // from_blob wraps the canvas, which outlives the encoding.
  c.save(out);
  std::printf("wrote %s (step %d, %.1f ms shown)\n", out.c_str(), step, span_ms);
  return 0;
}
