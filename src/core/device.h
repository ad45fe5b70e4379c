// Where a process computes: `train.device` / `--device` = auto | cpu | cuda | cuda:N (docs/gpu.md).
// auto takes the GPU of this process's LOCAL_RANK when LibTorch sees a CUDA GPU, else the CPU; cuda
// the same, but no GPU is an error; cuda:N that GPU. Every failure says what was asked, what this
// machine has, and what to write instead.
#pragma once
#include <string>

#include <torch/types.h>

namespace ddm {

// Checks the spelling alone (no GPU needed): config validation. `key` names it in the error.
void check_device_spec(const std::string& spec, const std::string& key);
// The device `spec` means for the process of node-local rank `local_rank` on a machine with
// `cuda_count` CUDA GPUs (the rule above; testable without a GPU).
torch::Device resolve_device(const std::string& spec, int local_rank, int cuda_count, const std::string& key);
// The same on this machine (LibTorch's CUDA device count).
torch::Device resolve_device(const std::string& spec, int local_rank, const std::string& key);

}  // namespace ddm
