#!/usr/bin/env bash
# Training across slow links (issue 18): two "nodes" on this machine, two network namespaces joined
# by a veth pair whose egress `tc ... tbf` limits to a given rate, one training process with one
# thread per node. For every link rate in RATES and every mode in MODES it trains the same budget
# (the quickstart's model and global batch of 128) and records the time to finish, the training
# throughput and the bytes sent, both as ddm accounts them (Comm::bytes_sent, `sent_bytes` in
# metrics.jsonl) and as the interfaces count them (/sys/class/net/<veth>/statistics/tx_bytes inside
# each namespace, read before and after each run), and optionally the quality (`ddm eval`).
#
# Modes (every one spends the same training FLOPs; steps = STEPS + E, where E is the router's
# training FLOPs expressed in steps of the model at batch 128, as bench/ddm_vs_monolith.sh does):
#   dp           data parallel: 2 ranks (one per namespace) x 64 images, gradients all-reduced every step
#   diloco       DiLoCo: 2 replicas x 64 images, pseudo-gradients all-reduced every H inner steps, one
#                run per H in H (a sweep), labelled diloco-H<h>
#   streaming    Streaming DiLoCo: STREAM = "H fragments overlap wire" (default 50 4 1 float16)
#   independent  the no-communication reference: 2 plain one-process `ddm train` runs (world 1), one
#                per namespace, each with batch 64 (train.seed 2 SEED and 2 SEED + 1), STEPS + E steps. This is DiLoCo
#                without any synchronization: the ceiling its throughput is measured against.
#   islands      decentralized islands: `ddm partition --k 2` (k-means, pixels:64, on node A, once per
#                invocation; its time is added to every islands row), then expert 0 on node A and
#                expert 1 on node B at once (split-batch: 64 images each, STEPS steps), then the router
#                (router-dit-tiny, ROUTER_STEPS steps at batch 128, `ddm train-router` including its
#                held-out report) on node A after expert 0; finally `ddm ensemble` (not timed). No
#                communication: the time to finish is partition + max(expert 0 + router, expert 1).
# Every rank runs `ddm train` directly in its namespace (`ip netns exec`) with RANK, WORLD_SIZE,
# LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK, MASTER_ADDR (rank 0's address, which hosts the store),
# MASTER_PORT and GLOO_SOCKET_IFNAME (the namespace's veth); train.threads=1, one checkpoint at the end
# (train.ckpt_every = steps; a DiLoCo checkpoint gathers every replica's state to rank 0, which is part
# of its time and bytes), parallel.timeout=900.
#
# The link (bench/netns_link.sh): namespaces ddm-sl<PID>-a / -b, veth ddmsl<PID>a (node A, rank 0)
# and ddmsl<PID>b (node B), each direction limited by tbf at its sender (BURST, LATENCY: see there);
# "unlimited" removes the qdisc. With CHECK_LINK=1 (default) each rate is verified once by timing a
# bulk TCP transfer A -> B, and the qdisc is printed. Everything the script creates is removed on
# exit, on Ctrl-C, on SIGTERM and on failure (the processes it started are stopped first).
#
# With ROUNDS=R every rate and mode runs R times, interleaved (round 1 of everything, then round 2,
# ...); the table shows medians, and the ratios to independent training and to data parallel are
# taken within each round (runs minutes apart) before their median, as bench/data_parallel.sh does:
# this machine is shared and its speed drifts by tens of percent within minutes. Each run also
# records the load average before it and the CPU seconds its processes used ("cores the run got").
# Run directories are reused across rounds (the last round's files remain).
# Throughput ("img/s") is the training loop's: global training images over the seconds the steps
# took, from the img/s of each metrics.jsonl interval (train.log_every = LOG_EVERY); it excludes
# process start, data loading, the initial state broadcast and the last checkpoint, which the time
# to finish includes. Runs are deterministic per mode (identical weights at every link rate, which
# the model-weights hash in the results shows), so the quality of a mode is evaluated once per
# distinct set of weights.
#
# Outputs, in OUT: results.jsonl (a record per run), results.tsv, results.md (the table and the
# performance targets), slow_links.png (time to finish against link rate; with EVAL=1 also FD-fmnist
# against link rate), and per rate and mode the run directories and logs (OUT/<rate>/<mode>/).
# Needs root, iproute2 (ip netns, tc with sch_tbf), Debian's python3 and gnuplot (package gnuplot-nox:
# apt-get install gnuplot-nox); the script installs nothing and refuses before any run if one is missing.
# Builds nothing: it uses build/ddm.
#
# usage: bench/slow_links.sh [OUT]                        (default /tmp/ddm-slow-links)
#   env: STEPS=1200  RATES="unlimited 1gbit 100mbit 10mbit"  MODES="dp diloco streaming independent islands"
#        (MODES="" only sets up and checks the links)  ROUNDS=1  H="10 50 200"  STREAM="50 4 1 float16"
#        ROUTER_STEPS=STEPS/2  LOG_EVERY=10  CHECK_LINK=1
#        EVAL=0 (1: ddm eval each distinct result)  EVAL_N=2000  LATENCY=100ms  BURST=(bytes)
#        SYSCTLS="net.ipv4.tcp_slow_start_after_idle=0 ..." (set in both namespaces; their TCP stacks are their own)
#        SEED=0 (train.seed of every run; independent training's two runs take 2 SEED and 2 SEED + 1)
#        CONFIG=configs/quickstart.toml  DDM=build/ddm  PYTHON=/usr/bin/python3
#   smoke: STEPS=40 RATES="unlimited 10mbit" H="10 20" STREAM="20 4 1 float16" bench/slow_links.sh /tmp/sl-smoke
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/ddm-slow-links}
ddm=${DDM:-build/ddm}
py=${PYTHON:-/usr/bin/python3}
cfg=${CONFIG:-configs/quickstart.toml}
steps=${STEPS:-1200}
router_steps=${ROUTER_STEPS:-$((steps / 2))}
rates=${RATES:-"unlimited 1gbit 100mbit 10mbit"}
modes=${MODES-"dp diloco streaming independent islands"}  # MODES="" checks the links only
hs=${H:-"10 50 200"}
read -r stream_h stream_f stream_o stream_w <<< "${STREAM:-50 4 1 float16}"
log_every=${LOG_EVERY:-10}
rounds=${ROUNDS:-1}
evaluate=${EVAL:-0}
eval_n=${EVAL_N:-2000}
check_link=${CHECK_LINK:-1}
seed=${SEED:-0}

