// Loading libddm_cuda.so (see cuda_load.h).
#include "core/cuda_load.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <mutex>

#include "core/error.h"

namespace ddm {
namespace {

struct State {
  std::mutex mu;
  bool tried = false;
  const CudaModule* module = nullptr;
  std::string status = "not loaded: load_cuda() was not called in this process";
};

State& state() {
  static State s;
  return s;
}

// The directory of this process's executable, with a trailing slash ("" if unknown).
std::string executable_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/') + 1);
}

// Whether the NVIDIA driver's library (what the CUDA runtime opens) can be opened here.
bool driver_present() {
  void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (h == nullptr) return false;
  dlclose(h);
  return true;
}

void load(State& s, bool always) {
  const char* env = std::getenv("DDM_CUDA");
  const std::string want = always ? "1" : env != nullptr ? env : "";
  if (want == "0") {
    s.status = "not loaded: DDM_CUDA=0";
    return;
  }
  const bool driver = driver_present();
  if (want != "1" && !driver) {
    s.status = "not loaded: no NVIDIA driver here (libcuda.so.1 cannot be opened)";
    return;
  }
  const std::string path = executable_dir() + "libddm_cuda.so";
  // Global: LibTorch's CUDA libraries it pulls in are then visible as a binary linked with them sees them.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    const char* why = dlerror();
    s.status = "not loaded: " + path + " cannot be opened (" + (why != nullptr ? why : "no reason given") +
               "); it is built beside ddm's binaries (scripts/setup.sh), keep it with them";
  } else if (auto* get = reinterpret_cast<decltype(&ddm_cuda_module)>(dlsym(h, "ddm_cuda_module")); get == nullptr) {
    s.status = "not loaded: " + path + " has no ddm_cuda_module (a library of another build?): rebuild with scripts/setup.sh";
  } else if (const CudaModule* m = get(kCudaModuleInterface); m == nullptr) {
    s.status = "not loaded: " + path + " was built for another version of ddm (a stale build beside this binary): rebuild "
               "with scripts/setup.sh";
  } else {
    s.module = m;
    s.status = "loaded";
    return;
  }
  if (driver) std::cerr << "warning: an NVIDIA driver is present, but CUDA is unavailable in this process: " << s.status << "\n";
}

}  // namespace

void load_cuda(bool always) {
  if (const char* env = std::getenv("DDM_CUDA"); !always && env != nullptr && *env != '\0' &&
                                                 std::string(env) != "0" && std::string(env) != "1") {
    // At a process's start, before any error handler (and before the lock below): said and ended
    // here, as ddm ends on bad input.
    std::cerr << "error: DDM_CUDA=" << env << ": expected 1 (always load ddm's CUDA module) or 0 (never); unset it "
              << "for the default, where an NVIDIA driver is (docs/gpu.md)" << std::endl;
    std::exit(kExitBadInput);
  }
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  if (s.module != nullptr || (s.tried && !always)) return;
  s.tried = true;
  load(s, always);
}

bool cuda_loaded() { return state().module != nullptr; }

std::string cuda_status() { return state().status; }

const CudaModule* loaded_cuda_module() { return state().module; }

}  // namespace ddm
