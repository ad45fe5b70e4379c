// Fuzz target: a WebDataset tar shard read from memory (libarchive through TarShardReader), every
// sample's label parsed as the loader does.
#include "data/shards.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ddm::fuzz::expect_errors([&] {
    ddm::TarShardReader r(reinterpret_cast<const char*>(data), size, "fuzz.tar");
    ddm::ShardSample s;
    while (r.next(s)) ddm::fuzz::expect_errors([&] { (void)ddm::sample_label(s, "fuzz.tar " + s.key); });
  });
  return 0;
}
