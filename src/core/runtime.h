// Process-wide runtime settings for training on CPU.
#pragma once

namespace ddm {

// Keeps freed memory in the heap instead of returning it to the OS. A training step allocates and
// frees the same large activation buffers every iteration; with glibc's defaults, buffers above
// its (dynamic) mmap threshold are mapped and unmapped each time and every page faults on first
// touch, which cost 10-15% of a DiT step here (measured in docs/results.md). Call once from main().
void configure_allocator();

// Peak resident memory of this process so far, in MiB.
double peak_rss_mib();

}  // namespace ddm
