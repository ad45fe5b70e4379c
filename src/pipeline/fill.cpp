// The greedy bubble filler; the algorithm is described in fill.h.
#include "pipeline/fill.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "core/error.h"

namespace ddm {
namespace {

int consumer_rank(const PipeSchedule& s, int stage) {
  for (int r = 0; r < static_cast<int>(s.ranks.size()); ++r)
    for (const PipeAction& a : s.ranks[r])
      if (a.op == PipeOp::kForward && a.stage == stage) return r;
  DDM_FAIL("schedule '" << s.name << "' has no forward of stage " << stage);
}

int serial_rank(const PipeSchedule& s, const PipeTask& t) {
  const int r = consumer_rank(s, t.consumer);
  return t.allowed_on(r) ? r : t.ranks.front();
}

// `s` with serial pieces of `rows[t][m]` rows of each instance at the front of the ranks, each rank's
// ordered by micro-batch, then task: on the task's serial rank, or (spread) split in whole quanta as
// evenly as can be over the ranks the task may run on, the lower ranks taking the remainder.
PipeSchedule front_loaded(const PipeSchedule& s, const PipeCosts& c, const std::vector<std::vector<int64_t>>& rows,
                          bool spread) {
  PipeSchedule out = s;
  const int R = static_cast<int>(s.ranks.size());
  std::vector<std::vector<PipeAction>> front(s.ranks.size());
  for (int m = 0; m < s.micro; ++m)
    for (int t = 0; t < static_cast<int>(c.tasks.size()); ++t) {
      if (rows[t][m] == 0) continue;
      const PipeTask& k = c.tasks[t];
      PipeAction a;
      a.op = PipeOp::kTask, a.stage = -1, a.micro = m, a.task = t, a.serial = true;
      std::vector<int> on;
      if (spread) {
        for (int r = 0; r < R; ++r)
          if (k.allowed_on(r)) on.push_back(r);
      } else {
        on = {serial_rank(s, k)};
      }
      const int64_t quanta = rows[t][m] / k.quantum, n = static_cast<int64_t>(on.size());
      for (int64_t i = 0; i < n; ++i) {
        a.rows = (quanta / n + (i < quanta % n ? 1 : 0)) * k.quantum;
        if (a.rows > 0) front[on[static_cast<size_t>(i)]].push_back(a);
      }
    }
  for (size_t r = 0; r < s.ranks.size(); ++r) out.ranks[r].insert(out.ranks[r].begin(), front[r].begin(), front[r].end());
  return out;
}

// Largest n in [0, limit], a whole number of the task's quanta, with t.time(n) <= budget (time grows
// with rows).
int64_t rows_that_fit(const PipeTask& t, int64_t limit, double budget) {
  int64_t lo = 0, hi = limit / t.quantum;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (t.time(mid * t.quantum) <= budget + 1e-12) lo = mid;
    else hi = mid - 1;
  }
  return lo * t.quantum;
}

}  // namespace

PipeSchedule with_serial_tasks(const PipeSchedule& s, const PipeCosts& c) {
  validate_costs(c, s.stages, static_cast<int>(s.ranks.size()));
  std::vector<std::vector<int64_t>> rows(c.tasks.size());
  for (size_t t = 0; t < c.tasks.size(); ++t) rows[t].assign(s.micro, c.tasks[t].rows);
  return front_loaded(s, c, rows, false);
}

