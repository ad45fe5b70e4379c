// Schedule generators and checks; see schedule.h for each schedule's shape.
#include "pipeline/schedule.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"

namespace ddm {
namespace {

PipeAction act(PipeOp op, int stage, int micro) {
  PipeAction a;
  a.op = op, a.stage = stage, a.micro = micro;
  return a;
}

PipeSchedule gpipe(int S, int M) {
  PipeSchedule s{"gpipe", S, M, false, std::vector<std::vector<PipeAction>>(S), {}};
  for (int r = 0; r < S; ++r) {
    for (int m = 0; m < M; ++m) s.ranks[r].push_back(act(PipeOp::kForward, r, m));
    for (int m = 0; m < M; ++m) s.ranks[r].push_back(act(PipeOp::kBackward, r, m));
  }
  return s;
}

// 1F1B and ZB-H1 share their forward order; ZB-H1 splits each B into I and a W that lags `r`
// micro-batches behind on rank r.
PipeSchedule one_f_one_b(int S, int M, bool zb) {
  PipeSchedule s{zb ? "zb-h1" : "1f1b", S, M, zb, std::vector<std::vector<PipeAction>>(S), {}};
  for (int r = 0; r < S; ++r) {
    std::vector<PipeAction>& a = s.ranks[r];
    const int warm = std::min(S - r - 1, M), lag = r;
    for (int m = 0; m < warm; ++m) a.push_back(act(PipeOp::kForward, r, m));
    int w = 0;
    for (int k = 0; k < M; ++k) {
      if (warm + k < M) a.push_back(act(PipeOp::kForward, r, warm + k));
      if (!zb) {
        a.push_back(act(PipeOp::kBackward, r, k));
        continue;
      }
      a.push_back(act(PipeOp::kInputGrad, r, k));
      if (k >= lag) a.push_back(act(PipeOp::kWeightGrad, r, w++));
    }
    while (zb && w < M) a.push_back(act(PipeOp::kWeightGrad, r, w++));
  }
  return s;
}

// 1F1B-V and ZB-V in the phases of Qi et al.'s ZB-V (Zero Bubble Pipeline Parallelism, section 6),
// written from the paper's description. Rank r holds chunk 0 (stage r) and chunk 1 (stage 2R-1-r);
// "B" is B, or I then W at once (ZB-V), unless a phase defers the W:
//   1. 2(R-r)-1 forwards of chunk 0
//   2. r times: F chunk 1, F chunk 0
//   3. R-r times: F chunk 1, B chunk 1
//   4. until every forward ran: F chunk 0 (while any is left), B chunk 0, F chunk 1, B chunk 1
//   5. r times: I chunk 0, I chunk 1 (W's deferred; 1F1B-V: B, B)
//   6. R-r times: I chunk 0 and one deferred W of chunk 0 (1F1B-V: B chunk 0)
//   7. the deferred W's, chunk 1's first
// The phases assume at least 2R-1 micro-batches; with fewer, the schedule is built for 2R-1 and the
// actions of micro-batches past M are dropped. Each rank holds at most 2R chunk activations (1F1B's
// first-rank peak when a chunk is half a stage). Deadlock-freedom is a property of the per-rank
// orders alone; the tests run every shape through the simulator.
PipeSchedule v_shape(int R, int M, bool zb) {
  const int S = 2 * R, built = std::max(M, 2 * R - 1);
  PipeSchedule s{zb ? "zb-v" : "1f1b-v", S, M, zb, std::vector<std::vector<PipeAction>>(R), {}};
  for (int v = 0; v < S; ++v) s.stage_rank.push_back(v < R ? v : S - 1 - v);
  for (int r = 0; r < R; ++r) {
    const int stage[2] = {r, S - 1 - r};
    int f[2] = {0, 0}, b[2] = {0, 0}, w[2] = {0, 0};  // next micro-batch of each kind, per chunk
    std::vector<PipeAction>& out = s.ranks[r];
    auto emit = [&](PipeOp op, int chunk, int& next) {
      if (next < M) out.push_back(act(op, stage[chunk], next));
      ++next;
    };
    auto forward = [&](int c) { emit(PipeOp::kForward, c, f[c]); };
    auto backward = [&](int c, bool with_w) {
      if (!zb) return emit(PipeOp::kBackward, c, b[c]);
      emit(PipeOp::kInputGrad, c, b[c]);
      if (with_w) emit(PipeOp::kWeightGrad, c, w[c]);
    };
    for (int k = 0; k < 2 * (R - r) - 1; ++k) forward(0);
    for (int k = 0; k < r; ++k) forward(1), forward(0);
    for (int k = 0; k < R - r; ++k) forward(1), backward(1, true);
    while (f[1] < f[0] || f[0] < built) {
      if (f[0] < built) forward(0);
      backward(0, true), forward(1), backward(1, true);
    }
    for (int k = 0; k < r; ++k) backward(0, false), backward(1, false);
    for (int k = 0; k < R - r; ++k) {
      backward(0, false);
      if (zb) emit(PipeOp::kWeightGrad, 0, w[0]);
    }
    while (zb && w[1] < b[1]) emit(PipeOp::kWeightGrad, 1, w[1]);
    while (zb && w[0] < b[0]) emit(PipeOp::kWeightGrad, 0, w[0]);
  }
  return s;
}

}  // namespace

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "zb-h1", "1f1b-v", "zb-v"};
  return names;
}

