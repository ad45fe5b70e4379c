#!/usr/bin/env bash
# The pipeline seed's statistic on Stable Diffusion 2.1's real architecture: a training step of
# diffusers' UNet (865M parameters, model.arch = sd-unet) on the VAE's latents with the CLIP ViT-H/14
# text tower as SD 2.x keeps it, all at full size with random weights (bench/sd_pipeline.py, written
# by diffusers), split at its phase boundaries by `ddm_bench phases`: the frozen work (the text
# encoder on the captions and the VAE's encoder on the images, the prepare phase) against the
# trainable forward + backward. DiffusionPipe reports 44% for SD 2.1. Images of SIZE px (random,
# captioned), BATCH per step. Needs build/ with the benchmarks and about 6 GB of disk (the pipeline is
# kept in SD_DIR, default /tmp/ddm-KIND, for the next run). Prints one JSON line per size.
# KIND=sd15-controlnet measures ControlNet v1.0 on SD 1.5 instead (DiffusionPipe: 89%): the frozen
# work is then the text encoder (CLIP ViT-L/14), the VAE's encoder, the edge maps and the locked
# UNet's encoder half; the trainable part is the ControlNet, whose forward + backward also runs the
# locked UNet's decoder (reported apart: locked_decoder_ms).
#
# PLAN=1 profiles the same training with `ddm plan` instead (its units and frozen work at micro-batches
# of ROWS rows, default "1 2", one repeat) and prints its plans for 2 devices at a global batch of 8
# (PLAN_ARGS adds options, e.g. "--bandwidth 1 --memory 80"); the profile is kept in
# SD_DIR/profile-SIZE.json.
#
# On a GPU machine (scripts/gpu-check.sh's SD_PLAN): PLAN=1 DEVICE=cuda PRECISION=bf16 profile there
# (train.device, train.precision; `ddm_bench phases` measures on the CPU only), PYTHON names a python
# with diffusers, transformers and open_clip instead of the reference environment's, and BIN the
# folder of ddm and ddm_bench instead of build/.
#
# usage: [KIND=sd21|sd15-controlnet] [PLAN=1 [REPEATS=1] [ROWS="1 2"]] [DEVICE=auto] [PRECISION=fp32]
#        [PYTHON=...] [BIN=build]
#        bench/sd_phases.sh [SIZES="256 512"] [BATCH=1] [THREADS=2] [STEPS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
sizes=${1:-256 512} batch=${2:-1} threads=${3:-2} steps=${4:-3}
kind=${KIND:-sd21}
python=${PYTHON:-$(bash scripts/reference-env.sh)}
bin=${BIN:-build}
sd=${SD_DIR:-/tmp/ddm-$kind}
[ -f "$sd/model_index.json" ] || "$python" bench/sd_pipeline.py "$sd" "$kind"
if [ "$kind" = sd15-controlnet ]; then
  objective=eps extra="controlnet = \"$sd\"
control = \"edges\""
else
  objective=v extra=""
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for size in $sizes; do
  "$python" - "$work/images-$size" "$size" "$batch" <<'PY'
import os, sys
import numpy as np
from PIL import Image
root, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(root)
rng = np.random.default_rng(0)
for i in range(max(n, 2)):
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(f"{root}/{i:03d}.png")
    open(f"{root}/{i:03d}.txt", "w").write(f"a photograph of a random pattern, number {i}, in many colours\n")
PY
  cat > "$work/sd-$size.toml" <<TOML
[data]
source = "folder"
root = "$work/images-$size"
[model]
arch = "sd-unet"
unet = "$sd"
latent = "$sd"
text_encoder = "$sd"
$extra
[diffusion]
objective = "$objective"
scheduler = "$sd"
[train]
device = "${DEVICE:-auto}"
precision = "${PRECISION:-fp32}"
TOML
  if [ "${PLAN:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=$threads "$bin/ddm" plan --config "$work/sd-$size.toml" --set train.threads="$threads" --rows ${ROWS:-1 2} \
      --repeats "${REPEATS:-1}" --devices 2 --batch 8 --save-profile "$sd/profile-$size.json" --top 8 ${PLAN_ARGS:-}
  else
    OMP_NUM_THREADS=$threads "$bin/ddm_bench" phases "$work/sd-$size.toml" --batch "$batch" --threads "$threads" \
      --steps "$steps" --warmup 1
  fi
done
