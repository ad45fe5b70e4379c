// A pipeline-parallel training step (docs/pipeline.md): this process runs one stage, a contiguous
// run of the backbone's units (NetImpl::units, model/net.h), of a pipeline of S processes, driven by
// a schedule (pipeline/schedule.h: GPipe, 1F1B, ZB-H1) over the step's M micro-batches. Under a
// V-shaped schedule (1F1B-V, ZB-V) each of R processes runs two of the 2R stages, r and 2R-1-r, in
// the order of its action list; what the two pass each other (the carry at the V's turn, a skip
// made and read on one rank, their gradients) goes through a mailbox in the process, not the group.
// With replicas, V-shaped placement's gradient sync runs after the last action instead of
// overlapping it.
//   prepare  the objective's prepare (x_t, t, conditioning, target; the frozen work: a latent
//            encoder, a ControlNet's locked encoder) in quanta of rows (pipeline/prepare.h). Without
//            a fill plan every stage prepares every micro-batch itself before the pipeline starts
//            (its draws are keyed by sample position, so every stage gets the same). With one
//            (parallel.fill, planned after the run's first two steps from their measurements,
//            pipeline/calibrate.h), the prepare work is task pieces in the schedule: a piece in a
//            bubble prepares rows of the *next* step's micro-batch, a serial piece rows of this
//            step's; its rank sends each other stage what that stage reads of them
//   first    with train.self_cond: the rows each micro-batch chooses pass through every stage without
//            gradients (this step's weights), the last stage's output goes back to stage 0, whose
//            forward feeds the x0 estimate in. A stage runs the chosen rows of each quantum of the
//            micro-batch's positions alone, so however a plan cuts the pass into pieces the result
//            is the same bit for bit; once a stage has run all of a micro-batch's pieces, it sends
//            their rows on as one message. Without a fill plan, a sweep once this step's serial
//            prepare pieces are done; with one, the plan's pieces per stage and micro-batch, partial
//            batches where a bubble holds only part (never in the previous step's bubbles: the
//            weights change)
//   F        stage 0 runs its units on x_t; stage s > 0 first receives the carry (h, the conditioning
//            embedding, the open U-Net skips) from stage s-1; the last stage computes the loss, the
//            others send their carry on to s+1
//   B        the last stage back-propagates loss / M; the others first receive the gradient of their
//            carry from s+1; every stage but the first sends its input's gradient to s-1
//   I, W     ZB-H1's split of B: I computes and sends only the input gradient (the critical path),
//            W later accumulates the weight gradients from the same graph, from the gradients I
//            kept at its edges toward the parameters (pipeline/split_backward.h), not walking I again
// Sends are posted without waiting and waited for at the end of the step (Gloo's send completes only
// once the peer has posted its receive); a receive is waited for when its action needs it (the
// prepared pieces' receives are posted when the step starts). Then one small all-reduce gives every
// stage the loss and the gradient norm over all stages, every stage clips by that norm, and each
// stage's AdamW + EMA updates its own parameters.
//
// Every stage builds the whole model alike (same seed); the parameters of the other stages are
// frozen here, so this stage's optimizer holds its own alone. Checkpoints hold every parameter by
// name, assembled from the stages (gather_view / send_own / share), so a run resumes under another split or as one
// process, and `ddm sample` loads it like any other. The next step's prepared rows are not part of a
// checkpoint: a resumed run prepares them again, alike.
//
// Files: runtime.cpp (the interpreter of the action list, run; the loss and the update),
// runtime_fill.cpp (bubble filling and its measurements); a stage's forward and backward are
// pipeline/stage.h's, self-conditioning's first pass pipeline/first_pass.h's, the messages between
// the stages and the carry's format pipeline/wire.h's, the split backward pipeline/split_backward.h's.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/grad_sync.h"
#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/objective.h"
#include "model/net.h"
#include "pipeline/calibrate.h"
#include "pipeline/first_pass.h"
#include "pipeline/prepare.h"
#include "pipeline/routes.h"
#include "pipeline/schedule.h"
#include "pipeline/simulate.h"
#include "pipeline/split_backward.h"
#include "pipeline/stage.h"
#include "pipeline/timeline.h"
#include "pipeline/wire.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace ddm {

// The first unit of every stage plus the unit count at the end (stage s = units [b[s], b[s+1])):
// from parallel.cuts when given (checked against the model's units), else balanced by each unit's
// estimated multiply-adds (parameters x output positions, measured on `sample`: one prepared row)
// with the partition DP (pipeline/partition.h; v_shaped: the V's, `stages` / 2 ranks balanced).
// Deterministic: every stage computes the same.
std::vector<int> pipe_stage_bounds(NetImpl& net, const Prepared& sample, int stages,
                                   const std::vector<int64_t>& cuts, bool v_shaped = false);

