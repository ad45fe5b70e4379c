// Comm (see comm.h): TCPStore rendezvous, the Gloo group, collectives, and the translation of c10d /
// Gloo failures into ddm::Error. What Gloo reports (first seen on LibTorch 1.13, the same on 2.11; checked by
// tests/unit/comm/test_comm.cpp):
//   peer process died          -> "[.../pair.cc:N] Connection closed by peer [addr]:port" (or a read
//                                 / write error on the socket) within milliseconds
//   peer alive, never joins    -> "[.../unbound_buffer.cc:N] Timed out waiting Nms for recv
//                                 operation to complete" after CommOptions::timeout
//   either                     -> the group stays unusable: later collectives fail too.
//   store port taken (rank 0)  -> "The server socket has failed to listen on any local network
//                                 address ... (errno: 98 - Address already in use)" at once
//   no store yet (other ranks) -> see Comm::create: 1.13's client needs our retries
#include "comm/comm.h"

#include <algorithm>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <c10/util/Logging.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/nccl.h"
#include "core/error.h"
#include "core/input_check.h"

namespace ddm {
namespace {

// A work item that is complete from the start: what collectives return with one process.
struct DoneWork : c10d::Work {
  DoneWork() { finish(); }
};

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Gloo prefixes messages with its source location "[../gloo/transport/tcp/pair.cc:598] ".
std::string strip_location(std::string msg) {
  if (!msg.empty() && msg[0] == '[') {
    const size_t close = msg.find("] ");
    if (close != std::string::npos && close < 200) msg = msg.substr(close + 2);
  }
  // c10::Error appends a C++ backtrace after the first line; keep only the message.
  const size_t nl = msg.find('\n');
  if (nl != std::string::npos) msg = msg.substr(0, nl);
  return msg;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

[[noreturn]] void store_error(const DistEnv& env, const CommOptions& options, bool server, const std::exception& e) {
  const std::string msg = strip_location(e.what());
  DDM_CHECK(!(server && (contains(msg, "in use") || contains(msg, "failed to bind") || contains(msg, "failed to listen"))),
            "rank 0: port " << env.master_port << " on " << env.master_addr
                            << " is already in use (another job or a leftover process holds it); choose another "
                               "MASTER_PORT ("
                            << msg << ")");
  DDM_FAIL("rank " << env.rank << ": cannot reach the rendezvous store at " << env.master_addr << ":"
                   << env.master_port << " within " << seconds_str(options.connect_timeout) << ": is "
                   << (env.agent_store ? "the launcher" : "rank 0") << " running, is MASTER_ADDR right? (" << msg
                   << ")");
}

}  // namespace

std::string seconds_str(std::chrono::milliseconds ms) {
  std::ostringstream os;
  os << static_cast<double>(ms.count()) / 1000.0 << "s";
  return os.str();
}

Comm::Comm(int rank, int world, CommOptions options) : rank_(rank), world_(world), options_(std::move(options)) {}

Comm::~Comm() {
  // An NCCL group is aborted explicitly: that never waits (a graceful shutdown could wait on a peer
  // that died, and the destructor alone warns), and nothing uses the group afterwards.
  if (!nccl_) return;
  try {
    nccl_->abort();
  } catch (const std::exception&) {
    // Tearing down: nothing left to report to.
  }
}

std::string Comm::backend_description() const {
  return nccl_ ? "nccl " + nccl_version() + " for CUDA tensors, gloo for the rest" : std::string("gloo");
}

c10d::Backend& Comm::carrier(const at::Tensor& t) {
  if (t.is_cuda() && nccl_) return *nccl_;
  return *pg_;
}

std::shared_ptr<Comm> Comm::create(const DistEnv& env, CommOptions options) {
  return create_impl(env, std::move(options), true);
}

std::shared_ptr<Comm> Comm::create_store_only(const DistEnv& env, CommOptions options) {
  return create_impl(env, std::move(options), false);
}

namespace {
// LibTorch 2.11's c10d flight recorder (a process-wide ring buffer of every collective, on by
// default) registers each group's status in an unordered_map before taking its lock: groups that
// record from several threads at once (ranks as threads in tests, a pipeline's groups, gradient
// hooks on the autograd engine's threads) race on it, and one was seen spinning forever inside it (a
// pipeline test, 13 minutes, in recordWithResetEnabled). ddm does not read the recorder, so it is off
// unless TORCH_FR_BUFFER_SIZE is set; set as the program loads, before any thread or group exists.
[[maybe_unused]] const bool kFlightRecorderOff = [] { return setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0; }();
}  // namespace

namespace {

// While a rank connects to the store and waits for the others to join, ddm names what failed itself
// (the store that never answered, the ranks that never joined): LibTorch's own lines for each failed
// try or slow wait (a warning, or an error with its stack trace) would only come before that line,
// so they are quieted meanwhile, unless TORCH_CPP_LOG_LEVEL asks for them. Counted, for ranks that
// are threads of one process (tests). LibTorch reads its level without a lock: a thread that logs
// meanwhile sees the old or the new level, either of which is harmless here.
std::mutex g_quiet_mutex;
int g_quiet_depth = 0, g_quiet_saved = 0;  // under g_quiet_mutex

class QuietStoreLog {
 public:
  QuietStoreLog() {
    std::lock_guard<std::mutex> lock(g_quiet_mutex);
    if (g_quiet_depth++ > 0) return;
    g_quiet_saved = ::FLAGS_caffe2_log_level;
    if (!std::getenv("TORCH_CPP_LOG_LEVEL")) ::FLAGS_caffe2_log_level = std::max(g_quiet_saved, 3);  // FATAL only
  }
  ~QuietStoreLog() {
    std::lock_guard<std::mutex> lock(g_quiet_mutex);
    if (--g_quiet_depth == 0) ::FLAGS_caffe2_log_level = g_quiet_saved;
  }
  QuietStoreLog(const QuietStoreLog&) = delete;
  QuietStoreLog& operator=(const QuietStoreLog&) = delete;
};

}  // namespace

std::shared_ptr<Comm> Comm::create_impl(const DistEnv& env, CommOptions options, bool form_group) {
  std::shared_ptr<Comm> comm(new Comm(env.rank, env.world_size, options));
  if (!env.distributed()) return comm;
  comm->store_host_ = env.agent_store ? "the launcher" : "rank 0";
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const bool server = env.rank == 0 && !env.agent_store;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = server;
  so.waitWorkers = false;  // the join below waits, and says which ranks are missing
  so.timeout = options.connect_timeout;
  c10::intrusive_ptr<c10d::Store> store;
  // LibTorch 1.13's TCPStore connect (measured): it keeps its timeout in whole seconds, truncated (a
  // 999 ms timeout fails at once, "timed out after 0s", even for rank 0 connecting to its own
  // server), and it retries a refused connection only while more than one second is left (with a 1 s
  // timeout a rank that starts before rank 0 has opened the store fails in 0.5 ms). So: whole
  // seconds, and our own retries until connect_timeout, backing off from 50 ms to 1 s.
  const auto deadline = std::chrono::steady_clock::now() + options.connect_timeout;
  auto backoff = std::chrono::milliseconds(50);
  while (!store) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    so.timeout = std::chrono::seconds(std::max<int64_t>(1, (left.count() + 999) / 1000));
    try {
      // A client's refused connects are retried here and, at the deadline, named by store_error.
      const QuietStoreLog quiet;
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      const auto now = std::chrono::steady_clock::now();
      if (server || now >= deadline) store_error(env, options, server, e);
      std::this_thread::sleep_for(std::min(backoff, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now)));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }
  if (!env.store_prefix.empty()) store = c10::make_intrusive<c10d::PrefixStore>(env.store_prefix, store);
  // A host that is not loopback: bind Gloo to this machine's hostname (PyTorch's default device).
  if (form_group) {
    comm->connect(store, "the rendezvous store at " + where, is_loopback(env.master_addr));
  } else {
    comm->base_store_ = store;
    comm->where_ = "the rendezvous store at " + where;
    comm->loopback_ = is_loopback(env.master_addr);
    comm->broken_ = "rank " + std::to_string(env.rank) + " joined the store only (it is rejoining a running job)";
  }
  return comm;
}

std::shared_ptr<Comm> Comm::create_for_test(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                                            CommOptions options, bool form_group) {
  DDM_CHECK(world >= 1 && rank >= 0 && rank < world, "create_for_test: rank " << rank << " of world " << world);
  std::shared_ptr<Comm> comm(new Comm(rank, world, options));
  comm->store_host_ = "the test's process";
  if (world > 1 && form_group) {
    comm->connect(std::move(store), "the test store", /*loopback=*/true);
  } else if (world > 1) {
    comm->base_store_ = std::move(store);
    comm->where_ = "the test store";
    comm->broken_ = "rank " + std::to_string(rank) + " joined the store only (it is rejoining a running job)";
  }
  return comm;
}

std::shared_ptr<Comm> Comm::subgroup(const std::string& name, const std::vector<int>& members) const {
  DDM_CHECK(base_store_, "rank " << job_rank() << ": a process group of one process has no store to build groups on");
  const auto me = std::find(members.begin(), members.end(), job_rank());
  DDM_CHECK(me != members.end(), "rank " << job_rank() << " is not a member of group " << name);
  CommOptions o = options_;
  o.group = name;
  std::shared_ptr<Comm> comm(new Comm(static_cast<int>(me - members.begin()), static_cast<int>(members.size()), o));
  comm->base_store_ = base_store_;
  comm->where_ = where_;
  comm->store_host_ = store_host_;
  comm->loopback_ = loopback_;
  comm->members_ = members;
  if (members.size() > 1) comm->connect(base_store_, where_, loopback_);
  return comm;
}

void Comm::connect(c10::intrusive_ptr<c10d::Store> store, const std::string& where, bool loopback) {
  base_store_ = store;
  where_ = where;
  loopback_ = loopback;
  // NCCL needs its GPU: checked before anything connects, so every rank fails alike (a rank failing
  // after the Gloo group formed would close its half while another rank is still connecting it).
  if (options_.nccl_device >= 0 && options_.nccl_device >= static_cast<int>(torch::cuda::device_count()))
    fail("connecting the NCCL group on cuda:" + std::to_string(options_.nccl_device),
         "NCCL needs that CUDA device, and this process sees " + std::to_string(torch::cuda::device_count()));
  store_ = c10::make_intrusive<c10d::PrefixStore>("ddm/" + options_.group, std::move(store));
  // Join: every rank announces itself and waits for all others, so a missing rank is named here
  // rather than surfacing as an anonymous timeout inside Gloo's rendezvous.
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back("joined/" + std::to_string(r));
  bool duplicate = false;
  try {
    // The job's first group: a rank that never joins is named below. (Not a later group, a pipeline's
    // or a regrouping's, whose wait runs beside the training's threads.)
    std::optional<QuietStoreLog> quiet;
    if (members_.empty()) quiet.emplace();
    // A counter rather than a flag: a second process started with the same RANK is told so at once
    // (with a flag it would pass the join and fail later inside Gloo's rendezvous, in Gloo's words).
    if (store_->add(keys[rank_], 1) > 1) duplicate = true;
    if (!duplicate) store_->wait(keys, options_.connect_timeout);
  } catch (const std::exception& e) {
    std::string missing;
    try {
      for (int r = 0; r < world_; ++r)
        if (!store_->check({keys[r]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    } catch (const std::exception&) {
      missing.clear();  // the store itself is gone; say so below
    }
    DDM_CHECK(missing.empty(), "rank " << job_rank() << ": " << (members_.empty() ? "rank(s) " : "group rank(s) ") << missing << " did not join at " << where
                                       << " within " << seconds_str(options_.connect_timeout)
                                       << ": did every rank start, with the same WORLD_SIZE and MASTER_PORT?");
    DDM_FAIL("rank " << job_rank() << ": lost " << where << " while joining (" << strip_location(e.what())
                     << "): rank 0 or the launcher exited; the job stops");
  }
  DDM_INPUT_CHECK(!duplicate, "rank " << job_rank() << ": another process already joined " << where << " as "
                                 << (members_.empty() ? "rank " : "group rank ") << rank_
                                 << ": two processes were started with the same RANK; give each of the "
                                 << world_ << " processes its own RANK, 0 to " << world_ - 1
                                 << " (or, if this rank was started again while the job was still forming, start "
                                    "every rank again)");
  auto opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
  opts->threads = std::max(1, options_.gloo_threads);
  try {
    // As PyTorch does: GLOO_SOCKET_IFNAME names the interface; otherwise loopback for a job on one
    // host, else the address this machine's hostname resolves to (loopback if it does not).
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (loopback)
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, world_, opts);
  } catch (const std::exception& e) {
    fail("connecting the Gloo group", e.what());
  }
  if (options_.nccl_device < 0) return;
  try {
    nccl_ = make_nccl_group(c10::make_intrusive<c10d::PrefixStore>("nccl", store_), rank_, world_,
                            options_.nccl_device, options_.timeout);
  } catch (const std::exception& e) {
    fail("connecting the NCCL group on cuda:" + std::to_string(options_.nccl_device), e.what());
  }
}

[[noreturn]] void Comm::fail(const std::string& op, const std::string& what) {
  const std::string msg = strip_location(what);
  // Which library spoke: NCCL's messages name it (and PyTorch's NCCL watchdog's say "NCCL" too).
  const char* lib = contains(msg, "NCCL") || contains(msg, "nccl") ? "nccl" : "gloo";
  std::ostringstream os;
  os << "rank " << job_rank() << ": ";
  if (contains(msg, "Timed out") || contains(msg, "timed out") || contains(msg, "Timeout") ||
      contains(msg, "timing out")) {
    std::string whom = world_ == 2 ? "rank " + std::to_string(job_rank_of(1 - rank_)) + " (hung, stopped or much slower)"
                                   : std::string();
    if (whom.empty() && broken_.empty()) whom = probe_peers(op);
    if (whom.empty()) whom = "the other ranks (a rank is hung, stopped or much slower)";
    os << op << " timed out after " << seconds_str(options_.timeout) << " waiting for " << whom
       << "; raise parallel.timeout if "
          "a rank legitimately needs longer between collectives ("
       << lib << ": " << msg << ")";
  } else if (contains(msg, "closed by peer") || contains(msg, "reset by peer") || contains(msg, "Socket closed") ||
             contains(msg, "unexpectedly closed") || contains(msg, "Broken pipe") || contains(msg, "Read error") ||
             contains(msg, "Write error") || contains(msg, "Connection refused")) {
    // With more ranks, a rank that times out meanwhile reads this, so it does not name this one as hung.
    if (world_ > 2 && broken_.empty()) report_lost(op);
    os << "lost the connection to " << (world_ == 2 ? "rank " + std::to_string(job_rank_of(1 - rank_)) : "a peer rank")
       << " during " << op << " (it exited or was killed); the job stops (" << lib << ": " << msg << ")";
  } else {
    os << op << " failed: " << msg;
  }
  if (broken_.empty()) broken_ = os.str();
  throw Error(os.str());
}

void Comm::report_lost(const std::string& op) {
  if (!store_ || options_.probe_wait.count() == 0) return;
  const std::string v = "lost\t" + op;
  try {
    store_->set("failed/" + std::to_string(rank_), std::vector<uint8_t>(v.begin(), v.end()));  // sends only
  } catch (const std::exception&) {
    // The store is gone too: nothing to tell the others through it.
  }
}

namespace {
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}
}  // namespace

std::string Comm::probe_peers(const std::string& op) {
  using std::chrono::milliseconds;
  const milliseconds wait = options_.probe_wait.count() >= 0
                                ? options_.probe_wait
                                : std::clamp(milliseconds(options_.timeout.count() / 4), milliseconds(1000), milliseconds(10000));
  if (wait.count() == 0 || world_ <= 2 || !store_) return "";
  // Each rank whose collective failed writes what it was in under "failed/<group rank>", then waits
  // for the others' keys. All on a thread of its own: if the store's host is the stopped process, a
  // store call can block for good (holding the store client's lock, so no other call may be made on
  // this rank either), and this rank must still fail. Such a thread is left behind (detached, holding
  // the store); the process is about to stop with the error anyway.
  auto answer = std::make_shared<std::promise<std::vector<std::string>>>();
  auto reported = answer->get_future();
  std::thread([this_rank = rank_, store = store_, world = world_, wait, answer, mine = "timeout\t" + op] {
    try {
      store->set("failed/" + std::to_string(this_rank), std::vector<uint8_t>(mine.begin(), mine.end()));
      std::vector<std::string> keys;
      for (int r = 0; r < world; ++r) keys.push_back("failed/" + std::to_string(r));
      // Polled rather than a store wait, whose timeout c10d logs as a warning on every rank.
      const auto deadline = std::chrono::steady_clock::now() + wait;
      while (!store->check(keys) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(milliseconds(50));
      std::vector<std::string> ops(world);  // "" where the rank did not report
      for (int r = 0; r < world; ++r)
        if (store->check({keys[r]})) {
          const auto v = store->get(keys[r]);
          ops[r].assign(v.begin(), v.end());
        }
      answer->set_value(ops);
    } catch (...) {
      answer->set_exception(std::current_exception());
    }
  }).detach();
  if (reported.wait_for(wait + milliseconds(3000)) != std::future_status::ready)
    return "the other ranks (a rank is hung, stopped or much slower, and " + where_ + " did not answer either: " +
           store_host_ + " serves it, so it may be the one stopped)";
  std::vector<std::string> ops;
  try {
    ops = reported.get();
  } catch (const std::exception& e) {
    return "the other ranks (a rank is hung, stopped or much slower; " + where_ + " failed too: " +
           strip_location(e.what()) + ")";
  }
  std::vector<int> silent, lost;
  std::map<std::string, std::vector<int>> by_op;  // the collective each rank that timed out was in
  for (int r = 0; r < world_; ++r) {
    if (ops[r].empty()) silent.push_back(job_rank_of(r));
    else if (ops[r].rfind("lost\t", 0) == 0) lost.push_back(job_rank_of(r));
    else by_op[ops[r].substr(ops[r].find('\t') + 1)].push_back(job_rank_of(r));  // "timeout\t<op>"
  }
  std::ostringstream os;
  if (!silent.empty()) {
    os << rank_list(silent) << " (hung, stopped or much slower: of the " << world_ << " ranks, "
       << (silent.size() == 1 ? "it alone" : "they") << " did not report the failure within " << seconds_str(wait);
    if (!lost.empty())
      os << "; " << rank_list(lost) << (lost.size() == 1 ? " has" : " have")
         << " lost a connection, so it may also have exited or been killed";
    os << ")";
    return os.str();
  }
  // Every rank failed in a collective of its own: not a hung rank, but ranks that disagree on what to
  // run next (or one that came so late that the others had given up).
  os << "the other ranks (every rank reported a failure:";
  const char* sep = " ";
  if (!lost.empty()) {
    os << sep << rank_list(lost) << " lost a connection";
    sep = ", ";
  }
  bool first = true;
  for (const auto& [what, ranks] : by_op) {
    os << sep << rank_list(ranks) << (first ? " timed out in " : " in ") << what;
    sep = ", ";
    first = false;
  }
  if (by_op.size() > 1) os << "; the ranks ran different collectives, so their code paths or configs differ";
  else if (lost.empty()) os << "; a rank may have entered it much later than the others";
  os << ")";
  return os.str();
}

void Comm::close(const std::string& why) {
  if (broken_.empty()) broken_ = why;
  pg_.reset();
  if (nccl_) {
    try {
      nccl_->abort();
    } catch (const std::exception&) {
      // Closing a failed group: its own errors no longer matter.
    }
    nccl_.reset();
  }
}

void Comm::check_usable(const std::string& op) const {
  DDM_CHECK(broken_.empty(), "rank " << job_rank() << ": cannot run " << op
                                     << ": the process group failed earlier and a Gloo or NCCL group cannot recover ("
                                     << broken_ << ")");
}

template <class F>
auto Comm::guarded(const std::string& op, F&& f) -> decltype(f()) {
  check_usable(op);
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(op, e.what());
  }
}

c10::intrusive_ptr<c10d::Work> Comm::allreduce_async(std::vector<at::Tensor>& tensors) {
  DDM_CHECK(!tensors.empty(), "allreduce: no tensors");
  for (const auto& t : tensors)
    DDM_CHECK(t.is_contiguous() && t.device() == tensors[0].device() && (t.device().is_cpu() || t.device().is_cuda()),
              "allreduce: tensors must be contiguous and on one device, the CPU or a CUDA GPU");
  if (world_ == 1) return c10::make_intrusive<DoneWork>();
  for (const auto& t : tensors) count_sent(2.0 * (world_ - 1) / world_ * static_cast<double>(t.nbytes()));
  return guarded("all-reduce", [&] { return carrier(tensors[0]).allreduce(tensors); });
}

void Comm::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op) {
  if (world_ == 1 || !work) return;
  try {
    work->wait();
  } catch (const std::exception& e) {
    fail(op, e.what());
  }
}

c10::intrusive_ptr<c10d::Work> Comm::send_async(at::Tensor& tensor, int peer, int tag) {
  DDM_CHECK(tensor.is_contiguous() && (tensor.device().is_cpu() || (tensor.is_cuda() && nccl_)),
            "send: the tensor must be contiguous, on the CPU or (over NCCL) on a CUDA GPU");
  DDM_CHECK(peer >= 0 && peer < world_ && peer != rank_,
            "rank " << job_rank() << ": send to rank " << peer << " in a world of " << world_);
  count_sent(static_cast<double>(tensor.nbytes()));
  std::vector<at::Tensor> ts{tensor};
  const std::string op = "send to rank " + std::to_string(job_rank_of(peer));
  return guarded(op, [&] { return carrier(tensor).send(ts, peer, tag); });
}

c10::intrusive_ptr<c10d::Work> Comm::recv_async(at::Tensor& tensor, int peer, int tag) {
  DDM_CHECK(tensor.is_contiguous() && (tensor.device().is_cpu() || (tensor.is_cuda() && nccl_)),
            "recv: the tensor must be contiguous, on the CPU or (over NCCL) on a CUDA GPU");
  DDM_CHECK(peer >= 0 && peer < world_ && peer != rank_,
            "rank " << job_rank() << ": receive from rank " << peer << " in a world of " << world_);
  std::vector<at::Tensor> ts{tensor};
  const std::string op = "receive from rank " + std::to_string(job_rank_of(peer));
  return guarded(op, [&] { return carrier(tensor).recv(ts, peer, tag); });
}

void Comm::allreduce_sum(at::Tensor& tensor) {
  std::vector<at::Tensor> ts{tensor};
  wait(allreduce_async(ts), "all-reduce");
}

void Comm::broadcast(at::Tensor& tensor, int root) {
  DDM_CHECK(root >= 0 && root < world_, "broadcast: root " << root << " is not a rank of a world of " << world_);
  DDM_CHECK(tensor.is_contiguous(), "broadcast: the tensor must be contiguous");
  if (world_ == 1) return;
  std::vector<at::Tensor> ts{tensor};
  if (rank_ == root) count_sent(static_cast<double>(world_ - 1) * static_cast<double>(tensor.nbytes()));
  c10d::BroadcastOptions o;
  o.rootRank = root;
  wait(guarded("broadcast", [&] { return carrier(tensor).broadcast(ts, o); }), "broadcast");
}

void Comm::barrier() {
  if (world_ == 1) return;
  wait(guarded("barrier", [&] { return pg_->barrier(); }), "barrier");
}

int64_t Comm::max_int(int64_t v) {
  if (world_ == 1) return v;
  auto t = torch::tensor({v}, torch::kInt64);
  std::vector<at::Tensor> ts{t};
  count_sent(2.0 * (world_ - 1) / world_ * static_cast<double>(t.nbytes()));
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  wait(guarded("max-reduce", [&] { return pg_->allreduce(ts, o); }), "max-reduce");
  return t.item<int64_t>();
}

std::vector<at::Tensor> Comm::gather(const at::Tensor& tensor, int root) {
  DDM_CHECK(root >= 0 && root < world_, "gather: root " << root << " is not a rank of a world of " << world_);
  DDM_CHECK(tensor.is_contiguous(), "gather: the tensor must be contiguous");
  if (world_ == 1) return {tensor.is_cpu() ? tensor.clone() : tensor.to(torch::kCPU)};
  std::vector<at::Tensor> inputs{tensor.to(torch::kCPU)};  // Gloo gathers host tensors
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank_ == root) {
    outputs.emplace_back();
    for (int r = 0; r < world_; ++r) outputs[0].push_back(torch::empty_like(inputs[0]));
  } else {
    count_sent(static_cast<double>(tensor.nbytes()));
  }
  c10d::GatherOptions o;
  o.rootRank = root;
  wait(guarded("gather", [&] { return pg_->gather(outputs, inputs, o); }), "gather");
  return rank_ == root ? outputs[0] : std::vector<at::Tensor>{};
}

