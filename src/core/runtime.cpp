// Process-wide runtime settings (see runtime.h).
#include "core/runtime.h"

#include <malloc.h>
#include <sys/resource.h>

#include <cstdlib>
#include <fstream>
#include <string>

#if defined(DDM_TCMALLOC)  // defined for this file when the binaries link tcmalloc (CMakeLists.txt)
#include <gperftools/malloc_extension_c.h>
#elif defined(__SANITIZE_ADDRESS__)
#define DDM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DDM_ASAN 1
#endif
#endif
#ifdef DDM_ASAN
#include <sanitizer/allocator_interface.h>
#endif

namespace ddm {

void configure_allocator() {
#ifdef M_MMAP_THRESHOLD
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);  // glibc's maximum: serve up to 32 MiB from the heap
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);  // do not give the heap's top back after each step
  mallopt(M_TOP_PAD, 64 * 1024 * 1024);
#endif
}

double allocated_bytes() {
#if defined(DDM_TCMALLOC)
  size_t bytes = 0;
  MallocExtension_GetNumericProperty("generic.current_allocated_bytes", &bytes);
  return static_cast<double>(bytes);
#elif defined(DDM_ASAN)
  return static_cast<double>(__sanitizer_get_current_allocated_bytes());
#else
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
#endif
}

double peak_rss_mib() {
  // VmHWM: this program's own high-water mark. getrusage's ru_maxrss survives execve, so under a
  // launcher that forks and execs it (torchrun's Python agent) it would report the launcher's peak.
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;  // in kB
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

}  // namespace ddm
