// Process-wide runtime settings for training on CPU.
#pragma once

namespace ddm {

// ddm's binaries run on tcmalloc (linked in, CMakeLists.txt: DDM_TCMALLOC), which keeps a step's
// large buffers for the next step by itself; there this call changes nothing (tcmalloc ignores
// mallopt). For a build on glibc's allocator (-DDDM_TCMALLOC=OFF) it keeps freed memory in the heap
// instead of returning it to the OS after each step: blocks up to 32 MiB, glibc's largest mmap
// threshold (larger ones are still mapped afresh each time; docs/results.md, "The allocator").
// Call once from main().
void configure_allocator();

// Bytes the process's allocator has handed out and not taken back (tcmalloc's count; ASan's in the
// sanitizer build; glibc's heap and mapped chunks in a build on glibc).
double allocated_bytes();

// Peak resident memory of this process so far, in MiB.
double peak_rss_mib();

}  // namespace ddm
