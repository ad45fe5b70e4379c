// run_loop (src/run/loop.h) driven by an engine of the test's own over a real in-memory batch source:
// the checkpoint cadence (every ckpt_every, the last step, deferred while the engine cannot take
// one), stops agreed after a signal on this or another rank (with a checkpoint first), a non-finite
// loss, a resumed loop drawing what the uninterrupted one drew, micro-batches, a replica that
// joins a running group, and a sample that cannot be used (one process alone; several that agree
// every step stop together after the same step).
#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/dataset.h"
#include "run/data_position.h"
#include "run/loop.h"
#include "run/run_log.h"

namespace ddm {
namespace {

// Records what the loop asks of it; stops, refuses checkpoints and fails where told.
class FakeEngine : public Engine {
 public:
  struct Seen {
    int64_t step;
    std::vector<int64_t> rows, firsts;  // each micro-batch's rows and its first row's global position
    double sum;                         // of the whole step's images
    std::vector<const void*> memory, next_memory;  // where each micro-batch's images are; the next step's
  };
  std::vector<Seen> seen;
  int64_t busy_at = -1;       // can_checkpoint() is false after this many steps
  int64_t fail_at = -1;       // step() reports a non-finite loss at this 0-based step
  int64_t others_stop_at = -1;  // another rank's SIGINT, agreed after this many steps
  bool want_next = false;       // wants_next(): the next step's micro-batches with each step
  bool every_step = false;      // agrees_every_step(): data parallelism's or a pipeline's agreement
  int rank = 0;                 // this process's, put in a cannot-read stop as agree_on_stop does
  int64_t others_bad_at = -1;   // rank 2 cannot read its next batch after this many steps
  bool others_bad_input = true; // ... because of a sample it cannot use (false: another failure)
  int agreements = 0;           // agree_stop calls
  int64_t done = 0;

  FlatAdamW& optim() override { throw std::logic_error("the loop never asks for the optimizer"); }
  void take_resumed(const Checkpoint*, const std::string&, int64_t) override {}
  std::vector<torch::Tensor> initial_weights() override { return {}; }
  bool wants_next() const override { return want_next; }
  StepResult step(const std::vector<Batch>& micro, int64_t step, const std::vector<Batch>& next) override {
    Seen s{step, {}, {}, 0.0, {}, {}};
    for (const Batch& b : micro) {
      s.rows.push_back(b.x.size(0));
      s.firsts.push_back(b.first);
      s.sum += b.x.to(torch::kDouble).sum().item<double>();
      s.memory.push_back(b.x.data_ptr());
    }
    for (const Batch& b : next) s.next_memory.push_back(b.x.data_ptr());
    seen.push_back(s);
    StepResult r;
    r.loss = step == fail_at ? std::nan("") : 1.0 / static_cast<double>(step + 1);
    r.finite = step != fail_at;
    return r;
  }
  int agree_stop(int64_t d, int64_t, int signal) override {
    done = d;
    ++agreements;
    int best = -1;  // the strongest cannot-read part, 2 rank + bad input, as agree_on_stop's all-reduce
    if (is_cannot_read_stop(signal)) best = 2 * rank + (signal - kStopCannotRead);
    if (d == others_bad_at) best = std::max(best, 2 * 2 + (others_bad_input ? 1 : 0));
    if (best >= 0) return kStopCannotRead + best;
    if (d == others_stop_at) return signal == SIGINT || signal == 0 ? SIGINT : signal;
    return signal;
  }
  bool agrees_every_step() const override { return every_step; }
  bool can_checkpoint() const override { return done != busy_at; }
  std::vector<std::string> contribute(Checkpoint&, int64_t, const std::string& mine) override { return {mine}; }
  std::string describe() const override { return {}; }
  int64_t bytes_sent() const override { return 0; }
  Comm& group() override { throw std::logic_error("the loop never asks for the group"); }
};

// 64 distinct 1x4x4 images: every batch's sum tells it apart.
Dataset numbered_images() {
  Dataset d;
  d.images = (torch::arange(64 * 16) % 251).to(torch::kUInt8).reshape({64, 1, 4, 4});
  d.labels = torch::zeros({64}, torch::kLong);
  d.description = "numbered";
  return d;
}

// The in-memory loader, but its `bad_draw`-th batch (0-based) holds a sample it cannot use, as a
// shard's corrupt image does: next() and peek() of it throw InputError.
class FailingSource : public BatchSource {
 public:
  FailingSource(const Dataset& data, int64_t batch) : inner_(data, batch, 7, false) {}
  int64_t bad_draw = -1;
  bool io_error = false;  // the bad draw fails as a read error, not a sample that cannot be used
  Batch next(int64_t begin, int64_t count) override {
    check();
    ++drawn_;
    return inner_.next(begin, count);
  }
  Batch peek(int64_t begin, int64_t count) override {
    check();
    return inner_.peek(begin, count);
  }
  bool may_fail() const override { return true; }
  Cursor cursor() const override { return inner_.cursor(); }
  void set_cursor(const Cursor& c) override { inner_.set_cursor(c); }

