// ShardLoader (see shard_loader.h): a producer thread ahead of the trainer, decoding on a pool.
#include "data/shard_loader.h"

#include <algorithm>
#include <limits>
#include <atomic>
#include <cstring>
#include <iostream>
#include <set>
#include <sstream>
#include <vector>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/captions.h"
#include "data/origin.h"

namespace ddm {
namespace {

// One sample, ready for the batch: its image [C, S, S] (uint8, any strides) and whether it is to be
// mirrored, or its posterior [2z, h, w] (float, contiguous); its label; or why it cannot be used.
struct Decoded {
  torch::Tensor image, posterior;
  torch::Tensor context, context_mask, pooled;  // cached text encodings (latent shards with text): [T, D], [T], [P]
  bool flip = false;
  int64_t label = 0;
  std::string caption;
  std::string bad;  // non-empty: the reason it is skipped (data.skip_bad)
};

// A reason without its advice to set data.skip_bad (it is set: the sample is being skipped).
std::string without_skip_advice(std::string why) {
  for (const char* advice : {" (or set data.skip_bad = true to skip such samples)",
                             ", or set data.skip_bad = true to skip such samples", ", or set data.skip_bad = true to skip it"})
    for (size_t at = why.find(advice); at != std::string::npos; at = why.find(advice))
      why.erase(at, std::strlen(advice));
  return why;
}

Decoded decode_one(const ShardSample& s, const SampleRef& ref, int64_t epoch, const ShardIndex& index,
                   const ShardOrder& order, const ShardLoaderOptions& o) {
  const std::string what = "shard " + index.shards[static_cast<size_t>(ref.shard)] + ", sample '" + s.key + "'";
  Decoded d;
  try {
    const int64_t label = sample_label(s, what);
    DDM_CHECK(index.num_classes == 0 || label >= 0, what << " has no label (.cls or .json), as the others have");
    d.label = std::max<int64_t>(0, label);
    if (index.captioned > 0) {
      const auto caption = sample_caption(s, what);
      DDM_CHECK(caption, what << " has no caption (.txt, or .json with \"caption\" or \"text\"), as the others have");
      d.caption = *caption;
    }
    if (o.posteriors) {  // latent shards: the posterior as it was written
      const auto st = s.files.find("safetensors");
      DDM_CHECK(st != s.files.end(), what << " has no posterior (.safetensors)");
      EncodedSample e = read_encoded(st->second, *o.posteriors, what);
      d.posterior = e.posterior.contiguous();  // float [2z, h, w]
      d.context = std::move(e.context), d.context_mask = std::move(e.context_mask), d.pooled = std::move(e.pooled);
      return d;
    }
    const std::pair<const std::string, std::string>* img = sample_image(s.files, what);
    DDM_CHECK(img, what << " has no image (.jpg, .jpeg, .png or .webp)");
    if (o.text_encodings) {  // images that `ddm encode --text` kept, with their captions' encodings
      const auto st = s.files.find("safetensors");
      DDM_CHECK(st != s.files.end(), what << " has no text encodings (.safetensors), as " << kLatentShardsInfo
                                          << " says its samples have; encode again");
      EncodedSample e = read_encoded(st->second, *o.text_encodings, what);
      d.context = std::move(e.context), d.context_mask = std::move(e.context_mask), d.pooled = std::move(e.pooled);
    }
    // Keyed by the sample's place, not by when it is drawn: a resumed run draws the same values.
    auto key = [&](RngPurpose p) {
      return derive_seed({order.seed, static_cast<uint64_t>(p), static_cast<uint64_t>(epoch),
                          static_cast<uint64_t>(ref.shard), static_cast<uint64_t>(ref.index)});
    };
    torch::Tensor x = decode_image(img->second, img->first, o.channels, what);  // uint8 [C, H, W]
    d.image = crop_resize(x, o.resolution, o.crop, uniform_from_key(key(RngPurpose::kCrop)));  // uint8 [C, S, S]
    d.flip = o.hflip && (key(RngPurpose::kFlip) >> 63) != 0;
  } catch (const Error& e) {
    // Bad input (exit 2: a restart would meet it again), which data.skip_bad would skip.
    if (!o.skip_bad)
      throw InputError(std::string(e.what()) + ". Mend or remove it, or set data.skip_bad = true to skip such samples");
    d.bad = without_skip_advice(e.what());
  }
  return d;
}

// A decoded image as a batch row: uint8 [C, S, S] (any strides) -> float [C, S, S] at `out` in [-1, 1],
// as to_unit_range computes it (v / 127.5 - 1, each step rounded to float32), mirrored left-right
// when flip. Written by hand so that the decode threads start no OpenMP team of LibTorch's.
void unit_range_row(const torch::Tensor& image, bool flip, float* out) {
  const auto a = image.accessor<uint8_t, 3>();
  const int64_t c = image.size(0), h = image.size(1), w = image.size(2);
  for (int64_t k = 0; k < c; ++k)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x) *out++ = static_cast<float>(a[k][y][flip ? w - 1 - x : x]) / 127.5f - 1.0f;
}

// Runs f(i) for i in [0, n) on `threads` threads (this one among them); the first error is rethrown.
template <class F>
void parallel_for_each(int64_t n, int threads, F f) {
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex mu;
  auto work = [&] {
    for (int64_t i = next++; i < n; i = next++) {
      try {
        f(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        next = n;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min<int64_t>(threads, n); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

ShardLoader::ShardLoader(std::shared_ptr<const ShardIndex> index, ShardOrder order, ShardLoaderOptions options)
    : index_(std::move(index)), order_(order), o_(options) {
  DDM_CHECK(o_.batch > 0, "ShardLoader: the batch must have rows, got " << o_.batch);
  DDM_CHECK(o_.posteriors || o_.resolution > 0, "data.resolution must be > 0 for shards, got " << o_.resolution);
  DDM_CHECK(o_.posteriors || o_.channels == 1 || o_.channels == 3, "data.channels must be 1 or 3, got " << o_.channels);
  DDM_CHECK(!(o_.posteriors && o_.hflip), "latent shards are not flipped (a flipped image's latent is not the flip "
                                          "of its latent): set data.hflip = false");
  DDM_CHECK(!o_.clusters || static_cast<int64_t>(o_.clusters->size()) == index_->samples,
            "ShardLoader: clusters are given for " << o_.clusters->size() << " samples, the shards hold " << index_->samples);
  offsets_ = shard_offsets(*index_);
  ShardStream probe(index_, order_, 0, 0);  // the replica has samples (or a clear error, here)
  start({});
}

ShardLoader::~ShardLoader() { stop(); }

void ShardLoader::start(const Cursor& at) {
  delivered_ = at;
  stopping_ = false;
  ready_.clear();
  producer_ = std::thread([this, at] { produce(at); });
}

void ShardLoader::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (producer_.joinable()) producer_.join();
}

ShardLoader::Prepared ShardLoader::prepare(ShardStream& stream) {
  Prepared p;
  std::vector<Decoded> images;
  std::vector<int64_t> labels, clusters;
  std::vector<std::string> captions;
  while (static_cast<int64_t>(images.size()) < o_.batch) {
    // Read what is still missing (reading is sequential), then decode it on the pool.
    const int64_t need = o_.batch - static_cast<int64_t>(images.size());
    std::vector<ShardSample> raw(static_cast<size_t>(need));
    std::vector<SampleRef> refs(static_cast<size_t>(need));
    std::vector<int64_t> epochs(static_cast<size_t>(need));
    for (int64_t i = 0; i < need; ++i) {
      if (stream.drawn() == stream.epoch_size()) epochs[static_cast<size_t>(i)] = stream.epoch() + 1;
      else epochs[static_cast<size_t>(i)] = stream.epoch();
      raw[static_cast<size_t>(i)] = stream.next(&refs[static_cast<size_t>(i)]);
    }
    std::vector<Decoded> done(static_cast<size_t>(need));
    parallel_for_each(need, o_.threads, [&](int64_t i) {
      const auto u = static_cast<size_t>(i);
      done[u] = decode_one(raw[u], refs[u], epochs[u], *index_, order_, o_);
    });
    for (size_t i = 0; i < done.size(); ++i) {
      Decoded& d = done[i];
      if (!d.bad.empty()) {
        ++p.skipped;
        p.skip_note = d.bad;
        continue;
      }
      labels.push_back(d.label);
      if (index_->captioned > 0) captions.push_back(std::move(d.caption));
      if (o_.clusters)
        clusters.push_back((*o_.clusters)[static_cast<size_t>(offsets_[static_cast<size_t>(refs[i].shard)] + refs[i].index)]);
      images.push_back(std::move(d));
    }
  }
  const auto& first = o_.posteriors ? images.front().posterior : images.front().image;
  const bool first_cached = images.front().context.defined();
  const auto host = torch::TensorOptions().pinned_memory(o_.pin);
  p.batch.x = torch::empty({o_.batch, first.size(0), first.size(1), first.size(2)}, host);  // float [B, C, S, S]
  const int64_t row = first.numel();
  float* x = p.batch.x.data_ptr<float>();
  if (o_.posteriors) {  // [B, 2z, h, w]: each row copied as it is
    for (int64_t i = 0; i < o_.batch; ++i)
      std::memcpy(x + i * row, images[static_cast<size_t>(i)].posterior.data_ptr<float>(), row * sizeof(float));
  } else {
    parallel_for_each(o_.batch, o_.threads, [&](int64_t i) {
      const Decoded& d = images[static_cast<size_t>(i)];
      unit_range_row(d.image, d.flip, x + i * row);
    });
  }
  p.batch.y = torch::empty({o_.batch}, host.dtype(torch::kInt64));  // int64 [B]
  std::copy(labels.begin(), labels.end(), p.batch.y.data_ptr<int64_t>());
  if (o_.clusters) {
    p.batch.k = torch::empty({o_.batch}, host.dtype(torch::kInt64));  // int64 [B]
    std::copy(clusters.begin(), clusters.end(), p.batch.k.data_ptr<int64_t>());
  }
  p.batch.captions = std::move(captions);  // B captions, or none
  if (first_cached) {  // the text encoder's cached encodings, stacked as encode_texts gives them
    std::vector<torch::Tensor> c, m, q;
    for (const Decoded& d : images) c.push_back(d.context), m.push_back(d.context_mask), q.push_back(d.pooled);
    p.batch.context = torch::stack(c);                         // float [B, T, D]
    p.batch.context_mask = torch::stack(m).to(torch::kInt64);  // int64 [B, T]
    p.batch.pooled = torch::stack(q);                          // float [B, P]
    if (o_.pin) {
      p.batch.context = p.batch.context.pin_memory();
      p.batch.context_mask = p.batch.context_mask.pin_memory();
      p.batch.pooled = p.batch.pooled.pin_memory();
    }
  }
  p.after = {stream.epoch(), stream.drawn()};
  if (p.after.index == stream.epoch_size()) p.after = {stream.epoch() + 1, 0};
  return p;
}

void ShardLoader::produce(Cursor at) {
  std::unique_ptr<ShardStream> stream;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || static_cast<int>(ready_.size()) < o_.depth; });
      if (stopping_) return;
    }
    Prepared p;
    try {
      if (!stream) stream = std::make_unique<ShardStream>(index_, order_, at.epoch, at.index);
      p = prepare(*stream);
      at = p.after;
    } catch (...) {
      p.error = std::current_exception();
    }
    const bool failed = static_cast<bool>(p.error);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(std::move(p));
    }
    cv_.notify_all();
    if (failed) return;  // the error is handed out with the batch it stopped
  }
}

