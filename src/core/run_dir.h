// The names of the files in a run directory and a checkpoint directory, spelled in one place:
//   RUN/config.toml  metrics.jsonl  train.lock  samples.png  train.log
//       tensorboard/events.out.tfevents.*  grids/step-XXXXXXXX.png                (train.sample_every)
//       expert.json | router.json + router_eval.json | distill.json   (records of decentralized runs)
//       autoencoder.json + reconstructions.png                        (`ddm train-autoencoder`)
//       pipeline-timeline.json                                        (a pipelined `ddm train`)
//       ckpt/step-XXXXXXXX/{model,ema,optim}.safetensors + state.json
#pragma once
#include <string>
#include <vector>

namespace ddm {

struct RunDir {
  static constexpr const char* kConfig = "config.toml";
  static constexpr const char* kMetrics = "metrics.jsonl";
  static constexpr const char* kLock = "train.lock";
  static constexpr const char* kSamples = "samples.png";
  static constexpr const char* kTrainLog = "train.log";  // islands: a process's output
  static constexpr const char* kCheckpoints = "ckpt";
  static constexpr const char* kExpert = "expert.json";
  static constexpr const char* kRouter = "router.json";
  static constexpr const char* kRouterEval = "router_eval.json";
  static constexpr const char* kDistill = "distill.json";
  static constexpr const char* kAutoencoder = "autoencoder.json";
  static constexpr const char* kReconstructions = "reconstructions.png";
  static constexpr const char* kPipeTimeline = "pipeline-timeline.json";  // a pipelined run's measured last step
  static constexpr const char* kTensorBoard = "tensorboard";  // event files: the metrics, the grids
  static constexpr const char* kGrids = "grids";              // step-XXXXXXXX.png every train.sample_every
  static constexpr const char* kEval = "eval";                // `ddm eval --ckpt RUN`'s reports and samples
  // Inside a checkpoint directory.
  static constexpr const char* kModel = "model.safetensors";
  static constexpr const char* kEma = "ema.safetensors";
  static constexpr const char* kOptim = "optim.safetensors";
  static constexpr const char* kState = "state.json";

  explicit RunDir(std::string dir) : root(std::move(dir)) {}
  std::string root;
  std::string operator/(const char* name) const { return root + "/" + name; }
  std::string config() const { return *this / kConfig; }
  std::string metrics() const { return *this / kMetrics; }
  std::string lock() const { return *this / kLock; }
  std::string checkpoints() const { return *this / kCheckpoints; }

  // Everything a run writes into its directory (removed by --force, or when a run that saved no
  // checkpoint is started afresh); the lock is not among them.
  static std::vector<const char*> run_files() {
    return {kCheckpoints, kMetrics, kConfig, kSamples, kTrainLog, kExpert, kRouter, kRouterEval, kDistill,
            kAutoencoder, kReconstructions, kPipeTimeline, kTensorBoard, kGrids, kEval};
  }
};

}  // namespace ddm
