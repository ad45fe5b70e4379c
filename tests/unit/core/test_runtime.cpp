// The process runtime ddm's binaries run on (src/core/runtime.h): the memory allocator. A training or
// sampling step allocates and frees the same large activation buffers every iteration (dit-small's
// MLP at batch 128: 77 MB each); the allocator must hand them back without new page faults and
// without the heap growing from step to step. And its count of bytes in use, which the pipeline's
// profiler reads (activation bytes per unit), follows what is allocated.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include <torch/torch.h>

#include "core/runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#define DDM_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DDM_TEST_ASAN 1
#endif
#endif

namespace {
#ifndef DDM_TEST_ASAN  // the helpers of the two tests that the sanitizer build skips

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);  // every thread of the process (LibTorch's pool touches pages too)
  return usage.ru_minflt;
}

double resident_mib() {
  std::ifstream in("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  in >> pages_total >> pages_resident;
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

// One "step": two 80 MB activations, written, then a 160 MB one made from both; all freed.
void step() {
  const int64_t n = 80 * 1024 * 1024 / 4;
  torch::Tensor a = torch::empty({n}).fill_(1.0f);
  torch::Tensor b = torch::empty({n}).fill_(2.0f);
  torch::Tensor c = torch::cat({a, b});
  a.reset();
  b.reset();
  ASSERT_EQ(c.numel(), 2 * n);
}

#endif
}  // namespace

TEST(Allocator, IsTcmallocOutsideTheSanitizerBuild) {
#ifdef DDM_TEST_ASAN
  GTEST_SKIP() << "the sanitizer build runs on AddressSanitizer's allocator";
#else
  std::ifstream in("/proc/self/maps");
  std::stringstream maps;
  maps << in.rdbuf();
  EXPECT_NE(maps.str().find("libtcmalloc_minimal"), std::string::npos)
      << "ddm's binaries link gperftools' tcmalloc (CMakeLists.txt, DDM_TCMALLOC)";
#endif
}

TEST(Allocator, LargeStepBuffersAreReusedWithoutFaultsOrGrowth) {
#ifdef DDM_TEST_ASAN
  GTEST_SKIP() << "the sanitizer build runs on AddressSanitizer's allocator, which maps every large block afresh";
#else
  ddm::configure_allocator();  // as main() does
  for (int i = 0; i < 4; ++i) step();  // warm-up: the first steps fault their pages in
  const long faults_before = minor_faults();
  const double rss_before = resident_mib();
  const int steps = 16;
  for (int i = 0; i < steps; ++i) step();
  const double faults_per_step = static_cast<double>(minor_faults() - faults_before) / steps;
  const double pages_per_step = 320.0 * 1024 * 1024 / static_cast<double>(sysconf(_SC_PAGESIZE));
  // glibc maps blocks this large afresh each time (above its 32 MiB mmap maximum): every page faults,
  // 81920 per step. A reused heap faults on a few pages at most.
  EXPECT_LT(faults_per_step, 0.05 * pages_per_step) << "each step faulted its buffers' pages in again";
  // Neither does the heap grow from step to step (fragmentation): the same 320 MB serve every step.
  EXPECT_LT(resident_mib() - rss_before, 32.0) << "resident memory grew over " << steps << " identical steps";
#endif
}

TEST(Allocator, CountsTheBytesInUse) {
  const double before = ddm::allocated_bytes();
  const double mb = 1024.0 * 1024.0;
  torch::Tensor a = torch::empty({10 * 1024 * 1024 / 4});  // 10 MiB
  const double with = ddm::allocated_bytes();
  EXPECT_GE(with - before, 10 * mb);
  EXPECT_LT(with - before, 11 * mb);  // the block and LibTorch's few bytes of bookkeeping
  a.reset();
  EXPECT_LT(ddm::allocated_bytes() - before, 1 * mb);
}
