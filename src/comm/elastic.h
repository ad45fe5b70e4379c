// ElasticGroup: the processes of a job that are alive, as a sequence of process groups on the job's
// store, for DiLoCo replicas that go on without a dead peer and let it rejoin (docs/distributed.md,
// "Faults"). Gloo cannot recover a group after a lost peer or a timeout, so every change of
// membership builds a new group under a name of its own; the store (hosted by the launcher, or by
// rank 0) outlives them all.
//
// Membership is decided by the store's compare-and-set, so every process that takes part agrees:
//   round r        a synchronization (the caller names it, e.g. "s17" or "ckpt500"); its groups
//                  are named "elastic/<r>/<k>", k = 0, 1, ...
//   plan/<r>/<k>   "m0,m1,...|j0:token,..." the members of group k of round r and, among them, the
//                  joiners (with their tokens); the first proposal written wins
//   alive/<r>/<k>/<g>  job rank g survived the failure of group k-1 and takes part in group k
//   join/<g>       a restarted process g asks to join (its token); admit/<g>/<token> = "<r>/<k>"
//   outcome/<r>@<group>/<g>  "ok" or "failed": how round r's collectives ended on member g of the
//                  current group; outcome/<r>@<group>/decided  "commit" or "redo", the first written
//                  wins, and "commit" only once every member wrote "ok"
// A collective can end differently on different members: one that lost a peer fails, while another
// whose last message from that peer had arrived completes. So a round's result counts only when every
// member completed it (completed_everywhere); otherwise every member regroups and redoes the round.
// Before each round a group with missing members proposes itself plus whoever asked to join (no
// waiting). After a failed collective the survivors register and wait up to `peer_wait` for every
// missing process (a restarted one counts once it asks to join), then go on with whoever is there.
// Job rank 0 writes the run: a group without it is an error on every survivor, so they wait for rank 0
// up to the job's collective timeout (parallel.timeout) rather than peer_wait: it may only be late.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"

namespace ddm {

class ElasticGroup {
 public:
  // What no new group can mend: rank 0 or the store is gone, or this process was left out.
  struct Fatal : Error {
    using Error::Error;
  };

  // job: the job's Comm (every rank connected: the first group) or, for a rejoining process, a
  // store-only Comm (Comm::create_store_only); its job_size() is the job's world size.
  ElasticGroup(std::shared_ptr<Comm> job, int job_size, std::chrono::milliseconds peer_wait);

  Comm& comm() { return *current_; }
  const std::shared_ptr<Comm>& comm_ptr() const { return current_; }
  const std::vector<int>& members() const { return members_; }  // job ranks, ascending
  int job_rank() const { return job_rank_; }
  int job_size() const { return job_size_; }
  bool complete() const { return static_cast<int>(members_.size()) == job_size_; }
  // The group rank of the member that sends the state to joiners: the lowest job rank that was a
  // member before the last change.
  int source() const { return source_; }
  // Bytes this process sent in every group so far.
  int64_t bytes_sent() const;

  // Members, before round `round`'s collectives, when some job rank is missing: admits whoever asked
  // to join, without waiting. Returns the joiners' job ranks (empty: the group is unchanged).
  std::vector<int> admit(const std::string& round);
  // Members, after a collective of the current group failed in round `round` (`what` says which):
  // agrees on a new group with the other survivors, waiting up to peer_wait for missing processes
  // (and admitting joiners when `admit_joiners`). Returns the joiners. Throws Fatal if job rank 0 is
  // gone, or if this process came too late and was left out.
  std::vector<int> recover(const std::string& round, const std::string& what, bool admit_joiners);
  // After this process completed round `round`'s collectives: true when every member completed them
  // (the result holds everywhere), false when one failed, or did not say so within peer_wait: the
  // caller then recovers (as the failed one does) and redoes the round in the new group.
  bool completed_everywhere(const std::string& round);
  // A rejoining process: asks to join and waits up to `wait` to be admitted; returns the round, or
  // "" when the job finished meanwhile (finished() was called).
  std::string join(std::chrono::milliseconds wait);
  // Marks the job finished on the store, so a process waiting to rejoin stops waiting.
  void finished();

 private:
  struct Plan {
    std::vector<int> members, joiners;
    std::vector<std::string> tokens;  // the joiners'
  };
  static std::string encode(const Plan& p);
  static Plan decode(const std::string& s);
  Plan decide(const std::string& key, const Plan& proposal);  // compare-and-set; returns the winner
  void adopt(const std::string& round, int64_t k, const Plan& plan);  // builds the plan's group
  std::vector<int> joiners_asking(std::vector<std::string>& tokens);
  std::string get(const std::string& key);
  std::string outcome_prefix(const std::string& round) const;
  std::vector<int> admit_impl(const std::string& round);
  bool completed_everywhere_impl(const std::string& round);
  std::vector<int> recover_impl(const std::string& round, const std::string& what, bool admit_joiners);
  std::string join_impl(std::chrono::milliseconds wait);
  // Runs f; a failure of the store itself becomes Fatal (nothing can regroup without it).
  template <class F>
  auto on_store(const char* what, F&& f) -> decltype(f());

  std::shared_ptr<Comm> job_, current_;
  c10::intrusive_ptr<c10d::Store> store_;
  int job_rank_ = 0, job_size_ = 1, source_ = 0;
  std::vector<int> members_;
  std::chrono::milliseconds peer_wait_;
  std::string round_;           // the current group's plan: round and k
  int64_t k_ = 0;
  int64_t retired_bytes_ = 0;   // sent in groups already replaced
  std::string committed_prefix_;  // the outcome keys of the last round completed everywhere
};

}  // namespace ddm
