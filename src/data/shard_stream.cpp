// Scanning tar shards, a replica's order over them, and the stream of its samples (see
// shard_stream.h).
#include "data/shard_stream.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <fstream>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <torch/torch.h>

#include "core/error.h"
#include "core/rng.h"
#include "data/captions.h"
#include "data/decode.h"
#include "data/scan_cache.h"

namespace ddm {
namespace {

// Whether the sample has its content; two images are an error (sample_image).
bool has_content(const ShardSample& s, SampleContent content, const std::string& what) {
  if (content == SampleContent::kImage) return sample_image(s.files, what) != nullptr;
  return s.files.count("safetensors") > 0;
}

// What to do about a sample without its image: a label or caption apart from its picture means the
// tar was not made in sorted order; anything else is a stray file (Thumbs.db, notes).
std::string no_content_hint(const ShardSample& s, SampleContent content) {
  if (content != SampleContent::kImage) return "";
  bool companion = false;
  for (const auto& f : s.files) {
    companion = companion || f.first == "cls" || f.first == "txt" || f.first == "json";
    const size_t dot = f.first.rfind('.');
    if (dot != std::string::npos && is_decodable(f.first.substr(dot + 1)))
      return ". A sample's key ends at the first dot of a file's name (WebDataset's rule), so " + s.key + "." + f.first +
             " is not read as an image: rename it without the inner dots (e.g. " + s.key + "_" +
             f.first.substr(0, dot) + "." + f.first.substr(dot + 1) + "), or set data.skip_bad = true to skip it";
  }
  return companion ? ". A sample's files must be consecutive members of the tar: make it with `tar --sort=name` "
                     "(or set data.skip_bad = true to skip such samples)"
                   : ". A stray file? Remove it from the tar, or set data.skip_bad = true to skip such samples";
}

const char* content_text(SampleContent content) {
  return content == SampleContent::kImage ? "image (.jpg, .jpeg, .png or .webp)" : "posterior (.safetensors)";
}

// One shard's part of the index, and how its scan went.
struct ShardScan {
  ShardFacts f;
  ScanCache::FileId id;     // the file as it was when the scan began
  int64_t bad = 0;          // samples left for the loader to skip (skip_bad)
  bool cut = false;         // cut at a corrupt member (skip_bad)
  bool from_cache = false;
  std::string note;
  std::exception_ptr error;
};

ShardScan scan_one(const std::string& path, bool skip_bad, SampleContent content) {
  ShardScan s;
  try {
    TarShardReader r(path);
    r.set_filter([](int64_t, const std::string& ext) { return ext == "cls" || ext == "json" || ext == "txt"; });
    ShardSample smp;
    for (;;) {
      try {
        if (!r.next(smp)) break;
      } catch (const Error& e) {
        if (!skip_bad) throw;
        s.cut = true;
        s.note = std::string(e.what()) + "; its first " + std::to_string(s.f.count) + " samples are used";
        break;
      }
      ++s.f.count;
      const std::string what = "shard " + path + ", sample '" + smp.key + "'";
      int64_t label = -1;
      bool captioned = false;
      try {
        DDM_CHECK(has_content(smp, content, what), what << " has no " << content_text(content) << "; its files: "
                                       << [&] {
                                            std::string t;
                                            for (const auto& f : smp.files) t += (t.empty() ? "." : ", .") + f.first;
                                            return t;
                                          }()
                                       << no_content_hint(smp, content));
        label = sample_label(smp, what);
        captioned = sample_caption(smp, what).has_value();
      } catch (const Error&) {
        if (!skip_bad) throw;
        ++s.bad;
        continue;  // the loader finds it again, and skips and counts it
      }
      if (label >= 0) {
        ++s.f.labeled;
        s.f.max_label = std::max(s.f.max_label, label);
        if (s.f.labeled_key.empty()) s.f.labeled_key = smp.key;
      } else if (s.f.unlabeled_key.empty()) {
        s.f.unlabeled_key = smp.key;
      }
      if (captioned) {
        ++s.f.captioned;
        if (s.f.captioned_key.empty()) s.f.captioned_key = smp.key;
      } else if (s.f.uncaptioned_key.empty()) {
        s.f.uncaptioned_key = smp.key;
      }
    }
    // A tar ends with two blocks of zeros. One cut exactly between two members (a copy that stopped)
    // reads as a shorter tar, its last sample perhaps without all its files: that is said.
    if (!s.cut && !ends_as_a_tar(path)) {
      const std::string why = "shard " + path + " ends without a tar's end-of-archive blocks (two blocks of zeros): it "
                              "was cut short, e.g. by a copy that stopped";
      DDM_CHECK(skip_bad, why << "; copy it again, or set data.skip_bad = true to use it up to there");
      s.cut = true;
      s.note = why + "; its first " + std::to_string(s.f.count) + " samples are used";
    }
  } catch (...) {
    s.error = std::current_exception();
  }
  return s;
}

}  // namespace

bool ends_as_a_tar(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const std::streamoff size = in.tellg();
  if (!in || size < 1024) return false;
  std::string tail(1024, '\1');
  in.seekg(size - 1024);
  in.read(tail.data(), 1024);
  return in && tail.find_first_not_of('\0') == std::string::npos;
}

ShardIndex scan_shards(const std::vector<std::string>& shards, bool skip_bad, int threads, const std::string& key,
                       SampleContent content, const std::string& cache_dir) {
  DDM_CHECK(!shards.empty(), key << " names no shard");
  ScanCache cache(cache_dir, shards, content == SampleContent::kImage ? "image" : "posterior");
  std::vector<ShardScan> scans(shards.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < shards.size(); i = next++) {
      if (const auto cached = cache.find(i)) {
        scans[i].f = *cached;
        scans[i].from_cache = true;
      } else {
        const ScanCache::FileId id = ScanCache::identify(shards[i]);
        scans[i] = scan_one(shards[i], skip_bad, content);
        scans[i].id = id;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(1, std::min<int>(threads, static_cast<int>(shards.size()))); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardScan& s = scans[i];
    if (!s.from_cache && !s.error && !s.cut && s.bad == 0) cache.put(i, s.id, s.f);
  }
  cache.save();

  ShardIndex index;
  index.shards = shards;
  int64_t labeled = 0, max_label = -1;
  const ShardScan* unlabeled = nullptr;
  const ShardScan* with_label = nullptr;
  const ShardScan* uncaptioned = nullptr;
  const ShardScan* with_caption = nullptr;
  for (size_t i = 0; i < shards.size(); ++i) {
    const ShardScan& s = scans[i];
    if (s.error) std::rethrow_exception(s.error);
    index.counts.push_back(s.f.count);
    index.samples += s.f.count;
    labeled += s.f.labeled;
    max_label = std::max(max_label, s.f.max_label);
    if (s.cut) ++index.bad_shards, index.notes.push_back(s.note);
    if (!s.f.unlabeled_key.empty() && !unlabeled) unlabeled = &s;
    if (!s.f.labeled_key.empty() && !with_label) with_label = &s;
    index.captioned += s.f.captioned;
    if (!s.f.uncaptioned_key.empty() && !uncaptioned) uncaptioned = &s;
    if (!s.f.captioned_key.empty() && !with_caption) with_caption = &s;
  }
  DDM_CHECK(index.samples > 0, key << ": the " << shards.size() << " shard" << (shards.size() > 1 ? "s hold" : " holds")
                                   << " no sample (" << shards.front() << (shards.size() > 1 ? ", ..." : "") << ")");
  if (unlabeled && with_label) {
    const size_t u = static_cast<size_t>(unlabeled - scans.data()), l = static_cast<size_t>(with_label - scans.data());
    DDM_CHECK(skip_bad, key << ": sample '" << unlabeled->f.unlabeled_key << "' of shard " << shards[u]
                            << " has no label (.cls or .json) but sample '" << with_label->f.labeled_key << "' of shard "
                            << shards[l] << " has one; label every sample or none (or set data.skip_bad = true "
                            << "to skip the unlabeled ones)");
  }
  if (uncaptioned && with_caption) {
    const size_t u = static_cast<size_t>(uncaptioned - scans.data()), c = static_cast<size_t>(with_caption - scans.data());
    DDM_CHECK(skip_bad, key << ": sample '" << uncaptioned->f.uncaptioned_key << "' of shard " << shards[u]
                            << " has no caption (.txt, or .json with \"caption\" or \"text\") but sample '"
                            << with_caption->f.captioned_key << "' of shard " << shards[c] << " has one; caption every "
                            << "sample or none (an empty .txt for one meant to go uncaptioned), or set data.skip_bad = "
                            << "true to skip the uncaptioned ones");
  }
  index.num_classes = labeled > 0 ? max_label + 1 : 0;
  return index;
}

std::vector<int32_t> epoch_shards(const ShardIndex& index, const ShardOrder& o, int64_t epoch) {
  const int64_t n = static_cast<int64_t>(index.shards.size());
  std::vector<int32_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  if (o.shuffle) {
    at::Generator gen = make_generator(
        derive_seed({o.seed, static_cast<uint64_t>(RngPurpose::kDataOrder), static_cast<uint64_t>(epoch)}));
    const torch::Tensor perm = torch::randperm(n, gen, torch::TensorOptions().dtype(torch::kInt64));
    const int64_t* p = perm.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(p[i]);
  }
  std::vector<int32_t> mine;
  for (int64_t i = o.replica; i < n; i += o.replicas) mine.push_back(order[static_cast<size_t>(i)]);
  return mine;
}

std::vector<int64_t> shard_offsets(const ShardIndex& index) {
  std::vector<int64_t> first;
  int64_t at = 0;
  for (const int64_t c : index.counts) {
    first.push_back(at);
    at += c;
  }
  return first;
}

std::vector<SampleRef> epoch_order(const ShardIndex& index, const ShardOrder& o, int64_t epoch) {
  DDM_CHECK(!o.keep || static_cast<int64_t>(o.keep->size()) == index.samples,
            "ShardOrder: the samples to keep are given for " << o.keep->size() << " samples, the shards hold "
                                                             << index.samples);
  const std::vector<int64_t> first = o.keep ? shard_offsets(index) : std::vector<int64_t>();
  std::vector<SampleRef> out;
  std::vector<SampleRef> buffer;
  const size_t cap = static_cast<size_t>(std::max<int64_t>(1, o.shuffle_buffer));
  // The buffer's position for draw number out.size(), uniform over `size` positions.
  auto pick = [&](size_t size) {
    const uint64_t key = derive_seed({o.seed, static_cast<uint64_t>(RngPurpose::kShuffleBuffer),
                                      static_cast<uint64_t>(epoch), static_cast<uint64_t>(o.replica), out.size()});
    return std::min(size - 1, static_cast<size_t>(uniform_from_key(key) * static_cast<double>(size)));
  };
  for (const int32_t s : epoch_shards(index, o, epoch)) {
    for (int64_t i = 0; i < index.counts[static_cast<size_t>(s)]; ++i) {
      const SampleRef ref{s, i};
      if (o.keep && !(*o.keep)[static_cast<size_t>(first[static_cast<size_t>(s)] + i)]) continue;
      if (cap <= 1) {
        out.push_back(ref);
      } else if (buffer.size() < cap) {
        buffer.push_back(ref);
      } else {
        const size_t j = pick(cap);
        out.push_back(buffer[j]);
        buffer[j] = ref;
      }
    }
  }
  while (!buffer.empty()) {
    const size_t j = pick(buffer.size());
    out.push_back(buffer[j]);
    buffer[j] = buffer.back();
    buffer.pop_back();
  }
  return out;
}

struct ShardStream::Reading {
  std::unique_ptr<TarShardReader> reader;
  int32_t shard = 0;
  int64_t start = 0, count = 0, read = 0;
};

ShardStream::ShardStream(std::shared_ptr<const ShardIndex> index, ShardOrder order, int64_t epoch, int64_t drawn)
    : index_(std::move(index)), o_(order) {
  DDM_CHECK(o_.replicas >= 1 && o_.replica >= 0 && o_.replica < o_.replicas,
            "replica " << o_.replica << " of " << o_.replicas << " does not exist");
  if (static_cast<int64_t>(index_->shards.size()) < o_.replicas) {  // the same on every run: bad input (exit 2)
    std::ostringstream m;
    m << "data.root: " << index_->shards.size() << " shard" << (index_->shards.size() > 1 ? "s" : "") << " for "
      << o_.replicas << " data-parallel replicas; each replica reads shards of its own, so it needs at least one: "
      << "write the data as more, smaller shards (ddm shards write --shard-size N; an expert's cluster: ddm partition "
      << "--reshard --min-shards " << o_.replicas << ")";
    throw InputError(m.str());
  }
  begin_epoch(epoch, drawn);
}

ShardStream::~ShardStream() = default;

void ShardStream::begin_epoch(int64_t epoch, int64_t drawn) {
  epoch_ = epoch;
  order_ = epoch_order(*index_, o_, epoch);
  DDM_CHECK(!order_.empty(), "data.root: replica " << o_.replica << "'s shards in epoch " << epoch << " hold no sample "
                                                   << (o_.keep ? "that is not held out; hold out fewer samples, or "
                                                               : "(empty shards); ")
                                                   << "remove the empty shards");
  DDM_CHECK(drawn >= 0 && drawn < epoch_size(),
            "data position (epoch " << epoch << ", sample " << drawn << ") is past replica " << o_.replica
                                    << "'s epoch of " << epoch_size() << " samples; the checkpoint belongs to other shards");
  shards_ = epoch_shards(*index_, o_, epoch);
  std::vector<int64_t> first_of(index_->shards.size(), -1);
  stream_start_.clear();
  int64_t at = 0;
  for (const int32_t s : shards_) {
    first_of[static_cast<size_t>(s)] = at;
    stream_start_.push_back(at);
    at += index_->counts[static_cast<size_t>(s)];
  }
  drawn_at_.assign(static_cast<size_t>(at), -1);  // -1: never drawn (left out by ShardOrder::keep)
  for (size_t k = 0; k < order_.size(); ++k)
    drawn_at_[static_cast<size_t>(first_of[static_cast<size_t>(order_[k].shard)] + order_[k].index)] = static_cast<int64_t>(k);
  from_ = drawn_ = drawn;
  next_shard_ = 0;
  reading_.reset();
  held_.clear();
}

bool ShardStream::read_one() {
  for (;;) {
    if (!reading_) {
      if (next_shard_ == shards_.size()) return false;
      const size_t i = next_shard_++;
      auto r = std::make_unique<Reading>();
      r->shard = shards_[i];
      r->start = stream_start_[i];
      r->count = index_->counts[static_cast<size_t>(r->shard)];
      const auto first = drawn_at_.begin() + r->start;
      if (r->count == 0 || *std::max_element(first, first + r->count) < from_) continue;  // all drawn before
      r->reader = std::make_unique<TarShardReader>(index_->shards[static_cast<size_t>(r->shard)]);
      const int64_t* at = drawn_at_.data() + r->start;
      const int64_t from = from_;
      r->reader->set_filter([at, from](int64_t sample, const std::string&) { return at[sample] >= from; });
      reading_ = std::move(r);
    }
    Reading& r = *reading_;
    if (r.read == r.count) {
      reading_.reset();
      continue;
    }
    ShardSample s;
    DDM_CHECK(r.reader->next(s), "shard " << r.reader->name() << " ends after " << r.read << " samples, but held "
                                          << r.count << " when this run began; a shard changed under a running job");
    ++r.read;
    const int64_t k = drawn_at_[static_cast<size_t>(r.start + s.index)];
    if (k >= from_) held_.emplace(k, std::move(s));
    return true;
  }
}

ShardSample ShardStream::next(SampleRef* ref) {
  if (drawn_ == epoch_size()) begin_epoch(epoch_ + 1, 0);
  for (;;) {
    auto it = held_.find(drawn_);
    if (it != held_.end()) {
      ShardSample s = std::move(it->second);
      held_.erase(it);
      if (ref) *ref = order_[static_cast<size_t>(drawn_)];
      ++drawn_;
      return s;
    }
    DDM_CHECK(read_one(), "replica " << o_.replica << ": the shards of epoch " << epoch_ << " ran out after "
                                     << drawn_ << " of " << epoch_size() << " samples; a shard changed under a running job");
  }
}

}  // namespace ddm
