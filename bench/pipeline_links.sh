#!/usr/bin/env bash
# Pipelines against data parallelism across a link of known rate: the regime where DiffusionPipe's
# 1.28x over data parallelism lives (docs/pipeline.md). Two "nodes" on this machine, joined by a
# veth pair whose rate tbf limits (bench/netns_link.sh), one training process with THREADS threads
# (default 1) on each, the latent U-Net of configs/latent-quickstart.toml (its frozen encoder is 41%
# of the backbone's work) at global batch 128, for every rate in RATES:
#   dp                      data parallelism: gradients all-reduced every step (float32 on the wire)
#   dp-fp16                 the same with parallel.wire = float16 (half the bytes)
#   dp-sharded              data parallelism with parallel.shard_optimizer (ZeRO-1: each rank keeps the
#                           moments and EMA of half the parameters, and broadcasts its half after the update)
#   <schedule>-serial       a 2-stage pipeline of MICRO micro-batches, frozen work serial
#   <schedule>-filled       the same with its bubbles filled (parallel.fill, planned in the run)
#   <schedule>-filled-bf16  filled, its activations and their gradients in bfloat16 on the wire
#                           (parallel.pipe_wire; with BF16=0 left out)
# for each schedule in SCHEDULES, split where the planner puts the cut for that schedule at that
# link. Runs are interleaved over ROUNDS rounds; throughput is the mean img/s of the metrics.jsonl
# intervals after the first (steps STEPS/4+1..STEPS); ratios to dp are taken within each round,
# then their median. Beside each run the planner's prediction: from one profile of the workload
# (measured once, before any run, by one process alone on this machine) with the link's bandwidth
# as check_link measured it (`ddm plan --measured RUN --profile P --bandwidth B`; data parallelism:
# `ddm plan --profile P --stages 1`), and for filled runs the plan the run made itself from its
# second step (which times the link itself). Once a run's last step is logged the link is opened
# for its final checkpoint (not measured). Every process runs `ddm train` in its namespace with
# RANK, WORLD_SIZE, MASTER_ADDR (node A), GLOO_SOCKET_IFNAME (its veth), parallel.timeout = 600.
#
# Outputs in OUT: results.jsonl (a record per run), results.md (the table), link-<rate>.txt, the
# profile, and per rate and run the run directory with each rank's log.
# KIND=sd15-controlnet or KIND=sd21 runs the seed's own workloads instead, at their real shapes with
# random weights (bench/sd_pipeline.py writes the diffusers directory, kept in /tmp/ddm-KIND): ControlNet
# v1.0 on SD 1.5 (text encoder, VAE, edge maps and the locked UNet's encoder frozen) or SD 2.1's UNet
# (text encoder and VAE frozen), on SIZE px random captioned images, global batch BATCH; its profile is
# taken at the micro-batch's rows. Each rank holds the model's frozen parts and its stage's optimizer
# state; data parallelism holds the whole optimizer state on both, which is what RUNS leaves out on a
# machine too small for two such copies (docs/results.md says how much each needs); dp-sharded half
# of the moments and the EMA.
# THREADS (default 1) sets each process's threads (train.threads), and the profile's. LINK=loopback
# runs both processes on 127.0.0.1 without namespaces, for a machine that cannot make them (RATES must
# then be unlimited; bench/netns_link.sh).
# Needs root, iproute2 (ip netns, tc with sch_tbf) and Debian's python3 (with LINK=loopback only the
# python); builds nothing (build/ddm, or DDM).
# usage: bench/pipeline_links.sh AE_RUN [OUT]        (default /tmp/ddm-pipeline-links)
#        KIND=sd15-controlnet|sd21 bench/pipeline_links.sh [SD_DIR] [OUT]
#   AE_RUN  a `ddm train-autoencoder` run (the latent workload's frozen encoder)
#   env: RATES="unlimited 1gbit 200mbit 100mbit 50mbit"  SCHEDULES="gpipe 1f1b zb-h1"  MICRO=8
#        ROUNDS=2  STEPS=16  BF16=1  LATENCY=100ms BURST=(bytes) (the qdisc; bench/netns_link.sh)
#        BATCH=128 (SD: 8)  SIZE=128 (SD images, px)  RUNS="dp dp-fp16 serial filled filled-bf16" (and dp-sharded)
#        THREADS=1  LINK=veth|loopback  DDM=build/ddm  DEVICE=cpu (train.device)  PYTHON=/usr/bin/python3
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${KIND:-latent}
ddm=${DDM:-build/ddm}
py=${PYTHON:-/usr/bin/python3}
case $kind in
  latent) ae=${1:?usage: bench/pipeline_links.sh AE_RUN [OUT]}; batch=${BATCH:-128} ;;
  sd15-controlnet | sd21) sd=${1:-/tmp/ddm-$kind}; batch=${BATCH:-8} ;;
  *) echo "KIND must be latent, sd15-controlnet or sd21, not '$kind'" >&2; exit 2 ;;
