// Process-wide runtime settings (see runtime.h).
#include "core/runtime.h"

#include <malloc.h>
#include <sys/resource.h>

namespace ddm {

void configure_allocator() {
#ifdef M_MMAP_THRESHOLD
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);  // glibc's maximum: serve up to 32 MiB from the heap
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);  // do not give the heap's top back after each step
  mallopt(M_TOP_PAD, 64 * 1024 * 1024);
#endif
}

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

}  // namespace ddm