# --- Refuse early and clearly: before anything is created or trained. ---
. "$(dirname "$0")/netns_link.sh"
[ "$link_mode" = veth ] || die "LINK=$link_mode: this benchmark limits the link's rate, which needs the namespaces (LINK=veth)"
link_require
command -v gnuplot > /dev/null || die "gnuplot not found: it draws the plot; install Debian's gnuplot-nox (apt-get install gnuplot-nox)"
[ -x "$ddm" ] || die "$ddm not found: build it first (cmake --build build --target ddm)"
[ -f "$cfg" ] || die "config $cfg not found"
for r in $rates; do
  rate_ok "$r" || die "RATES: '$r' is not a rate (unlimited, or a number with kbit, mbit or gbit, e.g. 10mbit)"
done
for m in $modes; do
  case $m in dp | diloco | streaming | independent | islands) ;; *) die "MODES: unknown mode '$m' (dp diloco streaming independent islands)" ;; esac
done
for h in $hs; do [[ $h =~ ^[1-9][0-9]*$ ]] || die "H: '$h' is not a positive number of inner steps"; done
[[ "$stream_h $stream_f $stream_o" =~ ^[1-9][0-9]*\ [1-9][0-9]*\ [0-9]+$ && $stream_w =~ ^(float32|float16)$ ]] ||
  die "STREAM='${STREAM:-}' must be \"H fragments overlap wire\", e.g. \"50 4 1 float16\""
[[ $seed =~ ^[0-9]+$ ]] || die "SEED: '$seed' is not a non-negative integer"
[[ $steps =~ ^[1-9][0-9]*$ && $router_steps =~ ^[1-9][0-9]*$ && $log_every =~ ^[1-9][0-9]*$ && $rounds =~ ^[1-9][0-9]*$ ]] ||
  die "STEPS, ROUTER_STEPS, LOG_EVERY and ROUNDS must be positive integers"

