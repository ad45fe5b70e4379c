// The pipeline engine (parallel/engine.h): this process runs one stage (V-shaped: two) of a pipeline
// of parallel.pp processes, stepped by pipeline/runtime.h's PipeStep; with world / pp replicas of the
// pipeline, a stage's gradients are averaged over the same stage of every replica. Checkpoints hold
// the whole model by name, assembled from the stages, so a run resumes under another split or as
// one process. After the run, rank 0 writes the measured timeline of the last step
// (pipeline/timeline.h) for `ddm plan --measured`.
#include <chrono>
#include <sstream>

#include "core/device.h"
#include "core/error.h"
#include "core/tensor_hash.h"
#include "parallel/data_parallel.h"
#include "pipeline/profile.h"
#include "pipeline/routes.h"
#include "pipeline/runtime.h"
#include "pipeline/timeline.h"

namespace ddm {
namespace {

class PipelineEngine : public Engine {
 public:
  explicit PipelineEngine(const EngineParts& parts)
      : cfg_(parts.cfg), layout_(parts.layout), net_(parts.net), comm_(parts.comm) {
    // Stage bounds from parallel.cuts, or balanced on one prepared sample row (the same on every stage).
    Prepared sample;
    {
      torch::NoGradGuard no_grad;
      BatchLoader probe(parts.data, 1, static_cast<uint64_t>(cfg_.train.seed), false);
      const torch::Device device = net_->parameters().front().device();  // the model's
      sample = parts.objective->prepare(probe.next().to(device), 0);
      Autocast autocast(device, cfg_.train.precision);
      sample.cond = net_->precompute(sample.xt, sample.t, sample.cond);
    }
    PipeSchedule schedule = make_schedule(name_of(cfg_.parallel.schedule), layout_.pp, static_cast<int>(cfg_.train.grad_accum));
    std::vector<int> bounds =
        pipe_stage_bounds(*net_, sample, schedule.stages, cfg_.parallel.cuts, schedule.several_per_rank());
    // Replicas: the groups of this process's pipeline (its stages) and of its stage (its replicas).
    std::shared_ptr<Comm> line = comm_, same_stage;
    if (layout_.replicas > 1) {
      line = comm_->subgroup("pipeline" + std::to_string(layout_.replica), layout_.pipeline_ranks());
      same_stage = comm_->subgroup("stage" + std::to_string(layout_.stage), layout_.stage_ranks());
    }
    PipeSkipRoutes routes = pipe_skip_routes(*net_, sample, bounds);
    // The whole model's seeded initialization, hashed before the stage lets the other stages'
    // weights go (start_run compares it across ranks on a fresh start; a resumed run takes the
    // checkpoint's weights instead, and hashing 3.5 GB of SD 2.1's would cost every stage seconds).
    if (!parts.from_checkpoint) {
      torch::NoGradGuard no_grad;
      Sha256 hash;
      for (const torch::Tensor& w : net_->parameters()) hash_tensor(hash, w);
      const std::string hex = hash.hex();
      initial_digest_ = torch::from_blob(const_cast<char*>(hex.data()), {static_cast<int64_t>(hex.size())}, torch::kUInt8).clone();
    }
    // Each micro-batch: this replica's share of the global batch (the layout's), cut into grad_accum.
    const int64_t rows = layout_.local_batch / cfg_.train.grad_accum;
    pipe_ = std::make_unique<PipeStep>(cfg_, net_, parts.objective, line, std::move(bounds), std::move(schedule), rows,
                                       same_stage, comm_, std::move(routes));
  }

  FlatAdamW& optim() override { return pipe_->optim(); }