bool is_v_schedule(const std::string& name) { return name == "1f1b-v" || name == "zb-v"; }

PipeSchedule make_schedule(const std::string& name, int stages, int micro) {
  DDM_CHECK(stages >= 1, "pipeline stages must be >= 1, got " << stages);
  DDM_CHECK(micro >= 1, "pipeline micro-batches must be >= 1, got " << micro);
  PipeSchedule s;
  if (name == "gpipe")
    s = gpipe(stages, micro);
  else if (name == "1f1b")
    s = one_f_one_b(stages, micro, false);
  else if (name == "zb-h1")
    s = one_f_one_b(stages, micro, true);
  else if (is_v_schedule(name))
    s = v_shape(stages, micro, name == "zb-v");
  else
    DDM_FAIL("unknown pipeline schedule '" << name << "': use gpipe, 1f1b, zb-h1, 1f1b-v or zb-v");
  validate_schedule(s);
  return s;
}

void validate_schedule(const PipeSchedule& s) {
  const int R = static_cast<int>(s.ranks.size());
  DDM_CHECK(s.stage_rank.empty() ? R == s.stages : static_cast<int>(s.stage_rank.size()) == s.stages,
            "schedule '" << s.name << "' has " << R << " ranks and " << s.stage_rank.size() << " stage placements for "
                         << s.stages << " stages");
  for (int v = 0; v < s.stages; ++v)
    DDM_CHECK(0 <= s.rank_of(v) && s.rank_of(v) < R,
              "schedule '" << s.name << "' places stage " << v << " on rank " << s.rank_of(v) << " of " << R);
  const bool several = s.several_per_rank();
  for (int r = 0; r < R; ++r) {
    // Per (stage, micro-batch): 1 = F seen, 2 = B or I seen, 3 = W seen.
    std::vector<int> state(static_cast<size_t>(s.stages) * s.micro, 0);
    for (const PipeAction& a : s.ranks[r]) {
      if (a.op == PipeOp::kTask) continue;
      DDM_CHECK(a.stage >= 0 && a.stage < s.stages && s.rank_of(a.stage) == r && a.micro >= 0 && a.micro < s.micro,
                "schedule '" << s.name << "' rank " << r << ": action " << action_text(a, several) << " of stage "
                             << a.stage << " does not belong here");
      int& st = state[static_cast<size_t>(a.stage) * s.micro + a.micro];
      const bool ok = (a.op == PipeOp::kForward && st == 0) ||
                      (a.op == PipeOp::kBackward && st == 1 && !s.split_backward) ||
                      (a.op == PipeOp::kInputGrad && st == 1 && s.split_backward) ||
                      (a.op == PipeOp::kWeightGrad && st == 2 && s.split_backward);
      DDM_CHECK(ok, "schedule '" << s.name << "' rank " << r << ": " << action_text(a, several)
                                 << " is out of order or repeated: " << rank_text(s.ranks[r], several));
      st = a.op == PipeOp::kForward ? 1 : a.op == PipeOp::kWeightGrad ? 3 : 2;
    }
    const int done = s.split_backward ? 3 : 2;
    for (int v = 0; v < s.stages; ++v)
      for (int m = 0; m < s.micro && s.rank_of(v) == r; ++m)
        DDM_CHECK(state[static_cast<size_t>(v) * s.micro + m] == done,
                  "schedule '" << s.name << "' rank " << r << " does not finish micro-batch " << m << " of stage " << v
                               << ": " << rank_text(s.ranks[r], several));
  }
}

std::vector<int> peak_in_flight(const PipeSchedule& s) {
  std::vector<int> peak(s.stages, 0), now(s.stages, 0);
  for (const std::vector<PipeAction>& rank : s.ranks)
    for (const PipeAction& a : rank) {
      if (a.op == PipeOp::kForward) peak[a.stage] = std::max(peak[a.stage], ++now[a.stage]);
      if (a.op == PipeOp::kBackward || a.op == PipeOp::kWeightGrad) --now[a.stage];
    }
  return peak;
}

std::string action_text(const PipeAction& a, bool stage) {
  std::ostringstream o;
  switch (a.op) {
    case PipeOp::kForward: o << 'F' << a.micro; break;
    case PipeOp::kBackward: o << 'B' << a.micro; break;
    case PipeOp::kInputGrad: o << 'I' << a.micro; break;
    case PipeOp::kWeightGrad: o << 'W' << a.micro; break;
    case PipeOp::kTask: o << 'T' << a.task << '.' << a.micro << 'x' << a.rows; break;
  }
  if (stage && a.op != PipeOp::kTask) o << '@' << a.stage;
  return o.str();
}

std::string rank_text(const std::vector<PipeAction>& actions, bool stage) {
  std::string t;
  for (const PipeAction& a : actions) t += (t.empty() ? "" : " ") + action_text(a, stage);
  return t;
}

}  // namespace ddm
