// The stop a process was asked for: SIGINT or SIGTERM, caught while a run trains (run/trainer.cpp
// installs the handlers that set it), 0 if none. Process-wide, so that a wait deep inside a run can
// end on it: a DiLoCo replica regrouping after a lost peer (comm/elastic.cpp) waits up to the
// collective timeout for rank 0, and a launcher that is stopping the job (it lost a worker) must not
// wait that long for the replica to notice.
#pragma once

namespace ddm {

int stop_signal();
void set_stop_signal(int sig);  // async-signal-safe: called from the handlers

}  // namespace ddm