 private:
  void check() const {
    if (drawn_ == bad_draw && io_error) throw Error("shard s.tar: Input/output error");
    if (drawn_ == bad_draw) throw InputError("shard s.tar, sample '00000042': not a PNG");
  }
  BatchLoader inner_;
  int64_t drawn_ = 0;
};

struct Harness {
  Dataset data = numbered_images();
  FailingSource source{data, 8};
  DataPosition position{source};
  FakeEngine engine;
  LoopSpec spec;
  LoopState state;
  std::vector<int64_t> saved;                 // the steps checkpointed
  int64_t save_fails_at = -1;                 // the checkpoint of this step cannot be written
  std::vector<BatchSource::Cursor> cursors;   // the source's position at each
  int signal_from = -1;                       // this process gets SIGTERM once this many steps are done

  Harness() {
    spec.steps = 10, spec.ckpt_every = 4, spec.local_batch = 8;
  }
  int run(EngineBegun begun = {}) {
    RunLogSpec ls;
    ls.steps = spec.steps, ls.first_step = state.step, ls.quiet = true, ls.batch_size = 8;
    RunLog log(ls, [] { return int64_t{0}; }, position, source);
    LoopHooks hooks;
    hooks.save = [&](int64_t step) {
      if (step == save_fails_at) throw Error("No space left on device");
      saved.push_back(step);
      cursors.push_back(source.cursor());
      return "ckpt-" + std::to_string(step);
    };
    hooks.signal = [&] { return signal_from >= 0 && state.step >= signal_from ? SIGTERM : 0; };
    return run_loop(engine, source, spec, begun, state, log, hooks);
  }
};

TEST(Loop, ChecksPointsEveryCkptEveryAndAtTheLastStepDeferredWhileTheEngineIsBusy) {
  Harness h;
  EXPECT_EQ(h.run(), 0);
  EXPECT_EQ(h.state.step, 10);
  EXPECT_EQ(h.saved, (std::vector<int64_t>{4, 8, 10}));
  EXPECT_EQ(h.state.last_ckpt, "ckpt-10");
  ASSERT_EQ(h.engine.seen.size(), 10u);
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(h.engine.seen[static_cast<size_t>(i)].step, i);

  Harness busy;
  busy.engine.busy_at = 4;  // e.g. a DiLoCo all-reduce in flight after step 4
  busy.run();
  EXPECT_EQ(busy.saved, (std::vector<int64_t>{5, 8, 10}));
}

TEST(Loop, ASignalHereOrOnAnotherRankStopsAfterTheAgreedStepWithACheckpoint) {
  Harness here;
  here.signal_from = 3;
  EXPECT_EQ(here.run(), SIGTERM);
  EXPECT_EQ(here.state.step, 3);
  EXPECT_EQ(here.saved, (std::vector<int64_t>{3}));
  EXPECT_EQ(here.engine.seen.size(), 3u);

  Harness there;
  there.engine.others_stop_at = 6;  // this process received nothing; the group agreed on SIGINT
  EXPECT_EQ(there.run(), SIGINT);
  EXPECT_EQ(there.state.step, 6);
  EXPECT_EQ(there.saved, (std::vector<int64_t>{4, 6}));
}

TEST(Loop, AResumedLoopDrawsWhatTheUninterruptedOneDrew) {
  Harness whole;
  whole.spec.ckpt_every = 3;
  whole.run();
  ASSERT_EQ(whole.saved, (std::vector<int64_t>{3, 6, 9, 10}));

  Harness resumed;  // from the checkpoint of step 6: its step and data position
  resumed.spec.ckpt_every = 3;
  resumed.state.step = 6;
  resumed.source.set_cursor(whole.cursors[1]);
  resumed.run();
  ASSERT_EQ(resumed.engine.seen.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(resumed.engine.seen[i].step, whole.engine.seen[6 + i].step);
    EXPECT_EQ(resumed.engine.seen[i].sum, whole.engine.seen[6 + i].sum) << "step " << 6 + i;
  }
  EXPECT_EQ(resumed.saved, (std::vector<int64_t>{9, 10}));
  // The batches differ from step to step, so equal sums are the same batches.
  EXPECT_NE(whole.engine.seen[6].sum, whole.engine.seen[7].sum);
}

TEST(Loop, ANonFiniteLossStopsTheRunNamingTheStepAndTheLastGoodCheckpoint) {
  Harness h;
  h.engine.fail_at = 5;  // the sixth step
  h.spec.who = "rank 1: ";
  try {
    h.run();
    FAIL() << "a NaN loss was taken";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 1: step 6: the loss is nan"), std::string::npos) << m;
    EXPECT_NE(m.find("(ckpt-4) is intact"), std::string::npos) << m;
  }
  EXPECT_EQ(h.saved, (std::vector<int64_t>{4}));
  EXPECT_EQ(h.state.step, 5);
}

TEST(Loop, ThisProcesssRowsGoToTheEngineAsMicroBatchesWithTheirGlobalPositions) {
  Harness h;
  h.spec.shard_offset = 4, h.spec.local_batch = 4, h.spec.grad_accum = 2, h.spec.steps = 2;
  h.run();
  ASSERT_EQ(h.engine.seen.size(), 2u);
  EXPECT_EQ(h.engine.seen[0].rows, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(h.engine.seen[0].firsts, (std::vector<int64_t>{4, 6}));
  // Rows 4..7 of the global batch the whole-batch loop draws first.
  Harness all;
  all.spec.steps = 1;
  all.run();
  const Batch first = BatchLoader(all.data, 8, 7, false).next();  // what FailingSource wraps
  EXPECT_EQ(h.engine.seen[0].sum, first.x.slice(0, 4, 8).to(torch::kDouble).sum().item<double>());
}

TEST(Loop, AReplicaJoiningARunningGroupFinishesTheStepTheGroupWasAtFirst) {
  Harness h;
  h.state.step = 7;
  EngineBegun begun;
  begun.step = 7, begun.joined = true, begun.stop = SIGTERM;  // the group agreed to stop after step 7
  EXPECT_EQ(h.run(begun), SIGTERM);
  EXPECT_TRUE(h.engine.seen.empty());
  EXPECT_EQ(h.saved, (std::vector<int64_t>{7}));

  Harness going_on;
  going_on.state.step = 7;
  begun.stop = 0;
  EXPECT_EQ(going_on.run(begun), 0);
  EXPECT_EQ(going_on.engine.seen.size(), 3u);
  EXPECT_EQ(going_on.saved, (std::vector<int64_t>{8, 10}));
}

// What a run of several processes keeps when a sample of one of them cannot be used: the steps done,
// in a checkpoint of the last one at the position before the batch that holds it, and an error on
// every rank (the one that met it: its own; the others: naming it).
std::string bad_input_error(Harness& h) {
  try {
    h.run();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the bad sample did not stop the loop";
  return {};
}

// The same for a batch that could not be read for another reason (an I/O error): an Error, not bad
// input (exit 1, which a launcher may restart).
std::string read_error(Harness& h) {
  try {
    h.run();
  } catch (const InputError& e) {
    ADD_FAILURE() << "bad input: " << e.what();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "the failed read did not stop the loop";
  return {};
}

TEST(Loop, ASampleThatCannotBeUsedStopsEveryRankAfterTheSameStepWithItsCheckpoint) {
  Harness plain;  // where the data stands after 6 steps
  plain.spec.ckpt_every = 6;
  plain.run();
  ASSERT_EQ(plain.saved.front(), 6);
  for (const bool ahead : {false, true}) {  // with an engine that prepares the next batch or not
    SCOPED_TRACE(ahead ? "wants_next" : "no next");
    Harness mine;  // rank 1 meets it in the batch of its seventh step
    mine.engine.every_step = true, mine.engine.rank = 1, mine.engine.want_next = ahead;
    mine.spec.rank = 1, mine.spec.who = "rank 1: ";
    mine.source.bad_draw = 6;
    const std::string m = bad_input_error(mine);
    EXPECT_NE(m.find("sample '00000042': not a PNG (rank 0 writes the checkpoint of step 6: --resume goes on from it)"),
              std::string::npos) << m;
    EXPECT_EQ(mine.engine.seen.size(), 6u);
    EXPECT_EQ(mine.engine.agreements, 7);  // before the first step, and after each
    if (ahead) {  // the step before the unreadable batch prepares a stand-in of its own shapes instead
      const auto& before = mine.engine.seen[5];
      EXPECT_EQ(before.next_memory.size(), before.memory.size());
      EXPECT_NE(before.next_memory, before.memory);
    }
    EXPECT_EQ(mine.saved, (std::vector<int64_t>{4, 6}));
    EXPECT_EQ(mine.cursors.back().index, plain.cursors.front().index);  // before the bad batch
    EXPECT_EQ(mine.cursors.back().epoch, plain.cursors.front().epoch);

    Harness other;  // rank 0 reads its batches; rank 2 cannot read its seventh
    other.engine.every_step = true, other.engine.others_bad_at = 6, other.engine.want_next = ahead;
    other.spec.who = "rank 0: ";
    const std::string o = bad_input_error(other);
    EXPECT_NE(o.find("rank 0: stopped after step 6: rank 2 met a sample it cannot use in its next batch"),
              std::string::npos) << o;
    EXPECT_NE(o.find("the checkpoint of step 6 is written"), std::string::npos) << o;
    EXPECT_EQ(other.saved, (std::vector<int64_t>{4, 6}));
    EXPECT_EQ(other.engine.seen.size(), 6u);
    EXPECT_EQ(other.engine.agreements, 7);
  }
  // Another failure than a bad sample (an I/O error): every rank stops alike, as a failure (exit 1).
  Harness io;
  io.engine.every_step = true, io.engine.rank = 1, io.spec.rank = 1;
  io.source.bad_draw = 3, io.source.io_error = true;
  EXPECT_NE(read_error(io).find("Input/output error (rank 0 writes the checkpoint of step 3"), std::string::npos);
  Harness io_other;
  io_other.engine.every_step = true, io_other.engine.others_bad_at = 3, io_other.engine.others_bad_input = false;
  const std::string i = read_error(io_other);
  EXPECT_NE(i.find("stopped after step 3: rank 2 could not read its next batch (its message says why) (the checkpoint "
                   "of step 3 is written"),
            std::string::npos) << i;
  // Rank 0 cannot write the checkpoint: why they stopped is still said, and that it is not written.
  Harness full;
  full.engine.every_step = true, full.engine.others_bad_at = 6, full.save_fails_at = 6;
  const std::string u = bad_input_error(full);
  EXPECT_NE(u.find("rank 2 met a sample it cannot use in its next batch (its message says which) (and the "
                   "checkpoint of step 6 could not be written: No space left on device)"),
            std::string::npos) << u;
  // In the first batch: they agree on it before any step, and nothing is written.
  Harness first;
  first.engine.every_step = true, first.engine.rank = 1, first.spec.rank = 1;
  first.source.bad_draw = 0;
  const std::string f = bad_input_error(first);
  EXPECT_NE(f.find("not a PNG (no step was done)"), std::string::npos) << f;
  EXPECT_TRUE(first.saved.empty());
  EXPECT_TRUE(first.engine.seen.empty());
  // A resumed run's first batch: its checkpoint holds every step done.
  Harness resumed;
  resumed.engine.every_step = true, resumed.engine.rank = 1, resumed.spec.rank = 1;
  resumed.state.step = 4;
  resumed.source.bad_draw = 0;
  const std::string r = bad_input_error(resumed);
  EXPECT_NE(r.find("(the last checkpoint, of step 4, holds every step done: --resume goes on from it)"),
            std::string::npos) << r;
  EXPECT_TRUE(resumed.saved.empty());
}

TEST(Loop, OneProcessMeetingASampleItCannotUseWritesTheCheckpointAlone) {
  Harness alone;
  alone.spec.alone = true;
  alone.source.bad_draw = 6;
  const std::string m = bad_input_error(alone);
  EXPECT_NE(m.find("not a PNG (the checkpoint of step 6 is written: --resume goes on from it)"), std::string::npos) << m;
  EXPECT_EQ(alone.saved, (std::vector<int64_t>{4, 6}));
  // Several processes whose engine agrees only now and then (DiLoCo's replicas): the one that met it
  // stops with its error as it is (the others go on without it), and writes nothing.
  Harness replica;
  replica.source.bad_draw = 6;
  const std::string r = bad_input_error(replica);
  EXPECT_EQ(r, "shard s.tar, sample '00000042': not a PNG");
  EXPECT_EQ(replica.saved, (std::vector<int64_t>{4}));
}

}  // namespace
TEST(Loop, AnEngineGivenTheNextStepsBatchGetsTheSameTensorsAtThatStep) {
  // What prepare ahead relies on (train/step.h): the micro-batches handed over as `next` at step s
  // are the very tensors of step s + 1 (an engine recognises them by their memory), the batches are
  // the ones a loop without it draws, and checkpoints record the same data positions.
  Harness plain, ahead;
  plain.spec.grad_accum = ahead.spec.grad_accum = 2;
  ahead.engine.want_next = true;
  plain.run();
  ahead.run();
  ASSERT_EQ(ahead.engine.seen.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    const auto& a = ahead.engine.seen[i];
    EXPECT_EQ(a.sum, plain.engine.seen[i].sum) << "step " << i;
    EXPECT_EQ(a.firsts, plain.engine.seen[i].firsts) << "step " << i;
    EXPECT_TRUE(plain.engine.seen[i].next_memory.empty());
    if (i + 1 < 10) {
      EXPECT_EQ(a.next_memory, ahead.engine.seen[i + 1].memory) << "step " << i;
    } else {
      EXPECT_TRUE(a.next_memory.empty()) << "the last step has no next one";
    }
  }
  EXPECT_EQ(ahead.saved, plain.saved);
  ASSERT_EQ(ahead.cursors.size(), plain.cursors.size());
  for (size_t i = 0; i < plain.cursors.size(); ++i) {
    EXPECT_EQ(ahead.cursors[i].epoch, plain.cursors[i].epoch);
    EXPECT_EQ(ahead.cursors[i].index, plain.cursors[i].index);
  }
}

}  // namespace ddm
