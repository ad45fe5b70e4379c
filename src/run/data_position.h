// Where a run is in its data. The batch source a run draws from (made once, by make_batch_source),
// and DataPosition: each data-parallel replica's place in its data (the source's (epoch, index) and
// the bad samples it skipped) with the checkpoint step that recorded it. DataPosition is the one
// owner of that record: it reads it from a checkpoint on resume, shares rank 0's with every rank,
// hands it to a DiLoCo replica that rejoins (so that it goes on from its own position), gathers it
// from the ranks into every checkpoint (state.json's data_cursor and skipped_samples), and says how
// many samples all replicas have skipped.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "core/config.h"
#include "data/batch_source.h"
#include "data/dataset.h"
#include "parallel/layout.h"
#include "train/checkpoint.h"

namespace ddm {

class ShardLoader;

// The run's batch source: the shards' loader (each replica reads shards of its own, decoding ahead on
// threads, in page-locked memory for a GPU) or the in-memory loader (one cursor over the global batch).
std::unique_ptr<BatchSource> make_batch_source(const RunConfig& cfg, const Dataset& data, const ParallelLayout& layout,
                                               int local_processes, bool pin);

// One replica's place in its data.
struct ReplicaPosition {
  BatchSource::Cursor cursor;  // where its next batch starts
  int64_t skipped = 0;         // bad samples it skipped so far (data.skip_bad)
  int64_t step = 0;            // the checkpoint that recorded this; 0: the run's beginning
};

class DataPosition {
 public:
  // `source` is the run's; a ShardLoader also counts its skipped samples. Every replica starts at the
  // beginning.
  explicit DataPosition(BatchSource& source);

  // Rank 0, resuming: every replica's position from `ck` (one position for all when the source keeps
  // one cursor, or the checkpoint has another replica count: then every replica starts the latest
  // epoch any had reached afresh, and says so unless quiet); this process's source goes to its own.
  void resume(const Checkpoint& ck, bool quiet);
  // Collective over the job, after rank 0's resume (or fresh start): every rank takes rank 0's
  // positions and puts its source at its replica's.
  void share(Comm& comm);
  // Collective within a DiLoCo group a replica joins (the engine's transfer hook): `from` sends the
  // positions it holds (if it is rank 0, the only one that keeps them), and a `rejoining` replica
  // takes its own, once, and says where it goes on from (`rank`: this process's, for the message).
  void hand_over(Comm& comm, int from, bool lead, bool rejoining, int rank);

  // This process's position now: its record for Engine::contribute, which gathers every rank's.
  std::string mine() const;
  // A checkpoint at `step`: takes the gathered records (a replica absent from them keeps its last)
  // and writes state.json's data_cursor (this process's cursor, and every replica's when the source
  // keeps one per replica) and, with `skip_bad`, skipped_samples (every replica's and their total).
  void record(const std::vector<std::string>& gathered, int64_t step, bool skip_bad, nlohmann::json& state);

  // Samples all replicas skipped, as far as this process knows: its own now, the others' at the last
  // checkpoint that recorded them (the exact total of all replicas is in every checkpoint).
  int64_t skipped_known() const;
  int64_t skipped_mine() const;  // this process's replica's, now
  std::string last_skip() const;
  // The total of the positions as the last record() left them.
  int64_t skipped_recorded() const;

 private:
  BatchSource& source_;
  ShardLoader* shards_ = nullptr;             // the source, when it reads shards
  std::vector<ReplicaPosition> replicas_;     // [replica]
  bool adopted_ = false;                      // a rejoining replica has taken its position
};

}  // namespace ddm
