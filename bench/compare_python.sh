#!/usr/bin/env bash
# Training throughput of ddm (C++) against the same models and step in PyTorch (Debian's
# python3-torch, the same LibTorch 1.13), measured side by side: for each preset and batch size the
# two run alternately, ROUNDS times, and the ratio of their best step times is reported (each run's
# step time is the median of its steps).
# usage: bench/compare_python.sh [THREADS] [ROUNDS] [BATCHES...]    (defaults: 2 2 128 32)
#        PRESETS="dit-tiny dit-small" bench/compare_python.sh ...     (a subset of the presets)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
rounds=${2:-2}
shift 2 2>/dev/null || shift $#
batches=("$@")
[ ${#batches[@]} -gt 0 ] || batches=(128 32)
py=/usr/bin/python3
echo "| preset | batch | C++ img/s | Python img/s | C++ / Python | C++ train GFLOP/s |"
echo "|---|---|---|---|---|---|"
for preset in ${PRESETS:-unet-tiny unet-small dit-tiny dit-small}; do
  for batch in "${batches[@]}"; do
    steps=20
    case $preset in *small) steps=$((batch >= 128 ? 4 : 10));; esac
    best_c=999; best_p=999; gf=0
    for ((r = 0; r < rounds; r++)); do
      c=$(build/ddm_bench train "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2)
      p=$($py bench/reference.py "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2)
      cs=$(echo "$c" | $py -c 'import json,sys; print(json.load(sys.stdin)["step_s"])')
      ps=$(echo "$p" | $py -c 'import json,sys; print(json.load(sys.stdin)["step_s"])')
      best_c=$($py -c "print(min($best_c, $cs))")
      best_p=$($py -c "print(min($best_p, $ps))")
      gf=$(echo "$c" | $py -c "import json,sys; print(max($gf, json.load(sys.stdin)['train_gflops']))")  # of the best run
    done
    $py -c "print('| $preset | $batch | %.0f | %.0f | %.2fx | %.0f |' % ($batch/$best_c, $batch/$best_p, $best_p/$best_c, $gf))"
  done
done