esac
out=${2:-/tmp/ddm-pipeline-links${kind#latent}}
rates=${RATES:-"unlimited 1gbit 200mbit 100mbit 50mbit"}
read -r -a schedules <<< "${SCHEDULES:-gpipe 1f1b zb-h1}"
micro=${MICRO:-8}
rounds=${ROUNDS:-2}
steps=${STEPS:-16}
bf16=${BF16:-1}
size=${SIZE:-128}
threads=${THREADS:-1}
device=${DEVICE:-cpu}
runs=" ${RUNS:-dp dp-fp16 serial filled filled-bf16} "
[ "$bf16" = 1 ] || runs=${runs/ filled-bf16 / }
wanted() { [[ $runs == *" $1 "* ]]; }

. "$(dirname "$0")/netns_link.sh"
link_require
[ -x "$ddm" ] || die "$ddm not found: build it first (cmake --build build --target ddm)"
for r in $rates; do rate_ok "$r" || die "RATES: '$r' is not a rate (unlimited, or a number with kbit, mbit or gbit)"; done
[ "$link_mode" != loopback ] || [ "$rates" = unlimited ] || die "LINK=loopback takes RATES=unlimited only (not '$rates'): lo cannot be limited"
[[ $threads =~ ^[1-9][0-9]*$ ]] || die "THREADS must be a positive integer, not '$threads'"
[[ $micro =~ ^[1-9][0-9]*$ && $rounds =~ ^[1-9][0-9]*$ && $steps =~ ^[1-9][0-9]*$ && $steps -ge 8 ]] ||
  die "MICRO and ROUNDS must be positive integers, STEPS at least 8"
[[ $batch =~ ^[1-9][0-9]*$ && $((batch % (2 * micro))) = 0 ]] || die "BATCH ($batch) must be a multiple of 2 x MICRO ($micro)"
for r in $runs; do [[ " dp dp-fp16 dp-sharded serial filled filled-bf16 " == *" $r "* ]] || die "RUNS: unknown run '$r'"; done
mkdir -p "$out"
profile_args=()
if [ "$kind" = latent ]; then
  [ -f "$ae/config.toml" ] || die "$ae is not a ddm train-autoencoder run (no config.toml)"
  workload=(--config configs/latent-quickstart.toml --set model.latent="$ae")
else
  [[ $size =~ ^[1-9][0-9]*$ && $((size % 64)) = 0 ]] || die "SIZE ($size) must be a multiple of 64 (SD's latents, downsampled 3 times)"
  if [ ! -f "$sd/model_index.json" ]; then
    log "writing the $kind pipeline with random weights to $sd (diffusers; a few minutes)"
    "$(bash scripts/reference-env.sh)" bench/sd_pipeline.py "$sd" "$kind"
  fi
  # Random captioned images (the throughput depends on their size, not their content).
  "$py" - "$out/images-$size" "$size" "$batch" <<'PY'
import os, random, struct, sys, zlib
root, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(root, exist_ok=True)
rng = random.Random(0)
def png(path):
    rows = b"".join(b"\0" + rng.randbytes(3 * size) for _ in range(size))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    open(path, "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)) +
                           chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
for i in range(2 * n):
    png(f"{root}/{i:04d}.png")
    open(f"{root}/{i:04d}.txt", "w").write(f"a photograph of a random pattern, number {i}, in many colours\n")
PY
  cat > "$out/workload.toml" <<TOML
[data]
source = "folder"
root = "$out/images-$size"
[model]
arch = "sd-unet"
unet = "$sd"
latent = "$sd"
text_encoder = "$sd"
$([ "$kind" = sd15-controlnet ] && printf 'controlnet = "%s"\ncontrol = "edges"' "$sd")
[diffusion]
objective = "$([ "$kind" = sd21 ] && echo v || echo eps)"
scheduler = "$sd"
TOML
  workload=(--config "$out/workload.toml")
  profile_args=(--rows $((batch / micro)) --repeats 1)
  if wanted dp || wanted dp-fp16 || wanted dp-sharded; then profile_args=(--rows $((batch / micro)) $((batch / 2)) --repeats 1); fi
fi
workload+=(--set train.batch_size="$batch")
link_up pl

log "profiling the workload once ($threads thread(s), as one of the 2 ranks runs; node A)"
in_ns "$ns_a" "$ddm" plan "${workload[@]}" --set train.threads="$threads" --set train.device="$device" --devices 2 --stages 2 \
  --micro "$micro" "${profile_args[@]}" --save-profile "$out/profile.json" > "$out/profile.txt"

declare -A gbps cuts  # rate -> the link's measured bandwidth in GB/s; rate-schedule -> the planner's cuts
# RATE NAME ARGS...: one training of 2 ranks, rank r on node r; appends a record to results.jsonl
run() {
  local rate=$1 name=$2 dir=$out/$1/$2 p0 p1 rc=0
  shift 2
  mkdir -p "$out/$rate"
  rm -rf "$dir"
  port=$((port + 1))
  log "round $round/$rounds, $rate: $name"
  local common=(train "${workload[@]}" --out "$dir" --set train.threads="$threads" --set train.device="$device"
                --set train.steps="$steps" --set train.log_every=$((steps / 4)) --set train.ckpt_every=100000
                --set parallel.timeout=600 "$@")
  in_ns "$ns_a" env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 MASTER_ADDR="$addr_a" \
    MASTER_PORT=$port GLOO_SOCKET_IFNAME="$dev_a" "$ddm" "${common[@]}" > "$dir.rank0.log" 2>&1 &
  p0=$!
  started $p0
  in_ns "$ns_b" env RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=1 MASTER_ADDR="$addr_a" \
    MASTER_PORT=$port GLOO_SOCKET_IFNAME="$dev_b" "$ddm" "${common[@]}" > "$dir.rank1.log" 2>&1 &
  p1=$!
  started $p1
  # The final checkpoint is not measured: once the last step is logged, the link is opened for it
  # (at 20 Mbit/s an SD run's stage state would take 12 minutes to reach rank 0), then closed again.
  (while ! grep -qsE "\"step\":$steps[,}]" "$dir/metrics.jsonl"; do sleep 1; done; set_rate unlimited) &
  local opener=$!
  reap $p0 || rc=$?
  reap $p1 || rc=$((rc ? rc : $?))
  kill "$opener" 2> /dev/null || true
  wait "$opener" 2> /dev/null || true
  set_rate "$rate"
  [ $rc = 0 ] || { tail -n 3 "$dir".rank*.log >&2; die "$rate $name failed (exit $rc): see $dir.rank*.log"; }
  local predicted="" own=""
  if [ "${name#dp}" = "$name" ]; then  # a pipeline: the simulator on its split, schedule and micro-batches
    "$ddm" plan --measured "$dir" --profile "$out/profile.json" --bandwidth "${gbps[$rate]}" --latency 20 > "$dir.plan.txt"
    predicted=$(sed -n 's/^predicted from the profile[^:]*: \([0-9.]*\) ms.*/\1/p' "$dir.plan.txt")
    own=$(sed -n 's/^planned in the run from the costs it measured: \([0-9.]*\) ms.*/\1/p' "$dir.plan.txt")
  else
    case $name in
      dp) predicted=$(sed -n 's/^  data parallelism ([^)]*): \([0-9.]*\) ms.*/\1/p' "$out/plan-$rate.txt") ;;
      dp-sharded) predicted=$(sed -n 's/^  data parallelism, optimizer state sharded ([^)]*): \([0-9.]*\) ms.*/\1/p' \
                    "$out/plan-$rate.txt") ;;
      *) predicted="" ;;  # dp-fp16: the planner models a float32 all-reduce
    esac
  fi
  "$py" - "$dir" "$rate" "$name" "$round" "$steps" "${predicted:-0}" "${own:-0}" "$batch" >> "$out/results.jsonl" <<'PY'
import json, sys
d, rate, name, rnd, steps, predicted, own, batch = sys.argv[1:9]
recs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
ips = [r["img_per_s"] for r in recs[1:]]  # the first interval warms up (and plans the fill)
mean = sum(ips) / len(ips)
print(json.dumps({"rate": rate, "run": name, "round": int(rnd), "img_per_s": mean, "step_ms": int(batch) * 1e3 / mean,
                  "predicted_ms": float(predicted) or None, "own_plan_ms": float(own) or None,
                  "sent_per_step": recs[-1].get("sent_bytes_per_step", 0),
                  "rank0_peak_gib": max(r.get("peak_memory_bytes", 0) for r in recs) / 2**30}))
PY
  rm -rf "$dir/ckpt"  # its checkpoint is not measured (an SD run's is 5 GB or more)
}

