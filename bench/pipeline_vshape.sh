#!/usr/bin/env bash
# V-shaped placement against linear pipelines, planned (`ddm plan`; predictions from measured
# per-unit costs, not runs): the pixel U-Net of configs/quickstart.toml (two skip levels), the latent
# U-Net and the ControlNet, profiled once with 1 thread; then, for one pipeline of S ranks (no
# replicas) on devices of speed 1 (this machine) and 100 (roughly a GPU's class) over 10 and 1 GB/s
# links, the best linear plan (gpipe, 1f1b, zb-h1) and the best V-shaped plan (1f1b-v, zb-v), each
# over every micro-batch count, with the frozen work filled into the bubbles. Builds nothing: it
# uses build/ddm.
# usage: bench/pipeline_vshape.sh AE_RUN CONTROLNET_RUN [OUT_DIR]
#   AE_RUN           a `ddm train-autoencoder` run (the latent U-Net's frozen encoder)
#   CONTROLNET_RUN   a `ddm train --controlnet` run (its config.toml names the locked base)
#   OUT_DIR          profiles, plan JSON and timeline PNGs (default /tmp/ddm-pipeline-vshape)
set -euo pipefail
cd "$(dirname "$0")/.."
ae=${1:?usage: bench/pipeline_vshape.sh AE_RUN CONTROLNET_RUN [OUT_DIR]}
cn=${2:?usage: bench/pipeline_vshape.sh AE_RUN CONTROLNET_RUN [OUT_DIR]}
out=${3:-/tmp/ddm-pipeline-vshape}
py=/usr/bin/python3
mkdir -p "$out"

profile() {  # NAME ARGS...: profile once
  local name=$1; shift
  [ -f "$out/$name.json" ] || build/ddm plan "$@" --set train.threads=1 --devices 2 --save-profile "$out/$name.json" \
    > "$out/$name-profile.txt"
}
profile pixel-unet --config configs/quickstart.toml
profile latent-unet --config configs/latent-quickstart.toml --set model.latent="$ae"
profile controlnet --config "$cn/config.toml"

printf '%-12s %5s %5s %5s | %9s %9s %6s | %9s %9s %6s | %s\n' profile ranks speed GB/s "linear" "V" "lin/V" \
  "linear" "V" "lin/V" "best V plan"
printf '%-12s %5s %5s %5s | %9s %9s %6s | %9s %9s %6s |\n' "" "" "" "" "serial ms" "serial ms" "" "filled ms" "filled ms" ""
row() {  # PROFILE RANKS BATCH SPEED BANDWIDTH
  local base="$out/$1-$2-$4-$5"
  build/ddm plan --profile "$out/$1.json" --devices "$2" --stages "$2" --batch "$3" --speed "$4" --bandwidth "$5" \
    --schedule gpipe 1f1b zb-h1 --json "$base.linear.json" > /dev/null
  if ! build/ddm plan --profile "$out/$1.json" --devices "$2" --stages "$2" --batch "$3" --speed "$4" --bandwidth "$5" \
    --schedule 1f1b-v zb-v --json "$base.v.json" --timeline "$base.v.png" > "$base.v.txt" 2>&1; then
    printf '%-12s %5s %5s %5s | %s\n' "$1" "$2" "$4" "$5" "no V plan: $(sed 's/^error: //' "$base.v.txt")"
    return
  fi
  "$py" - "$base.linear.json" "$base.v.json" "$@" <<'PY'
import json, sys
lin, v = (json.load(open(f)) for f in sys.argv[1:3])
ls, vs = min(p["serial_ms"] for p in lin), min(p["serial_ms"] for p in v)
lf, best = min(p["filled_ms"] for p in lin), min(v, key=lambda p: p["filled_ms"])
print("%-12s %5s %5s %5s | %9.1f %9.1f %5.2fx | %9.1f %9.1f %5.2fx | %s, %d micro: %s" % (
    sys.argv[3], sys.argv[4], sys.argv[6], sys.argv[7], ls, vs, ls / vs, lf, best["filled_ms"], lf / best["filled_ms"],
    best["schedule"], best["micro"], best["cuts"]))
PY
}
for speed in 1 100; do
  for bw in 10 1; do
    for ranks in 2 4; do
      row pixel-unet $ranks $((64 * ranks)) $speed $bw
      row latent-unet $ranks $((64 * ranks)) $speed $bw
      row controlnet $ranks $((64 * ranks)) $speed $bw
    done
  done
done