# --- The two nodes (bench/netns_link.sh). Everything is undone on exit, whatever happens. ---
mkdir -p "$out"
link_up sl

# --- The budget: the router's FLOPs in steps of the model at batch 128 (as bench/ddm_vs_monolith.sh). ---
read -r model_mflop router_mflop < <($ddm presets | awk '$1 == "unet-tiny" {u = $4} $1 == "router-dit-tiny" {r = $4} END {print u, r}')
extra=$(awk -v s="$router_steps" -v u="$model_mflop" -v r="$router_mflop" 'BEGIN {x = s * r / u; print (x == int(x)) ? x : int(x) + 1}')
total_steps=$((steps + extra))
mkdir -p "$out"
results=$out/results.jsonl
: > "$results"
log "budget: $total_steps steps at global batch 128 ($steps + $extra for the router's $router_steps steps x $router_mflop MFLOP); islands: 2 experts x $steps steps x 64 + the router"

common=(--config "$cfg" --force --set train.seed="$seed" --set train.threads=1 --set train.log_every="$log_every" --set parallel.timeout=900)

# Appends one JSON record for the run just finished. Args: rate mode kind wall_s tx_a tx_b rc dirs...
record() {
  ROUND=$round LOAD=$run_load CPU=$(elapsed "$run_cpu0" "$(child_cpu)") "$py" - "$@" >> "$results" <<'EOF'
import glob, hashlib, json, os, re, sys
rate, mode, kind, wall, tx_a, tx_b, rc = sys.argv[1:8]
dirs = sys.argv[8:]
def metrics(d):
    p = os.path.join(d, "metrics.jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
def loop_seconds(recs, batch):  # the seconds the steps took: each interval's images over its img/s
    s, prev = 0.0, 0
    for r in recs:
        s += (r["step"] - prev) * batch / r["img_per_s"]
        prev = r["step"]
    return s
def weights_hash(d):
    h = hashlib.sha256()
    ck = sorted(glob.glob(os.path.join(d, "ckpt", "step-*")))
    if not ck: return ""
    for f in ("model.safetensors", "ema.safetensors"):
        h.update(open(os.path.join(ck[-1], f), "rb").read())
    return h.hexdigest()[:16]
def parse_mib(s):
    m = re.match(r"([\d.]+) (B|KiB|MiB|GiB)", s)
    return float(m.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)] if m else None
d = {"rate": rate, "mode": mode, "round": int(os.environ["ROUND"]), "load_before": float(os.environ["LOAD"]),
     "cpu_s": float(os.environ["CPU"]), "kind": kind, "wall_s": float(wall), "rc": int(rc),
     "veth_tx_a": int(tx_a), "veth_tx_b": int(tx_b)}
if kind == "ranks":  # dirs: the run (rank 0 writes it)
    recs = metrics(dirs[0])
    d["steps"] = recs[-1]["step"] if recs else 0
    d["images"] = d["steps"] * 128
    d["loop_s"] = loop_seconds(recs, 128)
    d["sent_rank0"] = recs[-1].get("sent_bytes", 0) if recs else 0
    d["final_loss"] = recs[-1]["loss"] if recs else None
    log = open(os.path.join(os.path.dirname(dirs[0]), os.path.basename(dirs[0]) + ".rank0.log")).read()
    m = re.search(r"the most any rank sent over the whole run: ([\d.]+ \w+)", log)
    d["sent_max_rank"] = parse_mib(m.group(1)) if m else None
    d["hash"] = weights_hash(dirs[0])
elif kind == "independent":  # dirs: the two processes' runs
    rs = [metrics(x) for x in dirs]
    d["steps"] = rs[0][-1]["step"] if rs[0] else 0
    d["images"] = sum(r[-1]["step"] * 64 for r in rs if r)
    d["loop_s"] = max(loop_seconds(r, 64) for r in rs)
    d["sent_rank0"] = 0
    d["final_loss"] = sum(r[-1]["loss"] for r in rs if r) / len(rs)
    d["hash"] = weights_hash(dirs[0])
else:  # islands: dirs = expert 0, expert 1, router; wall already includes the partition
    rs = [metrics(x) for x in dirs[:2]]
    router = metrics(dirs[2])
    d["steps"] = rs[0][-1]["step"] if rs[0] else 0
    d["images"] = sum(r[-1]["step"] * 64 for r in rs if r)
    d["loop_s"] = max(loop_seconds(r, 64) for r in rs)
    d["router_loop_s"] = loop_seconds(router, 128)
    d["sent_rank0"] = 0
    d["final_loss"] = sum(r[-1]["loss"] for r in rs if r) / len(rs)
    d["hash"] = "-".join(weights_hash(x)[:8] for x in dirs)
d["img_per_s"] = d["images"] / d["loop_s"] if d.get("loop_s") else 0
print(json.dumps(d))
EOF
  "$py" -c 'import json,sys; d=json.loads(open(sys.argv[1]).readlines()[-1])
acc = d["sent_rank0"]; tx = d["veth_tx_a"]
print("  %s at %s: %s, %.1f s to finish, %.1f s of steps, %.0f img/s, %.2f cores, rank 0 sent %.2f MB accounted, %.2f MB on its veth%s" % (
    d["mode"], d["rate"], "ok" if d["rc"] == 0 else "FAILED (exit %d)" % d["rc"], d["wall_s"], d["loop_s"], d["img_per_s"],
    d["cpu_s"] / d["wall_s"], acc / 1e6, tx / 1e6, " (%.3fx)" % (tx / acc) if acc else ""))' "$results" >&2
}

