#!/usr/bin/env bash
# docs/own-data.md followed as written, on a folder of 64x64 colour pictures: the pictures put in a
# tar, configs/own-64.toml trained with grids and TensorBoard, samples, a rotation feature network
# trained on the same pictures, and FD against held-out pictures, for the trained model and for the
# same model after its first grid's steps. The pictures are procedural (bench/make_jpeg_shards.py
# --style shapes, 80x72 JPEGs: one of 8 shapes in a random colour, size, place and angle on a
# two-colour gradient; no real colour dataset comes as a Debian or PyPI package), written as a plain
# folder without labels, as a user's photos are. The feature network learns the pictures' labels (the
# shape, from a .cls beside each picture in a second tar of the same pictures): the rotation task that
# unlabelled pictures get cannot be learned from these, whose shapes lie at any angle on gradients
# of any direction (measured: its loss stayed at chance, docs/results.md), and ddm says so.
# usage: bench/own_data_64.sh     DIR=... (default /tmp/ddm-own-64), N=6000 (training pictures),
#                                 STEPS=1200, BATCH=32, EVAL_N=500, EPOCHS=4 (the feature network's), DEVICE=cpu
# Prints each stage's time and the FDs; the grids are DIR/runs/mine/grids/, the samples DIR/samples.png.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DIR:-/tmp/ddm-own-64} n=${N:-6000} steps=${STEPS:-1200} batch=${BATCH:-32} eval_n=${EVAL_N:-500}
device=${DEVICE:-cpu}
source scripts/torch-env.sh
py=$venv/bin/python
"$py" -c "import PIL, numpy" 2>/dev/null || "$venv/bin/pip" install -q pillow==13.0.0
mkdir -p "$dir"
t() { date +%s; }
if [ ! -f "$dir/photos-000000.tar" ]; then
  start=$(t)
  for set in train:$n:1 held-out:1000:2; do
    IFS=: read -r name count seed <<<"$set"
    rm -rf "$dir/gen-$name" "$dir/$name"
    "$py" bench/make_jpeg_shards.py "$dir/gen-$name" --n "$count" --width 80 --height 72 --shards 1 \
      --style shapes --seed "$seed" >/dev/null
    mkdir -p "$dir/$name"
    tar xf "$dir/gen-$name/bench-000000.tar" -C "$dir/$name" --wildcards '*.jpg'   # pictures only: no labels
    rm -rf "$dir/gen-$name"
  done
  # Step 1 of docs/own-data.md.
  tar cf "$dir/held-out.tar" -C "$dir/held-out" .
  tar cf "$dir/photos-000000.tar" -C "$dir/train" .
  echo "own-64: $n + 1000 pictures made and put in tars in $(( $(t) - start )) s"
fi
run=$dir/runs/mine
set_data=(--set "data.root=$dir/photos-000000.tar")
# Steps 2 and 3: configs/own-64.toml as shipped, shortened to $steps steps (the shipped warm-up and
# EMA are for 30000), a grid every third of the run.
start=$(t)
build/ddm train --config configs/own-64.toml "${set_data[@]}" --out "$run" --resume \
  --set train.steps="$steps" --set train.batch_size="$batch" --set train.warmup=100 \
  --set train.ema_decay=0.999 --set train.log_every=50 --set train.ckpt_every=$(( steps / 3 )) \
  --set train.keep_ckpts=3 --set train.sample_every=$(( steps / 3 )) --set train.device="$device"
echo "own-64: training took $(( $(t) - start )) s"
# Step 4.
start=$(t)
build/ddm sample --ckpt "$run" --n 64 --out "$dir/samples.png" --device "$device"
echo "own-64: 64 samples took $(( $(t) - start )) s"
# Step 5: the feature network, on the same pictures with their labels, then FD against the
# held-out pictures.
if [ ! -f "$dir/labelled-000000.tar" ]; then
  "$py" bench/make_jpeg_shards.py "$dir/gen-labelled" --n "$n" --width 80 --height 72 --shards 1 --style shapes \
    --seed 1 >/dev/null
  mv "$dir/gen-labelled/bench-000000.tar" "$dir/labelled-000000.tar" && rm -rf "$dir/gen-labelled"
fi
start=$(t)
[ -f "$dir/net.safetensors" ] || build/ddm train-classifier --config configs/own-64.toml \
  --set "data.root=$dir/labelled-000000.tar" --epochs "${EPOCHS:-4}" --out "$dir/net.safetensors"
echo "own-64: the feature network took $(( $(t) - start )) s"
first=$(printf "%s/ckpt/step-%08d" "$run" $(( steps / 3 )))
for ckpt in "$run" "$first"; do
  start=$(t)
  build/ddm eval --ckpt "$ckpt" --feature-net "$dir/net.safetensors" --n "$eval_n" \
    --reference-set "data.root=$dir/held-out.tar" --device "$device" --out "$dir/eval-$(basename "$ckpt")"
  echo "own-64: eval of $ckpt took $(( $(t) - start )) s"
done
