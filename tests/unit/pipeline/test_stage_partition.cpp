// Tests of the stage-partitioning DPs (pipeline/partition.h), linear and V-shaped, against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "pipeline/calibrate.h"
#include "pipeline/fill.h"
#include "pipeline/partition.h"
#include "pipeline/plan.h"
#include "pipeline/prepare.h"
#include "pipeline/profile.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"
#include "pipeline/timeline.h"
#include "test_util.h"
#include "unit/pipeline/pipe_test_util.h"

using namespace ddm;
using namespace ddm::test;

TEST(PipePartition, MatchesBruteForce) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  const PipeLink link{100.0, 0.05};
  for (int trial = 0; trial < 200; ++trial) {
    const int L = 1 + trial % 8, S = 1 + (trial / 8) % std::min(L, 4);
    std::vector<double> carry;
    std::vector<PipeUnit> units = random_units(rng, L, trial % 2, carry);
    auto sends = [&](int i, int j) {
      double b = carry[j - 1];
      for (int l = i; l < j; ++l)
        for (const PipeSkip& k : units[l].skips) b += k.read >= j ? k.bytes : 0;
      return b;
    };
    std::vector<int> in_flight(S);
    for (int s = 0; s < S; ++s) in_flight[s] = S - s;
    const double limit = 30 + u(rng) * 40;
    // Brute force over all S-1 cuts.
    double best = std::numeric_limits<double>::infinity(), smallest = best;
    std::function<void(int, int, double, double)> go = [&](int s, int i, double worst_t, double worst_m) {
      if (s == S) {
        if (i == L) {
          smallest = std::min(smallest, worst_m);
          if (worst_m <= limit) best = std::min(best, worst_t);
        }
        return;
      }
      for (int j = i + 1; j <= L - (S - s - 1); ++j) {
        double t = 0, a = 0, st = 0;
        for (int l = i; l < j; ++l) t += units[l].forward + units[l].input_grad + units[l].weight_grad, a += units[l].activation_bytes, st += units[l].state_bytes;
        if (j < L) {
          t += link.time(sends(i, j));
          EXPECT_NEAR(stage_send_bytes(units, i, j), sends(i, j), 1e-9);
        }
        go(s + 1, j, std::max(worst_t, t), std::max(worst_m, st + in_flight[s] * a));
      }
    };
    go(0, 0, 0, 0);
    if (std::isfinite(best)) {
      const PipePartition p = partition_units(units, S, in_flight, limit, link);
      EXPECT_NEAR(p.bottleneck, best, 1e-9) << "trial " << trial;
      ASSERT_EQ(p.first.size(), static_cast<size_t>(S + 1));
      for (int s = 0; s < S; ++s) {
        EXPECT_LT(p.first[s], p.first[s + 1]);
        EXPECT_LE(p.stage_memory[s], limit);
        EXPECT_LE(p.stage_time[s], p.bottleneck + 1e-12);
      }
      // The simulator's stage costs add up to the units'.
      const PipeCosts c = costs_of_partition(units, p, link);
      double total = 0;
      for (const PipeStageCost& k : c.stage) total += k.forward + k.input_grad + k.weight_grad;
      double want = 0;
      for (const PipeUnit& x : units) want += x.forward + x.input_grad + x.weight_grad;
      EXPECT_NEAR(total, want, 1e-9);
      // Each skip leaves its stage once: in the next cut's carry, or by a route past the stages between.
      auto stage_of = [&](int l) {
        int s = 0;
        while (s + 1 < S && p.first[s + 1] <= l) ++s;
        return s;
      };
      std::vector<double> carried(S > 1 ? S - 1 : 0, 0);
      std::vector<std::pair<int, int>> routes, want_routes;
      for (int s = 0; s + 1 < S; ++s) carried[s] = carry[p.first[s + 1] - 1];
      for (int l = 0; l < L; ++l)
        for (const PipeSkip& k : units[l].skips) {
          const int from = stage_of(l), to = stage_of(std::min(k.read, L - 1));
          if (to == from + 1) carried[from] += k.bytes;
          if (to > from + 1) want_routes.push_back({from, to});
        }
      for (int s = 0; s + 1 < S; ++s) EXPECT_NEAR(c.send_forward[s], link.time(carried[s]), 1e-9) << "trial " << trial;
      for (const PipeSkipRoute& k : c.skips) routes.push_back({k.from, k.to});
      std::sort(routes.begin(), routes.end()), std::sort(want_routes.begin(), want_routes.end());
      EXPECT_EQ(routes, want_routes) << "trial " << trial;
    } else {
      const std::string e = error_message([&] { partition_units(units, S, in_flight, limit, link); });
      char b[64];
      std::snprintf(b, sizeof b, "the smallest limit that works is %.3g MiB", smallest / (1 << 20));
      EXPECT_NE(e.find(b), std::string::npos) << e;
    }
  }
  const std::vector<PipeUnit> two(2);
  EXPECT_NE(error_message([&] { partition_units(two, 3, {1, 1, 1}, 1e9, link); }).find("needs at least 3 units, but the model has 2"),
            std::string::npos);
}

// The V-shaped DP against every split of small random models into 2R stages (rank r holding stage r
// and stage 2R-1-r): the slowest rank (both its stages, sends without the skips its own second stage
// reads, nothing sent between the middle rank's two stages) under each rank's memory; the
// simulator's costs send nothing within a rank and route only skips between ranks.