void Comm::scatter(const std::vector<at::Tensor>& parts, at::Tensor& out, int root) {
  DDM_CHECK(root >= 0 && root < world_, "scatter: root " << root << " is not a rank of a world of " << world_);
  DDM_CHECK(out.is_contiguous(), "scatter: the output tensor must be contiguous");
  if (rank_ == root) {
    DDM_CHECK(static_cast<int>(parts.size()) == world_, "scatter: " << parts.size() << " parts for " << world_ << " ranks");
    for (const auto& p : parts)
      DDM_CHECK(p.sizes() == out.sizes() && p.dtype() == out.dtype(), "scatter: every part must match the output tensor");
  }
  if (world_ == 1) {
    out.copy_(parts[0]);
    return;
  }
  // Gloo scatters host tensors: a GPU output receives on the host first.
  at::Tensor host = out.is_cpu() ? out : torch::empty_like(out, torch::kCPU);
  std::vector<at::Tensor> outputs{host};
  std::vector<std::vector<at::Tensor>> inputs;
  if (rank_ == root) {
    inputs.emplace_back();
    for (const auto& p : parts) inputs[0].push_back(p.to(torch::kCPU).contiguous());
    count_sent(static_cast<double>(world_ - 1) * static_cast<double>(out.nbytes()));
  }
  c10d::ScatterOptions o;
  o.rootRank = root;
  wait(guarded("scatter", [&] { return pg_->scatter(outputs, inputs, o); }), "scatter");
  if (!out.is_cpu()) out.copy_(host);
}

