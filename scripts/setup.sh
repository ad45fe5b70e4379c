#!/usr/bin/env bash
# Installs what ddm needs, then configures and builds Release into build/. Idempotent (re-running
# only rebuilds what changed) and works on a fresh Debian 12 machine:
#   1. Debian's packages, if missing: compiler, CMake, ccache, the libraries ddm uses, Fashion-MNIST,
#      clang for the sanitizer build, python3-venv (it uses `sudo` when not root).
#   2. LibTorch: PyPI's torch==2.11.0 (the CUDA 13.0 build, with its nvidia-* wheels; its CPU ops run
#      without a GPU) in a Python virtual environment this script owns, outside the checkout and named
#      by the version, so that every clone on the machine shares it: $DDM_TORCH_VENV, by default
#      ${XDG_CACHE_HOME:-~/.cache}/ddm/torch-2.11.0. It also holds the torchrun the launcher tests use
#      and the PyTorch the Python benchmarks compare against. About 5 GB.
#   3. The reference environment (scripts/reference-env.sh): open_clip, transformers, diffusers and
#      sentence-transformers at pinned versions, whose outputs the tests compare ddm's with.
#   4. CMake, with Torch found through torch.utils.cmake_prefix_path, and the CUDA 13.0 toolkit in
#      /usr/local/cuda (or $CUDA_HOME) for the CUDA half of Torch's CMake configuration; no GPU is
#      needed: the GPU architectures are fixed (TORCH_CUDA_ARCH_LIST: 7.5 to 12.0, T4 to Blackwell), not
#      detected.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/torch-env.sh   # torch_version, venv, cuda, torch_cmake_args
source scripts/reference-env.sh  # reference_env_make, reference_env_python
numpy_version=2.3.5   # for the Python benchmarks (bench/compare_python.sh); torch warns without it

packages=(
  cmake ninja-build g++ ccache pkg-config python3-venv   # Ninja: a new file rebuilds that file alone (scripts/torch-env.sh)
  lld   # LLVM's linker: links each of the ~70 binaries several times faster than GNU ld (CMakeLists.txt)
  libgloo-dev   # declarations only: the Gloo that runs is the one inside the wheel's libtorch_cpu (docs/testing.md)
  dataset-fashion-mnist
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev libstb-dev zlib1g-dev libssl-dev
  libarchive-dev libturbojpeg0-dev libspng-dev libwebp-dev   # sharded datasets: tar, JPEG, PNG, WebP
  libpcre2-dev libicu-dev   # tokenizers: Unicode-aware regular expressions, normalization and case
  libgtest-dev libbenchmark-dev
  libgoogle-perftools-dev   # tcmalloc, the allocator ddm's binaries run on (CMakeLists.txt)
  clang-14 libclang-rt-14-dev llvm-14   # the sanitizer build and fuzzers (scripts/sanitize.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The virtual environment is complete once its marker holds the version; a half-made one (a failed
# or interrupted download) is made again from scratch.
marker="$venv/ddm-torch-complete"
if [ "$(cat "$marker" 2>/dev/null)" != "torch==$torch_version" ]; then
  parent=$(dirname "$venv")
  mkdir -p "$parent" || { echo "setup: cannot create $parent: set DDM_TORCH_VENV to a writable directory" >&2; exit 1; }
  free_gb=$(($(df --output=avail -k "$parent" | tail -n 1) / 1024 / 1024))
  if [ "$free_gb" -lt 8 ]; then
    echo "setup: $parent has ${free_gb} GB free; PyTorch $torch_version with its CUDA libraries needs about 8 GB" \
         "while installing: free some space or set DDM_TORCH_VENV to a directory on another disk" >&2
    exit 1
  fi
  rm -rf "$venv"
  echo "setup: installing torch==$torch_version (CUDA 13.0 build, about 3 GB to download) into $venv"
  /usr/bin/python3 -m venv "$venv"
  if ! "$venv/bin/pip" install --disable-pip-version-check --progress-bar off \
         "torch==$torch_version" "numpy==$numpy_version"; then
    echo "setup: pip could not install torch==$torch_version into $venv (see pip's message above: is PyPI" \
         "reachable, is the disk full?); nothing of it is kept: run scripts/setup.sh again" >&2
    rm -rf "$venv"
    exit 1
  fi
  echo "torch==$torch_version" >"$marker"
fi
# 3. The reference environment the tests compare ddm's text and model formats with (about 1 GB).
reference_env_make
[ -x "$cuda/bin/nvcc" ] || { echo "setup: no CUDA 13.0 toolkit at $cuda (nvcc): Torch's CMake configuration needs it; set CUDA_HOME" >&2; exit 1; }
args=$(torch_cmake_args)
generator=$(cmake_generator_args build)

jobs=$(nproc)
# shellcheck disable=SC2086  # the arguments are paths without spaces (the venv's, the toolkit's)
cmake -S . -B build $generator -DCMAKE_BUILD_TYPE=Release $args "-DDDM_REFERENCE_PYTHON=$(reference_env_python)" >/dev/null
cmake --build build -j"$jobs"
echo "setup: built build/ddm against LibTorch $torch_version ($venv)"