ShardLoader::Prepared& ShardLoader::front() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !ready_.empty(); });
  Prepared& p = ready_.front();
  if (p.error) std::rethrow_exception(p.error);
  return p;
}

Batch ShardLoader::next(int64_t begin, int64_t count) {
  DDM_CHECK(count == -1 || count == o_.batch,
            "ShardLoader: batches of " << o_.batch << " rows were prepared, " << count << " asked for");
  Prepared& p = front();
  Batch b = p.batch;
  b.first = begin;
  {
    std::lock_guard<std::mutex> lock(mu_);
    delivered_ = p.after;
    skipped_ += p.skipped;
    if (!p.skip_note.empty()) last_skip_ = p.skip_note;
    ready_.pop_front();
  }
  cv_.notify_all();
  return b;
}

Batch ShardLoader::peek(int64_t begin, int64_t count) {
  DDM_CHECK(count == o_.batch, "ShardLoader: batches of " << o_.batch << " rows were prepared, " << count << " asked for");
  Batch b = front().batch;
  b.first = begin;
  return b;
}

BatchSource::Cursor ShardLoader::cursor() const {
  std::lock_guard<std::mutex> lock(mu_);
  return delivered_;
}

void ShardLoader::set_cursor(const Cursor& c) {
  const int64_t size = c.epoch >= 0 ? static_cast<int64_t>(epoch_order(*index_, order_, c.epoch).size()) : 0;
  DDM_CHECK(c.epoch >= 0 && c.index >= 0 && c.index < size,
            "data position (epoch " << c.epoch << ", sample " << c.index << ") is out of range for replica "
                                    << order_.replica << "'s " << size << " samples in that epoch; the checkpoint "
                                    << "belongs to other shards");
  stop();
  start(c);
}

