// A pipelined run's measured timeline file, written and read (see timeline.h).
#include "pipeline/timeline.h"

#include <algorithm>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/json.h"

namespace ddm {
namespace {

const char* const kFormat = "ddm pipeline timeline 1";

// An action of the file on `rank`, shifted by `off` (runs before 2026-11-25 wrote no task for a task
// piece: the prepare phase's).
PipeSlot slot_of(const nlohmann::json& e, int rank, double off) {
  PipeAction a;
  const std::string op = e.at(0);
  a.op = op == "F" ? PipeOp::kForward : op == "B" ? PipeOp::kBackward : op == "I" ? PipeOp::kInputGrad
       : op == "W" ? PipeOp::kWeightGrad : PipeOp::kTask;
  DDM_CHECK(a.op != PipeOp::kTask || op == "T", "unknown action '" << op << "'");
  const std::string what = "event " + e.dump();
  a.stage = a.op == PipeOp::kTask ? -1 : e.size() > 4 ? json_int32(e.at(4), what, 0) : rank;  // [4]: a V rank's stage
  a.micro = json_int32(e.at(1), what, 0);
  if (a.op == PipeOp::kTask)
    a.task = e.size() > 6 ? json_int32(e.at(6), what, 0) : 0, a.rows = json_int(e.at(4), what, 0), a.serial = !e.at(5).get<bool>();
  return {a, off + e.at(2).get<double>(), off + e.at(3).get<double>()};
}

PipeTimelineRun run_of(const nlohmann::json& j) {
  auto count = [&](const char* key) { return json_int32(j.at(key), std::string("key \"") + key + "\"", 0); };
  PipeTimelineRun r;
  r.stages = count("stages");
  r.replicas = j.contains("replicas") ? count("replicas") : 1;
  r.schedule = j.at("schedule");
  r.micro = count("micro");
  r.rows = json_int(j.at("rows"), "key \"rows\"", 0);
  r.threads = count("threads");
  r.pipe_wire = j.value("pipe_wire", "float32");
  r.machine = j.value("machine", "");
  r.first_units = j.at("first_units").get<std::vector<int>>();
  r.units = j.value("units", std::vector<std::string>{});
  r.step = json_int(j.at("step"), "key \"step\"", 0);
  r.steps_timed = json_int(j.at("steps_timed"), "key \"steps_timed\"", 0);
  r.timed_from = j.contains("timed_from") ? json_int(j.at("timed_from"), "key \"timed_from\"", 0) : 0;
  r.step_ms = j.at("step_ms");
  return r;
}

}  // namespace

nlohmann::json timeline_event(const PipeAction& a, double start_ms, double end_ms, bool with_stage) {
  nlohmann::json e = {action_text(a).substr(0, 1), a.micro, start_ms, end_ms};
  if (a.op == PipeOp::kTask) {
    e.push_back(a.rows);
    e.push_back(!a.serial);
    e.push_back(a.task);
  } else if (with_stage) {
    e.push_back(a.stage);
  }
  return e;
}

std::string timeline_rank_json(const PipeTimelineRank& r) {
  nlohmann::json events = nlohmann::json::array();
  for (const PipeSlot& e : r.events) events.push_back(timeline_event(e.action, e.start, e.end, r.with_stage));
  return nlohmann::json{{"stage", r.stage},
                        {"step", r.step},
                        {"filled", r.filled},
                        {"start_ms", r.start_ms},
                        {"prepared_ms", r.prepared_ms},
                        {"actions_ms", r.actions_ms},
                        {"synced_ms", r.synced_ms},
                        {"end_ms", r.end_ms},
                        {"events", events}}
      .dump();
}

std::string fill_plan_json(const PipeFillPlan& p) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& slots : p.fill.timeline.ranks) {
    nlohmann::json r = nlohmann::json::array();
    for (const PipeSlot& x : slots) r.push_back(timeline_event(x.action, x.start, x.end, p.fill.schedule.several_per_rank()));
    ranks.push_back(r);
  }
  const PipeTask& t = p.costs.tasks.at(0);
  return nlohmann::json{{"used", p.used},
                        {"summary", p.summary},
                        {"planned_ms", p.fill.timeline.iteration},
                        {"serial_ms", p.serial.iteration},
                        {"bubble", p.fill.timeline.bubble_fraction()},
                        {"quantum", t.quantum},
                        {"prepare_ms", t.time(t.rows)},
                        {"ranks", ranks},
                        {"optimizer_ms", p.costs.optimizer}}
      .dump();
}

