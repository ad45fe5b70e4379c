#!/usr/bin/env bash
# Throughput of ddm (C++) against the same models in PyTorch (the torch 2.11 of scripts/setup.sh's
# virtual environment, the LibTorch ddm is built on), eager and under torch.compile, measured side by
# side: for each preset and batch size the three run in turn, ROUNDS times, and the ratios of their
# best times are reported (the compiled run's compile time, its warm-up, separately).
#   train:  one training step (flow matching, AdamW, clipping, EMA); each run's time is the median
#           of its steps (ddm_bench train, reference.py);
#   sample: BATCH images from noise, Euler with 20 steps, no guidance; each run's time is the best
#           of 3 (ddm_bench sample, reference.py --sample 20).
# usage: bench/compare_python.sh [THREADS] [ROUNDS] [BATCHES...]    (defaults: 2 2 128 32)
#        PRESETS="dit-tiny dit-small" ...   a subset of the presets
#        WHAT="train" | "sample" ...         one table only (default: both)
#        COMPILE=0 ...                       no torch.compile runs (each compiles for a minute or so)
#        TEXT=77:768 ...                     text models: each preset attends to T token states of width D
#                                            instead of class labels (--text of both; DiTs and U-Nets with attention)
#        PY_PRELOAD=libtcmalloc_minimal.so.4 ...  PyTorch on the allocator ddm links (LD_PRELOAD)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
rounds=${2:-2}
shift 2 2>/dev/null || shift $#
batches=("$@")
[ ${#batches[@]} -gt 0 ] || batches=(128 32)
source scripts/torch-env.sh
py=$venv/bin/python
compile=${COMPILE:-1}
pyrun=(env ${PY_PRELOAD:+LD_PRELOAD=$PY_PRELOAD} "$py")
text=(${TEXT:+--text "$TEXT"})
field() { $py -c "import json,sys; print(json.loads(sys.argv[1])['$2'])" "$1"; }
minf() { $py -c "print(min($1, $2))"; }

for what in ${WHAT:-train sample}; do
  echo
  if [ "$what" = train ]; then
    echo "Training step, $threads threads:"
    echo "| preset | batch | ddm img/s | eager img/s | compiled img/s | ddm / eager | ddm / compiled | compile s | ddm train GFLOP/s |"
    echo "|---|---|---|---|---|---|---|---|---|"
  else
    echo "Sampling, Euler 20 steps, $threads threads:"
    echo "| preset | batch | ddm img/s | eager img/s | compiled img/s | ddm / eager | ddm / compiled | compile s |"
    echo "|---|---|---|---|---|---|---|---|"
  fi
  for preset in ${PRESETS:-unet-tiny unet-small dit-tiny dit-small}; do
    for batch in "${batches[@]}"; do
      steps=20
      case $preset in *small) steps=$((batch >= 128 ? 4 : 10));; esac
      if [ "$what" = train ]; then
        ours=(build/ddm_bench train "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2 "${text[@]}")
        ref=(bench/reference.py "$preset" --batch "$batch" --threads "$threads" --steps "$steps" --warmup 2 "${text[@]}")
        key=step_s
      else
        ours=(build/ddm_bench sample "$preset" --n "$batch" --nfe 20 --threads "$threads" --steps 3 --warmup 1 "${text[@]}")
        ref=(bench/reference.py "$preset" --batch "$batch" --threads "$threads" --steps 3 --warmup 1 --sample 20 "${text[@]}")
        key=seconds
      fi
      best_c=999; best_p=999; best_k=999; gf=0; ks=0
      for ((r = 0; r < rounds; r++)); do
        c=$("${ours[@]}")
        p=$("${pyrun[@]}" "${ref[@]}")
        best_c=$(minf "$best_c" "$(field "$c" $key)")
        best_p=$(minf "$best_p" "$(field "$p" $key)")
        [ "$what" = train ] && gf=$($py -c "print(max($gf, $(field "$c" train_gflops)))")
        if [ "$compile" = 1 ]; then
          k=$("${pyrun[@]}" "${ref[@]}" --compile)
          best_k=$(minf "$best_k" "$(field "$k" $key)")
          ks=$(field "$k" compile_s)  # the last round's: with inductor's cache warm after the first
        fi
      done
      $py -c "
k = $best_k if $compile else float('nan')
row = '| $preset${TEXT:+ + text $TEXT} | $batch | %.0f | %.0f | %.0f | %.2fx | %.2fx | %.0f |' % ($batch/$best_c, $batch/$best_p, $batch/k, $best_p/$best_c, k/$best_c, $ks)
print(row + (' %.0f |' % $gf if '$what' == 'train' else ''))"
    done
  done
done