TEST(PipePartition, VShapedMatchesBruteForce) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  const PipeLink link{100.0, 0.05};
  int feasible = 0;
  for (int trial = 0; trial < 240; ++trial) {
    const int L = 2 + trial % 8, R = 1 + (trial / 8) % std::min(L / 2, 3), S = 2 * R;
    std::vector<double> carry;
    const std::vector<PipeUnit> units = random_units(rng, L, true, carry);
    // Sends of run [i, j), without the skips read in [lo, hi).
    auto sends = [&](int i, int j, int lo, int hi) {
      double b = carry[j - 1];
      for (int l = i; l < j; ++l)
        for (const PipeSkip& k : units[l].skips) b += k.read >= j && !(lo <= k.read && k.read < hi) ? k.bytes : 0;
      return b;
    };
    auto sum = [&](int i, int j, int what) {
      double t = 0;
      for (int l = i; l < j; ++l)
        t += what == 0 ? units[l].forward + units[l].input_grad + units[l].weight_grad
             : what == 1 ? units[l].activation_bytes : units[l].state_bytes;
      return t;
    };
    std::vector<int> in_flight(S);
    for (int v = 0; v < S; ++v) in_flight[v] = 1 + static_cast<int>(rng() % 3);
    const double limit = 60 + u(rng) * 100;
    double best = std::numeric_limits<double>::infinity(), smallest = best;
    std::vector<int> first(S + 1, L);
    first[0] = 0;
    std::function<void(int)> go = [&](int v) {  // choose first[v] for v = 1..S-1
      if (v == S) {
        double worst_t = 0, worst_m = 0;
        for (int r = 0; r < R; ++r) {
          const int a = first[r], a2 = first[r + 1], b2 = first[S - 1 - r], b = first[S - r];
          double t, m = sum(a, a2, 2) + sum(b2, b, 2) + in_flight[r] * sum(a, a2, 1) + in_flight[S - 1 - r] * sum(b2, b, 1);
          if (r == R - 1)
            t = sum(a, b, 0) + (R > 1 ? link.time(sends(a, b, 0, 0)) : 0);
          else
            t = sum(a, a2, 0) + link.time(sends(a, a2, b2, b == L ? L + 1 : b)) + sum(b2, b, 0) + (r > 0 ? link.time(sends(b2, b, 0, 0)) : 0);
          worst_t = std::max(worst_t, t), worst_m = std::max(worst_m, m);
        }
        smallest = std::min(smallest, worst_m);
        if (worst_m <= limit) best = std::min(best, worst_t);
        return;
      }
      for (int j = first[v - 1] + 1; j <= L - (S - v); ++j) first[v] = j, go(v + 1);
    };
    go(1);
    if (!std::isfinite(best)) {
      const std::string e = error_message([&] { partition_units_v(units, R, in_flight, limit, link); });
      char b[64];
      std::snprintf(b, sizeof b, "the smallest limit that works is %.3g MiB", smallest / (1 << 20));
      EXPECT_NE(e.find(b), std::string::npos) << e;
      EXPECT_NE(e.find("V-shaped"), std::string::npos) << e;
      continue;
    }
    ++feasible;
    const PipePartition p = partition_units_v(units, R, in_flight, limit, link);
    EXPECT_NEAR(p.bottleneck, best, 1e-9) << "trial " << trial;
    ASSERT_EQ(p.first.size(), static_cast<size_t>(S + 1));
    ASSERT_EQ(p.stage_rank.size(), static_cast<size_t>(S));
    for (int v = 0; v < S; ++v) {
      EXPECT_LT(p.first[v], p.first[v + 1]);
      EXPECT_EQ(p.rank_of(v), v < R ? v : S - 1 - v);
    }
    for (int r = 0; r < R; ++r) {
      EXPECT_LE(p.stage_memory[r] + p.stage_memory[S - 1 - r], limit + 1e-9);
      EXPECT_LE(p.stage_time[r] + p.stage_time[S - 1 - r], p.bottleneck + 1e-9);
    }
    const PipeCosts c = costs_of_partition(units, p, link);
    double total = 0;
    for (const PipeStageCost& k : c.stage) total += k.forward + k.input_grad + k.weight_grad;
    EXPECT_NEAR(total, sum(0, L, 0), 1e-9);
    auto stage_of = [&](int l) {
      int v = 0;
      while (v + 1 < S && p.first[v + 1] <= l) ++v;
      return v;
    };
    std::vector<double> carried(S - 1, 0);
    std::vector<std::pair<int, int>> routes, want_routes;
    for (int v = 0; v + 1 < S; ++v) carried[v] = p.rank_of(v) == p.rank_of(v + 1) ? 0 : carry[p.first[v + 1] - 1];
    for (int l = 0; l < L; ++l)
      for (const PipeSkip& k : units[l].skips) {
        const int from = stage_of(l), to = stage_of(std::min(k.read, L - 1));
        if (p.rank_of(from) == p.rank_of(to)) continue;  // stays on its rank
        if (to == from + 1) carried[from] += k.bytes;
        if (to > from + 1) want_routes.push_back({from, to});
      }
    for (int v = 0; v + 1 < S; ++v) EXPECT_NEAR(c.send_forward[v], link.time(carried[v]), 1e-9) << "trial " << trial;
    for (const PipeSkipRoute& k : c.skips) routes.push_back({k.from, k.to});
    std::sort(routes.begin(), routes.end()), std::sort(want_routes.begin(), want_routes.end());
    EXPECT_EQ(routes, want_routes) << "trial " << trial;
  }
  EXPECT_GT(feasible, 100);
  const std::vector<PipeUnit> three(3);
  EXPECT_NE(error_message([&] { partition_units_v(three, 2, {1, 1, 1, 1}, 1e9, link); })
                .find("over 2 ranks has 4 stages and needs at least 4 units, but the model has 3: use at most 1 ranks"),
            std::string::npos);
}
