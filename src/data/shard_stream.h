// The order in which a data-parallel replica reads a set of tar shards (data.source = "shards"),
// and the stream of its samples' bytes in that order.
//
// Epoch e of replica r of R: the shard list is permuted by a generator seeded with (seed, e) (or
// kept in order without shuffling), and the replica takes the shards at positions r, r + R, ... of
// that order; their samples, shard after shard, pass through a shuffle buffer of B samples (B <= 1:
// none): the buffer fills with the first B, then each further sample replaces the one drawn out at a
// position drawn from (seed, e, r, n), n counting the samples drawn so far, and the buffer empties in
// the same way at the epoch's end. So each sample is drawn exactly once per epoch, the replicas'
// epochs together draw every sample once, and the whole order is a function of the shards' sample
// counts alone: a resumed run computes it, then reads only the samples still to come (the tar data
// of those before them is skipped, not read). ShardOrder::keep leaves samples out of every epoch.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/shards.h"

namespace ddm {

// What a pass over every shard's headers found (no image is decoded).
struct ShardIndex {
  std::vector<std::string> shards;
  std::vector<int64_t> counts;  // samples per shard
  int64_t samples = 0;          // their sum
  int64_t num_classes = 0;      // 1 + the largest label; 0 when no sample has a label
  int64_t captioned = 0;        // samples with a caption (data/captions.h): all of them, or none
  int64_t bad_shards = 0;       // shards cut short at a corrupt or truncated member (skip_bad only)
  std::vector<std::string> notes;  // what was skipped, one line each (skip_bad only)
};

// Whether the file's last 1024 bytes are zeros, as every tar writer ends an archive (GNU and BSD tar,
// Python's tarfile, libarchive). A tar cut exactly between two members (a copy that stopped) reads as
// a shorter one without this check.
bool ends_as_a_tar(const std::string& path);

// What a sample must hold: an image (jpg, jpeg, png or webp), or a latent posterior (safetensors:
// latent shards, data/latent_shards.h).
enum class SampleContent { kImage, kPosterior };

// Scans the shards on `threads` threads. Every sample needs its content (an image, or a posterior);
// either every sample has a label (.cls or .json) or none has, and a caption (.txt or .json) or none. A corrupt or truncated shard, a malformed label
// or a sample without an image is an error naming the shard and key; with skip_bad, a shard is cut
// at its first corrupt member (the samples before it are kept) and the other faults are left for the
// loader to skip and count. `key` names the setting in errors (data.root). With a `cache_dir`, shards
// whose clean scan is cached there (data/scan_cache.h) are not read again, and new clean scans are
// added.
ShardIndex scan_shards(const std::vector<std::string>& shards, bool skip_bad, int threads, const std::string& key,
                       SampleContent content = SampleContent::kImage, const std::string& cache_dir = "");

struct ShardOrder {
  uint64_t seed = 0;
  int replica = 0, replicas = 1;
  bool shuffle = true;         // shards permuted per epoch (else in list order)
  int64_t shuffle_buffer = 0;  // samples; <= 1: none
  // The samples the stream takes, by position in shard order (shard_offsets); null: all. The others
  // are never drawn, and their tar data is skipped, not read (a router's held-out samples).
  std::shared_ptr<const std::vector<bool>> keep;
};

// The position in shard order (the index's shards in turn, their samples in turn) of each shard's
// first sample: sample i of shard s is sample shard_offsets(index)[s] + i.
std::vector<int64_t> shard_offsets(const ShardIndex& index);

// A sample's place: its shard (an index into ShardIndex::shards) and its position in that shard.
struct SampleRef {
  int32_t shard = 0;
  int64_t index = 0;
};

// The shards replica `o.replica` reads in epoch `epoch`, in order.
std::vector<int32_t> epoch_shards(const ShardIndex& index, const ShardOrder& o, int64_t epoch);
// The replica's samples in epoch `epoch`, in the order they are drawn.
std::vector<SampleRef> epoch_order(const ShardIndex& index, const ShardOrder& o, int64_t epoch);

// The samples of one replica, bytes and all, in epoch_order's order, epoch after epoch. Holds at most
// the shuffle buffer's samples in memory.
class ShardStream {
 public:
  // Starts at sample `drawn` of epoch `epoch`. Throws when the replica has no shard.
  ShardStream(std::shared_ptr<const ShardIndex> index, ShardOrder order, int64_t epoch, int64_t drawn);
  ~ShardStream();
  // The next sample, and where it came from. Throws ddm::Error (naming shard and key) for a fault of
  // the tar data that the scan did not see (a shard changed since).
  ShardSample next(SampleRef* ref = nullptr);
  int64_t epoch() const { return epoch_; }
  int64_t drawn() const { return drawn_; }    // samples drawn in this epoch so far
  int64_t epoch_size() const { return static_cast<int64_t>(order_.size()); }

 private:
  void begin_epoch(int64_t epoch, int64_t drawn);
  bool read_one();  // reads the next sample of the epoch's stream; false when the stream is over
  struct Reading;
  std::shared_ptr<const ShardIndex> index_;
  ShardOrder o_;
  int64_t epoch_ = 0, drawn_ = 0;
  std::vector<SampleRef> order_;
  std::vector<int32_t> shards_;      // the epoch's shards in stream order
  std::vector<int64_t> stream_start_;  // the stream position of each of those shards' first sample
  std::vector<int64_t> drawn_at_;    // stream position -> the draw that takes it
  int64_t from_ = 0;                 // draws before this one are not read (a resumed start)
  size_t next_shard_ = 0;            // the next of shards_ to open
  std::unique_ptr<Reading> reading_;  // the shard being read
  std::unordered_map<int64_t, ShardSample> held_;  // read, not yet drawn, by draw (at most the buffer's)
};

}  // namespace ddm
