// ElasticGroup (see elastic.h): membership on the store, and a new Gloo group per change.
#include "comm/elastic.h"

#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "core/error.h"
#include "core/stop_signal.h"

namespace ddm {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

}  // namespace

ElasticGroup::ElasticGroup(std::shared_ptr<Comm> job, int job_size, std::chrono::milliseconds peer_wait)
    : job_(job), current_(job), job_rank_(job->job_rank()), job_size_(job_size), peer_wait_(peer_wait) {
  for (int g = 0; g < job_size_; ++g) members_.push_back(g);
  if (job_size_ > 1) {
    DDM_CHECK(job->job_store(), "rank " << job_rank_ << ": an elastic group needs the job's store");
    store_ = c10::make_intrusive<c10d::PrefixStore>("ddm/elastic", job->job_store());
  }
}

int64_t ElasticGroup::bytes_sent() const { return retired_bytes_ + current_->bytes_sent(); }

std::string ElasticGroup::encode(const Plan& p) {
  std::string s = join_ints(p.members) + "|";
  for (size_t i = 0; i < p.joiners.size(); ++i)
    s += (i ? "," : "") + std::to_string(p.joiners[i]) + ":" + p.tokens[i];
  return s;
}

ElasticGroup::Plan ElasticGroup::decode(const std::string& s) {
  Plan p;
  const size_t bar = s.find('|');
  DDM_CHECK(bar != std::string::npos, "malformed membership plan '" << s << "' in the store");
  std::istringstream m(s.substr(0, bar)), j(s.substr(bar + 1));
  std::string item;
  while (std::getline(m, item, ',')) p.members.push_back(std::stoi(item));
  while (std::getline(j, item, ',')) {
    const size_t colon = item.find(':');
    p.joiners.push_back(std::stoi(item.substr(0, colon)));
    p.tokens.push_back(item.substr(colon + 1));
  }
  return p;
}

std::string ElasticGroup::get(const std::string& key) { return text(store_->get(key)); }

template <class F>
auto ElasticGroup::on_store(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // The store itself failed (c10d's own exceptions): its host is gone.
    throw Fatal("rank " + std::to_string(job_rank_) + ": lost the job's store while " + what + " (" + e.what() +
                "): rank 0 or the launcher that hosts it has exited; this replica stops");
  }
}

ElasticGroup::Plan ElasticGroup::decide(const std::string& key, const Plan& proposal) {
  return decode(text(store_->compareSet(key, {}, bytes(encode(proposal)))));
}

std::vector<int> ElasticGroup::joiners_asking(std::vector<std::string>& tokens) {
  std::vector<int> out;
  tokens.clear();
  for (int g = 0; g < job_size_; ++g) {
    if (std::find(members_.begin(), members_.end(), g) != members_.end()) continue;
    const std::string key = "join/" + std::to_string(g);
    if (!store_->check({key})) continue;
    out.push_back(g);
    tokens.push_back(get(key));
  }
  return out;
}

void ElasticGroup::adopt(const std::string& round, int64_t k, const Plan& plan) {
  // Admission first, so the joiners connect while the members do.
  for (size_t i = 0; i < plan.joiners.size(); ++i)
    store_->set("admit/" + std::to_string(plan.joiners[i]) + "/" + plan.tokens[i],
                bytes(round + "/" + std::to_string(k)));
  // The source of the state: the lowest job rank that is not a joiner.
  source_ = 0;
  for (size_t i = 0; i < plan.members.size(); ++i)
    if (std::find(plan.joiners.begin(), plan.joiners.end(), plan.members[i]) == plan.joiners.end()) {
      source_ = static_cast<int>(i);
      break;
    }
  retired_bytes_ += current_->bytes_sent();
  const std::string name = "elastic/" + round + "/" + std::to_string(k);
  current_.reset();  // a failed Gloo group is dropped before its successor connects
  current_ = job_->subgroup(name, plan.members);
  members_ = plan.members;
  round_ = round;
  k_ = k;
}

