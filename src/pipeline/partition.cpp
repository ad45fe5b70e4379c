// The stage-partitioning DP; see partition.h.
#include "pipeline/partition.h"

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

void check_units(const std::vector<PipeUnit>& units) {
  for (const PipeUnit& u : units)
    DDM_CHECK(std::isfinite(u.forward + u.input_grad + u.weight_grad + u.activation_bytes + u.state_bytes + u.cut_bytes) &&
                  std::min({u.forward, u.input_grad, u.weight_grad, u.activation_bytes, u.state_bytes, u.cut_bytes}) >= 0,
              "unit '" << u.name << "' has a negative or non-finite time or size");
}

[[noreturn]] void fail_memory(int L, int stages, const std::string& placement, double limit, double smallest) {
  DDM_FAIL("no " << placement << "split of the model's " << L << " units into " << stages << " stages fits in "
                 << bytes_text(limit) << " per " << (placement.empty() ? "stage" : "rank")
                 << "; the smallest limit that works is " << bytes_text(smallest)
                 << " (or use more stages or fewer micro-batches in flight)");
}

}  // namespace

double stage_send_bytes(const std::vector<PipeUnit>& units, int i, int j, std::pair<int, int> local) {
  double b = carry_bytes(units, j - 1);
  for (int l = i; l < j; ++l)
    for (const PipeSkip& k : units[l].skips)
      if (k.read >= j && !(local.first <= k.read && k.read < local.second)) b += k.bytes;
  return b;
}

