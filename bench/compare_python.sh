#!/usr/bin/env bash
# Training throughput of ddm (C++) against the same models and step in PyTorch (the torch 2.11 of
# scripts/setup.sh's virtual environment, the LibTorch ddm is built on), eager and under
# torch.compile, measured side by side: for each preset and batch size the three run in turn, ROUNDS
# times, and the ratios of their best step times are reported (each run's step time is the median
# of its steps; the compiled run's compile time, its warm-up steps, separately).
# usage: bench/compare_python.sh [THREADS] [ROUNDS] [BATCHES...]    (defaults: 2 2 128 32)
#        PRESETS="dit-tiny dit-small" bench/compare_python.sh ...     (a subset of the presets)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
rounds=${2:-2}
shift 2 2>/dev/null || shift $#
batches=("$@")
[ ${#batches[@]} -gt 0 ] || batches=(128 32)
source scripts/torch-env.sh
py=$venv/bin/python
# COMPILE=0 leaves out the torch.compile runs (each compiles for a minute or more on 2 cores).
compile=${COMPILE:-1}
echo "| preset | batch | ddm img/s | eager img/s | compiled img/s | ddm / eager | ddm / compiled | compile s | ddm train GFLOP/s |"
echo "|---|---|---|---|---|---|---|---|---|"
field() { $py -c "import json,sys; print(json.loads(sys.argv[1])['$2'])" "$1"; }
for preset in ${PRESETS:-unet-tiny unet-small dit-tiny dit-small}; do
  for batch in "${batches[@]}"; do
    steps=20
    case $preset in *small) steps=$((batch >= 128 ? 4 : 10));; esac
    best_c=999; best_p=999; best_k=999; gf=0; ks=0
    for ((r = 0; r < rounds; r++)); do
      c=$(build/ddm_bench train "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2)
      p=$($py bench/reference.py "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2)
      best_c=$($py -c "print(min($best_c, $(field "$c" step_s)))")
      best_p=$($py -c "print(min($best_p, $(field "$p" step_s)))")
      gf=$($py -c "print(max($gf, $(field "$c" train_gflops)))")
      if [ "$compile" = 1 ]; then
        k=$($py bench/reference.py "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2 --compile)
        best_k=$($py -c "print(min($best_k, $(field "$k" step_s)))")
        ks=$(field "$k" compile_s)  # the last round's: with inductor's cache warm after the first
      fi
    done
    $py -c "
k = $best_k if $compile else float('nan')
print('| $preset | $batch | %.0f | %.0f | %.0f | %.2fx | %.2fx | %.0f | %.0f |' % ($batch/$best_c, $batch/$best_p, $batch/k, $best_p/$best_c, k/$best_c, $ks, $gf))"
  done
done
