#!/usr/bin/env bash
# Cost of routed sampling next to one expert, measured side by side: builds a small K = 4 ensemble
# (2000 images, 4 unet-tiny experts and a router-dit-tiny router, 300 steps each), then samples N
# images with one expert alone and with the ensemble under each routing strategy, alternating
# ROUNDS times. Prints a markdown row per strategy: forward GFLOP per image, the router's share, and
# the wall-time ratio to the single expert (median over rounds). The issue's target: top-1 costs at
# most 1.1x one expert, in FLOPs and in time. Time on an otherwise idle machine.
# On CPU the time per image depends on the batch: the ensemble runs each expert on its group (about
# N/4 samples under top-1), so the reference is one expert sampling at --batch N/4; one expert at
# the full batch N is printed too.
# usage: bench/routing.sh [THREADS=2] [OUT=bench-routing] [N=500] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
out=${2:-bench-routing}
n=${3:-500}
rounds=${4:-3}
strategies=${STRATEGIES:-"top1 topk:2 full threshold:0.05 sample oracle"}
ddm=build/ddm
mkdir -p "$out"
common="--config configs/quickstart.toml --set data.limit=2000 --set train.steps=300 --set train.threads=$threads"
if [ ! -f "$out/ens/ensemble.json" ]; then
  echo "building the ensemble in $out/ens (about 2 minutes)" >&2
  $ddm partition --limit 2000 --k 4 --threads "$threads" --force --out "$out/part" > "$out/build.log"
  for k in 0 1 2 3; do
    $ddm train $common --partition "$out/part" --expert $k --budget split-batch --quiet --force \
      --out "$out/ens/expert$k" >> "$out/build.log"
  done
  $ddm train-router $common --partition "$out/part" --holdout 400 --quiet --force --out "$out/ens/router" >> "$out/build.log"
  $ddm ensemble --out "$out/ens" --partition "$out/part" --router "$out/ens/router" \
    --expert "$out/ens/expert0" --expert "$out/ens/expert1" --expert "$out/ens/expert2" --expert "$out/ens/expert3" \
    >> "$out/build.log"
fi
# seconds of one sampling run (the "NFE ..., X s" line)
timed() { "$@" --n "$n" --threads "$threads" --out "$out/x.png" | tee "$out/last.log" | sed -n 's/.*), \([0-9.]*\) s,.*/\1/p'; }
declare -A times
for r in $(seq "$rounds"); do
  times[single]+="$(timed $ddm sample --ckpt "$out/ens/expert0" --batch $((n / 4))) "
  times[single_full]+="$(timed $ddm sample --ckpt "$out/ens/expert0" --batch "$n") "
  for s in $strategies; do
    times[$s]+="$(timed $ddm sample --ensemble "$out/ens" --routing "$s") "
    grep "GFLOP" "$out/last.log" > "$out/flops-${s//[:.]/-}.txt"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
single=$(echo "${times[single]}" | median)
single_gflop=$($ddm presets | awk '$1 == "unet-tiny" {printf "%.3f", 2 * 20 * $4 / 1000}')  # 20 steps, CFG batch of 2
echo "| sampling ($n images, 20 Euler steps, CFG 2) | GFLOP / image | router share | time ratio to one expert (median of $rounds) |"
echo "|---|---|---|---|"
echo "| one expert, batch $((n / 4)) | $single_gflop | - | 1.00 ($single s) |"
single_full=$(echo "${times[single_full]}" | median)
echo "| one expert, batch $n | $single_gflop | - | $(python3 -c "print(f'{$single_full / $single:.2f}')") ($single_full s) |"
for s in $strategies; do
  t=$(echo "${times[$s]}" | median)
  python3 - "$s" "$t" "$single" "$out/flops-${s//[:.]/-}.txt" <<'PY'
import re, sys
s, t, single, f = sys.argv[1:]
m = re.search(r"per image ([0-9.]+) \(experts [0-9.]+ \+ router [0-9.]+, ([0-9.]+)%\)", open(f).read())
print(f"| ensemble, `{s}` | {m.group(1)} | {m.group(2)}% | {float(t) / float(single):.2f} ({t} s) |")
PY
done
