#!/usr/bin/env bash
# A latent model trained on latent shards (`ddm encode`, data.source = latents) against the same
# model on the images' shards, encoding every batch with the frozen encoder: training throughput
# (img/s of `ddm train`, loader and all) and the share of step time spent waiting for data, side by
# side, alternating, ROUNDS times. The workload is configs/latent-quickstart.toml (latent U-Net,
# batch 128) on N Fashion-MNIST images written as shards, with the autoencoder of
# configs/autoencoder.toml trained for a few steps only (its speed does not depend on its quality).
# usage: bench/latent_shards.sh [ROUNDS] [STEPS]      (defaults: 2 60)
#        N=20000 THREADS=2 DIR=/tmp/ddm-latent-bench (kept between runs)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
steps=${2:-60}
n=${N:-20000}
threads=${THREADS:-2}
dir=${DIR:-/tmp/ddm-latent-bench}
ddm=build/ddm
mkdir -p "$dir"
shards="$dir/shards/train-{000000..$(printf %06d $(( (n + 999) / 1000 - 1 )))}.tar"
[ -d "$dir/shards" ] || $ddm shards write --set data.limit="$n" --shard-size 1000 --out "$dir/shards" >/dev/null
data=(--set data.source=shards --set "data.root=$shards" --set data.resolution=28)
[ -f "$dir/ae/autoencoder.json" ] ||
  $ddm train-autoencoder --quiet --config configs/autoencoder.toml "${data[@]}" --set train.steps=20 \
    --set train.threads="$threads" --out "$dir/ae" --n 64 --stats-n 1000 >/dev/null
if [ ! -d "$dir/lat" ]; then
  start=$(date +%s.%N)
  $ddm encode --ae "$dir/ae" --config configs/autoencoder.toml "${data[@]}" --threads "$threads" --out "$dir/lat" >/dev/null
  echo "encode: $n images in $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s"
fi
train() {  # $1: run name, then the data settings
  local out="$dir/run-$1"
  shift
  rm -rf "$out"
  $ddm train --quiet --config configs/latent-quickstart.toml --set model.latent="$dir/ae" "$@" \
    --set train.steps="$steps" --set train.log_every=20 --set train.ckpt_every=100000 --set train.threads="$threads" \
    --out "$out" >/dev/null
  # The intervals after the first (its steps include the warm-up): median img/s and data wait.
  python3 - "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1])][1:]
print(f"{statistics.median(r['img_per_s'] for r in m):.0f} {100 * statistics.median(r['data_wait'] for r in m):.1f}")
PY
}
echo "| round | images' shards, encoded each step: img/s | data wait | latent shards: img/s | data wait | ratio |"
echo "|---|---|---|---|---|---|"
for r in $(seq "$rounds"); do
  read -r a wa < <(train images "${data[@]}")
  read -r b wb < <(train latents --set data.source=latents --set "data.root=$dir/lat")
  echo "| $r | $a | $wa% | $b | $wb% | $(python3 -c "print(f'{$b / $a:.2f}x')") |"
done
