#!/usr/bin/env bash
# Decentralized diffusion end to end on a colour dataset in tar shards: N procedural colour images
# (bench/make_jpeg_shards.py --style shapes: one of 8 shapes, the class, in a random colour, size,
# place and angle on a colour gradient, 40x40 JPEGs; no real colour dataset comes as a Debian or
# PyPI package), written as 50 shards, then `ddm islands`
# (partition over the shards with --reshard, K experts each on its own cluster's shards, a router
# over the original shards with 1000 samples held out, or a tenth of fewer), then routed samples
# at 32x32.
# usage: bench/colour_e2e.sh            DIR=... (default /tmp/ddm-colour-e2e), N=50000, K=4, STEPS=1200,
#                                       DEVICE=cpu (or cuda: the islands then run 5 at a time)
# Prints each stage's time; the grid is DIR/routed.png, the router's report DIR/isl/router/router_eval.json.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DIR:-/tmp/ddm-colour-e2e} n=${N:-50000} k=${K:-4} steps=${STEPS:-1200} device=${DEVICE:-cpu}
source scripts/torch-env.sh
py=$venv/bin/python
"$py" -c "import PIL, numpy" 2>/dev/null || "$venv/bin/pip" install -q pillow==13.0.0
mkdir -p "$dir"
last=$(printf "%s/data/bench-%06d.tar" "$dir" 49)  # the 50th shard: the data is complete
if [ ! -f "$last" ]; then
  start=$(date +%s)
  "$py" bench/make_jpeg_shards.py "$dir/data" --n "$n" --width 40 --height 40 --shards 50 --style shapes
  echo "colour-e2e: $n images written as shards in $(( $(date +%s) - start )) s ($(du -sh "$dir/data" | cut -f1))"
fi
cat >"$dir/colour.toml" <<TOML
# Class-conditional flow matching on 32x32 colour images streamed from tar shards.
[data]
source = "shards"
root = "$dir/data/bench-{000000..000049}.tar"
resolution = 32
hflip = true
[model]
preset = "unet-tiny"
[diffusion]
objective = "flow"
[train]
steps = $steps
batch_size = 128
lr = 2e-3
warmup = 100
ema_decay = 0.999
log_every = 100
ckpt_every = 200
label_dropout = 0.1
device = "$device"
[sample]
sampler = "euler"
steps = 20
cfg = 2.0
TOML
cat >"$dir/islands.toml" <<TOML
out = "$dir/isl"
config = "$dir/colour.toml"
[partition]
path = "$dir/part"
k = $k
features = "pixels:64"
[experts]
budget = "split-batch"
[router]
preset = "router-dit-tiny"
holdout = $(( n / 10 < 1000 ? n / 10 : 1000 ))
set = ["train.steps=$(( steps / 2 ))", "model.patch=4"]
[run]
concurrency = $([ "$device" = cuda ] && echo $((k + 1)) || echo 1)
TOML
start=$(date +%s)
build/ddm islands run "$dir/islands.toml"
echo "colour-e2e: islands (partition, $k experts, router) took $(( $(date +%s) - start )) s"
start=$(date +%s)
build/ddm sample --ensemble "$dir/isl" --n 64 --device "$device" --out "$dir/routed.png"
echo "colour-e2e: 64 routed samples took $(( $(date +%s) - start )) s; grid $dir/routed.png"
