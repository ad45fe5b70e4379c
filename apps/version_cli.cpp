// `ddm --version`: ddm's version and commit, the LibTorch it runs on, the CUDA toolkit and GPU
// architectures its own kernels were built for and whether they run (DDM_FUSED_CUDA, and the opt-in
// DDM_FUSED_GROUPNORM and DDM_CHANNELS_LAST), whether
// LibTorch's CUDA libraries are loaded
// (core/cuda_module.h), and the CUDA GPUs LibTorch sees now (what a bug
// report needs, as `python -c "import torch; print(torch.__version__)"` gives PyTorch's users).
#include <torch/cuda.h>
#include <torch/version.h>

#include <string>

#include "cli_util.h"
#include "core/cuda_load.h"
#include "core/version.h"
#include "ddm_commit.h"
#include "model/fused_gpu.h"
#include "model/ops.h"

namespace ddm {

std::string version_text() {
  std::string s = std::string("ddm ") + version() + " (commit " + DDM_COMMIT + ")\n";
  s += std::string("LibTorch ") + TORCH_VERSION + "\n";
  s += std::string("ddm's CUDA kernels: CUDA ") + DDM_CUDA_TOOLKIT + ", compute capability " + DDM_CUDA_ARCHS +
       (fused_cuda_enabled() ? "; on (DDM_FUSED_CUDA=0 turns them off)\n" : "; off (DDM_FUSED_CUDA=0)\n");
  // The two switches a GPU has not checked yet (docs/gpu.md), so off unless set.
  s += std::string("  U-Nets' GroupNorm kernel: ") +
       (fused_group_norm_enabled() ? "on (DDM_FUSED_GROUPNORM=1)" : "off (DDM_FUSED_GROUPNORM=1 turns it on)") +
       "; channels-last U-Nets: " +
       (channels_last_requested() ? "on (DDM_CHANNELS_LAST=1; on a GPU with the GroupNorm kernel only)\n"
                                  : "off (DDM_CHANNELS_LAST=1 turns them on)\n");
  s += "LibTorch's CUDA libraries: " + cuda_status() + "\n";
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  s += "CUDA GPUs LibTorch sees: " + std::to_string(gpus);
  return s;
}

}  // namespace ddm
