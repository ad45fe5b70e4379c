// libddm_cuda.so (src/cuda/, core/cuda_module.h) on a machine without a GPU: loaded on request, it
// brings LibTorch's CUDA library with it, exports its one function and nothing else, serves only
// binaries of its own interface version, and answers
// without a GPU as LibTorch does: errors to catch, not crashes. tests/gpu/test_cuda.cpp runs what it
// holds (graphs, streams, NCCL) on a GPU.
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "core/cuda_graph.h"
#include "core/cuda_module.h"
#include "test_util.h"

namespace {

using namespace ddm;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Before any test asks LibTorch about CUDA (static initialization, as test_util.cpp's own load).
const bool module_loaded = (load_cuda(/*always=*/true), true);

TEST(CudaModule, LoadsOnRequestWithLibTorchsCudaLibraryAndExportsOneFunction) {
  ASSERT_TRUE(module_loaded);
  ASSERT_TRUE(cuda_loaded()) << cuda_status();
  std::ifstream in("/proc/self/maps");
  std::stringstream maps;
  maps << in.rdbuf();
  EXPECT_TRUE(has(maps.str(), "/libtorch_cuda.so"));
  // Beside this program, as beside every binary of the build.
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  void* h = dlopen((exe.substr(0, exe.rfind('/')) + "/libddm_cuda.so").c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(h, nullptr) << "libddm_cuda.so is not loaded from beside " << exe;
  auto* get = reinterpret_cast<decltype(&ddm_cuda_module)>(dlsym(h, "ddm_cuda_module"));
  ASSERT_NE(get, nullptr);
  EXPECT_EQ(get(kCudaModuleInterface), loaded_cuda_module());
  // A binary of another interface version gets nothing to call into (the loader then says so).
  EXPECT_EQ(get(kCudaModuleInterface + 1), nullptr);
  // Its own functions are hidden: nothing of the binary's can bind to them by name.
  EXPECT_EQ(dlsym(h, "_ZN3ddm4cuda10make_graphEv"), nullptr);
  EXPECT_EQ(dlsym(h, "_ZN3ddm4cuda12nccl_versionB5cxx11Ev"), nullptr);
  dlclose(h);
  EXPECT_EQ(cuda_module().nccl_version().rfind("2.", 0), 0u) << cuda_module().nccl_version();
}

TEST(CudaModule, WithoutAGpuItsAnswersAreErrorsNotCrashes) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU (tests/gpu/test_cuda.cpp uses the module there)";
  EXPECT_EQ(torch::cuda::device_count(), 0u);
  EXPECT_THROW(torch::zeros({1}, torch::kCUDA), c10::Error);
  EXPECT_ANY_THROW(cuda_module().device_name(0));
  EXPECT_ANY_THROW(cuda_module().graph_stream(0));
  EXPECT_ANY_THROW(cuda_module().current_stream(0));
  // ddm's side of the graphs: a CPU device is refused before the module is asked.
  EXPECT_TRUE(has(test::error_message([] { GraphStream s(torch::Device(torch::kCPU)); }),
                        "CUDA graphs need a CUDA device, not cpu"));
  CapturedGraph g;
  EXPECT_FALSE(g.captured());
  EXPECT_TRUE(has(test::error_message([&] { g.replay(); }), "nothing was captured"));
}

}  // namespace