void write_pipe_timeline(const std::string& path, const PipeTimelineRun& run, const std::vector<std::string>& ranks,
                         const std::string& fill) {
  nlohmann::json rs = nlohmann::json::array();
  for (const std::string& r : ranks) rs.push_back(nlohmann::json::parse(r));
  const nlohmann::json record = {
      {"format", kFormat}, {"stages", run.stages}, {"replicas", run.replicas}, {"schedule", run.schedule},
      {"micro", run.micro}, {"rows", run.rows}, {"threads", run.threads},
      {"pipe_wire", run.pipe_wire},
      {"machine", run.machine},
      {"first_units", run.first_units}, {"units", run.units}, {"step", run.step},
      {"steps_timed", run.steps_timed}, {"timed_from", run.timed_from}, {"step_ms", run.step_ms}, {"ranks", rs},
      {"fill", nlohmann::json::parse(fill)}};
  write_file_atomic(path, record.dump(1) + "\n");
}

MeasuredPipeTimeline read_pipe_timeline(const std::string& path) {
  MeasuredPipeTimeline m;
  try {
    const nlohmann::json record = nlohmann::json::parse(read_file(path));
    DDM_CHECK(record.at("format") == kFormat, "unknown format " << record.at("format"));
    m.run = run_of(record);
    double t0 = std::numeric_limits<double>::infinity();
    for (const auto& r : record.at("ranks")) t0 = std::min(t0, r.at("start_ms").get<double>());
    for (const auto& r : record.at("ranks")) {
      const double off = r.at("start_ms").get<double>() - t0;
      std::vector<PipeSlot> slots;
      const double prepared = r.at("prepared_ms");
      if (prepared > 0.05) {  // a filled step's prepare phase only posts its receives
        PipeAction prep;
        prep.op = PipeOp::kTask, prep.task = 0, prep.serial = true, prep.stage = -1;
        slots.push_back({prep, off, off + prepared});
      }
      const int stage = json_int32(r.at("stage"), "key \"stage\"", 0);
      for (const auto& e : r.at("events")) slots.push_back(slot_of(e, stage, off));
      m.timeline.makespan = std::max(m.timeline.makespan, off + r.at("actions_ms").get<double>());
      m.optimizer.push_back(r.at("end_ms").get<double>() - r.at("synced_ms").get<double>());  // clip + AdamW + EMA
      m.timeline.ranks.push_back(std::move(slots));
    }
    // The run's fill plan, when the step shown ran it (a run shorter than 4 steps shows a step before).
    const nlohmann::json fill = record.value("fill", nlohmann::json());
    if (fill.is_object() && fill.at("used").get<bool>() && record.at("ranks").at(0).value("filled", false)) {
      PipeTimeline t;
      for (size_t r = 0; r < fill.at("ranks").size(); ++r) {
        t.ranks.emplace_back();
        for (const auto& e : fill.at("ranks")[r]) {
          t.ranks.back().push_back(slot_of(e, static_cast<int>(r), 0));
          t.makespan = std::max(t.makespan, t.ranks.back().back().end);
        }
      }
      t.iteration = fill.at("planned_ms");
      m.planned = t;
      m.planned_optimizer = fill.at("optimizer_ms").get<std::vector<double>>();
    }
  } catch (const nlohmann::json::exception& e) {
    DDM_FAIL(path << " is not a pipeline timeline ddm wrote: " << e.what());
  } catch (const Error& e) {
    DDM_FAIL(path << " is not a pipeline timeline ddm wrote: " << e.what());
  }
  double opt = 0;
  for (double o : m.optimizer) opt = std::max(opt, o);
  m.timeline.iteration = m.timeline.makespan + opt;
  return m;
}

}  // namespace ddm