std::vector<int> ElasticGroup::admit(const std::string& round) {
  return on_store("admitting replicas", [&] { return admit_impl(round); });
}

std::vector<int> ElasticGroup::admit_impl(const std::string& round) {
  if (complete()) return {};
  Plan proposal;
  proposal.joiners = joiners_asking(proposal.tokens);
  proposal.members = members_;
  for (int g : proposal.joiners) proposal.members.push_back(g);
  std::sort(proposal.members.begin(), proposal.members.end());
  const Plan plan = decide("plan/" + round + "/0", proposal);
  if (plan.joiners.empty()) return {};
  adopt(round, 0, plan);
  return plan.joiners;
}

std::string ElasticGroup::outcome_prefix(const std::string& round) const {
  return "outcome/" + round + "@" + (round_.empty() ? std::string("job") : round_ + "/" + std::to_string(k_)) + "/";
}

bool ElasticGroup::completed_everywhere(const std::string& round) {
  if (members_.size() <= 1) return true;
  return on_store("confirming a synchronization", [&] { return completed_everywhere_impl(round); });
}

bool ElasticGroup::completed_everywhere_impl(const std::string& round) {
  const std::string prefix = outcome_prefix(round);
  store_->set(prefix + std::to_string(job_rank_), bytes("ok"));
  std::vector<std::string> keys;
  for (int g : members_) keys.push_back(prefix + std::to_string(g));
  // The members complete a collective within moments of each other: poll briefly, then less often.
  auto deadline = std::chrono::steady_clock::now() + peer_wait_;
  bool signalled = false;
  auto pause = std::chrono::milliseconds(1);
  std::string proposal = "redo";  // if someone stays silent for peer_wait
  while (!store_->check({prefix + "decided"})) {
    // Asked to stop (a launcher stopping the job after it lost a worker): wait a second more, not
    // peer_wait, which could outlast the launcher's grace period; recover() then stops this process.
    if (!signalled && stop_signal() != 0) {
      signalled = true;
      deadline = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(1));
    }
    if (store_->check(keys)) {
      const auto said = store_->multiGet(keys);
      const bool all_ok = std::all_of(said.begin(), said.end(), [](const auto& b) { return text(b) == "ok"; });
      proposal = all_ok ? "commit" : "redo";
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  if (text(store_->compareSet(prefix + "decided", {}, bytes(proposal))) != "commit") return false;
  // A long run confirms every synchronization: its keys go once nobody reads them, which is true of
  // the last committed round's once this one commits (every member had left that round's wait
  // before it said "ok" to this one). Not this round's own: a member between its check of the words
  // and its multiGet would wait for a deleted key until the store's timeout.
  if (!committed_prefix_.empty()) {
    store_->deleteKey(committed_prefix_ + std::to_string(job_rank_));
    store_->deleteKey(committed_prefix_ + "decided");
  }
  committed_prefix_ = prefix;
  return true;
}

std::vector<int> ElasticGroup::recover(const std::string& round, const std::string& what, bool admit_joiners) {
  return on_store("regrouping", [&] { return recover_impl(round, what, admit_joiners); });
}

std::vector<int> ElasticGroup::recover_impl(const std::string& round, const std::string& what, bool admit_joiners) {
  // Members that completed this round's collectives learn that it failed here, and redo it too.
  const std::string outcome = outcome_prefix(round);
  store_->set(outcome + std::to_string(job_rank_), bytes("failed"));
  store_->compareSet(outcome + "decided", {}, bytes("redo"));
  const int64_t k = round_ == round ? k_ + 1 : 1;
  // The failed group goes first: a survivor still blocked in its collective on this process (the
  // ring's order decides which one learned of the lost replica) then fails at once and comes here
  // too, instead of after the collective timeout, which the others would spend waiting for it.
  current_->close("closed after " + what);
  const std::string prefix = "alive/" + round + "/" + std::to_string(k) + "/";
  const std::string plan_key = "plan/" + round + "/" + std::to_string(k);
  store_->set(prefix + std::to_string(job_rank_), bytes("1"));
  const std::vector<int> old = members_;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + peer_wait_;
  // A group without rank 0 cannot go on (it writes the run), so rank 0 itself is waited for longer:
  // up to the collective timeout. It may be late for good reasons (writing a checkpoint, fsync on a
  // busy disk); if it is dead, the store it hosts is usually gone too and this fails at once.
  const auto writer_deadline = start + std::max(peer_wait_, job_->options().timeout);
  Plan proposal;
  while (true) {
    proposal = Plan{};
    for (int g : old)
      if (store_->check({prefix + std::to_string(g)})) proposal.members.push_back(g);
    if (admit_joiners) {
      proposal.joiners = joiners_asking(proposal.tokens);
      for (int g : proposal.joiners) proposal.members.push_back(g);
    }
    std::sort(proposal.members.begin(), proposal.members.end());
    // Everyone is back, or someone already decided, or the wait is over (rank 0's, longer, included).
    const auto now = std::chrono::steady_clock::now();
    const bool writer_here = std::find(proposal.members.begin(), proposal.members.end(), 0) != proposal.members.end();
    if (static_cast<int>(proposal.members.size()) == job_size_ || store_->check({plan_key}) ||
        (now >= deadline && (writer_here || now >= writer_deadline)))
      break;
    // Asked to stop while waiting (a launcher stopping the job after it lost a worker): stop now,
    // not after the wait for rank 0, which would outlast the launcher's grace period.
    if (const int sig = stop_signal(); sig != 0) {
      const std::string own = "rank " + std::to_string(job_rank_) + ": ";  // named once
      const std::string why = what.rfind(own, 0) == 0 ? what.substr(own.size()) : what;
      throw Fatal(own + "stopped by signal " + std::to_string(sig) + " while regrouping (" + why +
                  "); nothing after the last checkpoint is kept");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const Plan plan = decide(plan_key, proposal);
  auto in_plan = [&](int g) { return std::find(plan.members.begin(), plan.members.end(), g) != plan.members.end(); };
  if (!in_plan(job_rank_))
    throw Fatal("rank " + std::to_string(job_rank_) + ": reached the synchronization after the others had gone on "
                "without it (" + what + "); it stops here, and its launcher may restart it to rejoin");
  if (!in_plan(0))
    throw Fatal("rank " + std::to_string(job_rank_) + ": rank 0, which writes the run, is gone (" + what +
                "); the job stops. Resume it from its last checkpoint (a launcher with restarts does)");
  adopt(round, k, plan);
  return plan.joiners;
}

void ElasticGroup::finished() {
  if (store_) store_->set("finished", bytes("1"));
}

std::string ElasticGroup::join(std::chrono::milliseconds wait) {
  return on_store("rejoining", [&] { return join_impl(wait); });
}

std::string ElasticGroup::join_impl(std::chrono::milliseconds wait) {
  DDM_CHECK(job_rank_ != 0, "rank 0 cannot rejoin a running job: it writes the run; restart the whole job");
  std::ostringstream token;
  token << ::getpid() << "-" << std::chrono::steady_clock::now().time_since_epoch().count();
  store_->set("join/" + std::to_string(job_rank_), bytes(token.str()));
  const std::string admit_key = "admit/" + std::to_string(job_rank_) + "/" + token.str();
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (!store_->check({admit_key})) {
    if (store_->check({"finished"})) {
      store_->deleteKey("join/" + std::to_string(job_rank_));
      return "";
    }
    DDM_CHECK(std::chrono::steady_clock::now() < deadline,
              "rank " << job_rank_ << ": asked to rejoin the running job but was not admitted within "
                      << seconds_str(wait) << ": are the other replicas still running (and synchronizing)?");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const std::string rk = get(admit_key);
  store_->deleteKey("join/" + std::to_string(job_rank_));
  const size_t slash = rk.rfind('/');
  const std::string round = rk.substr(0, slash);
  const int64_t k = std::stoll(rk.substr(slash + 1));
  adopt(round, k, decode(get("plan/" + rk)));
  return round;
}

}  // namespace ddm
