// The LibTorch ddm is built against: PyTorch 2.11's from the torch wheel (CUDA 13.0 build). ddm's
// binaries link its CPU libraries; its CUDA half (libtorch_cuda, NCCL's process group) comes with
// libddm_cuda.so (core/cuda_module.h), which this program loads although the machine may have no
// driver, to check it: it loads, LibTorch's CUDA library with it, CUDA is answered without a GPU, its
// CPU ops run, c10d's Gloo comes from the wheel, and NCCL's process group is there (tests/gpu/test_cuda.cpp
// runs it on a GPU). tests/unit/core/test_device.cpp checks that a process without a driver loads none of it.
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
#include "core/cuda_load.h"

namespace {
// Before any test asks LibTorch about CUDA (at static initialization, as test_util.cpp's own load).
const bool module_loaded = (ddm::load_cuda(/*always=*/true), true);

std::string maps() {
  std::ifstream in("/proc/self/maps");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

TEST(TorchBuild, IsLibTorch211WithItsCudaLibraryLoadedByTheModule) {
  EXPECT_EQ(TORCH_VERSION_MAJOR, 2);
  EXPECT_EQ(TORCH_VERSION_MINOR, 11);
  ASSERT_TRUE(module_loaded);
  EXPECT_TRUE(ddm::cuda_loaded()) << ddm::cuda_status();
  EXPECT_EQ(ddm::cuda_status(), "loaded");
  const std::string m = maps();
  EXPECT_NE(m.find("/libtorch_cpu.so"), std::string::npos);
  EXPECT_NE(m.find("/libddm_cuda.so"), std::string::npos);
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