: > "$out/results.jsonl"
for ((round = 1; round <= rounds; round++)); do
  for rate in $rates; do
    set_rate "$rate"
    if [ $round = 1 ]; then
      check_link "$rate"
      read -r got secs < "$out/link-$rate.txt"
      gbps[$rate]=$(awk -v n="$got" -v t="$secs" 'BEGIN { printf "%.6f\n", n / t / 1e9 }')
      "$ddm" plan --profile "$out/profile.json" --batch "$batch" --devices 2 --stages 1 --micro 1 --bandwidth "${gbps[$rate]}" \
        --latency 20 > "$out/plan-$rate.txt"
      for s in "${schedules[@]}"; do
        "$ddm" plan --profile "$out/profile.json" --batch "$batch" --devices 2 --stages 2 --micro "$micro" --schedule "$s" \
          --bandwidth "${gbps[$rate]}" --latency 20 --json "$out/plan-$rate-$s.json" > /dev/null
        cuts[$rate-$s]=$("$py" -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))[0]['first_units'][1:-1])))" \
          "$out/plan-$rate-$s.json")
      done
    fi
    if wanted dp; then run "$rate" dp --set train.grad_accum=1; fi
    if wanted dp-fp16; then run "$rate" dp-fp16 --set train.grad_accum=1 --set parallel.wire=float16; fi
    if wanted dp-sharded; then run "$rate" dp-sharded --set train.grad_accum=1 --set parallel.shard_optimizer=true; fi
    for s in "${schedules[@]}"; do
      pipe=(--set parallel.pp=2 --set parallel.schedule="$s" --set train.grad_accum="$micro" --set "parallel.cuts=[${cuts[$rate-$s]}]")
      if wanted serial; then run "$rate" "$s-serial" "${pipe[@]}" --set parallel.fill=false; fi
      if wanted filled; then run "$rate" "$s-filled" "${pipe[@]}" --set parallel.fill=true; fi
      if wanted filled-bf16; then run "$rate" "$s-filled-bf16" "${pipe[@]}" --set parallel.pipe_wire=bfloat16; fi
    done
  done
