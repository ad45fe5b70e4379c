// Process-wide runtime settings (see runtime.h).
#include "core/runtime.h"

#include <malloc.h>

namespace ddm {

void configure_allocator() {
#ifdef M_MMAP_THRESHOLD
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);  // glibc's maximum: serve up to 32 MiB from the heap
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);  // do not give the heap's top back after each step
  mallopt(M_TOP_PAD, 64 * 1024 * 1024);
#endif
}

}  // namespace ddm
