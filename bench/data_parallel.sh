#!/usr/bin/env bash
# Data parallelism on one machine, at equal global batch: 1 rank x 1 thread, 1 rank x 2 threads and
# 2 ranks x 1 thread (`ddm launch --nproc 2`), per preset, plus a gradient-bucket sweep on 2 ranks
# and two diagnostics: 1 x 2 with OMP_WAIT_POLICY=passive (OpenMP threads sleep instead of spinning
# at barriers, which matters when other processes share the cores) and 2 x 1 without the gradient
# all-reduce (what two processes on the cores cost without any communication).
# Every configuration runs once per round, interleaved, ROUNDS times; the table shows the median over
# rounds and the min-max spread. Ratios (speed-up, scaling efficiency) are computed within each round
# (runs made minutes apart, side by side) and then their median is taken. Builds nothing: it uses
# build/ddm and build/ddm_bench.
# usage: bench/data_parallel.sh [ROUNDS] [GLOBAL_BATCH]          (defaults: 3 128)
#        PRESETS="dit-small" bench/data_parallel.sh ...          (a subset; default unet-tiny unet-small dit-small)
#        SWEEP_PRESETS="dit-small" ...                            (where the bucket sweep runs; default dit-small)
#        TIMELINES=DIR ...   per-rank step timelines of the last round go to DIR (default /tmp/ddm-dp-timelines),
#                            and their PNGs too; PNG_DIR=docs redraws docs' two dit-small timelines there
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
batch=${2:-128}
presets=${PRESETS:-unet-tiny unet-small dit-small}
sweep_presets=${SWEEP_PRESETS:-dit-small}
tl=${TIMELINES:-/tmp/ddm-dp-timelines}
py=/usr/bin/python3
mkdir -p "$tl"
results=$(mktemp /tmp/ddm-dp-results.XXXXXX)
trap 'rm -f "$results"' EXIT

steps_for() {  # few steps on the slow presets: each is seconds long
  case $1 in *small) echo "--steps 3 --warmup 1";; *) echo "--steps 10 --warmup 2";; esac
}

# name | ranks | threads | extra ddm_bench flags | environment
configs_for() {
  echo "1x1|1|1||"
  echo "1x2|1|2||"
  echo "1x2 OMP passive|1|2||OMP_WAIT_POLICY=passive"
  echo "2x1|2|1||"
  for s in $sweep_presets; do
    if [ "$s" = "$1" ]; then
      echo "2x1 cap 1 MiB|2|1|--bucket-mb 1|"
      echo "2x1 cap 4 MiB|2|1|--bucket-mb 4|"
      echo "2x1 fp16 wire|2|1|--wire float16|"
      echo "2x1 no grad sync|2|1|--sync off|"
    fi
  done
}

run_one() {  # preset name ranks threads flags environment timeline-prefix
  local preset=$1 name=$2 ranks=$3 threads=$4 flags=$5 envs=$6 prefix=$7 line
  local cmd=(build/ddm_bench dp "$preset" --batch "$batch" --threads "$threads" $(steps_for "$preset") $flags)
  [ -n "$prefix" ] && cmd+=(--timeline "$prefix")
  if [ "$ranks" -gt 1 ]; then
    line=$(env ${envs} build/ddm launch --nproc "$ranks" --no-ddm -- "${cmd[@]}" | sed -n 's/^\[rank 0\] //p' | grep '"mode":"dp"')
  else
    line=$(env ${envs} "${cmd[@]}" | grep '"mode":"dp"')
  fi
  $py -c 'import json,sys; d=json.loads(sys.argv[1]); d["config"]=sys.argv[2]; d["round"]=int(sys.argv[3]); print(json.dumps(d))' \
    "$line" "$name" "$r" >> "$results"
  echo "  round $r $preset $name: $($py -c 'import json,sys; d=json.loads(sys.argv[1]); print("%.1f img/s, %.2f cores, exposed wait %.0f ms, load %.1f" % (d["img_per_s"], d["cores_used"], d["exposed_wait_ms"], d["load_before"]))' "$line")" >&2
}

