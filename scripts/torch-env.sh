# Sourced by scripts/setup.sh, scripts/sanitize.sh and the benchmarks: where the LibTorch ddm builds
# against lives. PyPI's torch==2.11.0 (CUDA 13.0 build) in a virtual environment outside the checkout,
# named by the version ($DDM_TORCH_VENV to move it), and the CUDA 13.0 toolkit its CMake
# configuration needs ($CUDA_HOME, default /usr/local/cuda).
torch_version=2.11.0
venv=${DDM_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ddm/torch-$torch_version}
cuda=${CUDA_HOME:-/usr/local/cuda}
# The CMake arguments that find them (after setup.sh has installed the venv).
torch_cmake_args() {
  local prefix
  prefix=$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null) ||
    { echo "no torch in $venv: run scripts/setup.sh first" >&2; return 1; }
  echo "-DCMAKE_PREFIX_PATH=$prefix -DDDM_TORCH_VENV=$venv -DCUDAToolkit_ROOT=$cuda -DTORCH_CUDA_ARCH_LIST=7.5;8.0;8.6;8.9;9.0;10.0;12.0"
}
# The CMake generator every build directory uses: Ninja. It rebuilds only the outputs whose inputs or
# command changed, so adding a source file compiles that file alone (CMake's Makefiles rewrote the
# library's flags file, which rebuilt the precompiled header and every object: 26 minutes here).
# A directory configured before with another generator (ddm used Makefiles until 2026-11) is
# configured afresh: CMake refuses to switch generators in place. Prints the arguments for `cmake`.
cmake_generator_args() {  # BUILD_DIR
  local cache="$1/CMakeCache.txt"
  if [ -f "$cache" ] && ! grep -qx 'CMAKE_GENERATOR:INTERNAL=Ninja' "$cache"; then
    echo "$1 was configured with another CMake generator: configuring it afresh for Ninja" >&2
    rm -rf "$cache" "$1/CMakeFiles"
  fi
  echo "-G Ninja"
}
