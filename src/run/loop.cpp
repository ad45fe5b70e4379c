// The loop of every training run (see loop.h).
#include "run/loop.h"

#include <chrono>
#include <cmath>
#include <exception>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace ddm {
namespace {

// This process's share of a global batch, split into equal micro-batches with their global positions.
std::vector<Batch> split_micro(const Batch& shard, int64_t n) {
  std::vector<Batch> out;
  const int64_t b = shard.x.size(0) / n;
  for (int64_t i = 0; i < n; ++i) out.push_back(shard.rows(i * b, b));
  return out;
}

// A step whose loss or gradient is not finite stops the run (fp16: after kMaxSkipsInARow skipped
// steps in a row), saying what to do.
[[noreturn]] void stop_not_finite(const LoopSpec& spec, const LoopState& state, const StepResult& r) {
  std::ostringstream m;
  m << spec.who << "step " << state.step + 1 << ": the " << (std::isfinite(r.loss) ? "gradient norm" : "loss") << " is "
    << (std::isfinite(r.loss) ? r.grad_norm : r.loss);
  if (r.overflow)
    m << " in float16 for " << r.overflows_in_a_row << " steps in a row (each skipped and the loss scale halved; "
      << "this step's was " << r.loss_scale << ")";
  m << "; training stopped. The last good checkpoint (" << state.last_ckpt << ") is intact. ";
  if (r.overflow)
    m << "Float16 cannot hold what the model computes, or the learning rate made it diverge: go on from it in bf16 "
         "(GPUs of compute capability 8.0 and newer) or fp32, which have the range float16 lacks (--resume --set "
         "train.precision=bf16), or in fp16 with a lower learning rate and the loss scale started again (--resume --set "
         "train.lr="
      << spec.lr / 10 << " --set train.loss_scale=" << std::setprecision(17) << spec.loss_scale / 2 << ")";
  else
    m << "Lower train.lr (now " << spec.lr << ") or train.grad_clip (now " << spec.grad_clip
      << "; 0 is off) and go on from it: --resume --set train.lr=" << spec.lr / 10;
  throw Error(m.str());
}

// A copy of a batch in memory of its own (an engine recognises the tensors it worked on by their
// memory): what a rank that cannot read its next batch prepares ahead instead, below.
Batch stand_in(const Batch& b) {
  Batch c = b;
  for (torch::Tensor* t : {&c.x, &c.y, &c.k, &c.index, &c.context, &c.context_mask, &c.pooled})
    if (t->defined()) *t = t->clone();
  return c;
}

// The error of a sample that cannot be used, with what became of the steps done, of its own type (a
// bad sample is bad input: exit 2, which a supervisor does not restart into).
[[noreturn]] void rethrow_saying(const std::exception& e, const std::string& said) {
  const std::string what = std::string(e.what()) + " (" + said + ")";
  if (dynamic_cast<const InputError*>(&e)) throw InputError(what);
  throw Error(what);
}

// What a stop for bad input leaves: the checkpoint of the step it stopped after (written by rank 0,
// `lead`), or the one that already holds every step done.
std::string kept(const LoopState& state, bool written_now, bool lead = true) {
  const std::string step = std::to_string(state.step);
  if (written_now && !lead) return "rank 0 writes the checkpoint of step " + step + ": --resume goes on from it";
  if (written_now) return "the checkpoint of step " + step + " is written: --resume goes on from it";
  if (state.step == 0) return "no step was done";
  return "the last checkpoint, of step " + step + ", holds every step done: --resume goes on from it";
}

// The error of this process, or a message for another rank's (`stop`, agreed): why the processes
// stopped after this step, with `said` (what became of the steps done).
[[noreturn]] void throw_cannot_read(const LoopSpec& spec, const LoopState& state, int stop,
                                    const std::exception_ptr& mine, const std::string& said) {
  if (mine) {
    try {
      std::rethrow_exception(mine);
    } catch (const std::exception& e) {
      rethrow_saying(e, said);
    }
  }
  const std::string what = spec.who + "stopped after step " + std::to_string(state.step) + ": rank " +
                           std::to_string(cannot_read_rank(stop)) +
                           (cannot_read_bad_input(stop) ? " met a sample it cannot use in its next batch"
                                                        : " could not read its next batch") +
                           " (its message says " + (cannot_read_bad_input(stop) ? "which" : "why") + ") (" + said + ")";
  if (cannot_read_bad_input(stop)) throw InputError(what);
  throw Error(what);
}

}  // namespace

