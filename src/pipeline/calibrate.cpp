// Planning bubble filling from a run's own measurements (see calibrate.h).
#include "pipeline/calibrate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace ddm {

std::string measure_json(const PipeStageMeasure& m) {
  return nlohmann::json{{"forward_ms", m.forward},
                        {"input_grad_ms", m.input_grad},
                        {"weight_grad_ms", m.weight_grad},
                        {"optimizer_ms", m.optimizer},
                        {"prepare_quantum_ms", m.prepare_quantum},
                        {"carry_bytes", m.carry_bytes},
                        {"prepared_bytes", m.prepared_bytes},
                        {"link_latency_ms", m.link_latency},
                        {"link_bytes_per_ms", m.link_bytes_per_ms},
                        {"skip_bytes", m.skip_bytes},
                        {"first_pass_ms", m.first_pass},
                        {"first_pass_bytes", m.first_pass_bytes}}
      .dump();
}

PipeStageMeasure measure_from_json(const std::string& text) {
  PipeStageMeasure m;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    m.forward = j.at("forward_ms");
    m.input_grad = j.at("input_grad_ms");
    m.weight_grad = j.at("weight_grad_ms");
    m.optimizer = j.at("optimizer_ms");
    m.prepare_quantum = j.at("prepare_quantum_ms");
    m.carry_bytes = j.at("carry_bytes");
    m.prepared_bytes = j.at("prepared_bytes").get<std::vector<int64_t>>();
    m.link_latency = j.at("link_latency_ms");
    m.link_bytes_per_ms = j.at("link_bytes_per_ms");
    m.skip_bytes = j.at("skip_bytes").get<std::vector<int64_t>>();
    m.first_pass = j.at("first_pass_ms");
    m.first_pass_bytes = j.at("first_pass_bytes");
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL("a pipeline stage's measurements are not what this ddm sends (" << e.what()
                                                                              << "): do all stages run the same ddm binary?");
  }
  for (double v : {m.forward, m.input_grad, m.weight_grad, m.optimizer, m.prepare_quantum, m.link_latency, m.link_bytes_per_ms})
    DDM_CHECK(std::isfinite(v) && v >= 0, "a pipeline stage measured a negative or non-finite time: " << v);
  return m;
}

PipeCosts costs_from_measures(const std::vector<PipeStageMeasure>& stages, int64_t rows, int64_t quantum,
                              const std::vector<int>& stage_rank) {
  const int S = static_cast<int>(stages.size());
  DDM_CHECK(S >= 2, "bubble filling needs a pipeline of at least 2 stages, got " << S);
  DDM_CHECK(stage_rank.empty() || static_cast<int>(stage_rank.size()) == S,
            "pipeline: " << stage_rank.size() << " stage placements for " << S << " stages");
  auto rank_of = [&](int s) { return stage_rank.empty() ? s : stage_rank[static_cast<size_t>(s)]; };
  int R = 0;
  for (int s = 0; s < S; ++s) R = std::max(R, rank_of(s) + 1);
  const PipeStageMeasure& lead = stages.front();
  // A link of unmeasurably high bandwidth (the round trips of both sizes took the same time) costs its latency.
  const double per_ms = lead.link_bytes_per_ms > 0 ? lead.link_bytes_per_ms : 1e300;
  auto link = [&](double bytes) { return lead.link_latency + bytes / per_ms; };
  PipeCosts c;
  c.latency = lead.link_latency;
  c.optimizer.assign(static_cast<size_t>(R), 0);
  double quantum_ms = 0;
  int64_t prepared = 0;
  for (int s = 0; s < S; ++s) {
    const PipeStageMeasure& m = stages[static_cast<size_t>(s)];
    c.stage.push_back({m.forward, m.input_grad, m.weight_grad});
    c.optimizer[static_cast<size_t>(rank_of(s))] += m.optimizer;  // a rank measures it once, on its first stage
    if (s + 1 < S) {  // nothing crosses the link between two stages of one rank
      const double t = rank_of(s + 1) == rank_of(s) ? 0 : link(static_cast<double>(m.carry_bytes));
      c.send_forward.push_back(t), c.send_backward.push_back(t);
    }
    quantum_ms += m.prepare_quantum / S;  // every rank prepared every micro-batch: their mean
    DDM_CHECK(static_cast<int>(m.prepared_bytes.size()) == R,
              "stage " << s << " measured the prepared bytes of " << m.prepared_bytes.size() << " ranks, not " << R);
    for (int64_t b : m.prepared_bytes) prepared = std::max(prepared, b);
    for (int t = 0; t < static_cast<int>(m.skip_bytes.size()); ++t)
      if (m.skip_bytes[static_cast<size_t>(t)] > 0) {
        DDM_CHECK(t > s + 1 && t < S, "stage " << s << " measured a direct skip route to stage " << t);
        const double time = link(static_cast<double>(m.skip_bytes[static_cast<size_t>(t)]));
        c.skips.push_back({s, t, time, time});
      }
  }
  PipeTask t;
  t.name = "prepare";
  t.cost = {{quantum, quantum_ms}};  // each quantum is prepared alone: time grows in proportion
  t.rows = rows;
  t.quantum = quantum;
  t.consumer = 0;
  t.send = link(static_cast<double>(prepared));
  t.cross_iteration = true;
  c.tasks.push_back(t);
  // Self-conditioning's first pass, stage by stage: the last stage's output returns to stage 0.
  const bool self_cond = std::all_of(stages.begin(), stages.end(), [](const PipeStageMeasure& m) { return m.first_pass >= 0; });
  for (int s = 0; s < S && self_cond; ++s) {
    const PipeStageMeasure& m = stages[static_cast<size_t>(s)];
    PipeTask k;
    k.name = "self-conditioning pass, stage " + std::to_string(s);
    k.cost = {{rows, m.first_pass}};
    k.rows = rows;
    k.quantum = quantum;  // partial batches of whole quanta (its rows go on once all of them ran)
    k.consumer = 0;
    k.ranks = {rank_of(s)};
    k.after = static_cast<int>(c.tasks.size()) - 1;  // stage 0's: the prepare task, whose serial rows are this step's
    const int to = s + 1 < S ? s + 1 : 0;
    k.send = rank_of(to) == rank_of(s) ? 0 : link(static_cast<double>(m.first_pass_bytes));
    c.tasks.push_back(k);
  }
  validate_costs(c, S, R);
  return c;
}

