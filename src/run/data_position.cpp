// Where a run is in its data (see data_position.h).
#include "run/data_position.h"

#include <algorithm>
#include <iostream>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "data/shard_loader.h"

namespace ddm {

std::unique_ptr<BatchSource> make_batch_source(const RunConfig& cfg, const Dataset& data, const ParallelLayout& layout,
                                               int local_processes, bool pin) {
  const uint64_t seed = derive_seed({static_cast<uint64_t>(cfg.train.seed), static_cast<uint64_t>(RngPurpose::kDataOrder)});
  if (!data.shards) return std::make_unique<BatchLoader>(data, cfg.train.batch_size, seed, cfg.data.hflip);
  ShardOrder order;
  order.seed = seed, order.replica = layout.replica, order.replicas = layout.replicas;
  order.shuffle_buffer = cfg.data.shuffle_buffer;
  order.keep = data.shard_keep;  // a router's held-out samples are never drawn
  ShardLoaderOptions lo = shard_loader_options(cfg.data, data, layout.local_batch, local_processes);
  lo.pin = pin;
  if (data.clusters.defined()) {  // a router or a distilled student: each sample's cluster, by position
    const torch::Tensor k = data.clusters.contiguous();
    lo.clusters = std::make_shared<const std::vector<int64_t>>(k.data_ptr<int64_t>(), k.data_ptr<int64_t>() + k.numel());
  }
  return std::make_unique<ShardLoader>(data.shards, order, lo);
}

namespace {

// The data positions a checkpoint holds, one per replica of this run: its "replicas" list when the
// source keeps one per replica and the run has as many replicas as the checkpoint's, else its one
// position for all (a per-replica run resumed with another replica count starts each replica at the
// beginning of the latest epoch any replica had reached, and says so).
std::vector<BatchSource::Cursor> saved_cursors(const Checkpoint& ck, const BatchSource& source, bool quiet) {
  const BatchSource::Cursor one{ck.field<int64_t>("/data_cursor/epoch"), ck.field<int64_t>("/data_cursor/index")};
  std::vector<BatchSource::Cursor> out(static_cast<size_t>(source.replicas()), one);
  if (!source.per_replica()) return out;
  const nlohmann::json* saved = ck.state.contains("data_cursor") && ck.state["data_cursor"].contains("replicas")
                                    ? &ck.state["data_cursor"]["replicas"]
                                    : nullptr;
  if (saved && saved->is_array() && static_cast<int>(saved->size()) == source.replicas()) {
    for (size_t r = 0; r < out.size(); ++r) {
      const nlohmann::json& e = (*saved)[r];
      DDM_CHECK(e.is_array() && e.size() == 2 && e[0].is_number_integer() && e[1].is_number_integer(),
                "checkpoint state.json: data_cursor.replicas[" << r << "] is not [epoch, index]");
      out[r] = {e[0].get<int64_t>(), e[1].get<int64_t>()};
    }
    return out;
  }
  int64_t latest = one.epoch;
  if (saved && saved->is_array())
    for (const nlohmann::json& e : *saved)
      if (e.is_array() && e.size() == 2 && e[0].is_number_integer()) latest = std::max(latest, e[0].get<int64_t>());
  if (!quiet)
    std::cout << "note: the checkpoint's data positions are for " << (saved && saved->is_array() ? saved->size() : 1)
              << " replica(s), this run has " << source.replicas() << ": the shards are dealt anew, and every replica "
              << "starts epoch " << latest + 1 << " from its beginning\n";
  for (auto& c : out) c = {latest + 1, 0};
  return out;
}

// The bad samples each replica had skipped (data.skip_bad) by a checkpoint: its state's
// skipped_samples.replicas when the run has as many replicas, else the total on replica 0 (the sum
// goes on); none in checkpoints of older versions.
std::vector<int64_t> saved_skipped(const Checkpoint& ck, int replicas) {
  std::vector<int64_t> out(static_cast<size_t>(replicas), 0);
  if (!ck.state.contains("skipped_samples")) return out;
  const nlohmann::json& j = ck.state["skipped_samples"];
  const nlohmann::json* each = j.contains("replicas") && j["replicas"].is_array() ? &j["replicas"] : nullptr;
  if (each && static_cast<int>(each->size()) == replicas) {
    for (size_t r = 0; r < out.size(); ++r) out[r] = (*each)[r].get<int64_t>();
  } else {
    out[0] = ck.field<int64_t>("/skipped_samples/total");
  }
  return out;
}

}  // namespace

DataPosition::DataPosition(BatchSource& source)
    : source_(source), shards_(dynamic_cast<ShardLoader*>(&source)), replicas_(static_cast<size_t>(source.replicas())) {}

void DataPosition::resume(const Checkpoint& ck, bool quiet) {
  const std::vector<BatchSource::Cursor> cursors = saved_cursors(ck, source_, quiet);
  const std::vector<int64_t> skipped = saved_skipped(ck, source_.replicas());
  for (size_t r = 0; r < replicas_.size(); ++r) replicas_[r] = {cursors[r], skipped[r], ck.step};
  const ReplicaPosition& mine = replicas_[static_cast<size_t>(source_.replica())];
  source_.set_cursor(mine.cursor);
  if (shards_) shards_->set_skipped(mine.skipped);
}

void DataPosition::share(Comm& comm) {
  if (!source_.per_replica()) {  // one cursor over the global batch: rank 0's
    const auto c = source_.cursor();
    auto t = torch::tensor({c.epoch, c.index}, torch::kLong);
    comm.broadcast(t, 0);
    source_.set_cursor({t[0].item<int64_t>(), t[1].item<int64_t>()});
    return;
  }
  auto at = torch::zeros({source_.replicas(), 4}, torch::kLong);  // [replica] = epoch, index, skipped, step
  if (comm.rank() == 0)
    for (size_t r = 0; r < replicas_.size(); ++r) {
      const ReplicaPosition& p = replicas_[r];
      at[static_cast<int64_t>(r)] = torch::tensor({p.cursor.epoch, p.cursor.index, p.skipped, p.step}, torch::kLong);
    }
  comm.broadcast(at, 0);
  for (size_t r = 0; r < replicas_.size(); ++r) {
    const auto row = at[static_cast<int64_t>(r)];
    replicas_[r] = {{row[0].item<int64_t>(), row[1].item<int64_t>()}, row[2].item<int64_t>(), row[3].item<int64_t>()};
  }
  const ReplicaPosition& mine = replicas_[static_cast<size_t>(source_.replica())];
  source_.set_cursor(mine.cursor);
  if (shards_) shards_->set_skipped(mine.skipped);
}

void DataPosition::hand_over(Comm& comm, int from, bool lead, bool rejoining, int rank) {
  if (!source_.per_replica()) {  // the one cursor walks on: the sender's
    const auto c = source_.cursor();
    auto t = torch::tensor({c.epoch, c.index}, torch::kLong);
    comm.broadcast(t, from);
    source_.set_cursor({t[0].item<int64_t>(), t[1].item<int64_t>()});
    return;
  }
  // A replica reading shards of its own goes on from its own position at the last checkpoint, which
  // the sender holds if it is rank 0 (-1: unknown): what it drew after that was lost with it, as a
  // --resume of the whole run would.
  auto at = torch::full({source_.replicas(), 4}, -1, torch::kLong);  // [replica] = epoch, index, skipped, step
  if (comm.rank() == from && lead)
    for (size_t r = 0; r < replicas_.size(); ++r) {
      const ReplicaPosition& p = replicas_[r];
      at[static_cast<int64_t>(r)] = torch::tensor({p.cursor.epoch, p.cursor.index, p.skipped, p.step}, torch::kLong);
    }
  comm.broadcast(at, from);
  if (!rejoining || adopted_) return;
  adopted_ = true;
  const auto row = at[source_.replica()];
  const int64_t epoch = row[0].item<int64_t>(), index = row[1].item<int64_t>();
  if (epoch < 0) {
    std::cerr << "rank " << rank << ": the replica that sent the state keeps no record of this replica's data "
              << "position; its shards start again from the beginning" << std::endl;
    return;
  }
  ReplicaPosition& mine = replicas_[static_cast<size_t>(source_.replica())];
  mine = {{epoch, index}, std::max<int64_t>(0, row[2].item<int64_t>()), row[3].item<int64_t>()};
  source_.set_cursor(mine.cursor);
  if (shards_) shards_->set_skipped(mine.skipped);
  std::cerr << "rank " << rank << ": replica " << source_.replica() << "'s shards go on from epoch " << epoch
            << ", sample " << index << ": "
            << (mine.step > 0 ? "its position at the checkpoint of step " + std::to_string(mine.step)
                              : std::string("the beginning (no checkpoint has recorded it yet)"))
            << std::endl;
}

std::string DataPosition::mine() const {
  const auto c = source_.cursor();
  return std::to_string(source_.replica()) + " " + std::to_string(c.epoch) + " " + std::to_string(c.index) + " " +
         std::to_string(skipped_mine());
}

void DataPosition::record(const std::vector<std::string>& gathered, int64_t step, bool skip_bad, nlohmann::json& state) {
  const auto c = source_.cursor();
  state["data_cursor"] = {{"epoch", c.epoch}, {"index", c.index}};
  if (!source_.per_replica()) return;
  for (const std::string& a : gathered) {  // the ranks of one replica (pipeline stages) read alike
    int64_t r = -1, e = 0, i = 0, k = 0;
    std::istringstream(a) >> r >> e >> i >> k;
    DDM_CHECK(r >= 0 && r < static_cast<int64_t>(replicas_.size()), "a rank's data position names replica " << r
                                                                          << " of " << replicas_.size());
    replicas_[static_cast<size_t>(r)] = {{e, i}, k, step};
  }
  nlohmann::json positions = nlohmann::json::array(), skipped = nlohmann::json::array();
  for (const ReplicaPosition& p : replicas_) {
    positions.push_back({p.cursor.epoch, p.cursor.index});
    skipped.push_back(p.skipped);
  }
  state["data_cursor"]["replicas"] = positions;
  if (shards_ && skip_bad) state["skipped_samples"] = {{"total", skipped_recorded()}, {"replicas", skipped}};
}

int64_t DataPosition::skipped_mine() const { return shards_ ? shards_->skipped() : 0; }

std::string DataPosition::last_skip() const { return shards_ ? shards_->last_skip() : std::string(); }

int64_t DataPosition::skipped_recorded() const {
  int64_t n = 0;
  for (const ReplicaPosition& p : replicas_) n += p.skipped;
  return n;
}

int64_t DataPosition::skipped_known() const {
  int64_t n = skipped_mine();
  for (size_t r = 0; r < replicas_.size(); ++r)
    if (static_cast<int>(r) != source_.replica()) n += replicas_[r].skipped;
  return n;
}

}  // namespace ddm