now() { date +%s.%N; }
# CPU seconds of this shell's reaped children (the ddm processes: `ip netns exec` execs into them).
child_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f\n", ($14 + $15) / hz }' "/proc/$$/stat"; }
begin_run() {  # load average and children's CPU before a run, for record()
  run_load=$(cut -d' ' -f1 /proc/loadavg)
  run_cpu0=$(child_cpu)
}
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f\n", b - a }'; }

run_ranks() {  # RATE MODE --set...: one job of 2 ranks, rank r in namespace r
  local rate=$1 mode=$2 dir=$out/$1/$2 t0 p0 p1 rc=0 a0 b0
  shift 2
  mkdir -p "$out/$rate"
  port=$((port + 1))
  log "round $round/$rounds, $rate: $mode (2 ranks)"
  begin_run
  a0=$(tx_bytes "$ns_a" "$dev_a") b0=$(tx_bytes "$ns_b" "$dev_b") t0=$(now)
  ip netns exec "$ns_a" env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 MASTER_ADDR="$addr_a" \
    MASTER_PORT=$port GLOO_SOCKET_IFNAME="$dev_a" "$ddm" train "${common[@]}" --set train.steps=$total_steps \
    --set train.ckpt_every=$total_steps "$@" --out "$dir" > "$dir.rank0.log" 2>&1 &
  p0=$!
  started $p0
  ip netns exec "$ns_b" env RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 GROUP_RANK=1 MASTER_ADDR="$addr_a" \
    MASTER_PORT=$port GLOO_SOCKET_IFNAME="$dev_b" "$ddm" train "${common[@]}" --set train.steps=$total_steps \
    --set train.ckpt_every=$total_steps "$@" --out "$dir" > "$dir.rank1.log" 2>&1 &
  p1=$!
  started $p1
  reap $p0 || rc=$?
  reap $p1 || rc=$((rc ? rc : $?))
  [ $rc = 0 ] || { log "  $mode failed (exit $rc); the end of its logs:"; tail -n 3 "$dir".rank*.log >&2; }
  record "$rate" "$mode" ranks "$(elapsed "$t0" "$(now)")" $(($(tx_bytes "$ns_a" "$dev_a") - a0)) \
    $(($(tx_bytes "$ns_b" "$dev_b") - b0)) $rc "$dir"
}

