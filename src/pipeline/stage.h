// One stage of a pipeline as a process runs it (docs/pipeline.md): a contiguous run of the
// backbone's units and their trainable parameters, and for each micro-batch of a step
//   forward   stage 0 starts from x_t; a later stage receives the carry (h, the conditioning
//             embedding, the open skips) from the previous stage and the skips routed straight to
//             it; the units run; the last stage hands its output to the caller (the loss is the
//             objective's), the others send their carry on and post the receives of its gradient
//   backward  B: back-propagates from the loss or from the received gradients of what it sent, and
//             sends its inputs' gradients back the way they came; ZB's split: I does only the input
//             gradients (kept by pipeline/split_backward.h), W the weight gradients later
// plus self-conditioning's first pass messages (no gradients, tags of their own). The carries'
// receives are posted a window of micro-batches ahead once their layout is known (the first carry
// this stage received). Every message travels on PipeWire (pipeline/wire.h); PipeStep (runtime.h)
// runs one or two stages in the order of its action list.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "model/net.h"
#include "pipeline/prepare.h"
#include "pipeline/routes.h"
#include "pipeline/schedule.h"
#include "pipeline/split_backward.h"
#include "pipeline/wire.h"

namespace ddm {

class PipeStage {
 public:
  // stage of `stages`; units: its run of the backbone's units, params: their trainable parameters;
  // routes: where the skips go (every stage's `in` filled); rows: a micro-batch's rows.
  PipeStage(int stage, int stages, std::vector<NetUnit> units, std::vector<torch::Tensor> params, PipeWire& wire,
            const PipeSkipRoutes& routes, int64_t rows);

  int stage() const { return stage_; }
  bool last() const { return stage_ + 1 == stages_; }
  const std::vector<NetUnit>& units() const { return units_; }
  const std::vector<torch::Tensor>& params() const { return params_; }

  // A step of `micro_count` micro-batches: the last step's activations go, and the carries' receives
  // are posted `window` micro-batches ahead (every schedule's forwards run in micro-batch order), one
  // more as each is taken, from another process's previous stage whose layout is known.
  void begin_step(int micro_count, int window);
  // Micro-batch `micro`'s forward with p's x_t (stage 0), t and conditioning. The last stage returns
  // its output h for the caller's loss (then give it to set_loss); the others an undefined tensor.
  torch::Tensor forward(int micro, const Prepared& p);
  // The last stage's backward root of `micro`: its loss, scaled for the step.
  void set_loss(int micro, torch::Tensor loss);
  // B, I or W of `micro` (after its forward; I before W).
  void backward(int micro, PipeOp op);

  // Self-conditioning's first pass: the carry of its rows to the next stage, from the previous one
  // (all b' rows, no gradients), and the last stage's output [b', C, H, W] back to stage 0.
  void send_first_pass(const NetCarry& k, int micro);
  NetCarry receive_first_pass(int micro);
  void send_first_out(const torch::Tensor& out, int micro);

  // What this stage sent other processes, for the fill plan's measurements: the last carry, per
  // stage the skips sent straight there, this step's first passes in all.
  int64_t carry_bytes() const { return carry_bytes_; }
  const std::vector<int64_t>& direct_bytes() const { return direct_bytes_; }
  int64_t first_bytes() const { return first_bytes_; }

 private:
  using Recv = PipeWire::Recv;
  struct DirectRoot {
    torch::Tensor tensor;  // a skip sent straight to the stage that reads it
    int to = 0, slot = 0;
  };
  struct Micro {
    std::vector<torch::Tensor> inputs;         // the received carry's tensors (stage > 0), leaves with gradients
    std::vector<torch::Tensor> direct_inputs;  // skips received straight from earlier stages (routes.in order)
    std::vector<torch::Tensor> roots;          // what backward starts from: the scaled loss, or the sent carry
    std::vector<DirectRoot> direct_roots;      // ... and the skips sent straight to their readers
    std::vector<torch::Tensor> grads;          // their gradients (the carry's, then the direct ones'; none for the loss)
    bool received = false;                     // grads received (I then W)
    SplitBackward split;                       // I's leftovers for W
    // The receives of those gradients, posted as soon as the forward has sent (the flat carry's,
    // then each direct root's), so they arrive while this stage works on other micro-batches.
    std::vector<Recv> grad_recvs;
  };
  // A micro-batch's carry receives (header, values, then each direct skip), posted ahead.
  struct PostedCarry {
    Recv header, values;
    std::vector<Recv> direct;
  };
  void post_next_carry();
  std::optional<PostedCarry>* posted_for(int micro);  // null: not posted (or already taken)
  std::vector<int64_t> direct_shape(const PipeSkipRoutes::Direct& d) const;  // [rows, row_shape...]
  // The carry of `micro` to the next stage and from the previous one (first_pass: under its own tags,
  // without gradients). With m, the sent tensors become m's backward roots.
  void send_carry(const NetCarry& k, int micro, bool first_pass, Micro* m);
  NetCarry recv_carry(int micro, std::vector<torch::Tensor>& inputs, bool first_pass);

  int stage_ = 0, stages_ = 0;
  std::vector<NetUnit> units_;
  std::vector<torch::Tensor> params_;
  PipeWire& wire_;
  const PipeSkipRoutes& routes_;
  int64_t rows_ = 0;
  std::vector<Micro> micro_;                        // per micro-batch of this step
  torch::Tensor carry_header_;                      // the carry's header as first received (empty: none yet)
  std::vector<std::optional<PostedCarry>> posted_;  // per micro-batch of this step
  std::vector<std::vector<int64_t>> carry_shapes_;  // the carry's tensors' shapes (empty: unknown)
  int next_post_ = 0;                               // the next micro-batch whose carry to post
  std::vector<bool> taken_;                         // per micro-batch: its carry was received
  int64_t carry_bytes_ = 0;
  std::vector<int64_t> direct_bytes_;
  int64_t first_bytes_ = 0;
};

}  // namespace ddm
