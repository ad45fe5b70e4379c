// The optimizer state sharded over data-parallel ranks (see shard.h).
#include "train/shard.h"

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "core/error.h"

namespace ddm {
namespace {

// Message tags between two ranks: a checkpoint's parts of parameter i are tag part * N + i (part 0
// the EMA, 1 and 2 the moments); whole ranges come after them.
int part_tag(int part, size_t i, size_t n) { return part * static_cast<int>(n) + static_cast<int>(i); }
int ema_tag(size_t n) { return 3 * static_cast<int>(n); }
int resume_tag(size_t n) { return 3 * static_cast<int>(n) + 1; }

// The part of parameter i (flat offset `offset`, `numel` elements) in range r: [a, b), empty if a >= b.
std::pair<int64_t, int64_t> overlap(const ShardRange& r, int64_t offset, int64_t numel) {
  return {std::max(r.begin, offset), std::min(r.end, offset + numel)};
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

void wait_all(Comm& comm, const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& op) {
  for (const auto& w : works) comm.wait(w, op);
}

}  // namespace

ShardRange shard_range(int64_t n, int world, int rank) {
  DDM_CHECK(world >= 1 && rank >= 0 && rank < world, "shard_range: rank " << rank << " of " << world);
  int64_t per = (n + world - 1) / world;
  per = (per + 15) / 16 * 16;
  ShardRange r;
  r.begin = std::min(n, per * rank);
  r.end = std::min(n, r.begin + per);
  return r;
}

void gather_parameters(Comm& comm, FlatAdamW& optim) {
  torch::NoGradGuard no_grad;
  for (int root = 0; root < comm.world_size(); ++root) {
    const ShardRange r = shard_range(optim.numel(), comm.world_size(), root);
    if (r.size() == 0) continue;
    torch::Tensor range = optim.flat_params().narrow(0, r.begin, r.size());
    comm.broadcast(range, root);
  }
}

void share_resumed(Comm& comm, FlatAdamW& optim, const Checkpoint* resumed, const std::string& origin) {
  torch::NoGradGuard no_grad;
  torch::Tensor params = optim.flat_params();
  comm.broadcast(params, 0);
  const size_t n = optim.names().size();
  const auto host = torch::TensorOptions().dtype(torch::kFloat);
  const std::string op = "sending each rank its range of the optimizer state from " + origin;
  if (comm.rank() == 0) {
    DDM_CHECK(resumed, "share_resumed: rank 0 has no checkpoint");
    // One rank's range at a time: rank 0 holds its own range and one other.
    for (int r = 1; r < comm.world_size(); ++r) {
      const ShardRange range = shard_range(optim.numel(), comm.world_size(), r);
      if (range.size() == 0) continue;
      torch::Tensor state = torch::empty({3, range.size()}, host);  // EMA, exp_avg, exp_avg_sq
      optim.state_range(resumed->ema, resumed->optim, range.begin, range.end, state[0], state[1], state[2], origin);
      comm.wait(comm.send_async(state, r, resume_tag(n)), op);
    }
    return;
  }
  const ShardRange range{optim.shard_begin(), optim.shard_end()};
  if (range.size() == 0) return;
  torch::Tensor state = torch::empty({3, range.size()}, host);
  comm.wait(comm.recv_async(state, 0, resume_tag(n)), op);
  const std::vector<torch::Tensor> mine = optim.state_buffers();  // params, EMA, exp_avg, exp_avg_sq
  for (int k = 0; k < 3; ++k) mine[static_cast<size_t>(k) + 1].copy_(state[k]);
}

void contribute_shards(Comm& comm, const FlatAdamW& optim, Checkpoint& ck) {
  torch::NoGradGuard no_grad;
  const std::vector<std::string>& names = optim.names();
  const std::vector<int64_t>& offsets = optim.offsets();
  const std::vector<std::vector<int64_t>>& shapes = optim.shapes();
  const size_t n = names.size();
  const int world = comm.world_size();
  const std::string op = "assembling the sharded optimizer state for a checkpoint";
  if (comm.rank() != 0) {
    // Every part of this rank's range, sent at once (a Gloo send completes when rank 0 receives it,
    // which it does in its writer's order); on the host, as Gloo carries them.
    const ShardRange mine{optim.shard_begin(), optim.shard_end()};
    const std::vector<torch::Tensor> bufs = optim.state_buffers();
    std::vector<torch::Tensor> held;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int part = 0; part < 3; ++part)
      for (size_t i = 0; i < n; ++i) {
        const auto [a, b] = overlap(mine, offsets[i], numel_of(shapes[i]));
        if (a >= b) continue;
        held.push_back(bufs[static_cast<size_t>(part) + 1].narrow(0, a - mine.begin, b - a).to(torch::kCPU).contiguous());
        works.push_back(comm.send_async(held.back(), 0, part_tag(part, i, n)));
      }
    wait_all(comm, works, op);
    return;
  }
  auto index = std::make_shared<std::map<std::string, size_t>>();
  for (size_t i = 0; i < n; ++i) {
    (*index)[names[i]] = i;
    const auto meta = torch::TensorOptions().dtype(torch::kFloat).device(torch::kMeta);
    ck.ema[names[i]] = torch::empty(shapes[i], meta);
    ck.optim["exp_avg." + names[i]] = torch::empty(shapes[i], meta);
    ck.optim["exp_avg_sq." + names[i]] = torch::empty(shapes[i], meta);
  }
  Comm* c = &comm;
  const FlatAdamW* o = &optim;
  ck.fetch = [c, o, index, world, n, op](int ck_part, const std::string& key) {
    torch::NoGradGuard no_grad;
    int part = 0;  // 0: EMA, 1: exp_avg, 2: exp_avg_sq
    std::string name = key;
    if (ck_part == 2) {
      const bool sq = key.rfind("exp_avg_sq.", 0) == 0;
      DDM_CHECK(sq || key.rfind("exp_avg.", 0) == 0, "sharded optimizer: no moment '" << key << "'");
      part = sq ? 2 : 1;
      name = key.substr(sq ? 11 : 8);
    }
    DDM_CHECK(ck_part == 1 || ck_part == 2, "sharded optimizer: part " << ck_part << " is not sharded");
    auto it = index->find(name);
    DDM_CHECK(it != index->end(), "sharded optimizer: no parameter '" << name << "'");
    const size_t i = it->second;
    const int64_t offset = o->offsets()[i], numel = numel_of(o->shapes()[i]);
    torch::Tensor out = torch::empty(o->shapes()[i], torch::kFloat);
    torch::Tensor flat = out.view({-1});
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int r = 0; r < world; ++r) {
      const ShardRange range = shard_range(o->numel(), world, r);
      const auto [a, b] = overlap(range, offset, numel);
      if (a >= b) continue;
      torch::Tensor dst = flat.narrow(0, a - offset, b - a);
      if (r == 0)
        dst.copy_(o->state_buffers()[static_cast<size_t>(part) + 1].narrow(0, a - range.begin, b - a));
      else
        works.push_back(c->recv_async(dst, r, part_tag(part, i, n)));
    }
    wait_all(*c, works, op);
    return out;
  };
}

TensorMap gather_ema(Comm& comm, const FlatAdamW& optim) {
  torch::NoGradGuard no_grad;
  const size_t n = optim.names().size();
  const std::string op = "assembling the sharded EMA for a grid";
  if (comm.rank() != 0) {
    if (optim.shard_end() > optim.shard_begin()) {
      torch::Tensor mine = optim.flat_ema().to(torch::kCPU).contiguous();
      comm.wait(comm.send_async(mine, 0, ema_tag(n)), op);
    }
    return {};
  }
  torch::Tensor flat = torch::empty({optim.numel()}, torch::kFloat);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int r = 0; r < comm.world_size(); ++r) {
    const ShardRange range = shard_range(optim.numel(), comm.world_size(), r);
    if (range.size() == 0) continue;
    torch::Tensor dst = flat.narrow(0, range.begin, range.size());
    if (r == 0)
      dst.copy_(optim.flat_ema());
    else
      works.push_back(comm.recv_async(dst, r, ema_tag(n)));
  }
  wait_all(comm, works, op);
  return optim.views(flat);
}

}  // namespace ddm
