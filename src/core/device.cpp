// Device selection (see device.h).
#include "core/device.h"

#include <cstdlib>

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>

#include "core/cuda_module.h"
#include "core/error.h"
#include "core/input_check.h"
#include "core/runtime.h"

namespace ddm {
namespace {

// -1: cuda without an index; N >= 0: cuda:N; -2: not a cuda spec.
int cuda_index(const std::string& spec) {
  if (spec == "cuda") return -1;
  if (spec.rfind("cuda:", 0) != 0 || spec.size() == 5 || spec.size() > 9) return -2;
  for (size_t i = 5; i < spec.size(); ++i)
    if (spec[i] < '0' || spec[i] > '9') return -2;
  return std::stoi(spec.substr(5));
}

std::string gpus(int n) { return std::to_string(n) + " CUDA GPU" + (n == 1 ? "" : "s"); }

}  // namespace

void check_device_spec(const std::string& spec, const std::string& key) {
  DDM_INPUT_CHECK(spec == "auto" || spec == "cpu" || cuda_index(spec) != -2,
            key << " = \"" << spec << "\" is not one of: auto, cpu, cuda, cuda:N (N = 0, 1, ...)");
}

torch::Device resolve_device(const std::string& spec, int local_rank, int cuda_count, const std::string& key) {
  check_device_spec(spec, key);
  if (spec == "cpu" || (spec == "auto" && cuda_count == 0)) return torch::Device(torch::kCPU);
  const int index = cuda_index(spec);
  DDM_INPUT_CHECK(cuda_count > 0, key << " = " << spec << ", but this machine has no CUDA GPU that LibTorch can use "
                                << "(" << (cuda_loaded() ? "no GPU, or CUDA_VISIBLE_DEVICES hides them" : "CUDA " + cuda_status())
                                << "): use cpu or auto");
  if (index >= 0) {
    DDM_INPUT_CHECK(index < cuda_count, key << " = " << spec << ", but this machine has " << gpus(cuda_count)
                                      << " (cuda:0.." << cuda_count - 1 << ")");
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  // auto / cuda: one GPU per process of the node, by LOCAL_RANK (as torchrun and srun number them).
  // A launcher that shows each process only its own GPU (Slurm's --gpus-per-task or --gpu-bind set
  // CUDA_VISIBLE_DEVICES per task) leaves local ranks above 0 without theirs: said so by name.
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string bound = visible != nullptr && local_rank > 0 && cuda_count == 1
                                ? std::string(" (CUDA_VISIBLE_DEVICES=") + visible +
                                      " shows this process one GPU: Slurm's --gpus-per-task and --gpu-bind give each "
                                      "task its own; ask for --gpus-per-node instead, so that every task of a node sees "
                                      "its GPUs and takes the one of its SLURM_LOCALID)"
                                : std::string();
  DDM_INPUT_CHECK(local_rank < cuda_count,
            key << " = " << spec << " gives each process of a node its own GPU, but this is local rank " << local_rank
                << " on a machine with " << gpus(cuda_count) << bound << ": launch at most " << cuda_count
                << (cuda_count == 1 ? " process" : " processes") << " per node, or name one GPU (cuda:N) for processes to share");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

torch::Device resolve_device(const std::string& spec, int local_rank, const std::string& key) {
  return resolve_device(spec, local_rank, static_cast<int>(torch::cuda::device_count()), key);
}

void configure_math(torch::Device device, bool deterministic) {
  if (!device.is_cuda()) return;
  at::Context& ctx = at::globalContext();
  ctx.setAllowTF32CuBLAS(false);
  ctx.setAllowTF32CuDNN(false);
  if (deterministic) {
    // cuBLAS reads this when it creates its handle: before the first matmul on the device.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    ctx.setDeterministicAlgorithms(true, /*warn_only=*/false);
    ctx.setDeterministicCuDNN(true);
    ctx.setBenchmarkCuDNN(false);
  } else {
    ctx.setDeterministicAlgorithms(false, /*warn_only=*/false);
    ctx.setDeterministicCuDNN(false);
    ctx.setBenchmarkCuDNN(true);
  }
}

torch::Tensor to_device_async(const torch::Tensor& t, torch::Device device) {
  if (!t.defined() || t.device() == device) return t;
  return (t.is_cpu() && device.is_cuda() ? t.pin_memory() : t).to(device, /*non_blocking=*/true);
}

void synchronize(torch::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

namespace {

// The CUDA caching allocator's count of the bytes a GPU's tensors take (current and peak).
c10::CachingAllocator::Stat allocated_on_gpu(torch::Device device) {
  const auto stats = at::accelerator::getDeviceStats(device.has_index() ? device.index() : 0);
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
}

}  // namespace

double allocated_bytes_on(torch::Device device) {
  return device.is_cuda() ? static_cast<double>(allocated_on_gpu(device).current) : allocated_bytes();
}

double peak_memory_bytes_on(torch::Device device) {
  return device.is_cuda() ? static_cast<double>(allocated_on_gpu(device).peak) : peak_rss_mib() * 1024.0 * 1024.0;
}

std::string gpu_name(torch::Device device) {
  if (!device.is_cuda()) return {};
  return cuda_module().device_name(device.has_index() ? device.index() : 0);
}

Autocast::Autocast(torch::Device device, Precision precision) : type_(device.type()) {
  if (precision == Precision::kFp32) return;
  on_ = true;
  was_enabled_ = at::autocast::is_autocast_enabled(type_);
  was_dtype_ = at::autocast::get_autocast_dtype(type_);
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::set_autocast_dtype(type_, precision == Precision::kBf16 ? at::kBFloat16 : at::kHalf);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  if (!on_) return;
  // Leaving the outermost region drops the cached bfloat16 copies of the weights.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, was_enabled_);
  at::autocast::set_autocast_dtype(type_, was_dtype_);
}

AutocastWeightCache::AutocastWeightCache() { at::autocast::increment_nesting(); }

AutocastWeightCache::~AutocastWeightCache() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

AutocastCacheOff::AutocastCacheOff() : was_(at::autocast::is_autocast_cache_enabled()) {
  at::autocast::set_autocast_cache_enabled(false);
}

AutocastCacheOff::~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(was_); }

}  // namespace ddm
