// The other process of the DistProcess tests (tests/unit/comm/test_comm.cpp), configured by the
// environment like a real launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
//   no argument: rank 1 of a job of two. It all-reduces, gathers, agrees and meets a barrier with the
//     parent, then waits to be killed (the parent checks what its peer sees when this rank dies
//     mid-collective).
//   "store-host": rank 0, serving the job's store; it all-reduces once with the parent's ranks, then
//     waits (the parent stops it with SIGSTOP, then kills it).
// Its exit status says which step failed: 2 all-reduce, 3 gather, 4 an error, 5 it was not killed.
#include <unistd.h>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "comm/comm.h"
#include "comm/env.h"
#include "core/cuda_load.h"
#include "unit/test_dist_util.h"

int main(int argc, char** argv) {
  ddm::load_cuda();  // before anything asks LibTorch about CUDA (core/cuda_load.h)
  alarm(60);  // never outlive a broken parent
  const bool store_host = argc > 1 && std::string(argv[1]) == "store-host";
  try {
    auto comm = ddm::Comm::create(ddm::detect_dist_env(), ddm::test::short_timeouts());
    auto t = torch::full({3}, 2.0f);
    if (store_host) {
      comm->allreduce_sum(t);
      pause();  // until the parent kills us
      _exit(5);
    }
    comm->allreduce_sum(t);
    if (!torch::equal(t, torch::full({3}, 3.0f))) return 2;
    if (comm->all_gather_strings("child") != std::vector<std::string>{"parent", "child"}) return 3;
    comm->check_same({{"k", "v"}}, "config");
    comm->barrier();
    pause();  // until the parent kills us
  } catch (...) {
    _exit(4);
  }
  _exit(5);
}
