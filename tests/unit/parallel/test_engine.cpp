// The Engine seam (parallel/engine.h), each mode's engine alone with ranks as threads of this process:
// the stop every rank agrees on, what each mode says about itself, one process stepping exactly as a
// TrainStep, the state rank 0 resumed reaching every rank, and checkpoints that hold the whole model
// in every mode. Whole runs through train() are in test_data_parallel, test_diloco and
// test_pipeline_train.
#include <gtest/gtest.h>

#include <csignal>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "parallel/data_parallel.h"
#include "parallel/engine.h"
#include "run/setup.h"
#include "unit/test_dist_util.h"
#include "unit/run/train_test_util.h"

namespace {

using namespace ddm;
using ddm::test::has;

// Runs fn(comm) on `world` ranks as threads sharing one HashStore; returns each rank's error ("" if none).
std::vector<std::string> on_ranks(int world, const std::function<void(std::shared_ptr<Comm>)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = Comm::create_for_test(store, r, world, test::short_timeouts());
        comm->barrier();
        fn(comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// What train() builds for this rank: the job, the seeded model, the layout and the engine.
struct Built {
  TrainJob job;
  BuiltModel model;
  ParallelLayout layout;
  std::unique_ptr<Engine> engine;
};

// with_engine = false: the job and the model only (an engine lays the model's parameters out in its
// optimizer's flat buffers: one per model).
Built build(const RunConfig& cfg, const std::shared_ptr<Comm>& comm, bool with_engine = true) {
  Built b;
  b.job = test::job_for(cfg);
  validate(b.job.cfg);
  b.layout = derive_layout(b.job.cfg, comm->world_size(), comm->rank());
  b.model = build_model(b.job, false);
  if (with_engine) b.engine = make_engine({b.job.cfg, b.layout, b.model.net, b.job.objective, comm, b.job.data});
  return b;
}

// This rank's micro-batches of the step after `steps` steps.
std::vector<Batch> micro_batches(const Built& b, int64_t steps = 0) {
  BatchLoader loader(b.job.data, b.job.cfg.train.batch_size, 9, false);
  for (int64_t s = 0; s < steps; ++s) loader.next();
  const Batch shard = loader.next(b.layout.shard_offset(), b.layout.local_batch);
  std::vector<Batch> out;
  const int64_t n = b.job.cfg.train.grad_accum, rows = b.layout.local_batch / n;
  for (int64_t i = 0; i < n; ++i) out.push_back(shard.rows(i * rows, rows));
  return out;
}

RunConfig mode(const std::string& which) {
  RunConfig cfg = test::tiny("unet");
  if (which == "diloco") {
    cfg.parallel.mode = SyncMode::kDiloco;
    cfg.diloco.inner_steps = 2;
  } else if (which == "dp-sharded") {
    cfg.parallel.shard_optimizer = true;
  } else if (which == "pipeline") {
    cfg.parallel.pp = 2;
    cfg.train.grad_accum = 2;
    cfg.parallel.fill = false;
  }
  return cfg;
}

TEST(Engine, AgreedStopIsTheStrongestSignalOfAnyRank) {
  EXPECT_EQ(cannot_read_rank(kStopCannotRead + 2 * 5 + 1), 5);  // the agreed value's parts
  EXPECT_TRUE(cannot_read_bad_input(kStopCannotRead + 2 * 5 + 1));
  EXPECT_FALSE(cannot_read_bad_input(kStopCannotRead + 2 * 5));
  struct Case {
    std::vector<int> signals;
    int agreed;
  };
  const std::vector<Case> cases{{{0, 0, 0}, 0},
                                {{0, SIGTERM, 0}, SIGTERM},
                                {{SIGTERM, 0, SIGINT}, SIGINT},
                                {{SIGINT, SIGINT, SIGTERM}, SIGINT},
                                // a rank that cannot read its next batch wins, named (the highest)
                                {{SIGINT, cannot_read_stop(true), 0}, kStopCannotRead + 2 * 1 + 1},
                                {{cannot_read_stop(false), SIGTERM, cannot_read_stop(true)}, kStopCannotRead + 2 * 2 + 1},
                                {{cannot_read_stop(false), 0, 0}, kStopCannotRead}};
  for (const Case& c : cases) {
    std::vector<int> got(3, -1);
    const auto errors = on_ranks(3, [&](std::shared_ptr<Comm> comm) {
      got[static_cast<size_t>(comm->rank())] = agree_on_stop(*comm, c.signals[static_cast<size_t>(comm->rank())]);
    });
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(errors[static_cast<size_t>(r)], "");
      EXPECT_EQ(got[static_cast<size_t>(r)], c.agreed) << "rank " << r << " of case agreeing on " << c.agreed;
    }
  }
  const auto errors = on_ranks(1, [](std::shared_ptr<Comm> comm) {
    EXPECT_EQ(agree_on_stop(*comm, SIGTERM), SIGTERM);  // one process: its own signal, no collective
    EXPECT_EQ(agree_on_stop(*comm, 0), 0);
    const int alone = agree_on_stop(*comm, cannot_read_stop(true));
    EXPECT_TRUE(is_cannot_read_stop(alone));
    EXPECT_EQ(cannot_read_rank(alone), 0);
    EXPECT_TRUE(cannot_read_bad_input(alone));
    EXPECT_FALSE(cannot_read_bad_input(agree_on_stop(*comm, cannot_read_stop(false))));
  });
  EXPECT_EQ(errors[0], "");
}

TEST(Engine, EveryModeDescribesItselfAndOneProcessSaysNothing) {
  const auto one = on_ranks(1, [](std::shared_ptr<Comm> comm) {
    const Built b = build(mode("dp"), comm);
    EXPECT_EQ(b.engine->describe(), "");
    EXPECT_TRUE(b.engine->wants_next());  // the next step prepared at the end of each (train/step.h)
    EXPECT_TRUE(b.engine->can_checkpoint());
  });
  EXPECT_EQ(one[0], "");
  const std::vector<std::pair<std::string, std::string>> expected{
      {"dp", "parallel: data parallel over 2 processes, gradient buckets up to 1 MiB"},
      {"dp-sharded", "parallel: data parallel over 2 processes, gradient buckets up to 1 MiB"},
      {"diloco", "parallel: DiLoCo over 2 replicas, 2 inner steps between syncs"},
      {"pipeline", "parallel: a pipeline of 2 stages (1f1b, 2 micro-batches of 8), units in.."}};
  for (const auto& [which, start] : expected) {
    std::vector<std::string> said(2);
    const auto errors = on_ranks(2, [&, which = which](std::shared_ptr<Comm> comm) {
      said[static_cast<size_t>(comm->rank())] = build(mode(which), comm).engine->describe();
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[static_cast<size_t>(r)], "") << which;
      EXPECT_EQ(said[static_cast<size_t>(r)].rfind(start, 0), 0u) << which << ": " << said[static_cast<size_t>(r)];
      EXPECT_EQ(said[static_cast<size_t>(r)].find("optimizer state sharded") != std::string::npos, which == "dp-sharded")
          << said[static_cast<size_t>(r)];
      if (which != "pipeline")  // the backend the gradients or the replicas' deltas travel over
        EXPECT_NE(said[static_cast<size_t>(r)].find(", over gloo"), std::string::npos) << said[static_cast<size_t>(r)];
    }
  }
}

TEST(Engine, OneProcessStepsExactlyAsATrainStep) {
  const auto errors = on_ranks(1, [](std::shared_ptr<Comm> comm) {
    const Built b = build(mode("dp"), comm);
    const Built ref = build(mode("dp"), comm, false);  // the same seeded model, stepped by a bare TrainStep
    TrainStep step(ref.job.cfg, ref.model.net, ref.job.objective);
    for (int64_t s = 0; s < 3; ++s) {
      const std::vector<Batch> micro = micro_batches(b, s);
      const StepResult got = b.engine->step(micro, s, {});
      const StepResult want = step.run(micro, s);
      EXPECT_EQ(got.loss, want.loss) << "step " << s;
      EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << s;
      EXPECT_EQ(b.engine->agree_stop(s + 1, 3, 0), 0);
    }
    EXPECT_TRUE(torch::equal(b.engine->optim().flat_params(), step.optim().flat_params()));
    EXPECT_TRUE(torch::equal(b.engine->optim().flat_ema(), step.optim().flat_ema()));
  });
  EXPECT_EQ(errors[0], "");
}

TEST(Engine, TheStateRankZeroResumedReachesEveryRank) {
  for (const std::string which : {"dp", "diloco"}) {
    std::vector<torch::Tensor> params(2), moments(2);
    const auto errors = on_ranks(2, [&](std::shared_ptr<Comm> comm) {
      const Built b = build(mode(which), comm);
      FlatAdamW& o = b.engine->optim();
      if (comm->rank() == 0) {  // as if rank 0 had loaded a checkpoint
        torch::NoGradGuard no_grad;
        o.flat_params().add_(0.25);
        o.state_buffers()[2].fill_(0.5);
      }
      b.engine->take_resumed(nullptr, "the checkpoint", 7);
      params[static_cast<size_t>(comm->rank())] = o.flat_params().clone();
      moments[static_cast<size_t>(comm->rank())] = o.state_buffers()[2].clone();
    });
    ASSERT_EQ(errors[0], "") << which;
    ASSERT_EQ(errors[1], "") << which;
    EXPECT_TRUE(torch::equal(params[0], params[1])) << which;
    EXPECT_TRUE(torch::equal(moments[0], moments[1])) << which;
    EXPECT_EQ(moments[1].max().item<float>(), 0.5f) << which;
  }
}

TEST(Engine, CheckpointsHoldTheWholeModelInEveryMode) {
  for (const std::string which : {"dp", "dp-sharded", "diloco", "pipeline"}) {
    std::vector<Checkpoint> cks(2);
    std::vector<std::string> names;  // every parameter and buffer of the whole model
    const auto errors = on_ranks(2, [&](std::shared_ptr<Comm> comm) {
      Built b = build(mode(which), comm);
      if (comm->rank() == 0) {
        for (const auto& [name, t] : module_state(*b.model.net)) names.push_back(name);
      }
      b.engine->begin({});
      b.engine->step(micro_batches(b), 0, {});
      b.engine->agree_stop(1, 4, 0);
      Checkpoint& ck = cks[static_cast<size_t>(comm->rank())];
      const auto records = b.engine->contribute(ck, 1, "rank " + std::to_string(comm->rank()));
      ck.fetch_all();  // a pipeline's rank 0 gathers the other stage's state part by part only now
      EXPECT_EQ(records, (std::vector<std::string>{"rank 0", "rank 1"})) << which;
      b.engine->finish(RunDir(""), 1, 1, 1);
    });
    ASSERT_EQ(errors[0], "") << which;
    ASSERT_EQ(errors[1], "") << which;
    const Checkpoint& ck = cks[0];
    for (const std::string& name : names) EXPECT_EQ(ck.model.count(name), 1u) << which << ": " << name;
    EXPECT_EQ(ck.model.size(), names.size()) << which;
    EXPECT_FALSE(ck.ema.empty()) << which;
    for (const auto& [name, t] : ck.ema) {
      EXPECT_EQ(ck.optim.count("exp_avg." + name), 1u) << which << ": " << name;
      EXPECT_EQ(ck.optim.count("exp_avg_sq." + name), 1u) << which << ": " << name;
    }
    EXPECT_TRUE(cks[1].model.empty() && cks[1].ema.empty() && cks[1].optim.empty()) << which << ": only rank 0 writes";
    EXPECT_EQ(ck.state.contains("diloco"), which == "diloco");
    EXPECT_EQ(ck.state.contains("pipeline"), which == "pipeline");
    if (which == "diloco") {
      EXPECT_TRUE(ck.optim.count("outer_momentum." + ck.ema.begin()->first));
    }
    if (which == "pipeline") {
      EXPECT_EQ(ck.state["pipeline"]["stages"].get<int>(), 2);
    }
  }
}

}  // namespace
