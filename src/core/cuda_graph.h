// CUDA graphs (train.cuda_graphs, `ddm sample --cuda-graphs`): what capturing and replaying a piece of
// ddm's work needs around LibTorch's at::cuda::CUDAGraph. The work runs on a stream of its own
// (capture is refused on the default stream), after what the caller queued on its stream and before
// what it queues next. A capture that fails (an op that reads back to the host or synchronizes) is
// ended cleanly and its reason returned, so that the caller goes on eagerly. Autocast's cache of
// low-precision weights is off while capturing: its copies would be stale on replay.
// Users: train/step_graph.cpp (a training step), model/graphed_net.cpp (a network's forward), and
// decentral/ensemble.cpp (experts side by side, each on a stream of its own).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

namespace ddm {

// A stream of the device's own, for graphs' capture and replay.
class GraphStream {
 public:
  explicit GraphStream(torch::Device device);  // a CUDA device
  ~GraphStream();
  GraphStream(const GraphStream&) = delete;
  GraphStream& operator=(const GraphStream&) = delete;
  // Runs f with this stream current: after the caller's stream's queued work; the caller's stream
  // then waits for f's.
  void run(const std::function<void()>& f);
  // run() in two halves, so that work on several such streams overlaps on the GPU: fork(f) runs f as
  // run() does, but the caller's stream does not wait; join(read) makes the current stream wait for
  // f's work, and keeps the tensors in `read` (made by f on this stream, read next on the current
  // one) from the caching allocator until that stream is done with them. One fork, then its join.
  void fork(const std::function<void()>& f);
  void join(const std::vector<torch::Tensor>& read);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One captured graph.
class CapturedGraph {
 public:
  CapturedGraph();
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  // Captures f's work on the current stream (inside GraphStream::run; nothing runs). Returns "" or,
  // when the capture failed, why (the first line of the error); the graph is then empty. Out of GPU
  // memory is thrown (c10::OutOfMemoryError) instead: the same capture may succeed with memory to spare.
  // share_pool_of: a captured graph whose memory pool this one allocates from, so that a set of
  // graphs holds the memory of its largest capture rather than the sum of all. Safe where the
  // graphs replay one at a time on one stream and what each leaves in the pool (its output) is read
  // right after its own replay, before another replays (GraphedNetImpl copies it out).
  std::string capture(const std::function<void()>& f, const CapturedGraph* share_pool_of = nullptr);
  bool captured() const;
  void replay();
  void reset();  // drops the graph and its memory

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What must match for inputs to be copied into a graph's: each slot's presence, type, shape and device.
std::string slots_signature(const std::vector<const torch::Tensor*>& slots);

}  // namespace ddm