run_independent() {  # RATE: two one-process runs with half the batch each, one per namespace
  local rate=$1 dir=$out/$1/independent t0 p0 p1 rc=0 a0 b0
  mkdir -p "$dir"
  log "round $round/$rounds, $rate: independent (2 processes, no communication)"
  begin_run
  a0=$(tx_bytes "$ns_a" "$dev_a") b0=$(tx_bytes "$ns_b" "$dev_b") t0=$(now)
  ip netns exec "$ns_a" env -u RANK -u WORLD_SIZE "$ddm" train "${common[@]}" --set train.steps=$total_steps \
    --set train.ckpt_every=$total_steps --set train.batch_size=64 --set train.seed=$((2 * seed)) --out "$dir/p0" > "$dir/p0.log" 2>&1 &
  p0=$!
  started $p0
  ip netns exec "$ns_b" env -u RANK -u WORLD_SIZE "$ddm" train "${common[@]}" --set train.steps=$total_steps \
    --set train.ckpt_every=$total_steps --set train.batch_size=64 --set train.seed=$((2 * seed + 1)) --out "$dir/p1" > "$dir/p1.log" 2>&1 &
  p1=$!
  started $p1
  reap $p0 || rc=$?
  reap $p1 || rc=$((rc ? rc : $?))
  [ $rc = 0 ] || { log "  independent failed (exit $rc)"; tail -n 3 "$dir"/p*.log >&2; }
  record "$rate" independent independent "$(elapsed "$t0" "$(now)")" $(($(tx_bytes "$ns_a" "$dev_a") - a0)) \
    $(($(tx_bytes "$ns_b" "$dev_b") - b0)) $rc "$dir/p0" "$dir/p1"
}

