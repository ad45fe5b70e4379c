// The LibTorch ddm is built against: PyTorch 2.11's from the torch wheel (CUDA 13.0 build), with
// libtorch_cuda loaded although ddm names none of its symbols (so that CUDA tensors work where a GPU
// exists), its CPU ops running on a machine without one, c10d's Gloo from the wheel, and its NCCL
// process group compiled into ddm and linked (tests/gpu/test_cuda.cpp runs it on a GPU).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <thread>
#include <vector>
#include <string>

#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/comm.h"
#include "comm/nccl.h"

namespace {
std::string maps() {
  std::ifstream in("/proc/self/maps");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

TEST(TorchBuild, IsLibTorch211WithItsCudaLibraryLoaded) {
  EXPECT_EQ(TORCH_VERSION_MAJOR, 2);
  EXPECT_EQ(TORCH_VERSION_MINOR, 11);
  const std::string m = maps();
  EXPECT_NE(m.find("/libtorch_cpu.so"), std::string::npos);
  EXPECT_NE(m.find("/libtorch_cuda.so"), std::string::npos) << "libtorch_cuda is not loaded: CUDA ops would be missing";
  // One OpenMP runtime in the process: the wheel's (ddm's own parallel loops link it too).
  size_t gomps = 0;
  std::istringstream lines(m);
  std::string line, seen;
  while (std::getline(lines, line)) {
    const size_t at = line.find('/');
    if (at == std::string::npos || line.find("libgomp") == std::string::npos) continue;
    if (line.substr(at) != seen) ++gomps, seen = line.substr(at);
  }
  EXPECT_EQ(gomps, 1u) << m;
}

// Without a GPU, asking for CUDA is an answer, not a crash; CPU ops run as ever.
TEST(TorchBuild, CpuOpsRunAndCudaIsAnsweredWithoutAGpu) {
  const auto a = torch::arange(6, torch::kFloat).reshape({2, 3});
  EXPECT_TRUE(torch::equal(torch::matmul(a, a.t()), torch::tensor({{5.f, 14.f}, {14.f, 50.f}})));
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU (tests/gpu checks it)";
  EXPECT_EQ(torch::cuda::device_count(), 0);
  EXPECT_THROW(torch::zeros({1}, torch::kCUDA), c10::Error);
}

// The Gloo inside the wheel's libtorch_cpu runs ddm's collectives (two ranks as threads).
TEST(TorchBuild, GlooFromTheWheelAllReduces) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<torch::Tensor> out(2);
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        auto comm = ddm::Comm::create_for_test(store, r, 2, ddm::CommOptions{});
        out[static_cast<size_t>(r)] = torch::full({4}, static_cast<float>(r + 1));
        comm->allreduce_sum(out[static_cast<size_t>(r)]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  for (const auto& t : out) EXPECT_TRUE(torch::equal(t, torch::full({4}, 3.f)));
}

// ProcessGroupNCCL is in the build: NCCL's version is answered without a GPU, and asking for an NCCL
// group on a machine without one is a ddm::Error naming the rank and NCCL on every rank, not a crash
// or a hang.
TEST(TorchBuild, NcclIsLinkedAndWithoutAGpuIsAClearError) {
  const std::string v = ddm::nccl_version();
  EXPECT_EQ(v.rfind("2.", 0), 0u) << v;
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU (tests/gpu/test_cuda.cpp forms NCCL groups)";
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      ddm::CommOptions o;
      o.nccl_device = 0;
      o.timeout = std::chrono::seconds(20);
      o.connect_timeout = std::chrono::seconds(20);
      try {
        auto comm = ddm::Comm::create_for_test(store, r, 2, o);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("rank " + std::to_string(r) + ": connecting the NCCL group on cuda:0 failed"), std::string::npos) << e;
  }
}
