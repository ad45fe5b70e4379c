// Where a process computes: `train.device` / `--device` = auto | cpu | cuda | cuda:N (docs/gpu.md).
// auto takes the GPU of this process's LOCAL_RANK when LibTorch sees a CUDA GPU, else the CPU; cuda
// the same, but no GPU is an error; cuda:N that GPU. Every failure says what was asked, what this
// machine has, and what to write instead.
//
// Also how a process computes there: configure_math (TF32, deterministic algorithms) and Autocast
// (train.precision = bf16: bfloat16 autocast around forward passes, float32 everywhere else).
#pragma once
#include <string>

#include <torch/types.h>

#include "core/config.h"

namespace ddm {

// Checks the spelling alone (no GPU needed): config validation. `key` names it in the error.
void check_device_spec(const std::string& spec, const std::string& key);
// The device `spec` means for the process of node-local rank `local_rank` on a machine with
// `cuda_count` CUDA GPUs (the rule above; testable without a GPU).
torch::Device resolve_device(const std::string& spec, int local_rank, int cuda_count, const std::string& key);
// The same on this machine (LibTorch's CUDA device count).
torch::Device resolve_device(const std::string& spec, int local_rank, const std::string& key);

// Process-wide math settings for computing on `device`, called once before its first op there.
// fp32 means float32: TF32 is off in cuBLAS and cuDNN (PyTorch leaves it on for cuDNN's
// convolutions), so a GPU step equals the CPU's within float32 rounding. deterministic: LibTorch's
// deterministic algorithms and cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, unless already set),
// so a run repeats bit for bit on the same card and software; otherwise cuDNN may pick the fastest
// convolution algorithm by timing it (benchmark mode). Nothing to do on the CPU.
void configure_math(torch::Device device, bool deterministic);

// `t` on `device` without the host waiting: a CPU tensor goes to a GPU through pinned memory, copied
// on the current stream while the host goes on (the caching host allocator keeps the pinned buffer
// until the copy is done); a plain `.to(device)` from pageable memory waits for everything queued on
// the stream first. Elsewhere t.to(device). The keyed draws of a step and the batches take this way.
torch::Tensor to_device_async(const torch::Tensor& t, torch::Device device);

// For measuring on `device` (profiles, timelines): waits for its queued work (nothing to wait for
// on the CPU); the bytes its tensors take now (the host allocator's, core/runtime.h, or CUDA's
// caching allocator's); its model name ("NVIDIA H100 80GB HBM3"; empty for the CPU, whose name
// /proc/cpuinfo gives).
void synchronize(torch::Device device);
double allocated_bytes_on(torch::Device device);
// The most memory this process has held for its work on `device` so far: on a GPU the peak of the
// bytes its tensors took (CUDA's caching allocator's statistics); on the CPU the process's peak
// resident set (weights, optimizer, activations, data and the libraries alike).
double peak_memory_bytes_on(torch::Device device);
std::string gpu_name(torch::Device device);

// bfloat16 autocast on `device`'s type while alive when `precision` is bf16 (otherwise nothing):
// matmuls, convolutions and attention run in bfloat16, reductions and losses in float32, and the
// backward of what ran inside follows the same types. Nests; restores what was set before.
class Autocast {
 public:
  Autocast(torch::Device device, Precision precision);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool on_ = false;
  c10::DeviceType type_;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kFloat;
};

// While alive, autocast's bfloat16 copies of the weights (made at a weight's first use inside an
// Autocast) outlive the Autocast regions inside it, until this ends: a sampler's steps cast each weight
// once instead of once a step (a pass over the weights and a launch per weight each step: 4% of a routed
// ensemble's kernel time on an H200), at the cost of holding those copies (2 bytes a parameter) while it
// lives. Only for code that does not change the weights meanwhile.
class AutocastWeightCache {
 public:
  AutocastWeightCache();
  ~AutocastWeightCache();
  AutocastWeightCache(const AutocastWeightCache&) = delete;
  AutocastWeightCache& operator=(const AutocastWeightCache&) = delete;
};

// While alive, autocast casts the weights afresh at every use (its cache off): for code whose tensors
// must not be ones that an AutocastWeightCache frees, e.g. a CUDA graph's capture.
class AutocastCacheOff {
 public:
  AutocastCacheOff();
  ~AutocastCacheOff();
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool was_ = true;
};

}  // namespace ddm
