// The pipeline simulator; the dependency rules are listed in simulate.h.
#include "pipeline/simulate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>

#include "core/error.h"

namespace ddm {

double PipeTask::time(int64_t n) const {
  DDM_CHECK(!cost.empty(), "task '" << name << "' has no profiled cost");
  if (n <= 0) return 0;
  if (n <= cost.front().first) return cost.front().second * static_cast<double>(n) / cost.front().first;
  for (size_t i = 1; i < cost.size(); ++i)
    if (n <= cost[i].first) {
      const auto& [r0, t0] = cost[i - 1];
      const auto& [r1, t1] = cost[i];
      return t0 + (t1 - t0) * static_cast<double>(n - r0) / static_cast<double>(r1 - r0);
    }
  return cost.back().second * static_cast<double>(n) / cost.back().first;
}

bool PipeTask::allowed_on(int rank) const {
  return ranks.empty() || std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

void validate_costs(const PipeCosts& c, int S, int R) {
  if (R < 0) R = S;
  auto finite = [](double v) { return std::isfinite(v) && v >= 0; };
  DDM_CHECK(static_cast<int>(c.stage.size()) == S, "pipeline costs: " << c.stage.size() << " stage costs for " << S << " stages");
  for (int s = 0; s < S; ++s)
    DDM_CHECK(finite(c.stage[s].forward) && finite(c.stage[s].input_grad) && finite(c.stage[s].weight_grad) &&
                  std::isfinite(c.stage[s].split_input) && std::isfinite(c.stage[s].split_weight),
              "pipeline costs: stage " << s << " has a negative or non-finite time");
  for (const auto* v : {&c.send_forward, &c.send_backward}) {
    DDM_CHECK(v->empty() || static_cast<int>(v->size()) == S - 1,
              "pipeline costs: send times need " << S - 1 << " entries (one per cut), got " << v->size());
    for (double t : *v) DDM_CHECK(finite(t), "pipeline costs: a send time is negative or not finite: " << t);
  }
  DDM_CHECK(finite(c.latency), "pipeline costs: the link's latency is negative or not finite: " << c.latency);
  DDM_CHECK(c.optimizer.empty() || static_cast<int>(c.optimizer.size()) == R,
            "pipeline costs: optimizer times need " << R << " entries (one per rank), got " << c.optimizer.size());
  for (const PipeSkipRoute& k : c.skips)
    DDM_CHECK(0 <= k.from && k.from < k.to && k.to < S && finite(k.forward) && finite(k.backward),
              "pipeline costs: skip route " << k.from << " -> " << k.to << " is not a forward route between stages 0.." << S - 1);
  for (size_t t = 0; t < c.tasks.size(); ++t) {
    const PipeTask& k = c.tasks[t];
    DDM_CHECK(!k.cost.empty(), "task '" << k.name << "': no profiled (rows, time) points");
    for (size_t i = 0; i < k.cost.size(); ++i)
      DDM_CHECK(k.cost[i].first > 0 && finite(k.cost[i].second) && (i == 0 || k.cost[i].first > k.cost[i - 1].first),
                "task '" << k.name << "': profiled points must have rows > 0, ascending, and finite times >= 0");
    DDM_CHECK(k.rows >= 1, "task '" << k.name << "': rows per micro-batch must be >= 1, got " << k.rows);
    DDM_CHECK(k.quantum >= 1 && k.rows % k.quantum == 0,
              "task '" << k.name << "': its quantum (" << k.quantum << " rows) must divide its " << k.rows << " rows");
    DDM_CHECK(0 <= k.consumer && k.consumer < S, "task '" << k.name << "': consumer stage " << k.consumer << " is not in 0.." << S - 1);
    DDM_CHECK(k.after < static_cast<int>(t), "task '" << k.name << "': `after` must name an earlier task, got " << k.after);
    DDM_CHECK(finite(k.send), "task '" << k.name << "': send time is negative or not finite");
    for (int r : k.ranks) DDM_CHECK(0 <= r && r < R, "task '" << k.name << "': rank " << r << " is not in 0.." << R - 1);
  }
}

double PipeTimeline::busy(int rank, bool tasks) const {
  double b = 0;
  for (const PipeSlot& x : ranks[rank])
    if ((x.action.op == PipeOp::kTask) == tasks) b += x.end - x.start;
  return b;
}

std::vector<PipeInterval> PipeTimeline::idle() const {
  constexpr double kEps = 1e-9;
  std::vector<PipeInterval> out;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    double t = 0;
    for (const PipeSlot& x : ranks[r]) {
      if (x.start > t + kEps) out.push_back({r, t, x.start});
      t = std::max(t, x.end);
    }
    if (makespan > t + kEps) out.push_back({r, t, makespan});
  }
  return out;
}

double PipeTimeline::bubble_fraction() const {
  if (ranks.empty() || makespan <= 0) return 0;
  double idle_time = 0;
  for (const PipeInterval& i : idle()) idle_time += i.end - i.start;
  return idle_time / (static_cast<double>(ranks.size()) * makespan);
}

double PipeTimeline::start_of(PipeOp op, int stage, int micro) const {
  for (const auto& r : ranks)
    for (const PipeSlot& x : r)
      if (x.action.op == op && x.action.stage == stage && x.action.micro == micro) return x.start;
  return -1;
}

PipeTimeline simulate(const PipeSchedule& s, const PipeCosts& c) {
  validate_costs(c, s.stages, static_cast<int>(s.ranks.size()));
  const int R = static_cast<int>(s.ranks.size()), S = s.stages;
  constexpr double kUnknown = -1;
  PipeTimeline tl;
  tl.ranks.resize(R);

  // Where each backbone action and each task piece sits: (rank, index in the rank's list).
  using Pos = std::pair<int, int>;
  std::map<std::tuple<int, int, int>, Pos> backbone;  // (kind 0 = F, 1 = B/I, 2 = W; stage; micro)
  std::map<std::pair<int, int>, std::vector<Pos>> pieces;  // (task, micro)
  auto kind = [](PipeOp op) { return op == PipeOp::kForward ? 0 : op == PipeOp::kWeightGrad ? 2 : 1; };
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const PipeAction& a = s.ranks[r][i];
      if (a.op == PipeOp::kTask) {
        DDM_CHECK(a.task >= 0 && a.task < static_cast<int>(c.tasks.size()) && a.rows >= 1,
                  "schedule '" << s.name << "' rank " << r << ": task piece " << action_text(a) << " names no task");
        DDM_CHECK(c.tasks[a.task].allowed_on(r), "schedule '" << s.name << "': task '" << c.tasks[a.task].name
                                                              << "' may not run on rank " << r);
        pieces[{a.task, a.micro}].push_back({r, i});
      } else {
        backbone[{kind(a.op), a.stage, a.micro}] = {r, i};
      }
    }
  std::vector<std::vector<double>> end(R);
  for (int r = 0; r < R; ++r) end[r].assign(s.ranks[r].size(), kUnknown);