namespace {

PipeFill fill_with(const PipeSchedule& s, const PipeCosts& c, bool spread) {
  const int T = static_cast<int>(c.tasks.size()), M = s.micro;
  std::vector<std::vector<int64_t>> serial(T, std::vector<int64_t>(M, 0));
  std::vector<int> consumer(T);
  for (int t = 0; t < T; ++t) consumer[t] = consumer_rank(s, c.tasks[t].consumer);

  struct Placed {
    int rank;
    double start, end;
    PipeAction action;
  };
  PipeFill out;
  out.spread = spread;
  for (;;) {
    ++out.rounds;
    const PipeSchedule base = front_loaded(s, c, serial, spread);
    const PipeTimeline tl = simulate(base, c);

    // Each instance's rows still to place, its deadline, and when its pieces so far finish (per rank).
    std::vector<std::vector<int64_t>> left(T, std::vector<int64_t>(M));
    std::vector<std::vector<double>> deadline(T, std::vector<double>(M));
    std::vector<std::vector<std::map<int, double>>> finish(T, std::vector<std::map<int, double>>(M));
    const auto serial_finish = [&] {  // the base's pieces: every one serial, this iteration's rows
      std::vector<std::vector<std::map<int, double>>> f(T, std::vector<std::map<int, double>>(M));
      for (const auto& r : tl.ranks)
        for (const PipeSlot& x : r)
          if (x.action.op == PipeOp::kTask) {
            double& e = f[x.action.task][x.action.micro][&r - tl.ranks.data()];
            e = std::max(e, x.end);
          }
      return f;
    }();
    std::map<std::pair<int, int>, double> f_start;  // (stage, micro) -> start of F
    for (const auto& r : tl.ranks)
      for (const PipeSlot& x : r) {
        if (x.action.op == PipeOp::kForward) f_start[{x.action.stage, x.action.micro}] = x.start;
        if (x.action.op == PipeOp::kTask) {
          double& f = finish[x.action.task][x.action.micro][&r - tl.ranks.data()];
          f = std::max(f, x.end);
        }
      }
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < M; ++m) {
        left[t][m] = c.tasks[t].rows - serial[t][m];
        deadline[t][m] = c.tasks[t].cross_iteration ? tl.makespan : f_start.at({c.tasks[t].consumer, m});
      }
    // When instance (t, m) is complete and its output is on rank r; +inf while rows are left. Of a
    // cross-iteration task only the serial pieces count: those in bubbles prepare the next iteration.
    auto available = [&](int t, int m, int r) {
      const bool next_iteration = c.tasks[t].cross_iteration;
      if (!next_iteration && left[t][m] > 0) return std::numeric_limits<double>::infinity();
      double a = 0;
      for (const auto& [rank, f] : (next_iteration ? serial_finish : finish)[t][m])
        a = std::max(a, f + (rank == r ? 0 : c.tasks[t].send));
      return a;
    };

    std::vector<Placed> placed;
    std::vector<PipeInterval> gaps = tl.idle();
    std::stable_sort(gaps.begin(), gaps.end(), [](const PipeInterval& a, const PipeInterval& b) { return a.start < b.start; });
    for (const PipeInterval& gap : gaps) {
      double cursor = gap.start;
      for (;;) {
        int best_t = -1, best_m = -1;
        double best_deadline = 0, best_limit = 0;
        for (int m = 0; m < M; ++m)
          for (int t = 0; t < T; ++t) {
            const PipeTask& k = c.tasks[t];
            if (left[t][m] == 0 || !k.allowed_on(gap.rank)) continue;
            if (k.after >= 0 && available(k.after, m, gap.rank) > cursor + 1e-12) continue;
            const double due = deadline[t][m] - (k.cross_iteration || gap.rank == consumer[t] ? 0 : k.send);
            const double limit = std::min(gap.end, due);
            if (k.time(k.quantum) > limit - cursor + 1e-12) continue;
            if (best_t < 0 || due < best_deadline) best_t = t, best_m = m, best_deadline = due, best_limit = limit;
          }
        if (best_t < 0) break;
        const PipeTask& k = c.tasks[best_t];
        const int64_t n = rows_that_fit(k, left[best_t][best_m], best_limit - cursor);
        PipeAction a;
        a.op = PipeOp::kTask, a.stage = -1, a.micro = best_m, a.task = best_t, a.rows = n;
        const double end = cursor + k.time(n);
        placed.push_back({gap.rank, cursor, end, a});
        left[best_t][best_m] -= n;
        double& f = finish[best_t][best_m][gap.rank];
        f = std::max(f, end);
        cursor = end;
      }
    }

    // Rows left run serially; so does all of their predecessors' instances, which must finish before
    // them (up to a cross-iteration one: the serial pieces need only its serial rows).
    bool all_placed = true;
    for (int t = T - 1; t >= 0; --t)
      for (int m = 0; m < M; ++m)
        if (left[t][m] > 0) {
          serial[t][m] += left[t][m], all_placed = false;
          for (int a = c.tasks[t].after; a >= 0 && !c.tasks[a].cross_iteration; a = c.tasks[a].after)
            left[a][m] = c.tasks[a].rows - serial[a][m];
        }
    if (!all_placed) continue;

    // Merge the pieces into the base schedule by start time (a piece sits in a gap, so it goes
    // before the backbone action that ends the gap).
    out.schedule = base;
    for (int r = 0; r < static_cast<int>(base.ranks.size()); ++r) {
      std::vector<std::tuple<double, int, PipeAction>> order;
      for (size_t i = 0; i < tl.ranks[r].size(); ++i) order.emplace_back(tl.ranks[r][i].start, 1, tl.ranks[r][i].action);
      for (const Placed& p : placed)
        if (p.rank == r) order.emplace_back(p.start, 0, p.action);
      std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
        return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) < std::get<0>(b) : std::get<1>(a) < std::get<1>(b);
      });
      out.schedule.ranks[r].clear();
      for (const auto& o : order) out.schedule.ranks[r].push_back(std::get<2>(o));
    }
    out.pieces = static_cast<int>(placed.size());
    break;
  }
  out.timeline = simulate(out.schedule, c);
  out.filled_rows.assign(T, 0), out.serial_rows.assign(T, 0);
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < M; ++m) out.serial_rows[t] += serial[t][m], out.filled_rows[t] += c.tasks[t].rows - serial[t][m];
  return out;
}

}  // namespace

PipeFill fill_bubbles(const PipeSchedule& s, const PipeCosts& c) {
  validate_costs(c, s.stages, static_cast<int>(s.ranks.size()));
  for (const std::vector<PipeAction>& r : s.ranks)
    for (const PipeAction& a : r) DDM_CHECK(a.op != PipeOp::kTask, "fill_bubbles takes a schedule without task pieces");
  PipeFill kept = fill_with(s, c, false);
  if (s.ranks.size() > 1) {
    PipeFill spread = fill_with(s, c, true);
    if (spread.timeline.iteration < kept.timeline.iteration - 1e-9) kept = std::move(spread);
  }
  return kept;
}

}  // namespace ddm