done
set_rate unlimited

"$py" - "$out" "$rates" "$kind" "$batch" "$size" "$threads" "$link_mode" <<'PY' | tee "$out/results.md"
import json, re, statistics as st, sys
out, rates, kind, batch, size, threads, link_mode = sys.argv[1], sys.argv[2].split(), *sys.argv[3:8]
workload = {"latent": "latent U-Net", "sd15-controlnet": f"ControlNet v1.0 on SD 1.5 at {size} px",
            "sd21": f"SD 2.1's UNet at {size} px"}[kind]
rows = [json.loads(l) for l in open(out + "/results.jsonl")]
def of(rate, run): return {r["round"]: r for r in rows if r["rate"] == rate and r["run"] == run}
def link(rate):
    n, t = open(f"{out}/link-{rate}.txt").read().split()
    return "%.0f Mbit/s" % (float(n) * 8 / float(t) / 1e6)
nodes = "two nodes joined by a tbf-limited veth pair" if link_mode == "veth" else "127.0.0.1 (LINK=loopback)"
print(f"2 processes x {threads} thread(s) on {nodes}; {workload}, global batch {batch};")
print("medians over rounds; ratios within each round, then their median (vs dp: dp-sharded where dp was not run);")
print("predictions as % of the measured step\n")
print("| link (measured) | run | img/s (min-max) | vs dp | vs the same schedule serial | MB sent per step (rank 0) | profile's prediction | the run's own plan | peak GiB (rank 0) |")
print("|---|---|---|---|---|---|---|---|---|")
for rate in rates:
    runs = list(dict.fromkeys(r["run"] for r in rows if r["rate"] == rate))
    dp = of(rate, "dp") or of(rate, "dp-sharded")  # the reference: dp, or dp-sharded where dp was not run
    for run in runs:
        x = of(rate, run)
        ips = [r["img_per_s"] for r in x.values()]
        both = [k for k in x if k in dp]
        vs_dp = "%.2fx" % st.median(x[k]["img_per_s"] / dp[k]["img_per_s"] for k in both) if both else "-"
        vs_serial = ""
        if "-filled" in run:
            s = of(rate, run.split("-filled")[0] + "-serial")  # empty where RUNS left serial out
            pairs = [x[k]["img_per_s"] / s[k]["img_per_s"] for k in x if k in s]
            vs_serial = "%.2fx" % st.median(pairs) if pairs else "-"
        step = st.median(r["step_ms"] for r in x.values())
        pct = lambda key: "%+.1f%%" % (100 * (st.median(r[key] for r in x.values()) - step) / step) if all(r[key] for r in x.values()) else "-"
        last = max(x.values(), key=lambda r: r["round"])
        print("| %s | %s | %.2f (%.2f-%.2f) | %s | %s | %.2f | %s | %s | %.2f |" % (
            f"{rate} ({link(rate)})", run, st.median(ips), min(ips), max(ips), vs_dp, vs_serial,
            last["sent_per_step"] / 1e6, pct("predicted_ms"), pct("own_plan_ms"), last.get("rank0_peak_gib", 0)))
    if not of(rate, "dp"):  # not run: the planner's data parallelism, beside the measured pipelines
        m = re.search(r"^  data parallelism \([^)]*\): ([0-9.]+) ms.*$", open(f"{out}/plan-{rate}.txt").read(), re.M)
        if m:
            print("| %s | dp (not run: predicted) | %.2f | | | | %s | | |" % (
                f"{rate} ({link(rate)})", int(batch) * 1e3 / float(m.group(1)), m.group(0).strip()))
PY
log "wrote $out/results.md and results.jsonl"
