// Helpers shared by the tests of the pipeline planner (tests/unit/pipeline/test_*.cpp): uniform
// costs, idle time, linear frozen tasks, backbone start times, random models, a synthetic profile.
#pragma once
#include <map>
#include <random>
#include <string>
#include <vector>

#include "pipeline/fill.h"
#include "pipeline/partition.h"
#include "pipeline/profile.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"

namespace ddm::test {

inline PipeCosts uniform_costs(int S, double f, double i, double w, double send = 0) {
  PipeCosts c;
  c.stage.assign(S, PipeStageCost{f, i, w});
  c.send_forward.assign(S - 1, send), c.send_backward.assign(S - 1, send);
  return c;
}

inline double idle_of(const PipeTimeline& tl, int rank) {
  double t = 0;
  for (const PipeInterval& i : tl.idle())
    if (i.rank == rank) t += i.end - i.start;
  return t;
}

inline PipeTask linear_task(const std::string& name, double per_row, int64_t rows) {
  PipeTask t;
  t.name = name, t.rows = rows;
  t.cost = {{1, per_row}, {rows, per_row * rows}};
  if (rows == 1) t.cost.pop_back();
  return t;
}

// Start times of every backbone action, keyed by its text and stage.
inline std::map<std::string, double> backbone_starts(const PipeTimeline& tl) {
  std::map<std::string, double> m;
  for (const auto& r : tl.ranks)
    for (const PipeSlot& x : r)
      if (x.action.op != PipeOp::kTask) m[std::to_string(x.action.stage) + action_text(x.action)] = x.start;
  return m;
}

// A random model of L units for the partition DPs' brute-force tests: times and sizes drawn from
// [0.1, 3) (scaled), `carry[l]` the carry after unit l, and with `skips` 0-2 skips per unit, each read
// by a later unit or by none (read = L). cut_bytes: the carry and every skip open after the unit.
inline std::vector<PipeUnit> random_units(std::mt19937& rng, int L, bool skips, std::vector<double>& carry) {
  std::uniform_real_distribution<double> u(0.1, 3.0);
  std::vector<PipeUnit> units(L);
  carry.assign(L, 0);
  for (int l = 0; l < L; ++l) {
    carry[l] = u(rng) * 50;
    units[l] = {"u" + std::to_string(l), u(rng), u(rng), u(rng), u(rng) * 10, u(rng) * 20, carry[l], {}, -1};
    if (skips && l + 1 < L)
      for (int k = 0; k < static_cast<int>(rng() % 3); ++k)
        units[l].skips.push_back({l + 1 + static_cast<int>(rng() % (L - l)), u(rng) * 40});  // read by l+1..L
  }
  for (int l = 0; l < L; ++l)
    for (int m = 0; m <= l; ++m)
      for (const PipeSkip& k : units[m].skips)
        if (k.read > l) units[l].cut_bytes += k.bytes;
  return units;
}


// A synthetic profile: `n` equal units (forward 1 ms, I 1 ms, W 1 ms per 8 rows, linear in rows),
// and one frozen task of `task_ms` per 8 rows.
inline PipeProfile synthetic_profile(int n, double task_ms, bool uses_weights = false) {
  PipeProfile p;
  p.model = "synthetic", p.workload = "a frozen encoder", p.machine = "test", p.threads = 1;
  p.optimizer_ms_per_mparam = 1, p.x_bytes_per_row = 1024;
  for (int l = 0; l < n; ++l) {
    PipeUnitProfile u;
    u.name = "u" + std::to_string(l), u.params = 1000;
    for (int64_t r : {8, 16}) u.samples.push_back({r, r / 8.0, r / 8.0, r / 8.0, r / 16.0, 1e4 * r, 1e3 * r, r / 4.0});
    p.units.push_back(u);
  }
  p.tasks.push_back({"encoder", {{8, task_ms}, {16, 2 * task_ms}}, uses_weights, 4096});
  return p;
}


}  // namespace ddm::test
