#!/usr/bin/env bash
# Pipeline-parallel training measured on this machine: 2 processes x 1 thread at equal global batch,
# data parallelism against 2-stage pipelines under GPipe, 1F1B and ZB-H1, each with the frozen work
# serial (parallel.fill = false: every stage prepares every micro-batch before the pipeline starts)
# and filled into the bubbles (parallel.fill = true: planned in the run after its second step), on
# the two workloads with the most frozen work: latent diffusion (a frozen encoder) and a ControlNet
# (control maps and the locked encoder in prepare, the locked decoder on the gradient path). Each run
# starts its 2 processes on 127.0.0.1 itself, each under /usr/bin/time for its peak memory. Per run:
# throughput over the steps after the first logging interval (metrics.jsonl: steps 5-16 of 16),
# each rank's peak RSS, and for pipelines the simulator's prediction for the same split, schedule
# and micro-batches (`ddm plan --measured`, from a profile measured once per workload; for a filled
# run also its own plan's prediction) with the error and a timeline PNG. Runs are interleaved over
# ROUNDS rounds; the table shows medians, and ratios taken within each round. Each pipeline is split
# where the planner puts the cut for its schedule. Builds nothing: it uses build/ddm.
# usage: bench/pipeline_runs.sh AE_RUN BASE_RUN [ROUNDS] [STEPS] [OUT_DIR]
#   AE_RUN    a `ddm train-autoencoder` run (the latent workload's frozen encoder)
#   BASE_RUN  a `ddm train --config configs/quickstart.toml` run (the ControlNet's locked base)
#   defaults: 3 rounds, 16 steps, /tmp/ddm-pipeline-runs; MICRO=8 micro-batches
#   SCHEDULES (default "gpipe 1f1b zb-h1"; the V-shaped 1f1b-v and zb-v run 4 stages on the 2
#   processes), FILLS (default "false true"),
#   WORKLOADS (default "latent controlnet"; "pixel" adds configs/quickstart.toml, two skip levels)
set -euo pipefail
cd "$(dirname "$0")/.."
ae=${1:?usage: bench/pipeline_runs.sh AE_RUN BASE_RUN [ROUNDS] [STEPS] [OUT_DIR]}
base=${2:?usage: bench/pipeline_runs.sh AE_RUN BASE_RUN [ROUNDS] [STEPS] [OUT_DIR]}
rounds=${3:-3}
steps=${4:-16}
out=${5:-/tmp/ddm-pipeline-runs}
micro=${MICRO:-8}
py=/usr/bin/python3
mkdir -p "$out"
port=$((29500 + RANDOM % 400))
log_every=$((steps / 4))

# WORKLOAD NAME WORLD ARGS...: one training of WORLD processes (our launcher's environment, set by hand)
run() {
  local workload=$1 name=$2 world=$3; shift 3
  local dir="$out/$workload-$name" pids=() r
  rm -rf "$dir"
  port=$((port + 1))
  for ((r = 0; r < world; r++)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      /usr/bin/time -f %M -o "$dir.rss$r" build/ddm train "$@" --out "$dir" --set train.threads=1 \
      --set train.steps="$steps" --set train.log_every="$log_every" --set train.ckpt_every=100000 \
      > "$dir.log$r" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "$dir failed: see $dir.log*" >&2; exit 1; }; done
  "$py" - "$dir" "$world" "$round" >> "$out/results.jsonl" <<'PY'
import json, sys
d, world, rnd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
recs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
ips = [r["img_per_s"] for r in recs[1:]]  # the first interval warms up
rss = [int(open(f"{d}.rss{r}").read().split()[-1]) * 1024 for r in range(world)]
print(json.dumps({"run": d, "round": rnd, "img_per_s": sum(ips) / len(ips), "peak_rss": rss}))
PY
}

