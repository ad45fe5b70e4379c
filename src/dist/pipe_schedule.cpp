// Schedule generators and checks; see pipe_schedule.h for each schedule's shape.
#include "dist/pipe_schedule.h"

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
  PipeSchedule s{"gpipe", S, M, false, std::vector<std::vector<PipeAction>>(S)};
  for (int r = 0; r < S; ++r) {
    for (int m = 0; m < M; ++m) s.ranks[r].push_back(act(PipeOp::kForward, r, m));
    for (int m = 0; m < M; ++m) s.ranks[r].push_back(act(PipeOp::kBackward, r, m));
  }
  return s;
}

// 1F1B and ZB-H1 share their forward order; ZB-H1 splits each B into I and a W that lags `r`
// micro-batches behind on rank r.
PipeSchedule one_f_one_b(int S, int M, bool zb) {
  PipeSchedule s{zb ? "zb-h1" : "1f1b", S, M, zb, std::vector<std::vector<PipeAction>>(S)};
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

}  // namespace

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "zb-h1"};
  return names;
}

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
  else
    DDM_FAIL("unknown pipeline schedule '" << name << "': use gpipe, 1f1b or zb-h1");
  validate_schedule(s);
  return s;
}

void validate_schedule(const PipeSchedule& s) {
  DDM_CHECK(static_cast<int>(s.ranks.size()) == s.stages,
            "schedule '" << s.name << "' has " << s.ranks.size() << " ranks for " << s.stages << " stages");
  for (int r = 0; r < s.stages; ++r) {
    // Per micro-batch: 1 = F seen, 2 = B or I seen, 3 = W seen.
    std::vector<int> state(s.micro, 0);
    for (const PipeAction& a : s.ranks[r]) {
      if (a.op == PipeOp::kTask) continue;
      DDM_CHECK(a.stage == r && a.micro >= 0 && a.micro < s.micro,
                "schedule '" << s.name << "' rank " << r << ": action " << action_text(a) << " of stage "
                             << a.stage << " does not belong here");
      int& st = state[a.micro];
      const bool ok = (a.op == PipeOp::kForward && st == 0) ||
                      (a.op == PipeOp::kBackward && st == 1 && !s.split_backward) ||
                      (a.op == PipeOp::kInputGrad && st == 1 && s.split_backward) ||
                      (a.op == PipeOp::kWeightGrad && st == 2 && s.split_backward);
      DDM_CHECK(ok, "schedule '" << s.name << "' rank " << r << ": " << action_text(a)
                                 << " is out of order or repeated: " << rank_text(s.ranks[r]));
      st = a.op == PipeOp::kForward ? 1 : a.op == PipeOp::kWeightGrad ? 3 : 2;
    }
    const int done = s.split_backward ? 3 : 2;
    for (int m = 0; m < s.micro; ++m)
      DDM_CHECK(state[m] == done, "schedule '" << s.name << "' rank " << r << " does not finish micro-batch "
                                               << m << ": " << rank_text(s.ranks[r]));
  }
}

std::vector<int> peak_in_flight(const PipeSchedule& s) {
  std::vector<int> peak(s.ranks.size(), 0);
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    int now = 0;
    for (const PipeAction& a : s.ranks[r]) {
      if (a.op == PipeOp::kForward) peak[r] = std::max(peak[r], ++now);
      if (a.op == PipeOp::kBackward || a.op == PipeOp::kWeightGrad) --now;
    }
  }
  return peak;
}

std::string action_text(const PipeAction& a) {
  std::ostringstream o;
  switch (a.op) {
    case PipeOp::kForward: o << 'F' << a.micro; break;
    case PipeOp::kBackward: o << 'B' << a.micro; break;
    case PipeOp::kInputGrad: o << 'I' << a.micro; break;
    case PipeOp::kWeightGrad: o << 'W' << a.micro; break;
    case PipeOp::kTask: o << 'T' << a.task << '.' << a.micro << 'x' << a.rows; break;
  }
  return o.str();
}

std::string rank_text(const std::vector<PipeAction>& actions) {
  std::string t;
  for (const PipeAction& a : actions) t += (t.empty() ? "" : " ") + action_text(a);
  return t;
}

}  // namespace ddm