PipePartition partition_units(const std::vector<PipeUnit>& units, int S, const std::vector<int>& in_flight,
                              double limit, const PipeLink& link) {
  const int L = static_cast<int>(units.size());
  DDM_CHECK(S >= 1, "pipeline stages must be >= 1, got " << S);
  DDM_CHECK(S <= L, "a pipeline of " << S << " stages needs at least " << S << " units, but the model has " << L
                                     << ": use at most " << L << " stages");
  DDM_CHECK(static_cast<int>(in_flight.size()) == S, "in-flight counts: " << in_flight.size() << " for " << S << " stages");
  check_units(units);
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
    fail_memory(L, S, "", limit, solve(false, 0, unused));
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

PipePartition partition_units_v(const std::vector<PipeUnit>& units, int R, const std::vector<int>& in_flight,
                                double limit, const PipeLink& link) {
  const int L = static_cast<int>(units.size()), S = 2 * R;
  DDM_CHECK(R >= 1, "pipeline ranks must be >= 1, got " << R);
  DDM_CHECK(S <= L, "a V-shaped pipeline over " << R << " ranks has " << S << " stages and needs at least " << S
                                                << " units, but the model has " << L << ": use at most " << L / 2 << " ranks");
  DDM_CHECK(static_cast<int>(in_flight.size()) == S, "in-flight counts: " << in_flight.size() << " for " << S << " stages");
  check_units(units);
  const Prefix p(units);
  // local[i][x]: bytes of the skips made before unit i and read before unit x (2-D prefix sums),
  // so the skips a run [a, a2) makes for a run [b2, b) on the same rank cost O(1).
  std::vector<std::vector<double>> local(L + 1, std::vector<double>(L + 2, 0));
  for (int l = 0; l < L; ++l) {
    std::vector<double> row(L + 1, 0);
    for (const PipeSkip& k : units[l].skips) row[std::min(std::max(k.read, 0), L)] += k.bytes;
    for (int x = 0; x <= L; ++x) local[l + 1][x + 1] = local[l][x + 1] + local[l + 1][x] - local[l][x] + row[x];
  }
  auto local_bytes = [&](int a, int a2, int lo, int hi) {
    return local[a2][hi] - local[a][hi] - local[a2][lo] + local[a][lo];
  };
  std::vector<std::vector<double>> send(L + 1, std::vector<double>(L + 1, 0));  // [i][j]: bytes run [i, j) sends on
  for (int i = 0; i < L; ++i)
    for (int j = i + 1; j < L; ++j) send[i][j] = stage_send_bytes(units, i, j);
  auto compute = [&](int i, int j) { return p.time[j] - p.time[i]; };
  auto act = [&](int i, int j) { return p.act[j] - p.act[i]; };
  auto state = [&](int i, int j) { return p.state[j] - p.state[i]; };
  // Rank r < R-1 holding [a, a2) as stage r and [b2, b) as stage S-1-r.
  // (A skip no unit reads stays on the last stage: rank 0's, so the read index L counts as its.)
  auto time_first = [&](int a, int a2, int b2, int b) {
    return compute(a, a2) + link.time(send[a][a2] - local_bytes(a, a2, b2, b == L ? L + 1 : b));
  };
  auto time_second = [&](int r, int b2, int b) { return compute(b2, b) + (r > 0 ? link.time(send[b2][b]) : 0); };
  auto memory = [&](int r, int a, int a2, int b2, int b) {
    return state(a, a2) + state(b2, b) + in_flight[r] * act(a, a2) + in_flight[S - 1 - r] * act(b2, b);
  };
  // The middle rank R-1 holding [a, b): the split m and its time or memory.
  // Values are (the slowest rank, the longest single stage): the second only breaks ties of the
  // first (within rounding), towards even stages, which the V schedules' unit-cost order assumes.
  struct Value {
    double rank = std::numeric_limits<double>::infinity(), stage = std::numeric_limits<double>::infinity();
    bool better_than(const Value& o) const {
      const double tol = 1e-12 * std::max(1.0, std::abs(o.rank));
      return rank < o.rank - tol || (rank <= o.rank + tol && stage < o.stage);
    }
  };
  auto middle = [&](int a, int b, bool by_time, double lim, int* split) {
    Value best;
    for (int m = a + 1; m < b; ++m) {
      const double mem = state(a, b) + in_flight[R - 1] * act(a, m) + in_flight[R] * act(m, b);
      if (by_time && mem > lim) continue;
      const Value v{by_time ? compute(a, b) + (R > 1 ? link.time(send[a][b]) : 0) : mem,
                    by_time ? std::max(compute(a, m), compute(m, b)) : 0};
      if (v.better_than(best)) best = v, *split = m;
    }
    return best;
  };

  // The DP; `by_time` false minimizes the largest rank memory instead (for the error message).
  // choice[r][a][b] = (a2, b2) for r < R-1, (m, m) for the middle rank.
  using Choice = std::pair<int, int>;
  auto solve = [&](bool by_time, double lim, std::vector<std::vector<std::vector<Choice>>>& choice) {
    std::vector<std::vector<std::vector<Value>>> V(R, std::vector<std::vector<Value>>(L + 1, std::vector<Value>(L + 1)));
    choice.assign(R, std::vector<std::vector<Choice>>(L + 1, std::vector<Choice>(L + 1, {-1, -1})));
    for (int r = R - 1; r >= 0; --r) {
      const int need = 2 * (R - r);  // units ranks r..R-1 need
      for (int a = r; a <= L; ++a)
        for (int b = a + need; b <= L - r; ++b) {
          if (r == 0 && (a != 0 || b != L)) continue;
          if (r == R - 1) {
            int m = -1;
            V[r][a][b] = middle(a, b, by_time, lim, &m);
            choice[r][a][b] = {m, m};
            continue;
          }
          for (int a2 = a + 1; a2 < b; ++a2)
            for (int b2 = a2 + need - 2; b2 < b; ++b2) {
              const Value& rest = V[r + 1][a2][b2];
              if (!std::isfinite(rest.rank)) continue;
              const double mem = memory(r, a, a2, b2, b);
              if (by_time && mem > lim) continue;
              const double first = time_first(a, a2, b2, b), second = time_second(r, b2, b);
              const Value v{std::max(rest.rank, by_time ? first + second : mem),
                            by_time ? std::max({rest.stage, first, second}) : 0};
              if (v.better_than(V[r][a][b])) V[r][a][b] = v, choice[r][a][b] = {a2, b2};
            }
        }
    }
    return V[0][0][L].rank;
  };
  std::vector<std::vector<std::vector<Choice>>> choice;
  const double best = solve(true, limit, choice);
  if (!std::isfinite(best)) {
    std::vector<std::vector<std::vector<Choice>>> unused;
    fail_memory(L, S, "V-shaped ", limit, solve(false, 0, unused));
  }
  PipePartition out;
  out.first.assign(S + 1, L);
  out.stage_time.assign(S, 0), out.stage_memory.assign(S, 0);
  for (int v = 0; v < S; ++v) out.stage_rank.push_back(v < R ? v : S - 1 - v);
  for (int r = 0, a = 0, b = L; r < R; ++r) {
    const auto [a2, b2] = choice[r][a][b];
    if (r == R - 1) {
      out.first[r] = a, out.first[r + 1] = a2, out.first[S - r] = b;
      out.stage_time[r] = compute(a, a2);
      out.stage_time[r + 1] = compute(a2, b) + (R > 1 ? link.time(send[a][b]) : 0);
      out.stage_memory[r] = state(a, a2) + in_flight[r] * act(a, a2);
      out.stage_memory[r + 1] = state(a2, b) + in_flight[r + 1] * act(a2, b);
      break;
    }
    out.first[r] = a, out.first[S - r] = b;
    out.stage_time[r] = time_first(a, a2, b2, b), out.stage_time[S - 1 - r] = time_second(r, b2, b);
    out.stage_memory[r] = state(a, a2) + in_flight[r] * act(a, a2);
    out.stage_memory[S - 1 - r] = state(b2, b) + in_flight[S - 1 - r] * act(b2, b);
    a = a2, b = b2;
  }
  out.bottleneck = best;
  return out;
}

PipeCosts costs_of_partition(const std::vector<PipeUnit>& units, const PipePartition& p, const PipeLink& link) {
  const int S = static_cast<int>(p.first.size()) - 1;
  PipeCosts c;
  c.latency = link.latency;
  for (int s = 0; s < S; ++s) {
    PipeStageCost k;
    for (int l = p.first[s]; l < p.first[s + 1]; ++l)
      k.forward += units[l].forward, k.input_grad += units[l].input_grad, k.weight_grad += units[l].weight_grad;
    // The split backward as the runtime runs it (pipeline/split_backward.h): I is the input gradients
    // alone, W the parameters' alone. Except on stage 0, whose inputs are data: no I, and W is the
    // whole backward of every unit after the first one with trainable parameters plus that unit's
    // parameter pass (its weight gradient where that pass was not profiled).
    if (s == 0) {
      int f = p.first[s];
      while (f < p.first[s + 1] && units[f].state_bytes <= 0) ++f;
      k.split_input = 0;
      k.split_weight = f == p.first[s + 1] ? 0 : units[f].weight_pass >= 0 ? units[f].weight_pass : units[f].weight_grad;
      for (int l = f + 1; l < p.first[s + 1]; ++l) k.split_weight += units[l].input_grad + units[l].weight_grad;
    }
    c.stage.push_back(k);
  }
  auto stage_of = [&](int u) {
    return u >= p.first[S] ? S - 1 : static_cast<int>(std::upper_bound(p.first.begin(), p.first.end(), u) - p.first.begin()) - 1;
  };
  for (int s = 0; s + 1 < S; ++s) {
    const int a = p.first[s], b = p.first[s + 1];
    if (p.rank_of(s) == p.rank_of(s + 1)) {  // V-shaped placement's turn: all on one rank
      c.send_forward.push_back(0), c.send_backward.push_back(0);
      for (int l = a; l < b; ++l)
        for (const PipeSkip& k : units[l].skips) {
          const int reader = stage_of(k.read);
          if (reader > s + 1 && p.rank_of(reader) != p.rank_of(s)) {
            const double t = link.time(k.bytes);
            c.skips.push_back({s, reader, t, t});
          }
        }
      continue;
    }
    double carried = carry_bytes(units, b - 1);
    for (int l = a; l < b; ++l)
      for (const PipeSkip& k : units[l].skips) {
        const int reader = stage_of(k.read);
        if (reader == s + 1) {
          carried += k.bytes;
        } else if (reader > s + 1 && p.rank_of(reader) != p.rank_of(s)) {
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
