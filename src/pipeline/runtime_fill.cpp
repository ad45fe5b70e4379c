// PipeStep's bubble filling (see runtime.h and docs/pipeline.md, "Filling the bubbles"): the
// prepare phase with and without a fill plan, the plan's prepare pieces and their messages between
// the stages, and the measurements the plan is made from.
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "pipeline/runtime.h"

namespace ddm {
namespace {
using Clock = std::chrono::steady_clock;

std::mutex override_mutex;
std::function<void(std::vector<PipeStageMeasure>&)> measures_override;  // see PipeStep::override_measures
}  // namespace

void PipeStep::override_measures(std::function<void(std::vector<PipeStageMeasure>&)> f) {
  std::lock_guard<std::mutex> lock(override_mutex);
  measures_override = std::move(f);
}

void PipeStep::prepare(const std::vector<Batch>& micro, int64_t step, bool filling, bool has_next) {
  const int M = static_cast<int>(micro.size());
  torch::NoGradGuard no_grad;
  if (!filling) {  // every stage prepares every micro-batch itself, alike
    for (int i = 0; i < M; ++i)
      prep_[static_cast<size_t>(i)] =
          prepare_rows(*objective_, *net_, micro[static_cast<size_t>(i)], 0, rows_, quantum_, step, cfg_.train.precision);
    prepared_bytes_.clear();
    for (const PrepNeeds& n : needs_) {
      int64_t bytes = 0;
      for (const auto& kv : prepared_tensors(prep_.front(), n)) bytes += static_cast<int64_t>(kv.second.nbytes());
      prepared_bytes_.push_back(bytes);
    }
    return;
  }
  // The rows the plan prepares ahead: the previous step's pieces prepared them, or (the plan's first
  // step, a resumed run) every stage prepares them now, alike.
  if (ahead_step_ == step) {
    now_ = std::move(ahead_);
  } else {
    now_.assign(static_cast<size_t>(M), Rows{});
    std::vector<int64_t> ahead_rows(static_cast<size_t>(M), 0);
    for (const PrepPiece& pc : pieces_)
      if (pc.ahead) ahead_rows[static_cast<size_t>(pc.micro)] += pc.rows;
    for (int m = 0; m < M; ++m)
      if (ahead_rows[static_cast<size_t>(m)] > 0)
        now_[static_cast<size_t>(m)].emplace_back(
            0, prepared_tensors(prepare_rows(*objective_, *net_, micro[static_cast<size_t>(m)], 0,
                                             ahead_rows[static_cast<size_t>(m)], quantum_, step, cfg_.train.precision),
                                needs_[static_cast<size_t>(rank_)]));
  }
  ahead_.assign(static_cast<size_t>(M), Rows{});
  ahead_step_ = -1;
  post_incoming(has_next);
}

void PipeStep::run_piece(size_t i, const std::vector<Batch>& micro, const std::vector<Batch>& next, int64_t step) {
  const PrepPiece& pc = pieces_[i];
  Prepared p;
  {
    torch::NoGradGuard no_grad;
    p = prepare_rows(*objective_, *net_, (pc.ahead ? next : micro)[static_cast<size_t>(pc.micro)], pc.first, pc.rows,
                     quantum_, pc.ahead ? step + 1 : step, cfg_.train.precision);
  }
  for (int to = 0; to < comm_->world_size(); ++to) {
    if (to == rank_) continue;
    SafetensorsFile f;
    f.tensors = prepared_tensors(p, needs_[static_cast<size_t>(to)]);
    for (auto& [key, t] : f.tensors) t = t.to(torch::kCPU);  // (from a GPU: its bytes on the host)
    const std::string bytes = safetensors_bytes(f);
    auto values = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kByte);
    std::memcpy(values.data_ptr(), bytes.data(), bytes.size());
    wire_->send_to_rank(torch::full({1}, static_cast<int64_t>(bytes.size()), torch::kLong), to, wire_->piece_tag(i, 0));
    wire_->send_to_rank(values, to, wire_->piece_tag(i, 1));
  }
  (pc.ahead ? ahead_ : now_)[static_cast<size_t>(pc.micro)].emplace_back(pc.first,
                                                                         prepared_tensors(p, needs_[static_cast<size_t>(rank_)]));
}

void PipeStep::post_incoming(bool has_next) {
  incoming_.clear();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const PrepPiece& pc = pieces_[i];
    if (pc.rank == rank_ || (pc.ahead && !has_next)) continue;
    Incoming in;
    in.piece = i;
    in.length = torch::zeros({1}, torch::kLong);
    in.work = comm_->recv_async(in.length, pc.rank, wire_->piece_tag(i, 0));
    incoming_.push_back(std::move(in));
  }
}

void PipeStep::receive(Incoming& in) {
  const PrepPiece& pc = pieces_[in.piece];
  const std::string what = "receiving prepared rows from stage " + std::to_string(pc.rank);
  comm_->wait(in.work, what);
  const int64_t n = in.length.item<int64_t>();
  DDM_CHECK(n > 0 && n < (int64_t{1} << 40), "pipeline: stage " << pc.rank << " announced " << n << " bytes of prepared rows");
  auto bytes = torch::empty({n}, torch::kByte);
  comm_->wait(comm_->recv_async(bytes, pc.rank, wire_->piece_tag(in.piece, 1)), what);
  const SafetensorsFile f = parse_safetensors(std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n)),
                                              "the prepared rows from stage " + std::to_string(pc.rank));
  TensorMap rows = f.tensors;
  for (auto& [key, t] : rows) t = t.to(device_);
  (pc.ahead ? ahead_ : now_)[static_cast<size_t>(pc.micro)].emplace_back(pc.first, std::move(rows));
  in.done = true;
  wire_->note_arrival(Clock::now());
}