partition_s=""
run_islands() {  # RATE: partition (once), 2 experts at once, the router after expert 0, the ensemble
  local rate=$1 dir=$out/$1/islands part=$out/partition-k2 t0 p0 p1 pr rc=0 a0 b0 wall
  mkdir -p "$dir/logs"
  if [ -z "$partition_s" ]; then
    log "partition: k-means into 2 clusters on node A (once; its time counts in every islands row)"
    t0=$(now)
    ip netns exec "$ns_a" "$ddm" partition --config "$cfg" --k 2 --threads 1 --force --out "$part" > "$out/partition.log" 2>&1 ||
      { tail -n 3 "$out/partition.log" >&2; die "ddm partition failed (log $out/partition.log)"; }
    partition_s=$(elapsed "$t0" "$(now)")
    log "  partition took $partition_s s"
  fi
  log "round $round/$rounds, $rate: islands (2 experts at once, then the router on node A)"
  local ex=(train "${common[@]}" --partition "$part" --budget split-batch --set train.steps=$steps --set train.ckpt_every=$steps)
  begin_run
  a0=$(tx_bytes "$ns_a" "$dev_a") b0=$(tx_bytes "$ns_b" "$dev_b") t0=$(now)
  ip netns exec "$ns_a" env -u RANK -u WORLD_SIZE "$ddm" "${ex[@]}" --expert 0 --out "$dir/experts/0" > "$dir/logs/expert0.log" 2>&1 &
  p0=$!
  started $p0
  ip netns exec "$ns_b" env -u RANK -u WORLD_SIZE "$ddm" "${ex[@]}" --expert 1 --out "$dir/experts/1" > "$dir/logs/expert1.log" 2>&1 &
  p1=$!
  started $p1
  reap $p0 || rc=$?
  ip netns exec "$ns_a" env -u RANK -u WORLD_SIZE "$ddm" train-router --config "$cfg" --partition "$part" \
    --preset router-dit-tiny --holdout 1000 --force --set train.seed="$seed" --set train.threads=1 --set train.log_every="$log_every" \
    --set train.steps="$router_steps" --set train.ckpt_every="$router_steps" --out "$dir/router" > "$dir/logs/router.log" 2>&1 &
  pr=$!
  started $pr
  reap $p1 || rc=$((rc ? rc : $?))
  reap $pr || rc=$((rc ? rc : $?))
  wall=$(awk -v a="$(elapsed "$t0" "$(now)")" -v p="$partition_s" 'BEGIN { printf "%.3f\n", a + p }')
  if [ $rc = 0 ]; then
    "$ddm" ensemble --out "$dir" --partition "$part" --router "$dir/router" --expert "$dir/experts/0" \
      --expert "$dir/experts/1" --force > "$dir/logs/ensemble.log" 2>&1 || rc=$?
  fi
  [ $rc = 0 ] || { log "  islands failed (exit $rc)"; tail -n 3 "$dir"/logs/*.log >&2; }
  record "$rate" islands islands "$wall" $(($(tx_bytes "$ns_a" "$dev_a") - a0)) $(($(tx_bytes "$ns_b" "$dev_b") - b0)) \
    $rc "$dir/experts/0" "$dir/experts/1" "$dir/router"
}

# --- The experiment: every mode at every rate. ---
for ((round = 1; round <= rounds; round++)); do
for rate in $rates; do
  set_rate "$rate"
  [ "$check_link" = 1 ] && [ $round = 1 ] && check_link "$rate"
  for mode in $modes; do
    case $mode in
      dp) run_ranks "$rate" dp ;;
      diloco) for h in $hs; do run_ranks "$rate" "diloco-H$h" --set parallel.mode=diloco --set diloco.inner_steps="$h"; done ;;
      streaming)
        run_ranks "$rate" "streaming-H$stream_h-F$stream_f" --set parallel.mode=diloco --set diloco.inner_steps="$stream_h" \
          --set diloco.fragments="$stream_f" --set diloco.overlap="$stream_o" --set diloco.wire="$stream_w" ;;
      independent) run_independent "$rate" ;;
      islands) run_islands "$rate" ;;
    esac
  done
done
done
set_rate unlimited

# --- Quality (EVAL=1): once per distinct set of weights, outside the namespaces. ---
if [ "$evaluate" = 1 ]; then
  declare -A done_eval=()
  while IFS=$'\t' read -r rate mode hash; do
    [ -n "${done_eval[$hash]:-}" ] && continue
    done_eval[$hash]=1
    if [ "$mode" = islands ]; then args=(--ensemble "$out/$rate/islands" --routing top1); else args=(--ckpt "$out/$rate/$mode"); fi
    log "eval $mode ($rate run; weights $hash): ddm eval ${args[*]} --n $eval_n --seed 1"
    mkdir -p "$out/eval"
    "$ddm" eval "${args[@]}" --n "$eval_n" --seed 1 --out "$out/eval/$mode-$hash" > "$out/eval/$mode-$hash.log" 2>&1 ||
      log "  ddm eval failed (log $out/eval/$mode-$hash.log)"
  done < <("$py" -c 'import json,sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d["rc"] == 0 and d["mode"] != "independent": print("%s\t%s\t%s" % (d["rate"], d["mode"], d["hash"]))' "$results")
fi

# --- Tables and the plot. ---
[ -s "$results" ] || { log "no runs (MODES is empty): links checked only"; exit 0; }
"$py" - "$out" "$rates" "$evaluate" <<'EOF'
import glob, json, os, statistics as st, sys
out, rates, evaluate = sys.argv[1], sys.argv[2].split(), sys.argv[3] == "1"
rows = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
def bps(r):
    if r == "unlimited": return 0
    for u, m in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if r.endswith(u): return float(r[:-len(u)]) * m
for d in rows:  # quality, from the evaluation of the same weights
    d["fd"] = d["kid"] = d["precision"] = d["recall"] = None
    for f in glob.glob(os.path.join(out, "eval", "%s-%s" % (d["mode"], d["hash"]), "*.json")):
        e = json.load(open(f))
        if "fd_fmnist" in e:
            d["fd"], d["kid"], d["precision"], d["recall"] = e["fd_fmnist"], e["kid_mean"], e["precision"], e["recall"]
cols = ["round", "rate", "mode", "rc", "steps", "wall_s", "loop_s", "img_per_s", "cpu_s", "load_before", "sent_rank0",
        "veth_tx_a", "sent_max_rank", "veth_tx_b", "final_loss", "hash", "fd", "kid", "precision", "recall"]
with open(os.path.join(out, "results.tsv"), "w") as f:
    f.write("\t".join(cols) + "\n")
    for d in rows: f.write("\t".join("" if d.get(c) is None else str(d.get(c)) for c in cols) + "\n")
ok = [d for d in rows if d["rc"] == 0]
med = lambda v: st.median(v) if v else None
rounds = sorted({d["round"] for d in rows})
keys = []
for d in rows:
    if (d["rate"], d["mode"]) not in keys: keys.append((d["rate"], d["mode"]))
one = {(d["rate"], d["mode"], d["round"]): d for d in ok}
def ratio(rate, mode, ref, key="img_per_s"):  # median over rounds of key against ref's in the same round and at the same rate
    return med([one[(rate, mode, r)][key] / one[(rate, ref, r)][key] for r in rounds
                if (rate, mode, r) in one and (rate, ref, r) in one])
for d in ok:  # the work itself, whatever else ran on the machine (CPU of the whole processes, start included)
    d["img_per_cpu_s"] = d["images"] / d["cpu_s"] if d["cpu_s"] > 0 else 0
fmt = lambda x, f: "—" if x is None else f % x
mb = lambda x: "—" if x is None else "%.2f" % (x / 1e6)
S = {}  # per (rate, mode): medians over the rounds
L = ["| link | mode | runs | time to finish s | steps s | img/s (min-max) | vs independent | vs dp | cores the run got | img per CPU-s | vs independent, per CPU-s | load before | rank 0 sent MB (ddm) | its veth tx MB | veth / ddm | most any rank sent MB (ddm, rounded) | veth B tx MB | final loss | FD-fmnist | KID | precision | recall |",
     "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for rate, mode in keys:
    v = [d for d in ok if d["rate"] == rate and d["mode"] == mode]
    failed = len([d for d in rows if d["rate"] == rate and d["mode"] == mode]) - len(v)
    if not v:
        L.append("| %s | %s | %d failed |" % (rate, mode, failed) + " |" * 19); continue
    m = lambda k: med([d[k] for d in v if d.get(k) is not None])
    last = v[-1]
    s = S[(rate, mode)] = {"wall_s": m("wall_s"), "img_per_s": m("img_per_s"), "fd": last["fd"],
                           "vs_indep": ratio(rate, mode, "independent"), "vs_dp": ratio(rate, mode, "dp"),
                           "cores": med([d["cpu_s"] / d["wall_s"] for d in v]),
                           "vs_indep_cpu": ratio(rate, mode, "independent", "img_per_cpu_s")}
    ips = [d["img_per_s"] for d in v]
    L.append("| %s | %s | %d%s | %.1f | %.1f | %.0f (%.0f-%.0f) | %s | %s | %.2f | %.0f | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        rate, mode, len(v), " (+%d failed)" % failed if failed else "", s["wall_s"], m("loop_s"), s["img_per_s"], min(ips), max(ips),
        fmt(s["vs_indep"], "%.3f"), fmt(s["vs_dp"], "%.2f"), s["cores"], m("img_per_cpu_s"), fmt(s["vs_indep_cpu"], "%.3f"), m("load_before"),
        mb(m("sent_rank0")), mb(m("veth_tx_a")), fmt(med([d["veth_tx_a"] / d["sent_rank0"] for d in v if d["sent_rank0"]]), "%.3f"),
        mb(m("sent_max_rank")), mb(m("veth_tx_b")), fmt(last["final_loss"], "%.4f"),
        fmt(last["fd"], "%.3f"), fmt(last["kid"], "%.5f"), fmt(last["precision"], "%.3f"), fmt(last["recall"], "%.3f")))
# The issue's two performance targets, for every DiLoCo variant (ratios taken within each round, median).
T = []
slow = sorted([r for r in rates if bps(r)], key=bps)
for (rate, mode), s in S.items():
    if not (mode.startswith("diloco") or mode.startswith("streaming")): continue
    if rate == "unlimited" and s["vs_indep"] is not None:
        x = s["vs_indep"]
        T.append("- unlimited link, %s: %.3fx the throughput of independent training (%.1f%% %s; target: within 5%%: %s); "
                 "the runs got %.2f and %.2f cores; per CPU-second %s" % (
            mode, x, 100 * abs(x - 1), "slower" if x < 1 else "faster", "met" if x >= 0.95 else "NOT met",
            s["cores"], S[("unlimited", "independent")]["cores"], fmt(s["vs_indep_cpu"], "%.3fx")))
    if rate in ("10mbit", slow[0] if slow else None) and s["vs_dp"] is not None:  # the target's rate, and the slowest
        T.append("- %s link, %s: %.2fx the throughput of data parallel%s" % (rate, mode, s["vs_dp"],
            " (target at 10 Mbit/s: at least 5x: %s)" % ("met" if s["vs_dp"] >= 5 else "NOT met") if rate == "10mbit" else ""))
# Determinism: a mode's weights should not depend on the link (the schedule counts steps, not seconds).
by_mode = {}
for d in ok: by_mode.setdefault(d["mode"], set()).add(d["hash"])
if by_mode:
    T.append("- weights identical in every run (every link rate and round): " + ", ".join(
        "%s %s" % (m, "yes" if len(h) == 1 else "NO (%d different)" % len(h)) for m, h in by_mode.items()))
text = ("Medians over %d round%s; ratios (vs independent, vs dp) are taken within each round at the same link rate, "
        "then their median.\n\n" % (len(rounds), "s" if len(rounds) > 1 else "") + "\n".join(L) +
        "\n\nPerformance targets (throughput of the training steps):\n\n" + "\n".join(T) + "\n")
open(os.path.join(out, "results.md"), "w").write(text)
print(text)
# Data for gnuplot: one block per mode, "unlimited" drawn at 10x the fastest finite rate.
finite = [bps(r) for r in rates if bps(r)]
unl = 10 * max(finite) if finite else 1e10
all_modes = list(dict.fromkeys(m for _, m in keys))
def blocks(path, col):  # one block per mode that has the column; returns gnuplot's plot arguments, a colour per mode
    args = []
    with open(path, "w") as f:
        for mode in all_modes:
            pts = sorted([(bps(r) or unl, s[col]) for (r, m), s in S.items() if m == mode and s[col] is not None])
            if not pts: continue
            f.write("# %s\n" % mode)
            for x, y in pts: f.write("%g %g\n" % (x, y))
            f.write("\n\n")
            args.append("'%s' index %d using 1:2 with linespoints lw 2 pt 7 lt %d title '%s'" % (
                path, len(args), all_modes.index(mode) + 1, mode))
    return ", \\\n  ".join(args)
dat, fd_dat = os.path.join(out, "plot.dat"), os.path.join(out, "plot-fd.dat")
plot_time = blocks(dat, "wall_s")
plot_fd = blocks(fd_dat, "fd")
tics = ", ".join('"%s" %g' % (r, bps(r) or unl) for r in rates)
quality = evaluate and any(s["fd"] is not None for s in S.values())
lo = min(finite) / 2 if finite else unl / 2
if os.path.exists(os.path.join(out, "plot.gp")): os.remove(os.path.join(out, "plot.gp"))
if not plot_time: sys.exit(0)  # no run finished: nothing to draw
with open(os.path.join(out, "plot.gp"), "w") as f:
    f.write("set terminal pngcairo size %d,520 font 'sans,10'\nset output '%s'\n" % (1400 if quality else 760, os.path.join(out, "slow_links.png")))
    f.write("set logscale x\nset xrange [%g:%g]\nset xtics (%s)\nset grid\nset key outside right top\n" % (lo, 2 * unl, tics))
    f.write("set xlabel 'link rate (tbf on a veth pair; unlimited drawn at 10x the fastest)'\n")
    if quality: f.write("set multiplot layout 1,2\n")
    f.write("set logscale y\nset ylabel 'time to finish, s (median over rounds)'\nset title 'Time to finish the same training budget'\n")
    f.write("plot %s\n" % plot_time)
    if quality:
        f.write("unset logscale y\nset ylabel 'FD-fmnist (lower is better)'\nset title 'Quality at equal training FLOPs'\n")
        f.write("plot %s\nunset multiplot\n" % plot_fd)
EOF
if [ -f "$out/plot.gp" ]; then
  gnuplot "$out/plot.gp" && log "wrote $out/results.md, results.tsv, results.jsonl and slow_links.png"
else
  log "wrote $out/results.md, results.tsv and results.jsonl (no run finished: no plot)"
fi
if grep -q '"rc": [1-9]' "$results"; then log "some runs failed: see the table"; exit 1; fi