read -r -a workloads <<< "${WORKLOADS:-latent controlnet}"
read -r -a schedules <<< "${SCHEDULES:-gpipe 1f1b zb-h1}"
read -r -a fills <<< "${FILLS:-false true}"
args_latent=(--config configs/latent-quickstart.toml --set model.latent="$ae")
args_controlnet=(--controlnet "$base")
args_pixel=(--config configs/quickstart.toml)
plan_latent=(--config configs/latent-quickstart.toml --set model.latent="$ae")
plan_controlnet=(--config "$out/controlnet-config/config.toml")
plan_pixel=(--config configs/quickstart.toml)
# The ControlNet's config as `ddm train --controlnet` resolves it, for `ddm plan` to profile.
build/ddm train --controlnet "$base" --out "$out/controlnet-config" --force --set train.steps=1 > /dev/null
# Each workload profiled once (1 thread, as one of the 2 ranks runs), before any run; each
# schedule's split is the planner's (the partition DP on the measured units) for 2 stages x 8.
declare -A cuts
for w in "${workloads[@]}"; do
  declare -n pargs="plan_$w"
  build/ddm plan "${pargs[@]}" --set train.threads=1 --devices 2 --stages 2 --micro "$micro" \
    --save-profile "$out/$w.profile.json" > "$out/$w.profile.txt"
  for s in "${schedules[@]}"; do
    build/ddm plan --profile "$out/$w.profile.json" --batch 128 --devices 2 --stages 2 --micro "$micro" --schedule $s \
      --json "$out/$w-$s.plans.json" > /dev/null
    cuts[$w-$s]=$("$py" -c "import json,sys; p=json.load(open(sys.argv[1]))[0]; print(','.join(map(str, p['first_units'][1:-1])))" \
      "$out/$w-$s.plans.json")
  done
done
: > "$out/results.jsonl"
for ((round = 0; round < rounds; round++)); do
  for w in "${workloads[@]}"; do
    declare -n wargs="args_$w"
    run "$w" dp 2 "${wargs[@]}" --set train.grad_accum=1
    for s in "${schedules[@]}"; do
      for fill in "${fills[@]}"; do
        run "$w" "$s$([ $fill = true ] && echo -filled || echo -serial)" 2 "${wargs[@]}" --set parallel.pp=2 \
          --set parallel.schedule=$s --set train.grad_accum="$micro" --set "parallel.cuts=[${cuts[$w-$s]}]" \
          --set parallel.fill=$fill
      done
    done
  done
done
# The simulator against the last round's measured pipelines, one profile per workload.
for w in "${workloads[@]}"; do
  for s in "${schedules[@]}"; do
    for fill in "${fills[@]}"; do
      f=$([ "$fill" = true ] && echo filled || echo serial)
      build/ddm plan --measured "$out/$w-$s-$f" --profile "$out/$w.profile.json" --timeline "$out/$w-$s-$f.png" \
        > "$out/$w-$s-$f.plan.txt"
    done
  done
done
"$py" - "$out" "$micro" <<'PY'
import json, re, statistics, sys
out, micro = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(out + "/results.jsonl")]
runs = sorted({r["run"] for r in rows}, key=lambda r: ([w in r for w in ("latent", "controlnet", "pixel")].index(True), r))
def ips_of(run): return [r["img_per_s"] for r in rows if r["run"] == run]
def error(run, what):
    try:
        return re.search(what + r"[^\n]*?([+-][0-9.]+)% of the measured", open(run + ".plan.txt").read()).group(1) + "%"
    except (OSError, AttributeError):
        return "-"
print(f"2 processes x 1 thread, global batch 128, pipelines of 2 stages (V-shaped: 4) with {micro} micro-batches")
print("%-26s %8s %7s %10s %13s %20s %10s %10s" % ("run", "img/s", "vs dp", "vs serial", "rounds", "peak RSS MiB (r0, r1)",
                                               "profile", "own plan"))
for run in runs:
    name = run.rsplit("/", 1)[1]
    w = name.split("-")[0]
    ips, dp = ips_of(run), ips_of(f"{out}/{w}-dp")
    # Ratios within each round, then their median.
    ratio = statistics.median(a / b for a, b in zip(ips, dp))
    vs_serial = "-"
    if name.endswith("-filled"):
        serial = ips_of(run[: -len("-filled")] + "-serial")
        vs_serial = "%.2fx" % statistics.median(a / b for a, b in zip(ips, serial))
    rss = [r["peak_rss"] for r in rows if r["run"] == run][-1]
    print("%-26s %8.1f %6.2fx %10s %6.1f-%-6.1f %9.0f, %-9.0f %10s %10s" % (name, statistics.median(ips), ratio, vs_serial,
          min(ips), max(ips), rss[0] / 2**20, rss[1] / 2**20, error(run, "predicted from the profile"),
          error(run, "planned in the run")))
PY