  void take_resumed(const Checkpoint* resumed, const std::string& origin, int64_t optimizer_step) override {
    // Stage 0 read the checkpoint: every stage of its pipeline takes its own parameters' state from
    // it, by name (whatever split, or none, wrote it); the other replicas then from that pipeline.
    const TensorMap none;
    if (layout_.replica == 0) {
      const TensorMap params = pipe_->share(resumed ? resumed->model : none, "", origin);
      const TensorMap ema = pipe_->share(resumed ? resumed->ema : none, "", origin);
      TensorMap moments = pipe_->share(resumed ? resumed->optim : none, "exp_avg.", origin);
      moments.merge(pipe_->share(resumed ? resumed->optim : none, "exp_avg_sq.", origin));
      pipe_->optim().load(params, ema, moments, optimizer_step, origin);
    }
    if (layout_.replicas > 1) pipe_->share_with_replicas();
  }

  // A stage holds only its own stages' trainable weights: the whole model's digest, taken before.
  std::vector<torch::Tensor> initial_weights() override {
    DDM_CHECK(initial_digest_.defined(), "pipeline: the initial weights were not hashed (the run resumes)");
    return {initial_digest_};
  }

  EngineBegun begin(const EngineStart& start) override {
    timed_from_ = start.step + 1;  // the first step of a run warms up: not timed
    return {start.step};
  }

  StepResult step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) override {
    const auto start = std::chrono::steady_clock::now();
    const StepResult r = pipe_->run(micro, step, next);
    if (step >= timed_from_) {
      timed_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      ++timed_steps_;
    }
    // With a fill plan, the steps after the first that runs it (which prepares its ahead rows itself).
    if (pipe_->fill_news() && pipe_->fill_plan()->used) timed_ms_ = 0, timed_steps_ = 0, timed_from_ = step + 2;
    return r;
  }
  bool wants_next() const override { return pipe_->wants_next(); }
  std::string news(int64_t done) override {
    if (!pipe_->fill_news()) return {};
    return "parallel.fill after step " + std::to_string(done) + ": " + pipe_->fill_plan()->summary;
  }
  int agree_stop(int64_t, int64_t, int signal) override { return agree_on_stop(*comm_, signal); }
  bool agrees_every_step() const override { return true; }

  std::vector<std::string> contribute(Checkpoint& ck, int64_t, const std::string& mine_record) override {
    // The data positions first; then rank 0 writes every stage's parameters' state by name while
    // the other stages send theirs, a tensor at a time as the writer reaches it (Checkpoint::fetch):
    // parameters, EMA, moments, in that order on every stage. Rank 0 holds no more of the other
    // stages' state than one tensor. Every replica holds the same, so replica 0's pipeline alone
    // takes part.
    std::vector<std::string> records =
        comm_->world_size() > 1 ? comm_->all_gather_strings(mine_record) : std::vector<std::string>{mine_record};
    const FlatAdamW& o = pipe_->optim();
    const TensorMap moments = o.optimizer_state();
    if (layout_.rank != 0) {
      if (layout_.replica == 0) {
        pipe_->send_own(o.named_params(), {""}, 0);
        pipe_->send_own(o.named_ema(), {""}, 1);
        pipe_->send_own(moments, {"exp_avg.", "exp_avg_sq."}, 2);
      }
      return records;
    }
    ck.model = module_state(*net_);
    for (auto& [name, t] : pipe_->gather_view(o.named_params(), "")) ck.model[name] = t;
    ck.ema = pipe_->gather_view(o.named_ema(), "");
    ck.optim = pipe_->gather_view(moments, "exp_avg.");
    ck.optim.merge(pipe_->gather_view(moments, "exp_avg_sq."));
    ck.fetch = [this](int part, const std::string& name) {
      if (part < 2) return pipe_->fetch(name, "", part);
      return name.rfind("exp_avg_sq.", 0) == 0 ? pipe_->fetch(name, "exp_avg_sq.", 3) : pipe_->fetch(name, "exp_avg.", 2);
    };
    ck.state["pipeline"] = {{"stages", pipe_->stages()},
                            {"processes", layout_.pp},
                            {"schedule", name_of(cfg_.parallel.schedule)},
                            {"first_units", pipe_->bounds()}};
    return records;
  }

