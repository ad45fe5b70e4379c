// The stop a process was asked for (see stop_signal.h).
#include "core/stop_signal.h"

#include <atomic>

namespace ddm {
namespace {

std::atomic<int> g_stop{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

}  // namespace

int stop_signal() { return g_stop.load(); }
void set_stop_signal(int sig) { g_stop.store(sig); }

}  // namespace ddm
