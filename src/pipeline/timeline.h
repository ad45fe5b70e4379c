// The measured timeline of a pipelined run, RunDir::kPipeTimeline ("pipeline-timeline.json", format
// "ddm pipeline timeline 1"): the one owner of that file's format. The training loop writes it after
// the last step (each stage's last step as it ran, the run's fill plan); `ddm plan --measured` reads it
// back onto one clock, to draw it and compare it with the simulator's prediction.
//
// The file: {"format", "stages" (processes of one pipeline), "replicas", "schedule", "micro", "rows"
// (per micro-batch), "threads", "pipe_wire", "machine", "first_units", "units", "step", "steps_timed",
// "timed_from", "step_ms" (the mean timed step), "ranks": per pipeline rank {"stage", "step", "filled",
// "start_ms" (steady clock), "prepared_ms", "actions_ms", "synced_ms", "end_ms" (since its start),
// "events": its actions}, "fill": the fill plan or null}. An action (an event) is [op, micro, start_ms,
// end_ms]; a task piece ("T") adds its rows, whether it runs in a bubble and its task (0 the prepare
// phase, whose pieces in bubbles prepare the next step; 1 + s stage s's self-conditioning pass); on a
// rank of a V-shaped pipeline (two stages each), a backbone action adds its stage.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "pipeline/calibrate.h"
#include "pipeline/simulate.h"

namespace ddm {

// What the file records about the run (the fields the runs of every version wrote, and the newer ones
// with the value older runs imply).
struct PipeTimelineRun {
  int stages = 0;  // processes of one pipeline (parallel.pp)
  int replicas = 1;
  std::string schedule;
  int micro = 0;     // micro-batches per step
  int64_t rows = 0;  // rows per micro-batch of one pipeline (with replicas, of its share of the global batch)
  int threads = 0;
  std::string pipe_wire = "float32";  // runs before 2026-11-25 sent float32
  std::string machine;                // the CPU; "" in runs that did not record it
  std::vector<int> first_units;
  std::vector<std::string> units;     // the backbone's units by name; empty in runs that did not record them
  int64_t step = 0;                   // the step shown
  int64_t steps_timed = 0, timed_from = 0;
  double step_ms = 0;                 // the mean wall time of the timed steps
};

// One rank's last step, as it ran.
struct PipeTimelineRank {
  int stage = 0;  // its rank in the pipeline
  int64_t step = 0;
  bool filled = false;  // the step ran the fill plan
  double start_ms = 0;  // steady clock, shared by the ranks of one machine
  double prepared_ms = 0, actions_ms = 0, synced_ms = 0, end_ms = 0;  // since start_ms
  std::vector<PipeSlot> events;  // times since start_ms
  bool with_stage = false;       // V-shaped: events name their stage
};

// One action as the file writes it (see above; `with_stage`: a V-shaped rank's).
nlohmann::json timeline_event(const PipeAction& a, double start_ms, double end_ms, bool with_stage = false);
// A rank's entry of "ranks", as JSON text (ranks gather these as strings).
std::string timeline_rank_json(const PipeTimelineRank& r);
// The fill plan for "fill": {"used", "summary", "planned_ms" (the filled iteration), "serial_ms",
// "bubble", "quantum", "prepare_ms" (per micro-batch), "ranks": per rank the filled timeline's
// actions, "optimizer_ms": per rank}.
std::string fill_plan_json(const PipeFillPlan& p);

// Writes the file (atomically): the run, every rank's timeline_rank_json, fill_plan_json or "null".
void write_pipe_timeline(const std::string& path, const PipeTimelineRun& run, const std::vector<std::string>& ranks,
                         const std::string& fill);

// The file read back onto one clock: each stage's prepare phase as serial frozen work, then its
// actions (prepare pieces of a fill plan among them); the optimizer (with the loss and norm
// all-reduce) per rank after its last action. With a fill plan the step ran, also the plan.
struct MeasuredPipeTimeline {
  PipeTimelineRun run;
  PipeTimeline timeline;
  std::vector<double> optimizer;        // per rank, ms
  std::optional<PipeTimeline> planned;  // the run's fill plan, when the step shown ran it
  std::vector<double> planned_optimizer;
};
// A clear error naming the file when it is missing, of another format or malformed.
MeasuredPipeTimeline read_pipe_timeline(const std::string& path);

}  // namespace ddm
