// The pipeline's messages and the carry's format on the wire (see wire.h).
#include "pipeline/wire.h"

#include "core/error.h"

namespace ddm {

torch::Tensor flat_of(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> flat;
  for (const torch::Tensor& t : ts) flat.push_back(t.detach().reshape({-1}));
  return torch::cat(flat).contiguous();  // float [sum of numel]
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t numel_of(const std::vector<std::vector<int64_t>>& shapes) {
  int64_t n = 0;
  for (const auto& s : shapes) n += numel_of(s);
  return n;
}

std::vector<torch::Tensor> split_flat(const torch::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<torch::Tensor> out;
  int64_t at = 0;
  for (const auto& s : shapes) {
    out.push_back(flat.narrow(0, at, numel_of(s)).view(s));
    at += numel_of(s);
  }
  return out;
}

torch::Tensor carry_header(const NetCarry& k, const std::vector<bool>& carried, std::vector<torch::Tensor>& tensors) {
  DDM_CHECK(carried.size() == k.skips.size(),
            "pipeline: a carry of " << k.skips.size() << " skips, " << carried.size() << " of them routed");
  tensors.clear();
  auto header = torch::zeros({kCarryHeaderSize}, torch::kLong);
  auto* h = header.data_ptr<int64_t>();
  h[0] = (k.h.defined() ? 1 : 0) | (k.emb.defined() ? 2 : 0);
  int64_t at = 2, entries = 0;
  auto put = [&](const torch::Tensor& t) {
    DDM_CHECK(at + 1 + (t.defined() ? t.dim() : 0) <= kCarryHeaderSize,
              "pipeline: the carry has too many tensors for its header");
    ++entries;
    if (!t.defined()) {
      h[at++] = -1;
      return;
    }
    DDM_CHECK(t.scalar_type() == torch::kFloat, "pipeline: a carried tensor is " << t.scalar_type() << ", not float");
    h[at++] = t.dim();
    for (int64_t d : t.sizes()) h[at++] = d;
    tensors.push_back(t);
  };
  for (const torch::Tensor& t : {k.h, k.emb})
    if (t.defined()) put(t);
  for (size_t i = 0; i < k.skips.size(); ++i) put(carried[i] ? k.skips[i] : torch::Tensor());
  h[1] = entries;
  return header;
}

std::vector<std::vector<int64_t>> header_shapes(const torch::Tensor& header, std::vector<bool>* present) {
  const auto* h = header.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t i = 0, at = 2; i < h[1]; ++i) {
    if (present) present->push_back(h[at] >= 0);
    if (h[at] >= 0) shapes.emplace_back(h + at + 1, h + at + 1 + h[at]);
    at += h[at] >= 0 ? 1 + h[at] : 1;
  }
  return shapes;
}

NetCarry carry_from(const torch::Tensor& header, const std::vector<torch::Tensor>& tensors) {
  const auto* h = header.data_ptr<int64_t>();
  std::vector<bool> present;
  header_shapes(header, &present);
  NetCarry k;
  size_t e = 0, i = 0;
  if (h[0] & 1) ++e, k.h = tensors.at(i++);
  if (h[0] & 2) ++e, k.emb = tensors.at(i++);
  for (; e < present.size(); ++e) k.skips.push_back(present[e] ? tensors.at(i++) : torch::Tensor());
  return k;
}

PipeWire::PipeWire(std::shared_ptr<Comm> comm, const PipeSchedule& schedule, int skip_slots, bool bf16,
                   torch::Device device)
    : comm_(std::move(comm)),
      placement_(schedule),
      rank_(comm_->rank()),
      stages_(schedule.stages),
      micro_(schedule.micro),
      tags_(kSkip + 2 * skip_slots),
      bf16_(bf16),
      device_(device) {}

namespace {
// A host buffer for a message to or from a GPU: pinned, so the copies run at the link's full speed
// (LibTorch's caching host allocator keeps it until the copies that use it are done).
torch::Tensor host_like(const torch::Tensor& t, torch::ScalarType type) {
  return torch::empty(t.sizes(), torch::TensorOptions().dtype(type).pinned_memory(true));
}
}  // namespace

void PipeWire::send_to_rank(torch::Tensor t, int rank, int tag) {
  if (!t.is_cpu()) t = host_like(t, t.scalar_type()).copy_(t);  // waits for the copy: Gloo reads the host buffer
  sends_.emplace_back(comm_->send_async(t, rank, tag), t);
}

int64_t PipeWire::bytes(const torch::Tensor& t) const {
  return static_cast<int64_t>(t.nbytes()) / (narrowed(t) ? 2 : 1);
}

void PipeWire::send(torch::Tensor t, int to_stage, int tag) {
  // Across processes a float tensor travels as bfloat16 with parallel.pipe_wire = bfloat16 (rounded
  // to nearest); within one the mailbox hands it over as it is.
  if (!here(to_stage)) return send_to_rank(narrowed(t) ? t.to(torch::kBFloat16) : t, rank_of(to_stage), tag);
  DDM_CHECK(mailbox_.emplace(tag, t.detach()).second, "pipeline: message " << tag << " sent twice within rank " << rank_);
}

PipeWire::Recv PipeWire::post_recv(torch::Tensor t, int from_stage, int tag) {
  Recv r;
  r.tensor = t, r.from = from_stage, r.tag = tag, r.local = here(from_stage);
  if (r.local) return r;
  const torch::ScalarType type = narrowed(t) ? torch::kBFloat16 : t.scalar_type();
  r.wire = !t.is_cpu() ? host_like(t, type) : type != t.scalar_type() ? torch::empty(t.sizes(), type) : t;
  r.work = comm_->recv_async(r.wire, rank_of(from_stage), tag);
  return r;
}

torch::Tensor PipeWire::wait(Recv& r, const std::string& what) {
  if (!r.local) {
    comm_->wait(r.work, what);
    // bfloat16 -> float32 (exact), host -> device (after the receive: ordered before the kernels that read it)
    if (!r.wire.is_same(r.tensor)) r.tensor.copy_(r.wire, /*non_blocking=*/true);
    arrived_ = std::chrono::steady_clock::now();
    return r.tensor;
  }
  auto it = mailbox_.find(r.tag);
  // A stage here sends before a stage here receives: the schedule orders both on this rank.
  DDM_CHECK(it != mailbox_.end(), "pipeline: rank " << rank_ << " waits for message " << r.tag << " from stage " << r.from
                                                     << ", which this rank has not sent yet (" << what << ")");
  DDM_CHECK(it->second.sizes() == r.tensor.sizes(), "pipeline: message " << r.tag << " within rank " << rank_ << " has shape "
                                                                          << it->second.sizes() << ", expected " << r.tensor.sizes());
  r.tensor = it->second;
  mailbox_.erase(it);
  arrived_ = std::chrono::steady_clock::now();
  return r.tensor;
}

void PipeWire::wait_sends() {
  for (auto& [work, tensor] : sends_) comm_->wait(work, "sending to a neighbouring stage");
  sends_.clear();
}

}  // namespace ddm