class PipeStep {
 public:
  // cfg.model resolved; net built from it (the whole model); comm: this pipeline's group, one rank
  // per stage, rank s runs stage s (V-shaped: the schedule's placement); bounds from pipe_stage_bounds; schedule over comm's world size and
  // the step's M micro-batches; rows: the rows of each micro-batch (this replica's batch / M, as the
  // job's layout derived it, parallel/layout.h; the step's micro-batches are checked against it);
  // routes: where each open skip goes (routes.h; none: every
  // skip travels in the carry through every stage). Pipelines of data-parallel replicas (parallel.dp > 1): replicas
  // is this stage's data-parallel group (the same stage of every replica; rank r = replica r), whose
  // gradients are averaged during the stage's last backward (comm/grad_sync.h), and world the whole
  // job (the loss and the gradient norm); null for one pipeline. The pipeline's shape (stages,
  // micro-batches, rows) is what it is handed; of cfg it reads the training's settings alone.
  PipeStep(const RunConfig& cfg, Net net, std::shared_ptr<Objective> objective, std::shared_ptr<Comm> comm,
           std::vector<int> bounds, PipeSchedule schedule, int64_t rows, std::shared_ptr<Comm> replicas = nullptr,
           std::shared_ptr<Comm> world = nullptr, PipeSkipRoutes routes = {});
  // Its stages and first pass hold references to its wire and routes: it stays where it was built.
  PipeStep(const PipeStep&) = delete;
  PipeStep& operator=(const PipeStep&) = delete;
  // One step over this replica's M micro-batches (every stage passes the same ones). `next`: the
  // next step's micro-batches, for a fill plan's pieces that prepare them in this step's bubbles;
  // empty when this is the run's last step (and may always be, at the cost of preparing those rows
  // at the start of the next step). wants_next() says whether they are used.
  StepResult run(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next = {});
  bool wants_next() const { return cfg_.parallel.fill; }
  // The fill plan, once made (after the run's second step, on every stage alike), and its line of
  // output; fill_news() is true for the step that made it.
  const std::optional<PipeFillPlan>& fill_plan() const { return plan_; }
  bool fill_news() const { return fill_news_; }
  // Runs `plan` (made by plan_fill for this pipeline's schedule, rows and quantum; every stage the
  // same) from the next step on, instead of the plan the run makes after its second step: a plan
  // with known pieces, for tests.
  void use_fill_plan(PipeFillPlan plan);
  // For tests of whole runs: when set, every stage passes the gathered measurements (all stages, in
  // stage order) through `f` before planning, so that which plan a run makes does not depend on the
  // speed of the machine that runs the test (a test asserts what the runtime does with a plan, never
  // which plan this machine's timings give). Process-wide (the stages of such tests are threads);
  // an empty function turns it off.
  static void override_measures(std::function<void(std::vector<PipeStageMeasure>&)> f);
  // fill_plan_json of the plan, or "null" before one is made.
  std::string fill_json() const { return plan_ ? fill_plan_json(*plan_) : "null"; }

  FlatAdamW& optim() { return *optim_; }
  int stage() const { return rank_; }  // this process's rank in the pipeline (its first stage)
  int replica() const { return replicas_ ? replicas_->rank() : 0; }
  // Bytes sent over the groups of its own (the pipeline's and the replicas'), not counting the job's.
  int64_t group_bytes_sent() const {
    return (comm_ != world_ ? comm_->bytes_sent() : 0) + (replicas_ ? replicas_->bytes_sent() : 0);
  }
  // Every stage's last_step_json, indexed by stage (a collective of this pipeline's group).
  std::vector<std::string> all_last_steps() { return comm_->all_gather_strings(last_step_json()); }
  int stages() const { return static_cast<int>(bounds_.size()) - 1; }
  int micro_batches() const { return schedule_.micro; }  // per step
  int64_t rows() const { return rows_; }                 // per micro-batch (this replica's share)
  int rank_of_stage(int stage) const { return schedule_.rank_of(stage); }
  const std::vector<int>& bounds() const { return bounds_; }
  const std::vector<std::string>& unit_names() const { return unit_names_; }
  // The last step on this stage as JSON (with a fill plan, the last that had a next step to prepare:
  // the run's very last step runs none of the pieces in bubbles): {"stage", "step" (1-based), "filled" (it ran a fill plan), "start_ms" (steady clock, comparable between the
  // processes of one machine), "prepared_ms", "actions_ms" (the last send waited for), "synced_ms"
  // (loss and norm all-reduced), "end_ms" (from the start), "events": [[op, micro, start_ms, end_ms],
  // ...]} (a task piece: ["T", micro, start_ms, end_ms, rows, in a bubble, task], task 0 the prepare
  // phase (in a bubble: the next step's rows), 1 + s stage s's first pass). An event starts once its input
  // has arrived: waiting for a receive is idle time.
  std::string last_step_json() const;