for ((r = 0; r < rounds; r++)); do
  for preset in $presets; do
    while IFS='|' read -r name ranks threads flags envs; do
      prefix=""
      if [ $((r + 1)) -eq "$rounds" ] && [ "$ranks" -gt 1 ]; then
        prefix="$tl/$preset-$(echo "$name" | tr ' ' '-')"
      fi
      run_one "$preset" "$name" "$ranks" "$threads" "$flags" "${envs}" "$prefix"
    done < <(configs_for "$preset")
  done
done

# Timelines of the last round.
for f in "$tl"/*.rank0.json; do
  [ -e "$f" ] || continue
  base=${f%.rank0.json}
  build/ddm_bench timeline "$base.png" "$base".rank*.json >&2
done
if [ -n "${PNG_DIR:-}" ]; then  # the two images of docs/results.md
  build/ddm_bench timeline "$PNG_DIR/dp-timeline-dit-small.png" "$tl"/dit-small-2x1.rank*.json >&2
  build/ddm_bench timeline "$PNG_DIR/dp-timeline-dit-small-1mib.png" "$tl"/dit-small-2x1-cap-1-MiB.rank*.json \
    --window 1100 2700 --title "dit-small, global batch $batch, 2 ranks x 1 thread, buckets 1 MiB (first 1 MiB), float32 wire: the backward of one step" >&2
fi

$py - "$results" <<'EOF'
import json, sys, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda v: st.median(v) if v else float("nan")
by, order = {}, []
for d in rows:
    k = (d["preset"], d["config"])
    if k not in by: order.append(k)
    by.setdefault(k, []).append(d)
one = {(d["preset"], d["round"]): d for d in rows if d["config"] == "1x1"}
def ratios(v, key):  # within each round, against that round's 1 x 1 run
    return [d[key] / one[(d["preset"], d["round"])][key] for d in v if (d["preset"], d["round"]) in one]
print("Throughput at equal global batch (median over rounds, min-max; ratios taken within each round):\n")
print("| preset | config | img/s | vs 1x1 | scaling efficiency | cores the run got | img per CPU-second | vs 1x1, per CPU-second | load average before |")
print("|---|---|---|---|---|---|---|---|---|")
for k in order:
    v = by[k]
    ips = [d["img_per_s"] for d in v]
    par = v[0]["ranks"] * v[0]["threads"]
    r, rc = med(ratios(v, "img_per_s")), med(ratios(v, "img_per_cpu_s"))
    print("| %s | %s | %.1f (%.1f-%.1f) | %.2fx | %s | %.2f | %.1f | %.2fx | %.1f |" % (
        k[0], k[1], med(ips), min(ips), max(ips), r, "%.0f%%" % (100 * r / par) if par > 1 else "—",
        med([d["cores_used"] for d in v]), med([d["img_per_cpu_s"] for d in v]), rc, med([d["load_before"] for d in v])))
print("\nOne step, phase by phase (medians; per rank where it says so):\n")
print("| preset | config | MB all-reduced / rank / step | buckets (launched during backward) | all-reduce busy ms | exposed wait ms | exposed / all-reduce | skew between ranks ms | Gloo threads CPU ms / step | forward ms | backward compute ms | loss all-reduce ms | AdamW+EMA ms | step ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for k in order:
    v = by[k]
    m = lambda key: med([d[key] for d in v])
    dp = v[0]["ranks"] > 1
    sync = dp and v[0]["sync"] == "on"
    dash = "—"
    print("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.0f | %.0f | %.1f | %.0f | %.0f |" % (
        k[0], k[1],
        "%.2f" % (v[0]["allreduce_bytes_per_rank"] / 1e6) if sync else dash,
        "%d (%d)" % (v[0]["buckets"], v[0]["buckets_launched_early"]) if sync else dash,
        "%.1f" % m("allreduce_busy_ms") if sync else dash,
        "%.1f" % m("exposed_wait_ms") if sync else dash,
        "%.0f%%" % (100 * m("exposed_frac")) if sync else dash,
        "%.0f" % m("skew_ms") if dp else dash,
        "%.0f" % (m("other_threads_cpu_ms") / v[0]["ranks"]) if v[0]["threads"] == 1 and dp else dash,
        m("fwd_ms"), m("bwd_compute_ms"), m("loss_sync_ms"), m("update_ms"), 1e3 * m("step_s")))
EOF
