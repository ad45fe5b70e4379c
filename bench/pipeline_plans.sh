#!/usr/bin/env bash
# Pipeline plans (`ddm plan`) for the workloads with frozen work, on this machine and on described
# larger ones: profiles three trainings once (1 thread each, as one of 2 ranks here would run), then
# plans each for several device counts, link bandwidths and memory limits, and prints one line per
# case with the three references `ddm plan` reports: data parallelism, the best pipeline with its
# frozen work serial, the best pipeline with it filled into the bubbles (any stage count > 1, any
# replicas, any schedule and micro-batch count). These are the planner's predictions from measured
# per-unit costs, not measured runs; the V-shaped schedules are among the candidates (a V plan's
# depth is its ranks: 2 ranks (V) hold 4 stages). Last, a sweep of one DiT pipeline over 4 to 64 stages. Builds
# nothing: it uses build/ddm.
# usage: bench/pipeline_plans.sh AE_RUN CONTROLNET_RUN [OUT_DIR]
#   AE_RUN           a `ddm train-autoencoder` run (the latent workloads' frozen encoder)
#   CONTROLNET_RUN   a `ddm train --controlnet` run (its config.toml names the locked base)
#   OUT_DIR          profiles, plan JSON and timeline PNGs (default /tmp/ddm-pipeline-plans)
set -euo pipefail
cd "$(dirname "$0")/.."
ae=${1:?usage: bench/pipeline_plans.sh AE_RUN CONTROLNET_RUN [OUT_DIR]}
cn=${2:?usage: bench/pipeline_plans.sh AE_RUN CONTROLNET_RUN [OUT_DIR]}
out=${3:-/tmp/ddm-pipeline-plans}
py=/usr/bin/python3
mkdir -p "$out"

profile() {  # NAME ARGS...: profile once, with the timeline of its 2-device plan
  local name=$1; shift
  [ -f "$out/$name.json" ] || build/ddm plan "$@" --set train.threads=1 --devices 2 --save-profile "$out/$name.json" \
    --timeline "$out/$name-2dev.png" > "$out/$name-2dev.txt"
}
profile latent-unet --config configs/latent-quickstart.toml --set model.latent="$ae"
profile controlnet --config "$cn/config.toml"
profile latent-dit62 --config configs/latent-quickstart.toml --set model.latent="$ae" --set model.preset=latent-dit \
  --set model.depth=62

printf '%-13s %4s %6s %5s %6s %7s | %9s %9s %9s | %7s %6s %7s  %s\n' profile dev batch speed GB/s mem_GiB dp_ms serial_ms \
  filled_ms filled filled bubble "best filled pipeline"
printf '%-13s %4s %6s %5s %6s %7s | %9s %9s %9s | %7s %6s %7s\n' "" "" "" "" "" "" "" "(pipe)" "(pipe)" "/serial" "/dp" "filled"
row() {  # PROFILE DEVICES BATCH SPEED BANDWIDTH MEMORY_GIB(0: unlimited)
  local json="$out/$1-$2-$4-$5-$6.plans.json" mem=()
  [ "$6" != 0 ] && mem=(--memory "$6")
  build/ddm plan --profile "$out/$1.json" --devices "$2" --batch "$3" --speed "$4" --bandwidth "$5" "${mem[@]}" \
    --json "$json" --timeline "$out/$1-$2-$4-$5-$6.png" > /dev/null
  "$py" - "$json" "$@" <<'PY'
import json, math, sys
plans = json.load(open(sys.argv[1]))
dp = min((p["serial_ms"] for p in plans if p["stages"] == 1), default=math.nan)
pipes = [p for p in plans if p["stages"] > 1]
ser = min((p["serial_ms"] for p in pipes), default=math.nan)
best = min(pipes, key=lambda p: p["filled_ms"]) if pipes else None
fil = best["filled_ms"] if best else math.nan
depth = lambda p: f'{p["stages"]} ranks (V)' if p["schedule"].endswith("-v") else f'{p["stages"]} stages'
desc = f'{depth(best)} x {best["replicas"]}, {best["schedule"]}, {best["micro"]} micro' if best else "-"
dp_text = "   -  " if math.isnan(dp) else "%5.2fx" % (dp / fil)
print("%-13s %4s %6s %5s %6s %7s | %9s %9.1f %9.1f | %6.2fx %6s %6.1f%%  %s" % (
    *sys.argv[2:8], "-" if math.isnan(dp) else "%.1f" % dp, ser, fil, ser / fil, dp_text,
    100 * best["filled_bubble"] if best else math.nan, desc))
PY
}
# speed: each device's compute relative to one core here (100: roughly a GPU's class); the link is
# what data parallelism's gradient all-reduce and the pipeline's activations cross.
for speed in 1 100; do
  for bw in 10 1; do
    row latent-unet 2 128 $speed $bw 0
    row latent-unet 4 256 $speed $bw 0
    row controlnet 2 128 $speed $bw 0
    row controlnet 8 512 $speed $bw 0
    row latent-dit62 8 256 $speed $bw 0
    row latent-dit62 64 2048 $speed $bw 0
  done
done
# Devices too small for the whole DiT's weights and optimizer state (353 MiB) plus its activations:
# data parallelism does not fit, pipelines must.
for dev in 8 64; do row latent-dit62 $dev $((32 * dev)) 100 10 0.25; done
# A stage sweep: the DiT on S devices of speed 100 as one pipeline of S stages (no replicas), 64 rows
# per device, over 10 and 1 GB/s links: where filling pays as stages are added, and where the
# bubbles are links, not missing work.
echo
printf '%-13s %6s %6s | %9s %9s %7s | %8s %8s  %s\n' profile stages GB/s serial_ms filled_ms filled serial filled "best schedule"
printf '%-13s %6s %6s | %9s %9s %7s | %8s %8s\n' "" "" "" "" "" /serial bubble bubble
for stages in 4 8 16 64; do
  for bw in 10 1; do
    json="$out/sweep-$stages-$bw.plans.json"
    build/ddm plan --profile "$out/latent-dit62.json" --devices $stages --stages $stages --batch $((64 * stages)) \
      --speed 100 --bandwidth $bw --json "$json" > /dev/null
    "$py" - "$json" $stages $bw <<'PY'
import json, sys
plans = json.load(open(sys.argv[1]))
ser = min(plans, key=lambda p: p["serial_ms"])
fil = min(plans, key=lambda p: p["filled_ms"])
print("%-13s %6s %6s | %9.1f %9.1f %6.2fx | %7.1f%% %7.1f%%  %s, %d micro" % ("latent-dit62", sys.argv[2], sys.argv[3],
      ser["serial_ms"], fil["filled_ms"], ser["serial_ms"] / fil["filled_ms"], 100 * ser["serial_bubble"],
      100 * fil["filled_bubble"], fil["schedule"], fil["micro"]))
PY
  done
done
