#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and PyTorch 2.11 (+cu130) in its python3. Two steps:
#   scripts/gpu-check.sh pack DIR     (here, after scripts/setup.sh) copies the test binaries the
#                                     checks run, stripped, and the one library a GPU machine may
#                                     lack (toml++, stb), into DIR, to carry there;
#   scripts/gpu-check.sh run DIR OUT  (there) runs them against that machine's LibTorch (the torch of
#                                     its python3, or $TORCH_LIB) and writes each one's output to OUT:
#       test_torch_build  the LibTorch build: 2.11, libtorch_cuda loaded, Gloo from the wheel;
#       test_cuda         the `gpu` tests: CUDA results equal the CPU's within float32 rounding.
# Exits non-zero if any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-}
case "$what" in
  pack)
    dir=${2:?usage: $0 pack DIR}
    mkdir -p "$dir/lib"
    for b in test_torch_build test_cuda; do
      [ -x "build/$b" ] || { echo "gpu-check: build/$b is missing: run scripts/setup.sh first" >&2; exit 1; }
      strip -o "$dir/$b" "build/$b"
    done
    cp -L /usr/lib/x86_64-linux-gnu/libtomlplusplus.so.3 /usr/lib/x86_64-linux-gnu/libstb.so.0 "$dir/lib/"
    du -sh "$dir"
    ;;
  run)
    dir=${2:?usage: $0 run DIR OUT}
    out=${3:?usage: $0 run DIR OUT}
    mkdir -p "$out"
    torch_lib=${TORCH_LIB:-$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')}
    export LD_LIBRARY_PATH="$dir/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
    failed=()
    for t in "$dir"/test_*; do
      name=$(basename "$t")
      start=$(date +%s)
      if "$t" --gtest_brief=1 >"$out/$name.log" 2>&1; then status=ok; else status=FAILED; failed+=("$name"); fi
      echo "gpu-check: $name $status ($(($(date +%s) - start)) s): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')"
    done
    if [ ${#failed[@]} -gt 0 ]; then
      for f in "${failed[@]}"; do echo "--- $f"; grep -B2 -A12 -E 'Failure|FAILED' "$out/$f.log" | head -60; done
      echo "gpu-check: failed: ${failed[*]}" >&2
      exit 1
    fi
    echo "gpu-check: all passed"
    ;;
  *)
    echo "usage: $0 pack DIR | run DIR OUT" >&2
    exit 2
    ;;
esac
