// Comm: ddm's handle on one process group (c10d TCPStore rendezvous + ProcessGroupGloo, and with
// CommOptions::nccl_device a ProcessGroupNCCL beside it for CUDA tensors), with the few collectives
// training needs, and every c10d / Gloo / NCCL failure turned into a ddm::Error that names this rank,
// the operation, the peer when it can be inferred, and what to do. With one process it is a no-op
// that never touches the network.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/env.h"

namespace c10d {
class ProcessGroupGloo;  // comm.cpp includes its header (which needs Gloo's declarations)
}  // namespace c10d

namespace ddm {

struct CommOptions {
  // A collective that has not completed after this long fails on every rank that issued it (Gloo's
  // own default is 30 minutes: far too long to wait on a dead or hung peer).
  std::chrono::milliseconds timeout{60000};
  // How long to wait for the store and for every rank to join the rendezvous.
  std::chrono::milliseconds connect_timeout{60000};
  int gloo_threads = 1;  // Gloo's worker threads (they compete with intra-op threads on CPU)
  // Store keys of this group live under "ddm/<group>/", so a rebuilt group (after a failure) can use
  // a fresh name on the same store.
  std::string group = "pg0";
  // After a collective times out in a group of more than two, each rank that failed says so on the
  // store and waits this long for the others to say so too; the ranks that did not are named as the
  // hung ones. Negative: a quarter of `timeout`, at least 1 s and at most 10 s; zero: no probe
  // (DiLoCo's ElasticGroup keeps its own account of who is alive).
  std::chrono::milliseconds probe_wait{-1};
  // >= 0: this rank's CUDA GPU, and the data collectives (all-reduce, broadcast, send / receive) of
  // tensors on it go over NCCL (parallel.backend, docs/gpu.md); Gloo carries everything else.
  int nccl_device = -1;
};

class Comm {
 public:
  // From the detected environment: world 1 gives a local no-op Comm; otherwise connects to (rank 0 or
  // the launcher's agent: hosts) the TCPStore at env.master_addr:master_port and builds a Gloo group.
  static std::shared_ptr<Comm> create(const DistEnv& env, CommOptions options = {});
  // Ranks as threads of one process: every thread passes the same store (e.g. a c10d::HashStore) and
  // its own rank; Gloo talks over the loopback device.
  // With form_group = false, as create_store_only: no group, only the store (a rejoining process).
  static std::shared_ptr<Comm> create_for_test(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                                               CommOptions options = {}, bool form_group = true);
  // A new group of some ranks of this one's job on the same store, for rebuilding after a failure
  // (Gloo cannot recover a group): `members` are the ranks of this job in it, in group-rank order
  // (this process must be one); `name` must be new on the store. Its collectives use group ranks.
  std::shared_ptr<Comm> subgroup(const std::string& name, const std::vector<int>& members) const;
  // With connect = false, create() reaches the store but forms no group (a process rejoining a
  // running job makes its groups with subgroup()); its collectives then fail.
  static std::shared_ptr<Comm> create_store_only(const DistEnv& env, CommOptions options = {});
  // The job's store (under this attempt's prefix, without this group's), for coordination keys.
  c10::intrusive_ptr<c10d::Store> job_store() const { return base_store_; }
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }  // in this group
  // This process's rank in the job (== rank() except in a subgroup), and a group rank's.
  int job_rank() const { return job_rank_of(rank_); }
  int job_rank_of(int group_rank) const { return members_.empty() ? group_rank : members_[group_rank]; }
  const std::vector<int>& members() const { return members_; }  // job ranks; empty: all, in order
  int world_size() const { return world_; }
  bool distributed() const { return world_ > 1; }
  const CommOptions& options() const { return options_; }

  // "gloo", or "nccl 2.28.9 for CUDA tensors, gloo for the rest": for the run's header.
  std::string backend_description() const;
  bool uses_nccl() const { return static_cast<bool>(nccl_); }

  // Starts a sum all-reduce of contiguous tensors in place (CPU or CUDA, all on one device); call
  // wait() on the result. With one process the returned work is already complete. All ranks must
  // issue collectives in the same order. CUDA tensors go over NCCL when the Comm has it: the
  // all-reduce then runs on NCCL's stream after the caller's current stream's work, and wait() only
  // orders the caller's stream after it (no host synchronization). Over Gloo, CUDA tensors are
  // reduced through host copies and wait() blocks.
  c10::intrusive_ptr<c10d::Work> allreduce_async(std::vector<at::Tensor>& tensors);
  // Waits for work from this Comm; failures become ddm::Error naming `op`.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op);