  // Every trainable parameter of the whole model by name ("<prefix><name>"), for rank 0 of the
  // pipeline to write, a tensor at a time: its own from `mine` (this stage's tensors, e.g.
  // optim().named_params()), the other stages' as placeholders on the meta device that fetch()
  // receives, one at a time in any order, while the owners run send_own with the same prefix and
  // slot. `slot` (0..kSlots-1) tells the tensors of one gathering from another's on the wire;
  // send_own sends prefixes[k] in slot first_slot + k, all before it waits for any.
  static constexpr int kSlots = 4;
  TensorMap gather_view(const TensorMap& mine, const std::string& prefix) const;
  torch::Tensor fetch(const std::string& name, const std::string& prefix, int slot);
  void send_own(const TensorMap& mine, const std::vector<std::string>& prefixes, int first_slot);
  // The reverse for loading: stage 0's `whole` (every trainable parameter, "<prefix><name>") is
  // checked there, and each rank receives only its own stages' parameters; the others pass an
  // empty map. No rank holds more of the model's state than its stages' share (and rank 0 `whole`).
  TensorMap share(const TensorMap& whole, const std::string& prefix, const std::string& origin);
  // With replicas: every replica's stage takes replica 0's optimizer state (weights, EMA, moments).
  void share_with_replicas();

 private:
  using Recv = PipeWire::Recv;
  PipeStage& local(int stage);
  int rank_of(int stage) const { return schedule_.rank_of(stage); }
  // Micro-batch m's forward on stage l (stage 0: with self-conditioning's estimate; the last: its loss).
  void forward(PipeStage& l, int micro);
  // Self-conditioning: a piece of micro-batch m's first pass through stage l, positions [first,
  // first + rows) (whole quanta; serial: not in a bubble), recorded as an event.
  void first_pass(PipeStage& l, int m, int64_t first, int64_t rows, bool filling, bool serial);
  double ms_since_start(std::chrono::steady_clock::time_point t) const;
  // Bubble filling: run piece `i` (sending its rows to the other stages); post the receives of the
  // other stages' pieces; receive piece `in` (waiting for it); make micro-batch m's Prepared whole.
  void run_piece(size_t i, const std::vector<Batch>& micro, const std::vector<Batch>& next, int64_t step);
  // The prepare phase: every micro-batch here (no fill plan), or the rows prepared ahead (or, when
  // there are none, those rows now) and the receives of the other stages' pieces.
  void prepare(const std::vector<Batch>& micro, int64_t step, bool filling, bool has_next);
  struct Incoming {
    size_t piece;
    torch::Tensor length;  // int64 [1]: the bytes of the piece's safetensors message
    c10::intrusive_ptr<c10d::Work> work;
    bool done = false;
  };
  void post_incoming(bool has_next);
  void receive(Incoming& in);
  void complete(int micro);
  void measure_and_plan();

  RunConfig cfg_;
  Net net_;
  std::shared_ptr<Objective> objective_;
  std::shared_ptr<Comm> comm_, replicas_, world_;
  std::shared_ptr<GradSync> sync_;  // with replicas: this stage's gradients averaged over them
  std::vector<int> bounds_;
  PipeSchedule schedule_;
  PipeSkipRoutes routes_;
  torch::Device device_ = torch::kCPU;   // where this process's stages compute (the model's device)
  std::unique_ptr<PipeWire> wire_;       // the messages between the stages
  int rank_ = 0;
  std::vector<PipeStage> locals_;        // the stages this process runs, ascending
  std::vector<Prepared> prep_;           // per micro-batch of this step: its prepared inputs
  std::vector<std::string> unit_names_;  // every unit's, in order
  std::vector<std::string> all_names_;   // every trainable parameter of the whole model, in order
  std::vector<std::vector<int64_t>> all_shapes_;
  std::vector<int> all_owners_;          // the rank (in this pipeline) whose stage trains each one
  std::map<std::string, size_t> index_of_;  // all_names_' positions
  std::unique_ptr<FlatAdamW> optim_;
  double scale_ = 1, loss_sum_ = 0;
  StepTimes times_;
  std::vector<PipeSlot> events_;         // this step's actions, ms since its start: from their input's arrival to their end
  StepTimes shown_times_;                // last_step_json's step
  int64_t shown_step_ = 0;
  bool shown_filled_ = false;
  std::vector<PipeSlot> shown_events_;
  // Bubble filling.
  int64_t rows_ = 0, quantum_ = 1;     // rows per micro-batch, rows per prepare call
  std::vector<PrepNeeds> needs_;       // per rank: what its stages read of a prepared micro-batch
  int64_t steps_run_ = 0;
  std::vector<int64_t> prepared_bytes_;  // per rank: what it reads of a prepared micro-batch
  std::optional<PipeFillPlan> plan_;
  bool fill_news_ = false;
  std::vector<PrepPiece> pieces_;      // the plan's, every rank's
  std::vector<int> piece_at_;          // this rank's action index -> piece index (-1: none)
  std::vector<int64_t> pass_first_;    // this rank's action index -> a first-pass piece's first position
  using Rows = std::vector<std::pair<int64_t, TensorMap>>;
  std::vector<Rows> now_, ahead_;      // per micro-batch: prepared rows of this step, of the next
  int64_t ahead_step_ = -1;            // the step ahead_ belongs to
  std::vector<Incoming> incoming_;
  // Self-conditioning's first pass (train.self_cond > 0; else null).
  std::unique_ptr<PipeFirstPass> first_pass_;
};

}  // namespace ddm
