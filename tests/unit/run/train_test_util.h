// Helpers for the tests that train through the real trainer with ranks as threads of this process
// sharing a c10d HashStore (Gloo over loopback): a tiny config, synthetic data, and readers of what
// a run wrote.
#pragma once
#include <algorithm>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/comm.h"
#include "core/config.h"
#include "run/trainer.h"
#include "train/checkpoint.h"
#include "train/text.h"

namespace ddm::test {

inline RunConfig tiny(const std::string& arch) {
  RunConfig cfg;
  cfg.model.arch = arch;
  cfg.model.channels = 8;
  cfg.model.channel_mult = {1, 2};
  cfg.model.groups = 4;
  cfg.model.width = 32;
  cfg.model.depth = 2;
  cfg.model.heads = 2;
  cfg.model.patch = 2;
  cfg.train.steps = 20;
  cfg.train.batch_size = 16;
  cfg.train.warmup = 2;
  cfg.train.threads = 1;
  cfg.train.log_every = 1;
  cfg.train.ckpt_every = 10;
  cfg.train.seed = 4;
  cfg.data.hflip = true;
  // The CPU whatever the machine (train.device defaults to auto): these runs are the reference the
  // GPU tests compare against, and ranks as threads sharing one GPU would wait on each other in a
  // backward's gradient sync (tests/gpu/test_cuda.cpp says why).
  cfg.train.device = "cpu";
  return cfg;
}

// 96 random 8x8 grayscale images in 3 classes (the trainer's data path without the disk).
inline Dataset synthetic_data() {
  torch::manual_seed(1);
  Dataset d;
  d.images = torch::randint(0, 256, {96, 1, 8, 8}).to(torch::kUInt8);
  d.labels = torch::randint(0, 3, {96});
  d.num_classes = 3;
  d.class_names = {"a", "b", "c"};
  d.description = "synthetic 96 x 1x8x8";
  return d;
}

// The same images captioned by their class ("a picture of a"), for text models (model.text_encoder).
inline Dataset synthetic_captioned_data() {
  Dataset d = synthetic_data();
  for (int64_t i = 0; i < d.labels.size(0); ++i)
    d.captions.push_back("a picture of " + d.class_names[static_cast<size_t>(d.labels[i].item<int64_t>())]);
  d.description += ", captioned";
  return d;
}

inline TrainJob job_for(RunConfig cfg) {
  static const Dataset data = synthetic_data();  // made once: ranks are threads, the generator is global
  static const Dataset captioned = synthetic_captioned_data();
  TrainJob job;
  job.data = cfg.model.text_encoder.empty() ? data : captioned;
  resolve_data_shape(cfg, job.data);
  if (!cfg.model.text_encoder.empty()) resolve_text(cfg.model, job.data);  // its sizes and sha256
  job.cfg = cfg;
  job.recorded = cfg;
  return job;
}

// Trains `world` ranks as threads; returns each rank's error message ("" if none), and fills
// `summaries` (one per rank) when given.
inline std::vector<std::string> train_ranks(int world, const std::vector<RunConfig>& cfgs, const std::string& out,
                                            bool resume = false, std::vector<TrainSummary>* summaries = nullptr) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  if (summaries) summaries->assign(static_cast<size_t>(world), TrainSummary{});
  std::vector<std::string> errors(world);
  job_for(cfgs[0]);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o;
        o.timeout = std::chrono::milliseconds(30000);
        TrainOptions opt{out, resume, false, true, Comm::create_for_test(store, r, world, o)};
        // Every rank is connected before any trains: a rank that fails its first check at once must
        // not close its connections while another is still joining the group.
        opt.comm->barrier();
        const TrainSummary sum = train(job_for(cfgs[static_cast<size_t>(r)]), opt);
        if (summaries) (*summaries)[static_cast<size_t>(r)] = sum;
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline std::vector<double> losses(const std::string& run) {
  std::vector<double> out;
  std::ifstream in(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

inline TensorMap final_weights(const std::string& run) { return read_checkpoint(*latest_checkpoint(run), true).model; }

inline double max_weight_difference(const TensorMap& a, const TensorMap& b) {
  double m = 0;
  for (const auto& [name, t] : a) m = std::max(m, (t - b.at(name)).abs().max().item<double>());
  return m;
}

}  // namespace ddm::test