PipeFillPlan plan_fill(const PipeSchedule& schedule, const std::vector<PipeStageMeasure>& stages, int64_t rows,
                       int64_t quantum) {
  PipeFillPlan p;
  p.costs = costs_from_measures(stages, rows, quantum, schedule.stage_rank);
  p.fill = fill_bubbles(schedule, p.costs);
  p.serial = simulate(with_serial_tasks(schedule, p.costs), p.costs);
  const int64_t filled = p.fill.filled_rows.at(0), total = filled + p.fill.serial_rows.at(0);
  int64_t pass_rows = 0;
  for (size_t t = 1; t < p.costs.tasks.size(); ++t) p.first_pass_rows += p.fill.filled_rows[t], pass_rows += rows * schedule.micro;
  p.used = filled > 0 || p.first_pass_rows > 0;
  const int passes = static_cast<int>(p.costs.tasks.size()) - 1;  // stages with a first pass
  int prepare_pieces = 0;
  for (const auto& r : p.fill.schedule.ranks)
    for (const PipeAction& a : r) prepare_pieces += a.op == PipeOp::kTask && a.task == 0 && !a.serial;
  char line[640];
  std::snprintf(line, sizeof line,
                "the prepare phase (%.1f ms per micro-batch of %lld rows) fills the bubbles: %.0f%% of its rows in %d "
                "pieces%s",
                p.costs.tasks[0].time(rows), static_cast<long long>(rows), total ? 100.0 * filled / total : 0.0,
                prepare_pieces,
                filled == total ? ""
                : p.fill.spread ? ", the rest shared by the stages before the pipeline starts"
                                : ", the rest serial on stage 0");
  std::string summary = filled > 0 ? line : "no piece of the prepare phase fits into a bubble (a quantum of " +
                                                std::to_string(quantum) + " rows takes longer than any): it stays serial";
  if (passes > 0) {
    std::snprintf(line, sizeof line,
                  "; %.0f%% of the rows of the self-conditioning first passes (%d stages x %d micro-batches) run in bubbles",
                  100.0 * static_cast<double>(p.first_pass_rows) / static_cast<double>(pass_rows), passes, schedule.micro);
    summary += line;
  }
  if (p.used) {
    std::snprintf(line, sizeof line, "; predicted step %.1f ms (bubbles %.1f%%) against %.1f ms with it serial",
                  p.fill.timeline.iteration, 100 * p.fill.timeline.bubble_fraction(), p.serial.iteration);
    summary += line;
  }
  p.summary = summary;
  return p;
}

}  // namespace ddm
