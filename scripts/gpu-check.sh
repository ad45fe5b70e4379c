#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and PyTorch 2.11 (+cu130) in its python3. Two steps:
#   scripts/gpu-check.sh pack DIR     (here, after scripts/setup.sh) copies the test binaries the
#                                     checks run, stripped, and the libraries a GPU machine may
#                                     lack (toml++, stb, tcmalloc), into DIR, to carry there;
#   scripts/gpu-check.sh run DIR OUT  (there) runs them against that machine's LibTorch (the torch of
#                                     its python3, or $TORCH_LIB) and writes each one's output to OUT:
#       test_torch_build  the LibTorch build: 2.11, libtorch_cuda loaded, Gloo from the wheel;
#       test_cuda         the `gpu` tests: CUDA results equal the CPU's within float32 rounding;
#   then (unless GPU_BENCH=0) the PyTorch baseline of the GPU benchmark, bench/reference.py on the
#   card: a training step of dit-b and unet-small at batch 256 in bf16, eager and torch.compile,
#   dit-b in fp32, and dit-b's sampling; one JSON line each in OUT/reference.jsonl.
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
    cp -L /usr/lib/x86_64-linux-gnu/libtomlplusplus.so.3 /usr/lib/x86_64-linux-gnu/libstb.so.0 \
      /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$dir/lib/"
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
    if [ "${GPU_BENCH:-1}" != 0 ]; then
      ref() {  # one reference.py run, bounded, its JSON line appended (a failure is reported, not fatal)
        local line
        if line=$(timeout 240 python3 bench/reference.py "$@" --device cuda --threads 8 2>"$out/reference.err"); then
          echo "$line" | tee -a "$out/reference.jsonl"
        else echo "gpu-check: reference.py $* failed: $(tail -3 "$out/reference.err")"; fi
      }
      ref dit-b --batch 256 --precision bf16 --steps 20 --warmup 3
      ref dit-b --batch 256 --precision bf16 --steps 20 --warmup 3 --compile
      ref unet-small --batch 256 --precision bf16 --steps 20 --warmup 3
      ref unet-small --batch 256 --precision bf16 --steps 20 --warmup 3 --compile
      ref dit-b --batch 256 --precision fp32 --steps 10 --warmup 2
      ref dit-b --batch 256 --precision bf16 --steps 3 --warmup 1 --sample 20
    fi
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