std::vector<std::string> Comm::all_gather_strings(const std::string& s) {
  if (world_ == 1) return {s};
  // Lengths first, then the strings padded to the longest, as uint8 tensors.
  auto gather = [&](const at::Tensor& in) {
    std::vector<at::Tensor> inputs{in};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_; ++r) outputs[0].push_back(torch::empty_like(in));
    count_sent(static_cast<double>(world_ - 1) * static_cast<double>(in.nbytes()));
    wait(guarded("all-gather", [&] { return pg_->allgather(outputs, inputs); }), "all-gather");
    return outputs[0];
  };
  const auto lens = gather(torch::tensor({static_cast<int64_t>(s.size())}, torch::kInt64));
  int64_t longest = 1;
  for (const auto& l : lens) longest = std::max(longest, l.item<int64_t>());
  auto padded = torch::zeros({longest}, torch::kUInt8);
  std::copy(s.begin(), s.end(), padded.data_ptr<uint8_t>());
  const auto all = gather(padded);
  std::vector<std::string> out;
  for (int r = 0; r < world_; ++r) {
    const auto* p = all[r].data_ptr<uint8_t>();
    out.emplace_back(p, p + lens[r].item<int64_t>());
  }
  return out;
}

void Comm::check_same(const std::vector<std::pair<std::string, std::string>>& key_values, const std::string& what) {
  if (world_ == 1) return;
  // Serialize as length-prefixed key and value, so no separator can be ambiguous.
  std::string blob;
  for (const auto& [k, v] : key_values)
    blob += std::to_string(k.size()) + ":" + k + std::to_string(v.size()) + ":" + v;
  const auto h = static_cast<int64_t>(fnv1a(blob));
  // Cheap path, one tiny all-reduce: the hashes agree iff max(h) == min(h) = ~max(~h).
  auto t = torch::tensor({h, ~h}, torch::kInt64);
  std::vector<at::Tensor> ts{t};
  count_sent(2.0 * (world_ - 1) / world_ * static_cast<double>(t.nbytes()));
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  wait(guarded("comparing " + what, [&] { return pg_->allreduce(ts, o); }), "comparing " + what);
  if (t[0].item<int64_t>() == ~t[1].item<int64_t>()) return;
  const auto blobs = all_gather_strings(blob);
  std::vector<std::map<std::string, std::string>> maps(world_);
  std::vector<std::string> order;  // keys in first-seen order
  for (int r = 0; r < world_; ++r) {
    const std::string& b = blobs[r];
    size_t i = 0;
    std::string kv[2];
    while (i < b.size()) {
      for (auto& part : kv) {
        const size_t colon = b.find(':', i);
        const size_t n = std::stoul(b.substr(i, colon - i));
        part = b.substr(colon + 1, n);
        i = colon + 1 + n;
      }
      if (!maps[r].count(kv[0]) && std::find(order.begin(), order.end(), kv[0]) == order.end()) order.push_back(kv[0]);
      maps[r][kv[0]] = kv[1];
    }
  }
  std::ostringstream os;  // the keys that differ, in the first rank's order: the first 5, then a count
  constexpr int kNamed = 5;
  int differ = 0;
  for (const auto& key : order) {
    // Group ranks by value: "ranks 0, 2 have 0.002, rank 1 has 0.001".
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (int r = 0; r < world_; ++r) {
      auto it = maps[r].find(key);
      const std::string v = it == maps[r].end() ? "(not set)" : it->second;
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == v; });
      if (g == groups.end()) groups.push_back({v, {r}});
      else g->second.push_back(r);
    }
    if (groups.size() == 1 || ++differ > kNamed) continue;
    os << (differ == 1 ? "ranks disagree on " : "; on ") << key << ": ";
    for (size_t i = 0; i < groups.size(); ++i) {
      const auto& ranks = groups[i].second;
      os << (i ? ", " : "") << (ranks.size() == 1 ? "rank " : "ranks ");
      for (size_t j = 0; j < ranks.size(); ++j) os << (j ? "," : "") << ranks[j];
      os << (ranks.size() == 1 ? " has " : " have ") << groups[i].first;
    }
  }
  if (differ > 0) {
    if (differ > kNamed) os << "; and " << differ - kNamed << " more key" << (differ - kNamed == 1 ? "" : "s");
    os << " (" << what << "); every rank must run the same " << what;
    throw InputError(os.str());  // the job's input: a restart would find the same
  }
  throw InputError("ranks disagree on " + what + " (same keys and values, different order); every rank must run the same " +
                   what);
}

}  // namespace ddm
