// A backward pass split in two, as zero-bubble schedules need (ZB-H1, ZB-V; docs/pipeline.md):
//   I  the gradients of a stage's inputs, now (the next stage back waits for them), computing no
//      parameter's gradient;
//   W  later, the parameters' gradients, from what I left behind, without walking the input-gradient
//      chain a second time.
// Autograd has no such split, so it is done here, on LibTorch's graph (written by hand: nothing
// packaged does it). Before I runs, the graph is walked from the roots: a node is an I node when an
// input can be reached from it. Autograd, asked for the inputs' gradients, runs exactly the I nodes
// and skips every edge to a node off that set (the derivative formulas check it, so a matmul's
// weight gradient is not computed). The I nodes with an edge leaving the set toward a parameter
// are the frontier: a hook on each keeps the gradient it receives during I. After I, each frontier
// node's edges into the input's chain are cut (that chain has run; the graph serves W only), and W
// runs from each frontier node alone with its kept gradient: only its parameters' side, a walk no
// larger than that side. Roots that reach no input start W directly, together. A parameter read in
// two places gets both contributions, each from its own frontier node (backward is linear in the
// incoming gradient, and the graph is kept until W ends).
//
// Should a frontier node's hook not have fired during I (autograd skipped it), W is the plain way
// instead: a second pass from the roots to the parameters (correct, slower); `split()` says which.
#pragma once
#include <memory>
#include <vector>

#include "core/torch_pch.h"

namespace ddm {

class SplitBackward {
 public:
  SplitBackward() = default;
  // I: the gradients of `inputs` (leaves; undefined where none reaches one) given `grads` for
  // `roots` (empty: ones for a single scalar root), keeping what W needs. `params`: the trainable
  // parameters whose gradients W accumulates.
  std::vector<torch::Tensor> input_grads(const std::vector<torch::Tensor>& roots, const std::vector<torch::Tensor>& grads,
                                         const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& params);
  // W: accumulates the parameters' gradients into their .grad, then frees the graph. Once.
  void weight_grads();
  // Whether W is the split one (false: the plain second pass; see above).
  bool split() const { return split_; }

 private:
  struct Part;  // one run of the engine in W: roots, their gradients, the parameters it reaches
  std::vector<std::shared_ptr<Part>> parts_;
  std::vector<torch::Tensor> roots_, grads_, params_;  // for the plain W
  bool split_ = false, pending_ = false;
};

}  // namespace ddm
