// Loading libddm_cuda.so, LibTorch's CUDA half (core/cuda_module.h says what it holds and why): at a
// process's start, where an NVIDIA driver is present. Free of LibTorch's headers, as it must run
// before anything asks LibTorch about CUDA. DDM_CUDA=0 in the environment never loads it, DDM_CUDA=1
// always does, driver or not (what the tests use to check the module on a machine without a GPU); any
// other value but the empty one ends the process with an error (exit status 2).
#pragma once
#include <string>

namespace ddm {

class CudaModule;

// Opens libddm_cuda.so where a driver is present or DDM_CUDA=1 asks, or `always` (once: later calls
// do nothing, but one with `always` where the first did not load it). Where a driver is present and
// it cannot be opened, says so on stderr (CUDA is then unavailable in this process, and asking for
// it names why).
void load_cuda(bool always = false);

// Whether it is loaded, and a line for `ddm --version` and errors: "loaded" or why not.
bool cuda_loaded();
std::string cuda_status();

// The module, or nullptr where it is not loaded (core/cuda_module.h's cuda_module() names why).
const CudaModule* loaded_cuda_module();

}  // namespace ddm

namespace ddm {
// The version of core/cuda_module.h's interface: raise it with every change there, so that a binary
// never calls into a libddm_cuda.so of another interface (a stale build beside it).
inline constexpr int kCudaModuleInterface = 3;
}  // namespace ddm

// The module's one exported function (src/cuda/module.cpp): its CudaModule, which lives as long as
// the process, or nullptr where `interface` is not the one it was built with.
extern "C" const ddm::CudaModule* ddm_cuda_module(int interface);
