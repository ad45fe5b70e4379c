// The DiLoCo engine (parallel/engine.h): every process a replica stepping like a data-parallel rank
// but without the gradient sync (its inner steps), with the outer loop of parallel/diloco.h after
// each step: the synchronizations, the stop agreed at them, checkpoints held while one is in
// flight, and a restarted replica rejoining its group (comm/elastic.h).
#include <chrono>
#include <iostream>
#include <sstream>

#include "comm/elastic.h"
#include "parallel/data_parallel.h"
#include "parallel/diloco.h"

namespace ddm {
namespace {

class DilocoEngine : public DataParallelEngine {
 public:
  explicit DilocoEngine(const EngineParts& parts) : DataParallelEngine(parts, false), world_(parts.layout.world) {
    step_.set_ema(false);  // the EMA follows the global weights, at each synchronization
    Diloco::split_fragments(step_.optim().params(), cfg_.diloco.fragments);  // a bad count fails before any file
  }

  EngineBegun begin(const EngineStart& start) override {
    const int64_t last = cfg_.train.steps;
    auto group = std::make_shared<ElasticGroup>(
        comm_, world_, std::chrono::milliseconds(static_cast<int64_t>(cfg_.diloco.peer_wait * 1000)));
    diloco_ = std::make_unique<Diloco>(cfg_.diloco, group, step_.optim(), cfg_.train.ema_decay, start.step);
    diloco_->set_transfer_hook(start.transfer);
    EngineBegun begun{start.step};
    if (!start.rejoining) {
      restore_diloco(*diloco_, step_.optim(), diloco_->group().comm(), start.resumed, start.step, start.quiet);
      return begun;
    }
    const int rank = comm_->rank();
    std::cerr << "rank " << rank << ": asking the running job to take this replica back" << std::endl;
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.parallel.timeout * 1000));
    const auto [at, report] = diloco_->rejoin(timeout, last);
    if (at < 0) {
      std::cerr << "rank " << rank << ": the job finished before this replica could rejoin it; nothing to do"
                << std::endl;
      begun.over = true;
      begun.step = last;
      return begun;
    }
    std::cerr << "rank " << rank << ": rejoined at step " << at << " with " << diloco_->group().members().size()
              << " of " << world_ << " replicas";
    if (step_.optim().loss_scale().on())  // fp16: the scale it goes on with (its sender's)
      std::cerr << ", loss scale " << step_.optim().loss_scale().scale();
    std::cerr << std::endl;
    begun.step = at;
    begun.joined = true;
    begun.stop = report.stop;
    return begun;
  }

  int agree_stop(int64_t done, int64_t last, int signal) override {
    return diloco_->after_step(done, last, signal).stop;
  }
  // Replicas agree at their synchronizations only: one that meets a bad sample stops with its error
  // and no checkpoint of the steps since the last (exit 2: a launcher stops the job, and --resume goes
  // on from that checkpoint).
  bool agrees_every_step() const override { return false; }
  // No prepare ahead: an outer step can change the weights between two inner steps, and
  // self-conditioning's first pass reads them.
  bool wants_next() const override { return false; }
  bool can_checkpoint() const override { return !diloco_->in_flight(); }

  std::vector<std::string> contribute(Checkpoint& ck, int64_t step, const std::string& mine) override {
    // Every replica sends its inner state to rank 0 (a collective: every rank saves alike).
    DilocoReplicas replicas = diloco_->gather_replicas(step, mine);
    fill_checkpoint(ck);
    if (lead_) add_diloco_state(ck, *diloco_, step_.optim(), replicas);
    return std::move(replicas.records);
  }

  std::string describe() const override {
    const DilocoConfig& d = cfg_.diloco;
    std::ostringstream s;
    s << "parallel: " << (d.fragments > 1 ? "Streaming DiLoCo" : "DiLoCo") << " over " << world_ << " replica"
      << (world_ > 1 ? "s" : "") << ", " << d.inner_steps << " inner steps between syncs";
    if (d.fragments > 1) s << " of each of " << d.fragments << " fragments";
    if (d.overlap > 0)
      s << ", each all-reduce overlapping " << d.overlap << " step" << (d.overlap > 1 ? "s" : "") << " (mix " << d.mix
        << ")";
    s << ", outer Nesterov lr " << d.outer_lr << " momentum " << d.outer_momentum << ", " << name_of(d.wire)
      << " on the wire, collective timeout " << cfg_.parallel.timeout << " s";
    if (world_ > 1) s << ", over " << comm_->backend_description();  // as data parallelism's line says it
    return s.str();
  }

  int64_t bytes_sent() const override { return diloco_ ? diloco_->group().bytes_sent() : comm_->bytes_sent(); }
  Comm& group() override { return diloco_ ? diloco_->group().comm() : *comm_; }
  // A replica waiting to rejoin stops waiting.
  void finish(const RunDir&, int64_t, int64_t, int) override { diloco_->group().finished(); }

 private:
  int world_;
  std::unique_ptr<Diloco> diloco_;
};

}  // namespace

std::unique_ptr<Engine> make_diloco_engine(const EngineParts& parts) { return std::make_unique<DilocoEngine>(parts); }

}  // namespace ddm
