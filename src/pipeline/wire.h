// What the stages of one pipeline send each other, and how (docs/pipeline.md): point-to-point
// messages on the pipeline's process group, tagged per (cut, micro-batch, kind); a mailbox for
// messages between two stages of one process (V-shaped placement), handed over as they are; float
// tensors narrowed to bfloat16 across processes with parallel.pipe_wire = bfloat16; and the carry's
// format on the wire: a fixed-size int64 header (which of h / emb are present, then each tensor's
// rank and sizes, -1 for a skip slot not carried) and every carried tensor's values in one flat
// float32 message. Sends are posted without waiting and waited for together (wait_sends), since
// Gloo's send completes only once the peer has posted its receive.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "comm/comm.h"
#include "model/net.h"
#include "pipeline/schedule.h"

namespace ddm {

// The kinds of message of one micro-batch: the carry (header, values) and its gradient;
// self-conditioning's first pass (its carry, and the last stage's output back to stage 0); each
// direct skip slot i's value (kSkip + 2i) and gradient (kSkipGrad + 2i).
enum PipeTag : int {
  kCarryHeader = 0, kCarryValues = 1, kGradient = 2, kFirstHeader = 3, kFirstValues = 4, kFirstOut = 5,
  kSkip = 6, kSkipGrad = 7
};

// The carry header's size in int64 entries.
constexpr int64_t kCarryHeaderSize = 128;

// A carry's header and the tensors it carries, in order: h and emb (when defined), then each skip
// slot whose `carried` entry is true (a slot an earlier stage holds, a placeholder, or one sent
// straight to its reader is listed as -1). Errors if the tensors do not fit the header or are not float.
torch::Tensor carry_header(const NetCarry& k, const std::vector<bool>& carried, std::vector<torch::Tensor>& tensors);
// The shapes of the tensors a header lists, and per entry whether it carries one.
std::vector<std::vector<int64_t>> header_shapes(const torch::Tensor& header, std::vector<bool>* present = nullptr);
// The carry a header describes, from its tensors (in header order): placeholders where it lists -1.
NetCarry carry_from(const torch::Tensor& header, const std::vector<torch::Tensor>& tensors);

// The tensors as one flat float message, and back: views of `flat` shaped like `shapes`, in order.
torch::Tensor flat_of(const std::vector<torch::Tensor>& ts);
std::vector<torch::Tensor> split_flat(const torch::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes);
int64_t numel_of(const std::vector<int64_t>& shape);
int64_t numel_of(const std::vector<std::vector<int64_t>>& shapes);

class PipeWire {
 public:
  // comm: the pipeline's group; schedule: which rank runs each stage, the micro-batch count;
  // skip_slots: the direct skip slots (PipeSkipRoutes::slots); bf16: parallel.pipe_wire = bfloat16;
  // device: where this process's stages compute.
  //
  // On a GPU a message goes through host memory over Gloo, not over NCCL. NCCL matches a pair's
  // point-to-point operations by their order on one stream, not by tag, and a pipeline's two
  // neighbours do not post them in the same order: under 1F1B stage s sends micro-batch w's carry
  // before it receives micro-batch 0's gradient, while stage s + 1 sends that gradient before it
  // receives that carry. Two streams each blocked on the other's later operation is a deadlock. Gloo
  // matches by tag, whatever the order.
  PipeWire(std::shared_ptr<Comm> comm, const PipeSchedule& schedule, int skip_slots, bool bf16,
           torch::Device device = torch::kCPU);

  int rank() const { return rank_; }
  bool here(int stage) const { return rank_of(stage) == rank_; }
  int rank_of(int stage) const { return placement_.rank_of(stage); }
  // The tag of a message of micro-batch `micro` at cut `cut` (between stages cut and cut + 1; a direct
  // skip's: the stage that made it), and of part `part` of prepared piece `piece` (after every
  // micro-batch's tags).
  int tag(int cut, int micro, int kind) const { return (cut * micro_ + micro) * tags_ + kind; }
  int piece_tag(size_t piece, int part) const { return tags_ * micro_ * stages_ + 2 * static_cast<int>(piece) + part; }

  // A receive: posted on the group, or (from a stage of this process) taken from the mailbox.
  struct Recv {
    c10::intrusive_ptr<c10d::Work> work;
    torch::Tensor tensor;
    torch::Tensor wire;  // what the group receives into: `tensor`, or its bfloat16
    int from = 0, tag = 0;
    bool local = false;
  };
  // Posts the receive of `t`'s shape and type from `from_stage`; wait() completes it and returns the
  // tensor (widened back to float32 when it travelled as bfloat16; on t's device when it travelled
  // through host memory). `what` names it in errors.
  Recv post_recv(torch::Tensor t, int from_stage, int tag);
  torch::Tensor wait(Recv& r, const std::string& what);
  // Sends t to the stage (posted; narrowed across processes), or leaves it in the mailbox for a stage here.
  void send(torch::Tensor t, int to_stage, int tag);
  // Posts t as it is to another rank of the group (a GPU tensor: a host copy of it).
  void send_to_rank(torch::Tensor t, int rank, int tag);
  // Float32 on this process's device: the receive buffers of carries and gradients.
  torch::TensorOptions floats() const { return torch::TensorOptions().dtype(torch::kFloat).device(device_); }
  torch::Device device() const { return device_; }
  // The bytes t takes on the wire to another process.
  int64_t bytes(const torch::Tensor& t) const;

  // When the last wait() returned: an action's work starts once its input has arrived (for
  // timelines). note_arrival sets it (an action's start, a receive outside the wire).
  std::chrono::steady_clock::time_point arrived() const { return arrived_; }
  void note_arrival(std::chrono::steady_clock::time_point t) { arrived_ = t; }

  // A new step: the mailbox starts empty.
  void begin_step() { mailbox_.clear(); }
  // Waits for every posted send.
  void wait_sends();

 private:
  bool narrowed(const torch::Tensor& t) const { return bf16_ && t.scalar_type() == torch::kFloat; }
  std::shared_ptr<Comm> comm_;
  PipeSchedule placement_;  // (only its placement and sizes are used)
  int rank_ = 0, stages_ = 0, micro_ = 0, tags_ = 0;
  bool bf16_ = false;
  torch::Device device_;
  std::map<int, torch::Tensor> mailbox_;  // by tag: what one stage here sent another stage here
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, torch::Tensor>> sends_;
  std::chrono::steady_clock::time_point arrived_;
};

}  // namespace ddm
