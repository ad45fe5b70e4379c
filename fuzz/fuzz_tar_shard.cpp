// Fuzz target: a WebDataset tar shard read from memory (libarchive through TarShardReader), every
// sample's label and caption parsed as the loader does; then read again as the scan and a resumed stream read it,
// skipping the data of the members a filter leaves out.
#include "data/captions.h"
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
    while (r.next(s)) {
      ddm::fuzz::expect_errors([&] { (void)ddm::sample_label(s, "fuzz.tar " + s.key); });
      ddm::fuzz::expect_errors([&] { (void)ddm::sample_caption(s, "fuzz.tar " + s.key); });
    }
  });
  ddm::fuzz::expect_errors([&] {
    ddm::TarShardReader r(reinterpret_cast<const char*>(data), size, "fuzz.tar");
    r.set_filter([](int64_t sample, const std::string& ext) { return sample % 2 == 1 || ext == "cls"; });
    ddm::ShardSample s;
    while (r.next(s)) {
    }
  });
  return 0;
}