  // Point-to-point (pipeline stages): starts sending a contiguous tensor to group rank `peer`, or
  // receiving one of the same size and type into `tensor` (CPU tensors; CUDA ones over NCCL only);
  // messages between two ranks match by tag. Gloo's send completes only once the peer has posted
  // the matching receive: post every send of a step before waiting on one (or wait on them all at
  // the end), or two stages deadlock.
  c10::intrusive_ptr<c10d::Work> send_async(at::Tensor& tensor, int peer, int tag);
  c10::intrusive_ptr<c10d::Work> recv_async(at::Tensor& tensor, int peer, int tag);

  void allreduce_sum(at::Tensor& tensor);              // in place, sum over ranks
  void broadcast(at::Tensor& tensor, int root);        // in place, root's values everywhere
  void barrier();
  // Gathers a contiguous tensor (same shape on every rank) to root: returned there indexed by rank,
  // on the host, empty on the other ranks. (Gather and scatter go over Gloo; GPU tensors are staged
  // through host copies.)
  std::vector<at::Tensor> gather(const at::Tensor& tensor, int root);
  // Root sends parts[r] to rank r, which receives it into `out` (root keeps parts[root]); the other
  // ranks pass no parts.
  void scatter(const std::vector<at::Tensor>& parts, at::Tensor& out, int root);
  // Every rank's string, indexed by rank.
  std::vector<std::string> all_gather_strings(const std::string& s);
  // The maximum of v over ranks: for agreeing on stop decisions (any rank's flag wins).
  int64_t max_int(int64_t v);
  // Throws ddm::Error on every rank if any key's value differs between ranks, naming each such key and
  // each rank's value ("ranks disagree on train.lr: rank 0 has 0.002, rank 1 has 0.001; on ..."). `what` says
  // what the pairs are ("config"). One small all-gather of hashes when they agree.
  void check_same(const std::vector<std::pair<std::string, std::string>>& key_values, const std::string& what);

  // Bytes this rank has sent in collectives since the Comm was made: the payload that Gloo's
  // algorithms move, not TCP/IP headers. An all-reduce of n bytes over W ranks sends 2 (W-1)/W n from
  // each rank (ring: reduce-scatter, then all-gather), a broadcast (W-1) n from the root, a gather n
  // from every other rank, a scatter n per receiver from the root, an all-gather (W-1) n from each.
  int64_t bytes_sent() const { return bytes_sent_.load(); }
  // Drops a failed group's connections (ElasticGroup, before regrouping): a peer still waiting on
  // this process inside one of the group's collectives fails at once ("connection closed") instead
  // of at its timeout. The group's collectives fail afterwards, naming `why`; the store stays.
  void close(const std::string& why);

 private:
  Comm(int rank, int world, CommOptions options);
  static std::shared_ptr<Comm> create_impl(const DistEnv& env, CommOptions options, bool form_group);
  void connect(c10::intrusive_ptr<c10d::Store> store, const std::string& where, bool loopback);
  // The group that carries `t`: NCCL for a CUDA tensor when there is one, else Gloo.
  c10d::Backend& carrier(const at::Tensor& t);
  // Runs f (a c10d call), turning any exception into ddm::Error about `op`.
  template <class F>
  auto guarded(const std::string& op, F&& f) -> decltype(f());
  [[noreturn]] void fail(const std::string& op, const std::string& what);
  // After `op` timed out in a group of more than two: who is hung, as fail()'s message says it
  // ("rank 2 (hung, ...: it alone did not report ...)"), from what each failed rank wrote on the store
  // within probe_wait; "" without a probe. Bounded even when the store's host is the stopped process.
  std::string probe_peers(const std::string& op);
  // Writes "failed/<group rank>" = "lost\t<op>" on the group's store, so the ranks that time out do not
  // name this one as hung (probe_peers writes "timeout\t<op>" itself); never throws.
  void report_lost(const std::string& op);
  void check_usable(const std::string& op) const;

  int rank_ = 0, world_ = 1;
  CommOptions options_;
  void count_sent(double bytes) { bytes_sent_ += static_cast<int64_t>(bytes); }
  std::atomic<int64_t> bytes_sent_{0};  // gradient hooks may launch all-reduces from autograd's threads
  std::string broken_;  // the first failure: a Gloo group is unusable after any error or timeout
  c10::intrusive_ptr<c10d::Store> store_, base_store_;
  std::vector<int> members_;  // a subgroup's job ranks by group rank (empty: the whole job)
  std::string where_;     // the store, for messages
  std::string store_host_ = "rank 0";  // who serves the store: "rank 0", "the launcher" (messages)
  bool loopback_ = true;  // Gloo's device: loopback, or this host's address / GLOO_SOCKET_IFNAME
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  c10::intrusive_ptr<c10d::Backend> nccl_;  // with options_.nccl_device >= 0 and world > 1
};

// Human-readable seconds for messages: "2s", "0.5s", "60s".
std::string seconds_str(std::chrono::milliseconds ms);

}  // namespace ddm
