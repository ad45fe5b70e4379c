// Shared by the libFuzzer targets (fuzz/fuzz_*.cpp, built by the sanitizer build, see
// docs/testing.md). A target hands the fuzzer's bytes to one of ddm's parsers of outside input.
// A ddm::Error is the expected outcome for bad input and is swallowed (call through expect_errors);
// anything else that escapes (std::out_of_range, nlohmann or c10 exceptions, std::bad_alloc) ends in
// std::terminate, and libFuzzer reports it as a crash together with ASan/UBSan findings.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <torch/types.h>

#include "core/error.h"

namespace ddm::fuzz {

// A directory of this process's own under the temp dir (TMPDIR), removed at exit. Targets whose
// parser takes a path write the input there.
inline const std::string& scratch_dir() {
  // Never freed: the atexit handler runs after static destructors would have run.
  static const std::string* dir = [] {
    std::string templ = (std::filesystem::temp_directory_path() / "ddm-fuzz-XXXXXX").string();
    if (!mkdtemp(templ.data())) std::abort();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return new std::string(templ);
  }();
  return *dir;
}

inline void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!f) std::abort();
}

inline std::string as_string(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// One thread for LibTorch: the inputs are tiny and a thread pool only adds noise.
inline void init_torch() { torch::set_num_threads(1); }

// Runs f; a ddm::Error (bad input, reported to the user) is fine, everything else escapes.
template <class F>
bool expect_errors(F&& f) {
  try {
    f();
    return true;
  } catch (const ddm::Error&) {
    return false;
  }
}

// Reads every byte of a tensor in instrumented code (a copy through memcpy, which ASan checks), so
// that a tensor over freed or foreign memory is reported here rather than silently copied by an
// uninstrumented LibTorch kernel.
inline volatile char touch_sink;  // keeps the copy below from being optimized away
inline void touch(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return;
  const torch::Tensor c = t.is_contiguous() ? t : t.contiguous();
  std::string copy(static_cast<size_t>(c.nbytes()), '\0');
  std::memcpy(copy.data(), c.data_ptr(), copy.size());
  touch_sink = copy.back();
}

}  // namespace ddm::fuzz