void PipeStep::complete(int micro) {
  if (prep_[static_cast<size_t>(micro)].t.defined()) return;  // already (for the first pass)
  for (Incoming& in : incoming_)
    if (!in.done && !pieces_[in.piece].ahead && pieces_[in.piece].micro == micro) receive(in);
  prep_[static_cast<size_t>(micro)] =
      prepared_from(std::move(now_[static_cast<size_t>(micro)]), rows_,
                    "pipeline stage " + std::to_string(rank_) + ", micro-batch " + std::to_string(micro));
}

namespace {
// Ranks 0 and 1 (the others return 0): the one-way time in ms of a message of `floats` float32
// values between them, the median of 5 round trips halved.
double ping(Comm& comm, int64_t floats) {
  constexpr int kPingTag = 1 << 24;  // past every step's tags
  const int rank = comm.rank();
  if (rank > 1) return 0;
  auto t = torch::zeros({floats}, torch::kFloat);
  std::vector<double> trips;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    for (int turn = 0; turn < 2; ++turn) {
      if ((turn == 0) == (rank == 0)) comm.wait(comm.send_async(t, 1 - rank, kPingTag), "time the link to stage 1 (send)");
      else comm.wait(comm.recv_async(t, 1 - rank, kPingTag), "time the link to stage 1 (receive)");
    }
    trips.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::nth_element(trips.begin(), trips.begin() + 2, trips.end());
  return trips[2] / 2;
}
}  // namespace

void PipeStep::measure_and_plan() {
  // Each stage's compute per micro-batch (each action from its input's arrival), this process's
  // prepare per quantum and optimizer (with the loss and norm all-reduce; on its first stage's
  // measurement), and what each stage sends.
  const double M = schedule_.micro;
  auto ms = [&](Clock::time_point t) { return ms_since_start(t); };
  // The link: latency from a 1-value message, bandwidth from a 4 MiB one.
  constexpr int64_t kBig = 1 << 20;
  const double small = ping(*comm_, 1), big = ping(*comm_, kBig);
  nlohmann::json mine = nlohmann::json::array();
  for (const PipeStage& l : locals_) {
    PipeStageMeasure m;
    for (const PipeSlot& e : events_) {
      const double d = (e.end - e.start) / M;
      if (e.action.op == PipeOp::kTask || e.action.stage != l.stage()) continue;  // a first pass is not in the plan
      if (e.action.op == PipeOp::kForward) m.forward += d;
      else if (e.action.op == PipeOp::kWeightGrad) m.weight_grad += d;
      else m.input_grad += d;
    }
    if (&l == &locals_.front()) m.optimizer = ms(times_.end) - ms(times_.synced);  // clip, AdamW, EMA: not the wait for the slowest stage
    m.prepare_quantum = ms(times_.prepared) / (M * static_cast<double>(rows_ / quantum_));
    m.carry_bytes = l.carry_bytes();
    m.prepared_bytes = prepared_bytes_;
    m.skip_bytes = l.direct_bytes();
    if (first_pass_) {  // the first pass of each micro-batch through this stage, and what it sent on
      m.first_pass = 0;
      for (const PipeSlot& e : events_)
        if (e.action.op == PipeOp::kTask && e.action.task == 1 + l.stage()) m.first_pass += (e.end - e.start) / M;
      m.first_pass_bytes = static_cast<int64_t>(static_cast<double>(l.first_bytes()) / M);
    }
    if (l.stage() == 0) {
      m.link_latency = small;
      m.link_bytes_per_ms = big > small ? static_cast<double>(4 * kBig - 4) / (big - small) : 0;
    }
    mine.push_back(measure_json(m));
  }
  // Every rank's measurements, in stage order (a rank's stages ascending).
  std::vector<std::vector<PipeStageMeasure>> by_rank;
  for (const std::string& text : comm_->all_gather_strings(mine.dump())) {
    by_rank.emplace_back();
    for (const auto& one : nlohmann::json::parse(text)) by_rank.back().push_back(measure_from_json(one.get<std::string>()));
  }
  std::vector<PipeStageMeasure> all(static_cast<size_t>(stages()));
  std::vector<size_t> next(by_rank.size(), 0);
  for (int v = 0; v < stages(); ++v) all[static_cast<size_t>(v)] = by_rank.at(static_cast<size_t>(rank_of(v))).at(next[static_cast<size_t>(rank_of(v))]++);
  {
    std::lock_guard<std::mutex> lock(override_mutex);
    if (measures_override) measures_override(all);
  }
  use_fill_plan(plan_fill(schedule_, all, rows_, quantum_));
  fill_news_ = true;
}

void PipeStep::use_fill_plan(PipeFillPlan plan) {
  plan_ = std::move(plan);
  if (!plan_->used) return;
  pieces_ = prep_pieces(plan_->fill.schedule, rows_);
  const std::vector<PipeAction>& mine_now = plan_->fill.schedule.ranks[static_cast<size_t>(rank_)];
  piece_at_.assign(mine_now.size(), -1);
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (pieces_[i].rank == rank_) piece_at_[static_cast<size_t>(pieces_[i].position)] = static_cast<int>(i);
  // A stage's first-pass pieces of a micro-batch all run on its rank: in list order, each takes the
  // positions after the one before.
  pass_first_.assign(mine_now.size(), 0);
  std::map<std::pair<int, int>, int64_t> covered;  // (task, micro) -> positions so far
  for (size_t i = 0; i < mine_now.size(); ++i)
    if (mine_now[i].op == PipeOp::kTask && mine_now[i].task > 0) {
      int64_t& c = covered[{mine_now[i].task, mine_now[i].micro}];
      pass_first_[i] = c;
      c += mine_now[i].rows;
    }
}

}  // namespace ddm