  // The backbone's messages: when each arrives, (direction 0 = forward / 1 = backward, from stage, to
  // stage, micro) -> time, set as its sender's action is simulated. A rank's actions are simulated
  // in its list's order, so each link sees its messages in the order they are sent.
  using Message = std::tuple<int, int, int, int>;
  std::map<Message, double> arrival;
  std::map<std::pair<int, int>, double> link_free;  // (from rank, to rank) -> when its last message has left
  auto post = [&](const Message& msg, double sent, double time) {
    const int a = s.rank_of(std::get<1>(msg)), b = s.rank_of(std::get<2>(msg));
    if (a == b) {
      arrival[msg] = sent + time;
      return;
    }
    double& free = link_free[{a, b}];
    const double start = std::max(sent, free);
    free = start + std::max(0.0, time - c.latency);  // the bytes hold the link; the latency does not
    arrival[msg] = start + time;
  };

  const auto at = [](const std::vector<double>& v, int i) { return v.empty() ? 0.0 : v[i]; };
  // Ready time of `a` on rank `r`, or kUnknown while an input is still missing.
  auto ready = [&](int r, const PipeAction& a) -> double {
    double t = 0;
    bool missing = false;
    auto need = [&](const Pos& p, double delay) {
      const double e = end[p.first][p.second];
      if (e == kUnknown) missing = true;
      else t = std::max(t, e + delay);
    };
    auto need_backbone = [&](int k, int stage, int micro, double delay) {
      auto it = backbone.find({k, stage, micro});
      DDM_CHECK(it != backbone.end(), "schedule '" << s.name << "' lacks the action " << (k == 0 ? "F" : "B/I") << micro
                                                   << " of stage " << stage);
      need(it->second, delay);
    };
    // The message of (direction, from stage, to stage, micro): known once its sender has run.
    auto need_message = [&](int dir, int from, int to, int micro) {
      need_backbone(dir, from, micro, 0);
      auto it = arrival.find({dir, from, to, micro});
      if (it != arrival.end()) t = std::max(t, it->second);
    };
    // Every piece of instance (task, micro), or only its serial ones (this iteration's rows of work
    // that otherwise prepares the next iteration).
    auto need_task = [&](int task, int micro, bool serial_only) {
      auto it = pieces.find({task, micro});
      if (it == pieces.end()) return;
      for (const Pos& p : it->second)
        if (!serial_only || s.ranks[p.first][p.second].serial) need(p, p.first == r ? 0 : c.tasks[task].send);
    };
    switch (a.op) {
      case PipeOp::kForward:
        if (a.stage > 0) need_message(0, a.stage - 1, a.stage, a.micro);
        for (const PipeSkipRoute& k : c.skips)
          if (k.to == a.stage) need_message(0, k.from, k.to, a.micro);
        for (int t = 0; t < static_cast<int>(c.tasks.size()); ++t)
          if (c.tasks[t].consumer == a.stage) need_task(t, a.micro, c.tasks[t].cross_iteration);
        break;
      case PipeOp::kBackward:
      case PipeOp::kInputGrad:
        need_backbone(0, a.stage, a.micro, 0);
        if (a.stage < S - 1) need_message(1, a.stage + 1, a.stage, a.micro);
        for (const PipeSkipRoute& k : c.skips)
          if (k.from == a.stage) need_message(1, k.to, k.from, a.micro);
        break;
      case PipeOp::kWeightGrad: need_backbone(1, a.stage, a.micro, 0); break;
      case PipeOp::kTask:
        if (const int after = c.tasks[a.task].after; after >= 0) need_task(after, a.micro, c.tasks[after].cross_iteration);
        break;
    }
    return missing ? kUnknown : t;
  };
  auto cost = [&](const PipeAction& a) {
    const PipeStageCost& k = a.op == PipeOp::kTask ? PipeStageCost{} : c.stage[a.stage];
    switch (a.op) {
      case PipeOp::kForward: return k.forward;
      case PipeOp::kBackward: return k.input_grad + k.weight_grad;
      case PipeOp::kInputGrad: return k.i_time();
      case PipeOp::kWeightGrad: return k.w_time();
      case PipeOp::kTask: return c.tasks[a.task].time(a.rows);
    }
    return 0.0;
  };

