// Activation checkpointing (train.checkpoint_activations): a network's forward run unit by unit
// (NetImpl::units: a ResBlock and its attention, a transformer block, ...) where each unit keeps
// only its inputs for backward and runs again, with gradients, when backward reaches it. Memory for
// activations falls from every intermediate of the network to what flows between units (the running
// activation, the conditioning, a U-Net's open skips) plus one unit's intermediates during its
// backward; the price is a second forward of every unit (about a third more compute).
//
// Each unit is one autograd node whose inputs are the carry it reads and its trainable parameters.
// Its backward recomputes the unit and takes the gradients of its inputs and parameters with
// torch::autograd::grad, so a parameter's gradient reaches its accumulator in the outer backward, in
// the same order as without checkpointing: data parallelism's gradient hooks (comm/grad_sync.h) see
// one ordinary backward. The recomputation runs under the autocast the forward ran under. Units draw
// no random numbers (ddm's networks have no dropout; diffusers' is kept as an identity), so the
// recomputed forward is the first one bit for bit.
//
// The output is the plain forward's bit for bit; gradients agree within float32 rounding: a tensor
// read by several ops (a U-Net skip, the time embedding) sums its gradient's parts per unit first,
// then over the units, another association than the plain backward's.
#pragma once
#include "model/net.h"

namespace ddm {

// forward(x, t, c) of `net`, computed unit by unit with each unit's activations recomputed in
// backward. Under no-grad (sampling, self-conditioning's first pass) it is net.forward. Throws
// ddm::Error when the network cannot be split into units (routers, autoencoders) or when c holds a
// tensor that needs a gradient (gradients do not flow into the conditioning through a unit).
// x: [B, C, H, W]; t: [B]; returns [B, C, H, W].
torch::Tensor forward_recomputed(NetImpl& net, const torch::Tensor& x, const torch::Tensor& t, const Cond& c);

// A network whose forward is forward_recomputed(inner, ...): what the training step's objective
// runs when train.checkpoint_activations is on. It owns no parameters of its own (the optimizer,
// the checkpoints and the gradient sync keep working on `inner`); precompute and self_conditioned
// are inner's.
class RecomputedNetImpl : public NetImpl {
 public:
  explicit RecomputedNetImpl(std::shared_ptr<NetImpl> inner);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  Cond precompute(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override {
    return inner_->precompute(x, t, c);
  }
  bool self_conditioned() const override { return inner_->self_conditioned(); }
  std::vector<NetUnit> units() override { return inner_->units(); }

 private:
  std::shared_ptr<NetImpl> inner_;
};

}  // namespace ddm
