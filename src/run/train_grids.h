// Grids of samples while a model trains (train.sample_every): every N steps rank 0 samples the same
// noise (train.seed) with the rows of a fixed grid (its classes, its prompts, or none; for a
// ControlNet or a model.embed model, the first images of its data, each row led by the control map
// or reference image its samples are conditioned on) from the
// weights training has reached (the EMA by default, sample.use_ema), and writes RUN/grids/
// step-XXXXXXXX.png; the run's TensorBoard files get the same picture. The network is the one being
// trained: its weights are swapped for the EMA's and back, bit for bit, so training goes on as if
// nothing had happened (every draw of a step is keyed, none comes from a generator the grid uses).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "data/dataset.h"
#include "diffusion/denoiser.h"
#include "model/net.h"
#include "train/checkpoint.h"
#include "train/latent.h"

namespace ddm {

class TrainingGrids {
 public:
  // cfg: the run's resolved config; net: the network being trained (whole, in this process); latent:
  // its frozen autoencoder (null for a pixel model); captions: the data's (a text model's default
  // prompts; its first images, a ControlNet's control maps or a model.embed model's references).
  // Loads and uses a text model's encoder or an embed model's network once, then lets it go.
  TrainingGrids(const RunConfig& cfg, Net net, std::shared_ptr<const LatentSpace> latent, const Dataset& data,
                torch::Device device, std::string dir);
  // One line for the run's header: what each grid holds and where it goes.
  std::string describe() const;
  bool due(int64_t step, int64_t last) const { return due(every_, step, last); }
  // Whether a grid is due after `step` (of `last`) every `every` steps (0: never), on any rank.
  static bool due(int64_t every, int64_t step, int64_t last) { return every > 0 && (step % every == 0 || step == last); }

  struct Written {
    std::string path;  // RUN/grids/step-XXXXXXXX.png
    std::string png;   // its bytes
  };
  // Samples with the weights after `step`: `ema` (named trainable tensors, as FlatAdamW::named_ema)
  // swapped in unless sample.use_ema is off or it is empty.
  Written write(int64_t step, const TensorMap& ema);

 private:
  RunConfig cfg_;
  Net net_;
  std::shared_ptr<const LatentSpace> latent_;
  std::vector<std::string> class_names_;
  torch::Device device_;
  std::string dir_;
  int64_t every_ = 0;
  std::unique_ptr<Denoiser> den_;
  Cond text_;                      // each sample's prompt encoding; undefined context: none
  torch::Tensor control_, embed_;  // each sample's control map [n, Cc, H, W] / embedding [n, D]; or undefined
  torch::Tensor labels_;           // each sample's label [n] (rows of data images); undefined: by row
  torch::Tensor leads_;            // a column before the samples: each row's map or reference, [rows, C, H, W]
  std::vector<std::string> rows_;  // row labels
  int64_t cols_ = 10;
};

}  // namespace ddm