  std::vector<size_t> next(R, 0);
  std::vector<double> clock(R, 0);
  for (;;) {
    bool progress = false, done = true;
    for (int r = 0; r < R; ++r)
      while (next[r] < s.ranks[r].size()) {
        const PipeAction& a = s.ranks[r][next[r]];
        const double t = ready(r, a);
        if (t == kUnknown) break;
        const double start = std::max(clock[r], t);
        const double e = clock[r] = end[r][next[r]] = start + cost(a);
        tl.ranks[r].push_back({a, start, e});
        if (a.op == PipeOp::kForward) {  // the carry to the next stage, then the skips sent straight on
          if (a.stage < S - 1) post({0, a.stage, a.stage + 1, a.micro}, e, at(c.send_forward, a.stage));
          for (const PipeSkipRoute& k : c.skips)
            if (k.from == a.stage) post({0, k.from, k.to, a.micro}, e, k.forward);
        } else if (a.op == PipeOp::kBackward || a.op == PipeOp::kInputGrad) {  // the gradients back
          if (a.stage > 0) post({1, a.stage, a.stage - 1, a.micro}, e, at(c.send_backward, a.stage - 1));
          for (const PipeSkipRoute& k : c.skips)
            if (k.to == a.stage) post({1, k.to, k.from, a.micro}, e, k.backward);
        }
        ++next[r];
        progress = true;
      }
    for (int r = 0; r < R; ++r) done = done && next[r] == s.ranks[r].size();
    if (done) break;
    if (!progress) {
      std::ostringstream o;
      for (int r = 0; r < R; ++r)
        if (next[r] < s.ranks[r].size())
          o << " rank " << r << " waits at " << action_text(s.ranks[r][next[r]], s.several_per_rank()) << ";";
      DDM_FAIL("schedule '" << s.name << "' deadlocks:" << o.str() << " each waits for an action that runs after it");
    }
  }
  for (int r = 0; r < R; ++r) tl.makespan = std::max(tl.makespan, clock[r]);
  double opt = 0;
  for (double o : c.optimizer) opt = std::max(opt, o);
  tl.iteration = tl.makespan + opt;
  return tl;
}

}  // namespace ddm