  std::string describe() const override {
    const std::vector<int>& b = pipe_->bounds();
    const int stages = pipe_->stages(), pp = layout_.pp, replicas = layout_.replicas;
    const ParallelConfig& p = cfg_.parallel;
    std::ostringstream s;
    s << "parallel: "
      << (replicas > 1 ? std::to_string(replicas) + " data-parallel replicas of a pipeline" : "a pipeline") << " of "
      << stages << " stages" << (stages > pp ? " on " + std::to_string(pp) + " processes, V-shaped" : "") << " ("
      << name_of(p.schedule) << ", " << pipe_->micro_batches()
      << (pipe_->micro_batches() == 1 ? " micro-batch of " : " micro-batches of ") << pipe_->rows() << "), units";
    const auto& names = pipe_->unit_names();
    for (int i = 0; i < stages; ++i)
      s << (i ? " | " : " ") << names[static_cast<size_t>(b[static_cast<size_t>(i)])] << ".."
        << names[static_cast<size_t>(b[static_cast<size_t>(i) + 1] - 1)]
        << (stages > pp ? " (rank " + std::to_string(pipe_->rank_of_stage(i)) + ")" : "");
    s << " (parallel.cuts = [";
    for (int i = 1; i < stages; ++i) s << (i > 1 ? ", " : "") << b[static_cast<size_t>(i)];
    s << "]), activations in " << name_of(p.pipe_wire) << " on the wire" << (replicas > 1 ? ", gradients in " + name_of(p.wire) : "")
      << ", collective timeout " << p.timeout << " s";
    if (pipe_->micro_batches() < stages)
      s << "\nnote: " << pipe_->micro_batches() << " micro-batch" << (pipe_->micro_batches() > 1 ? "es" : "")
        << " for " << stages << " stages: each stage waits for the others most of the step; train.grad_accum >= "
        << stages << " keeps them busy (the global batch stays, split finer)";
    return s.str();
  }

  int64_t bytes_sent() const override { return comm_->bytes_sent() + pipe_->group_bytes_sent(); }
  Comm& group() override { return *comm_; }

  void finish(const RunDir& dir, int64_t first_step, int64_t step, int threads) override {
    if (step <= first_step) return;
    // The measured timeline of the last step, every stage's, for `ddm plan --measured` to draw and to
    // compare with the simulator's; of each replica's pipeline: rank 0 writes its own.
    const std::vector<std::string> stages = pipe_->all_last_steps();
    if (layout_.rank != 0) return;
    PipeTimelineRun run;
    run.stages = layout_.pp, run.replicas = layout_.replicas, run.schedule = name_of(cfg_.parallel.schedule);
    // The micro-batches one pipeline ran: with replicas, each takes its share of the global batch.
    run.micro = pipe_->micro_batches(), run.rows = pipe_->rows();
    run.threads = threads, run.pipe_wire = name_of(cfg_.parallel.pipe_wire), run.machine = machine_name(net_->parameters().front().device());
    run.first_units = pipe_->bounds(), run.units = pipe_->unit_names(), run.step = step;
    run.steps_timed = timed_steps_, run.timed_from = timed_from_ + 1;
    run.step_ms = timed_steps_ > 0 ? timed_ms_ / timed_steps_ : 0.0;
    write_pipe_timeline(dir / RunDir::kPipeTimeline, run, stages, pipe_->fill_json());
  }

 private:
  const RunConfig cfg_;
  const ParallelLayout layout_;
  Net net_;
  std::shared_ptr<Comm> comm_;
  std::unique_ptr<PipeStep> pipe_;
  torch::Tensor initial_digest_;  // uint8 [64]: the hex sha256 of every parameter at construction
  // Wall time of this run's steps after its first, for the timeline.
  double timed_ms_ = 0;
  int64_t timed_steps_ = 0, timed_from_ = 1;
};

}  // namespace

std::unique_ptr<Engine> make_pipeline_engine(const EngineParts& parts) {
  return std::make_unique<PipelineEngine>(parts);
}

}  // namespace ddm
