// The stage-partitioning DP; see pipe_partition.h.
#include "dist/pipe_partition.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace ddm {
namespace {

struct Prefix {
  std::vector<double> time, act, state;
  explicit Prefix(const std::vector<PipeUnit>& u) : time(u.size() + 1, 0), act(u.size() + 1, 0), state(u.size() + 1, 0) {
    for (size_t l = 0; l < u.size(); ++l) {
      time[l + 1] = time[l] + u[l].forward + u[l].input_grad + u[l].weight_grad;
      act[l + 1] = act[l] + u[l].activation_bytes;
      state[l + 1] = state[l] + u[l].state_bytes;
    }
  }
};

std::string bytes_text(double b) {
  char s[64];
  std::snprintf(s, sizeof s, "%.3g MiB", b / (1 << 20));
  return s;
}

// The carry after unit u without its open skips.
double carry_bytes(const std::vector<PipeUnit>& units, int u) {
  double b = units[u].cut_bytes;
  for (int l = 0; l <= u; ++l)
    for (const PipeSkip& k : units[l].skips)
      if (k.read > u) b -= k.bytes;
  return std::max(0.0, b);
}

}  // namespace

double stage_send_bytes(const std::vector<PipeUnit>& units, int i, int j) {
  double b = carry_bytes(units, j - 1);
  for (int l = i; l < j; ++l)
    for (const PipeSkip& k : units[l].skips)
      if (k.read >= j) b += k.bytes;
  return b;
}

PipePartition partition_units(const std::vector<PipeUnit>& units, int S, const std::vector<int>& in_flight,
                              double limit, const PipeLink& link) {
  const int L = static_cast<int>(units.size());
  DDM_CHECK(S >= 1, "pipeline stages must be >= 1, got " << S);
  DDM_CHECK(S <= L, "a pipeline of " << S << " stages needs at least " << S << " units, but the model has " << L
                                     << ": use at most " << L << " stages");
  DDM_CHECK(static_cast<int>(in_flight.size()) == S, "in-flight counts: " << in_flight.size() << " for " << S << " stages");
  for (const PipeUnit& u : units)
    DDM_CHECK(std::isfinite(u.forward + u.input_grad + u.weight_grad + u.activation_bytes + u.state_bytes + u.cut_bytes) &&
                  std::min({u.forward, u.input_grad, u.weight_grad, u.activation_bytes, u.state_bytes, u.cut_bytes}) >= 0,
              "unit '" << u.name << "' has a negative or non-finite time or size");
  const Prefix p(units);
  std::vector<std::vector<double>> send(L + 1, std::vector<double>(L + 1, 0));  // [i][j]: stage [i, j) sends on
  for (int i = 0; i < L; ++i)
    for (int j = i + 1; j < L; ++j) send[i][j] = link.time(stage_send_bytes(units, i, j));
  auto time = [&](int i, int j) { return p.time[j] - p.time[i] + send[i][j]; };
  auto memory = [&](int i, int j, int s) { return p.state[j] - p.state[i] + in_flight[s] * (p.act[j] - p.act[i]); };

  // The DP; `by_time` false minimizes the largest stage memory instead (for the error message).
  auto solve = [&](bool by_time, double lim, std::vector<std::vector<int>>& choice) {
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> T(S + 1, std::vector<double>(L + 1, inf));
    choice.assign(S + 1, std::vector<int>(L + 1, -1));
    T[0][0] = 0;
    for (int s = 1; s <= S; ++s)
      for (int j = s; j <= L - (S - s); ++j)
        for (int i = s - 1; i < j; ++i) {
          if (T[s - 1][i] == inf) continue;
          const double mem = memory(i, j, s - 1);
          if (by_time && mem > lim) continue;
          const double v = std::max(T[s - 1][i], by_time ? time(i, j) : mem);
          if (v < T[s][j]) T[s][j] = v, choice[s][j] = i;
        }
    return T[S][L];
  };
  std::vector<std::vector<int>> choice;
  const double best = solve(true, limit, choice);
  if (!std::isfinite(best)) {
    std::vector<std::vector<int>> unused;
    const double smallest = solve(false, 0, unused);
    DDM_FAIL("no split of the model's " << L << " units into " << S << " stages fits in " << bytes_text(limit)
                                        << " per stage; the smallest limit that works is " << bytes_text(smallest)
                                        << " (or use more stages or fewer micro-batches in flight)");
  }
  PipePartition out;
  out.first.assign(S + 1, L);
  for (int s = S, j = L; s >= 1; --s) out.first[s - 1] = j = choice[s][j];
  out.bottleneck = best;
  for (int s = 0; s < S; ++s) {
    out.stage_time.push_back(time(out.first[s], out.first[s + 1]));
    out.stage_memory.push_back(memory(out.first[s], out.first[s + 1], s));
  }
  return out;
}

PipeCosts costs_of_partition(const std::vector<PipeUnit>& units, const PipePartition& p, const PipeLink& link) {
  const int S = static_cast<int>(p.first.size()) - 1;
  PipeCosts c;
  for (int s = 0; s < S; ++s) {
    PipeStageCost k;
    for (int l = p.first[s]; l < p.first[s + 1]; ++l)
      k.forward += units[l].forward, k.input_grad += units[l].input_grad, k.weight_grad += units[l].weight_grad;
    // The split backward as the runtime runs it, where the parameter pass is profiled: I is autograd
    // of the stage's inputs (nothing on stage 0, whose inputs are data); W a second pass from the
    // stage's outputs to its parameters, which walks the whole backward of every unit after the
    // first one with trainable parameters and that unit's parameter pass (nothing without any).
    int f = p.first[s];
    while (f < p.first[s + 1] && units[f].state_bytes <= 0) ++f;
    if (f == p.first[s + 1] || units[f].weight_pass >= 0) {
      k.split_input = s == 0 ? 0 : k.input_grad;
      k.split_weight = f == p.first[s + 1] ? 0 : units[f].weight_pass;
      for (int l = f + 1; l < p.first[s + 1]; ++l) k.split_weight += units[l].input_grad + units[l].weight_grad;
    }
    c.stage.push_back(k);
  }
  auto stage_of = [&](int u) {
    return u >= p.first[S] ? S - 1 : static_cast<int>(std::upper_bound(p.first.begin(), p.first.end(), u) - p.first.begin()) - 1;
  };
  for (int s = 0; s + 1 < S; ++s) {
    const int a = p.first[s], b = p.first[s + 1];
    double carried = carry_bytes(units, b - 1);
    for (int l = a; l < b; ++l)
      for (const PipeSkip& k : units[l].skips) {
        const int reader = stage_of(k.read);
        if (reader == s + 1) {
          carried += k.bytes;
        } else if (reader > s + 1) {
          const double t = link.time(k.bytes);
          c.skips.push_back({s, reader, t, t});
        }
      }
    const double t = link.time(carried);
    c.send_forward.push_back(t), c.send_backward.push_back(t);
  }
  return c;
}

}  // namespace ddm