int run_loop(Engine& engine, BatchSource& source, const LoopSpec& spec, const EngineBegun& begun, LoopState& state,
             RunLog& log, const LoopHooks& hooks) {
  // The end of every step: a checkpoint if one is due and the engine can take one, then the agreed
  // stop (true: the run stops here).
  int64_t saved_step = state.step;  // the step of the last checkpoint written (or resumed from)
  auto end_step = [&](int sig) {
    state.ckpt_due = state.ckpt_due || state.step % spec.ckpt_every == 0 || state.step == spec.steps || sig != 0;
    if (state.ckpt_due && engine.can_checkpoint()) {
      state.last_ckpt = hooks.save(state.step);
      state.ckpt_due = false;
      saved_step = state.step;
    }
    if (sig != 0 && !is_cannot_read_stop(sig)) log.stopped(sig, state.step, state.last_ckpt);
    return sig != 0;
  };
  // Several processes over data read while training, whose engine agrees after every step: each reads
  // its next batch before they agree, so that one meeting a sample it cannot use stops them all after
  // the same step, with its checkpoint (failing alone, it would leave the others waiting in the next
  // step's collectives). Before the first step, they agree once on the first batch.
  const bool agree_input = !spec.alone && engine.agrees_every_step() && source.may_fail();
  std::exception_ptr bad_next;  // this process could not read its next batch (agree_input)
  std::optional<Batch> peeked;  // the batch this step draws, on the device since the step before peeked it
  const auto peek_next = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      peeked = source.peek(spec.shard_offset, spec.local_batch).to(spec.device);
    } catch (const std::exception&) {
      peeked.reset();
      bad_next = std::current_exception();
    }
    log.waited(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  // This process's part of the agreement: whether it could read its next batch, and if not, whether
  // its error was bad input.
  const auto cannot_read = [&] {
    try {
      std::rethrow_exception(bad_next);
    } catch (const InputError&) {
      return cannot_read_stop(true);
    } catch (...) {
      return cannot_read_stop(false);
    }
  };
  if (agree_input && state.step < spec.steps && !begun.joined) {
    peek_next();
    const int stop = engine.agree_stop(state.step, spec.steps, bad_next ? cannot_read() : 0);
    if (is_cannot_read_stop(stop)) throw_cannot_read(spec, state, stop, bad_next, kept(state, false));
  }
  int stopped_by = 0;
  if (begun.joined) {  // a replica that joined a running group: the rest of the step the group was at
    stopped_by = state.step == spec.steps ? engine.agree_stop(state.step, spec.steps, 0) : begun.stop;
    if (end_step(stopped_by)) return stopped_by;
  }
  using Clock = std::chrono::steady_clock;
  while (state.step < spec.steps) {
    const auto wait_start = Clock::now();
    const BatchSource::Cursor before = source.cursor();
    Batch drawn;
    try {
      drawn = source.next(spec.shard_offset, spec.local_batch);  // [local_batch, C, H, W]
    } catch (const Error& e) {
      // A sample that cannot be used (data.skip_bad = false): one process keeps the steps since its
      // last checkpoint, at the position before this batch. (Several processes that agree on their
      // input met it before this step, above; others cannot: the rest wait in this step's
      // collectives.) The error, of its own type, says where --resume goes on.
      if (!spec.alone) throw;
      if (state.step == saved_step) rethrow_saying(e, kept(state, false));  // (nothing to write)
      if (!engine.can_checkpoint()) throw;
      source.set_cursor(before);
      try {
        state.last_ckpt = hooks.save(state.step);
      } catch (const std::exception& failed) {  // the bad sample is still the news
        throw Error(std::string(e.what()) + " (and the checkpoint of step " + std::to_string(state.step) +
                    " could not be written: " + failed.what() + ")");
      }
      rethrow_saying(e, kept(state, true));
    }
    const Batch shard = peeked ? *peeked : drawn.to(spec.device);  // the same rows: peek's contract
    peeked.reset();
    // The next step's batch, for engines that work on it during this step: a filled pipeline prepares
    // parts of it in this step's bubbles, one process or data parallelism prepares it at this step's
    // end (while a GPU still computes this one). It is handed back to the engine as the next shard:
    // an engine recognises the tensors it already worked on.
    std::vector<Batch> next;
    if (engine.wants_next() && state.step + 1 < spec.steps) {
      try {
        peeked = source.peek(spec.shard_offset, spec.local_batch).to(spec.device);
        next = split_micro(*peeked, spec.grad_accum);
      } catch (const std::exception&) {
        // A batch that cannot be read (a corrupt sample in a shard): this step runs, and its checkpoint
        // is written if one is due; then the batch fails at its own step, or (agree_input) every rank
        // stops after this one. There, this rank prepares a stand-in of this step's shapes instead,
        // so that a filled pipeline's peers that did read theirs (an I/O error on one machine; a bad
        // sample fails every stage alike) get the pieces they wait for; nothing of it is used.
        peeked.reset();
        next.clear();
        if (agree_input) {
          bad_next = std::current_exception();
          next = split_micro(stand_in(shard), spec.grad_accum);
        }
      }
    }
    log.waited(std::chrono::duration<double>(Clock::now() - wait_start).count());
    const StepResult r = engine.step(split_micro(shard, spec.grad_accum), state.step, next);
    // Data parallel: the loss and the gradient norm are global, so every rank stops here alike. DiLoCo:
    // they are this replica's; the others learn of its exit at their next synchronization.
    // fp16: a step that overflowed float16 was skipped and the loss scale halved (train/loss_scale.h);
    // training goes on unless it keeps happening.
    if (!r.finite && !(r.overflow && r.overflows_in_a_row < LossScale::kMaxSkipsInARow))
      stop_not_finite(spec, state, r);
    ++state.step;
    if (agree_input && !peeked && !bad_next && state.step < spec.steps) peek_next();
    // A signal to any rank stops every rank after the same step: agreed every step with data
    // parallelism, at the next synchronization with DiLoCo. A rank's bad input wins over signals.
    stopped_by = engine.agree_stop(state.step, spec.steps, bad_next ? cannot_read() : hooks.signal());
    log.step(state.step, r, engine.news(state.step));
    if (stopped_by == 0 && hooks.after_step) hooks.after_step(state.step);
    if (is_cannot_read_stop(stopped_by)) {  // every rank: the checkpoint of this step, then the error
      try {
        end_step(stopped_by);
      } catch (const std::exception& failed) {  // why they stopped is still the news
        throw_cannot_read(spec, state, stopped_by, bad_next,
                          "and the checkpoint of step " + std::to_string(state.step) + " could not be written: " +
                              failed.what());
      }
      throw_cannot_read(spec, state, stopped_by, bad_next, kept(state, !state.ckpt_due, spec.rank == 0));
    }
    if (end_step(stopped_by)) break;
  }
  return stopped_by;
}

}  // namespace ddm