int64_t ShardLoader::skipped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_;
}

void ShardLoader::set_skipped(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  skipped_ = n;
}

std::string ShardLoader::last_skip() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_skip_;
}

}  // namespace ddm

namespace ddm {

namespace {

ShardLoaderOptions loader_options(const DataConfig& cfg, int64_t channels, int64_t batch, int local_processes) {
  ShardLoaderOptions o;
  o.batch = batch;
  o.resolution = cfg.resolution;
  o.channels = static_cast<int>(channels);
  o.crop = cfg.crop == "random" ? CropMode::kRandom : CropMode::kCenter;
  o.hflip = cfg.hflip;
  o.skip_bad = cfg.skip_bad;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.threads = cfg.decode_threads > 0 ? static_cast<int>(cfg.decode_threads)
                                     : std::max(1, cores / (4 * std::max(1, local_processes)));
  return o;
}

// Image shards (`paths`): scanned, and the first few samples decoded as the loader decodes them.
Dataset open_image_shards(const DataConfig& cfg, const std::vector<std::string>& paths, int threads, bool quiet) {
  auto index = std::make_shared<ShardIndex>(scan_shards(paths, cfg.skip_bad, threads, "data.root", SampleContent::kImage,
                                                        cfg.scan_cache ? default_cache_dir() : ""));
  if (!quiet)
    for (const std::string& note : index->notes) std::cout << "data: skipped the rest of a shard: " << note << "\n";
  ShardOrder first;
  first.shuffle = false;
  // The first image says what data.channels = 0 means.
  int64_t channels = cfg.channels;
  if (channels == 0) {
    ShardStream s(index, first, 0, 0);
    for (int64_t i = 0; i < std::min<int64_t>(index->samples, 64) && channels == 0; ++i) {
      SampleRef ref;
      const ShardSample smp = s.next(&ref);
      for (const auto& f : smp.files) {
        if (!is_decodable(f.first)) continue;
        try {
          channels = image_channels(f.second, f.first, "shard " + index->shards[static_cast<size_t>(ref.shard)] + ", sample '" + smp.key + "'");
        } catch (const Error&) {
          if (!cfg.skip_bad) throw;
        }
        break;
      }
    }
    DDM_CHECK(channels > 0, "data.root: none of the first 64 samples has an image ddm can read; set data.channels");
  }
  Dataset d;
  d.shards = index;
  d.num_classes = index->num_classes;
  if (d.num_classes > index->samples && !quiet)  // a stray label (a .cls of 1000000) would make a model that large
    std::cerr << "note: data.root = " << cfg.root << ": the labels run to " << d.num_classes - 1 << ", so a model gets "
              << d.num_classes << " classes, more than the " << index->samples
              << " samples; if a .cls or .json label is wrong, mend it (labels are 0, 1, ... one per class)" << std::endl;
  // The names `ddm shards write` recorded (its data's sub-folders), else generic ones.
  const std::vector<std::string> recorded = d.num_classes > 0 ? recorded_class_names(paths) : std::vector<std::string>{};
  for (int64_t c = 0; c < d.num_classes; ++c)
    d.class_names.push_back(c < static_cast<int64_t>(recorded.size()) ? recorded[static_cast<size_t>(c)]
                                                                      : "class " + std::to_string(c));
  ShardLoaderOptions o = loader_options(cfg, channels, std::min<int64_t>(index->samples, 8), 1);
  o.crop = CropMode::kCenter, o.hflip = false, o.depth = 1;
  ShardLoader probe(index, first, o);
  const Batch b = probe.next();
  d.images = to_uint8(b.x);  // uint8 [n, C, S, S]
  d.labels = b.y;
  std::ostringstream desc;
  desc << "shards " << cfg.root << ": " << index->samples << " samples in " << index->shards.size() << " shard"
       << (index->shards.size() > 1 ? "s" : "") << ", as " << channels << "x" << cfg.resolution << "x" << cfg.resolution
       << " (" << cfg.crop << " crop), "
       << (d.num_classes > 1 ? std::to_string(d.num_classes) + " classes" : d.num_classes == 1 ? "1 class" : "unlabeled")
       << ", streamed";
  d.description = desc.str();
  return d;
}

// data.source = "latents": the shards of a `ddm encode` directory, checked against its encode.json.
Dataset open_latent_shards(const DataConfig& cfg, int threads, bool quiet) {
  const std::string& dir = cfg.root;
  const auto info = std::make_shared<const LatentShardsInfo>(read_latent_shards_info(dir));
  if (info->holds_images()) {  // images kept with their captions' text encodings: read as image shards are
    DataConfig c = cfg;
    if (c.resolution == 0) c.resolution = info->image_size;  // as encoded
    Dataset d = open_image_shards(c, latent_shard_paths(dir, *info), threads, quiet);
    DDM_CHECK(d.shards->samples == info->samples || d.shards->bad_shards > 0,
              "data.root = " << dir << ": its shards hold " << d.shards->samples << " samples, but " << kLatentShardsInfo
                             << " records " << info->samples << "; the directory changed since `ddm encode` wrote it: "
                             << "encode again");
    d.encoded = info;
    if (static_cast<int64_t>(info->class_names.size()) == d.num_classes) d.class_names = info->class_names;
    d.description = "images and cached text encodings in " + d.description.substr(std::string("shards ").size());
    return d;
  }
  const std::string images = std::to_string(info->image_channels) + "x" + std::to_string(info->image_size) + "x" +
                             std::to_string(info->image_size);
  DDM_CHECK(cfg.resolution == 0 || cfg.resolution == info->image_size,
            "data.resolution = " << cfg.resolution << ", but data.root = " << dir << " holds the latents of " << images
                                 << " images (" << kLatentShardsInfo << "); remove data.resolution, or encode the data "
                                 << "again at that resolution");
  DDM_CHECK(cfg.channels == 0 || cfg.channels == info->image_channels,
            "data.channels = " << cfg.channels << ", but data.root = " << dir << " holds the latents of " << images
                               << " images (" << kLatentShardsInfo << "); remove data.channels");
  DDM_CHECK(cfg.crop == "center", "data.crop = " << cfg.crop << ": latent shards hold the latents of centre-cropped "
                                  << "images, taken as they are; set data.crop = center");
  auto index = std::make_shared<ShardIndex>(
      scan_shards(latent_shard_paths(dir, *info), cfg.skip_bad, threads, "data.root", SampleContent::kPosterior,
                  cfg.scan_cache ? default_cache_dir() : ""));
  if (!quiet)
    for (const std::string& note : index->notes) std::cout << "data: skipped the rest of a shard: " << note << "\n";
  DDM_CHECK(index->samples == info->samples || index->bad_shards > 0,
            "data.root = " << dir << ": its shards hold " << index->samples << " samples, but " << kLatentShardsInfo
                           << " records " << info->samples << "; the directory changed since `ddm encode` wrote it: "
                           << "encode again");
  DDM_CHECK(index->num_classes <= info->num_classes && (index->num_classes > 0) == (info->num_classes > 0),
            "data.root = " << dir << ": its shards' labels give " << index->num_classes << " classes, but "
                           << kLatentShardsInfo << " records " << info->num_classes << "; encode again");
  Dataset d;
  d.shards = index;
  d.latents = info;
  d.encoded = info;
  d.num_classes = info->num_classes;
  d.class_names = info->class_names;  // the source's, as encode.json records them
  if (d.class_names.empty())          // a record written before it kept them
    for (int64_t c = 0; c < d.num_classes; ++c) d.class_names.push_back("class " + std::to_string(c));
  ShardOrder first;
  first.shuffle = false;
  ShardLoaderOptions o = shard_loader_options(cfg, d, std::min<int64_t>(index->samples, 8), 1);
  o.depth = 1;
  ShardLoader probe(index, first, o);
  const Batch b = probe.next();
  d.images = b.x;  // float [n, 2z, h, w]
  d.labels = b.y;
  std::ostringstream desc;
  desc << "latent shards " << dir << ": " << index->samples << " posteriors " << info->latent_channels << "x"
       << info->latent_size << "x" << info->latent_size << " in " << index->shards.size() << " shard"
       << (index->shards.size() > 1 ? "s" : "") << ", "
       << (d.num_classes > 0 ? std::to_string(d.num_classes) + " classes" : "unlabeled") << ", streamed (encoded from "
       << info->data << ")";
  d.description = desc.str();
  return d;
}

}  // namespace

ShardLoaderOptions shard_loader_options(const DataConfig& cfg, const Dataset& opened, int64_t batch,
                                        int local_processes) {
  ShardLoaderOptions o = loader_options(cfg, opened.latents ? 0 : opened.images.size(1), batch, local_processes);
  if (opened.latents) {  // posteriors, taken as they are
    o.posteriors = opened.latents;
    o.crop = CropMode::kCenter;
  } else if (opened.encoded) {  // images with their captions' text encodings
    o.text_encodings = opened.encoded;
    if (o.resolution == 0) o.resolution = opened.encoded->image_size;  // as encoded
  }
  return o;
}

Dataset open_shards(const DataConfig& cfg, int threads, bool quiet) {
  if (cfg.source == "latents") return open_latent_shards(cfg, threads, quiet);
  return open_image_shards(cfg, expand_shards(cfg.root, "data.root"), threads, quiet);
}

void for_each_in_order(const Dataset& opened, const DataConfig& cfg, int64_t n, int threads,
                       const std::function<void(const torch::Tensor&, const torch::Tensor&, int64_t)>& f,
                       std::shared_ptr<const std::vector<bool>> keep, std::vector<std::string>* captions) {
  constexpr int64_t kBatch = 256;
  ShardOrder order;
  order.shuffle = false;
  order.keep = std::move(keep);
  ShardLoaderOptions o = shard_loader_options(cfg, opened, kBatch, 1);
  o.crop = CropMode::kCenter, o.hflip = false, o.threads = std::max(1, threads);
  ShardLoader loader(opened.shards, order, o);
  for (int64_t first = 0; first < n; first += kBatch) {
    const Batch b = loader.next();
    const int64_t rows = std::min(kBatch, n - first);  // the last batch runs on into the next epoch
    if (captions && !b.captions.empty()) captions->insert(captions->end(), b.captions.begin(), b.captions.begin() + rows);
    f(b.x.narrow(0, 0, rows), b.y.narrow(0, 0, rows), first);
  }
}

std::vector<std::string> first_captions(const Dataset& d, int64_t want) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  const auto take = [&](const std::string& c) {
    if (!c.empty() && seen.insert(c).second) out.push_back(c);
    return static_cast<int64_t>(out.size()) >= want;
  };
  for (const std::string& c : d.captions)
    if (take(c)) return out;
  if (!d.captions.empty() || !d.shards || d.shards->samples == 0) return out;
  ShardOrder order;
  order.shuffle = false;
  ShardStream s(d.shards, order, 0, 0);
  for (int64_t i = 0; i < std::min<int64_t>(d.shards->samples, 256); ++i) {
    SampleRef ref;
    const ShardSample smp = s.next(&ref);
    std::optional<std::string> c;
    try {  // a bad caption is training's to refuse or skip (data.skip_bad), not the grid's
      c = sample_caption(smp, "shard " + d.shards->shards[static_cast<size_t>(ref.shard)] + ", sample '" + smp.key + "'");
    } catch (const Error&) {
    }
    if (c && take(*c)) break;
  }
  return out;
}

void require_images(const Dataset& opened) {
  DDM_CHECK(!opened.latents, "this command needs images, but " << opened.description << " are latents (`ddm "
                             "encode`); give it the data they were encoded from");
}

Dataset shard_prefix(const DataConfig& cfg, int64_t n, int threads) {
  Dataset d = open_shards(cfg, threads, /*quiet=*/true);
  require_images(d);
  n = std::min(n, d.shards->samples);
  std::vector<torch::Tensor> images, labels;
  for_each_in_order(d, cfg, n, threads, [&](const torch::Tensor& x, const torch::Tensor& y, int64_t) {
    images.push_back(to_uint8(x));
    labels.push_back(y);
  });
  d.images = torch::cat(images);  // uint8 [n, C, S, S]
  d.labels = torch::cat(labels);
  d.description = "the first " + std::to_string(n) + " samples of " + d.description;
  return d;
}

Dataset load_whole_dataset(const DataConfig& cfg, int threads) {
  if (cfg.source == "shards") return shard_prefix(cfg, std::numeric_limits<int64_t>::max(), threads);
  return load_dataset(cfg);
}

}  // namespace ddm
