#!/usr/bin/env bash
# The central claim of decentralized diffusion at Fashion-MNIST scale: at equal total training FLOPs
# (router included), is an ensemble of K experts trained in isolation on clusters of the data (top-1
# routing) better than one monolithic model? For each seed it trains and evaluates:
#   mono     the quickstart model (unet-tiny, flow, batch 128, STEPS steps) plus the router's training
#            FLOPs as extra steps, so both sides spend the same
#   k2 k4 k8 K unet-tiny experts on a balanced k-means partition (pixels:64), split-batch (batch
#            128 / K each, STEPS steps), and a router-dit-tiny router (ROUTER_STEPS steps), trained
#            as islands (`ddm islands run`)
#   rand4    the same with K = 4 on a random balanced partition (the ablation)
#   distill4 a unet-tiny student distilled from the k4 ensemble of the same seed, STEPS / 3 steps
#   mono3    the monolith trained from scratch for the student's STEPS / 3 steps: what distillation
#            must beat to be worth its teacher
# and evaluates each with `ddm eval --n N` (Euler, 20 steps, CFG 2; the same sampling seed for all),
# then prints a table of FD-fmnist, KID, precision, recall and class accuracy, as the mean and a 95%
# t-interval over the seeds; the difference of each run from the monolith; and the training loss by
# quarter of the run (the experts, each on its own cluster, against the monolith at the same steps).
# With ROUTING=1 it also evaluates every k4 ensemble under each routing strategy, with its GFLOP per
# image (the paper's Table 1). With CFGS="1 1.5 2.5 3" it also evaluates mono and k4 (top-1) at
# those guidance scales: the ensemble's experts each guide against their own cluster's unconditional
# model, so the same scale need not suit both. Everything resumes: re-running skips finished runs and
# evaluations, so the script can be stopped and started again. The partitions are made once (seed
# 0) and shared by the seeds: the interval is over training seeds.
# Cost on 2 cores: about 11 minutes of training and 2-3 of evaluation per run (mono3 and distill4:
# about 5); all of it (3 seeds, 7 runs each, ROUTING=1) is about 5.5 hours.
# usage: bench/ddm_vs_monolith.sh [OUT=exp]
#   env: SEEDS="0 1 2" RUNS="mono k4 rand4 k2 k8 distill4 mono3" N=2000 STEPS=1200 ROUTER_STEPS=600
#        ROUTING=0 STRATEGIES="top1 topk:2 full threshold:0.05 sample oracle" CFGS="" DDM=build/ddm
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-exp}
ddm=${DDM:-build/ddm}
seeds=${SEEDS:-"0 1 2"}
runs=${RUNS:-"mono k4 rand4 k2 k8 distill4 mono3"}
n=${N:-2000}
steps=${STEPS:-1200}
router_steps=${ROUTER_STEPS:-600}
strategies=${STRATEGIES:-"top1 topk:2 full threshold:0.05 sample oracle"}
cfgs=${CFGS:-}
for scale in $cfgs; do
  [[ $scale =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "CFGS: '$scale' is not a guidance scale (a number >= 0, e.g. CFGS=\"1 1.5 2.5\")" >&2; exit 2; }
done
cfg=configs/quickstart.toml
stem_at() { echo "euler-20steps-cfg$(printf %.2f "$1")-n$n"; }  # what ddm eval names its output at guidance scale $1
eval_stem=$(stem_at 2)
mkdir -p "$out/parts" "$out/logs"
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# The router's training FLOPs, in steps of the monolith (forward FLOPs per image from `ddm presets`;
# both train at batch 128 and pay about 3x the forward pass).
read -r unet_mflop router_mflop < <($ddm presets | awk '$1 == "unet-tiny" {u = $4} $1 == "router-dit-tiny" {r = $4}
                                                      END {print u, r}')
extra=$(awk -v s="$router_steps" -v u="$unet_mflop" -v r="$router_mflop" 'BEGIN {x = s * r / u; print (x == int(x)) ? x : int(x) + 1}')
log "router: $router_steps steps x $router_mflop MFLOP = $extra monolith steps; the monolith trains $((steps + extra))"

partition() {  # name k method
  local dir="$out/parts/$1"
  [ -f "$dir/partition.safetensors" ] && return
  log "partition $1"
  $ddm partition --config "$cfg" --k "$2" --method "$3" --force --out "$dir" > "$out/logs/partition-$1.log"
}

islands() {  # name k partition seed
  local file="$out/$1-s$4.toml"
  cat > "$file" <<EOF
out = "$out/$1-s$4"
config = "$cfg"
[partition]
path = "$out/parts/$3"
[experts]
budget = "split-batch"
set = ["train.steps=$steps", "train.seed=$4"]
[router]
preset = "router-dit-tiny"
holdout = 1000
set = ["train.steps=$router_steps", "train.seed=$4"]
[run]
routing = "top1"
EOF
  [ -f "$out/$1-s$4/ensemble.json" ] && return
  log "islands $1 seed $4"
  $ddm islands run "$file" > "$out/logs/$1-s$4.log"
}

evaluate() {  # --ckpt dir [""] | --ensemble dir routing, then optionally a guidance scale (default: the config's 2)
  local stem args=()
  stem=$(stem_at "${4:-2}")
  if [ -n "${3:-}" ]; then stem="routing-${3//:/}-$stem"; args+=(--routing "$3"); fi
  if [ -n "${4:-}" ]; then args+=(--cfg "$4"); fi
  [ -f "$2/eval/$stem.json" ] && return
  log "eval $2 ${3:-} ${4:+cfg $4}"
  $ddm eval "$1" "$2" "${args[@]}" --n "$n" --seed 1 --out "$2/eval" > "$out/logs/eval-$(basename "$2")${3:+-${3//:/}}${4:+-cfg$4}.log"
}

for seed in $seeds; do
  for run in $runs; do
    case $run in
      mono)
        if [ ! -f "$out/mono-s$seed/ckpt/step-$(printf %08d $((steps + extra)))/state.json" ]; then
          log "monolith seed $seed"
          $ddm train --config "$cfg" --set train.steps=$((steps + extra)) --set train.seed="$seed" --resume --quiet \
            --out "$out/mono-s$seed" > "$out/logs/mono-s$seed.log"
        fi
        evaluate --ckpt "$out/mono-s$seed" ;;
      k2 | k4 | k8)
        partition "$run" "${run#k}" kmeans
        islands "$run" "${run#k}" "$run" "$seed"
        evaluate --ensemble "$out/$run-s$seed" top1 ;;
      rand4)
        partition rand4 4 random
        islands rand4 4 rand4 "$seed"
        evaluate --ensemble "$out/rand4-s$seed" top1 ;;
      distill4)
        partition k4 4 kmeans
        islands k4 4 k4 "$seed"
        if [ ! -f "$out/distill4-s$seed/ckpt/step-$(printf %08d $((steps / 3)))/state.json" ]; then
          log "distill seed $seed"
          $ddm distill --ensemble "$out/k4-s$seed" --set train.steps=$((steps / 3)) --set train.seed="$seed" --resume \
            --quiet --out "$out/distill4-s$seed" > "$out/logs/distill4-s$seed.log"
        fi
        evaluate --ckpt "$out/distill4-s$seed" ;;
      mono3)
        if [ ! -f "$out/mono3-s$seed/ckpt/step-$(printf %08d $((steps / 3)))/state.json" ]; then
          log "monolith at $((steps / 3)) steps, seed $seed"
          $ddm train --config "$cfg" --set train.steps=$((steps / 3)) --set train.seed="$seed" --resume --quiet \
            --out "$out/mono3-s$seed" > "$out/logs/mono3-s$seed.log"
        fi
        evaluate --ckpt "$out/mono3-s$seed" ;;
      *) echo "unknown run '$run' (mono k2 k4 k8 rand4 distill4 mono3)" >&2; exit 2 ;;
    esac
  done
  if [ "${ROUTING:-0}" = 1 ] && [ -f "$out/k4-s$seed/ensemble.json" ]; then
    for s in $strategies; do evaluate --ensemble "$out/k4-s$seed" "$s"; done
  fi
  for scale in $cfgs; do
    [ -f "$out/mono-s$seed/eval/$eval_stem.json" ] && evaluate --ckpt "$out/mono-s$seed" "" "$scale"
    [ -f "$out/k4-s$seed/ensemble.json" ] && evaluate --ensemble "$out/k4-s$seed" top1 "$scale"
  done
done

# One row per run: mean and 95% t-interval (half-width) over the seeds that finished.
t975="12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262"  # Student t, 97.5%, 1-9 degrees of freedom
field() { sed -n "s/^  \"$2\": \([-0-9.e]*\),\{0,1\}$/\1/p" "$1"; }
summarize() {  # label glob-of-eval-jsons [gflop]: with gflop, first a column of GFLOP per image
  local files=() f
  for f in $2; do [ -f "$f" ] && files+=("$f"); done
  [ ${#files[@]} -eq 0 ] && return
  printf '| %s | %d |' "$1" ${#files[@]}
  [ -n "${3:-}" ] && sed -n 's/^    "gflop_per_image": "\([0-9.]*\)",\{0,1\}$/\1/p' "${files[@]}" |
    awk '{s += $1} END {printf " %.2f |", s / NR}'
  for key in fd_fmnist kid_mean precision recall mean_class_accuracy; do
    for f in "${files[@]}"; do field "$f" $key; done |
      awk -v T="$t975" '{x[NR] = $1; s += $1} END {m = s / NR; v = 0; for (i = 1; i <= NR; i++) v += (x[i] - m) ^ 2;
           split(T, t, " ");
           if (NR > 1) printf " %.4g +- %.2g |", m, t[NR - 1] * sqrt(v / (NR - 1)) / sqrt(NR); else printf " %.4g |", m}'
  done
  echo
}
echo
echo "| run | seeds | FD-fmnist | KID | precision | recall | class acc |"
echo "|---|---|---|---|---|---|---|"
for run in $runs; do
  case $run in
    mono | distill4 | mono3) summarize "$run" "$out/$run-s*/eval/$eval_stem.json" ;;
    *) summarize "$run top1" "$out/$run-s*/eval/routing-top1-$eval_stem.json" ;;
  esac
done

# Each run against the monolith: the difference of the means over the seeds and its 95% interval
# (Welch's standard error, with t at min(seeds) - 1 degrees of freedom, which errs on the wide side).
versus_mono() {  # label glob-of-eval-jsons
  local files=() mono=() f key
  for f in $2; do [ -f "$f" ] && files+=("$f"); done
  for f in "$out"/mono-s*/eval/"$eval_stem".json; do [ -f "$f" ] && mono+=("$f"); done
  if [ ${#files[@]} -lt 2 ] || [ ${#mono[@]} -lt 2 ]; then return; fi
  printf '| %s |' "$1"
  for key in fd_fmnist kid_mean precision recall; do
    { for f in "${files[@]}"; do echo "a $(field "$f" $key)"; done
      for f in "${mono[@]}"; do echo "b $(field "$f" $key)"; done; } |
      awk -v T="$t975" '{n[$1]++; s[$1] += $2; q[$1] += $2 * $2} END {
             split(T, t, " ")
             for (g in n) {m[g] = s[g] / n[g]; v[g] = (q[g] - n[g] * m[g] ^ 2) / (n[g] - 1); if (v[g] < 0) v[g] = 0}
             df = (n["a"] < n["b"] ? n["a"] : n["b"]) - 1
             printf " %+.3g +- %.2g |", m["a"] - m["b"], t[df] * sqrt(v["a"] / n["a"] + v["b"] / n["b"])}'
  done
  echo
}
echo
echo "| minus mono | FD-fmnist | KID | precision | recall |"
echo "|---|---|---|---|---|"
for run in $runs; do
  case $run in
    mono) ;;
    distill4 | mono3) versus_mono "$run" "$out/$run-s*/eval/$eval_stem.json" ;;
    *) versus_mono "$run top1" "$out/$run-s*/eval/routing-top1-$eval_stem.json" ;;
  esac
done

# The training loss (flow matching) by quarter of the run, averaged over the logged intervals, over
# the experts (each on its own cluster) and over the seeds: how well each side fits its data at
# equal steps. The monolith's extra router-budget steps are left out, so every column is the same
# steps for every row.
train_loss() {  # label metrics.jsonl files...
  local label=$1; shift
  [ $# -eq 0 ] && return
  awk -v S="$steps" -v label="$label" '
    match($0, /"loss":[-0-9.e]+/) {
      l = substr($0, RSTART + 7, RLENGTH - 7)
      if (match($0, /"step":[0-9]+/)) loss[FILENAME, substr($0, RSTART + 7, RLENGTH - 7) + 0] = l  # a resume may log a step twice: keep the last
    }
    END {
      for (key in loss) {split(key, k, SUBSEP); if (k[2] > 0 && k[2] <= S) {q = int((k[2] - 1) * 4 / S); sum[q] += loss[key]; cnt[q]++}}
      printf "| %s |", label; for (q = 0; q < 4; q++) printf " %.4f |", sum[q] / cnt[q]; print ""
    }' "$@"
}
loss_files() {  # run: the metrics of its finished seeds (every expert for an ensemble)
  local d
  for d in "$out/$1"-s*; do
    if [ -f "$d/ensemble.json" ]; then ls "$d"/experts/*/metrics.jsonl
    elif [ "$1" = mono ] && [ -f "$d/eval/$eval_stem.json" ]; then echo "$d/metrics.jsonl"; fi
  done
}
echo
echo "| training loss | 1-$((steps / 4)) | $((steps / 4 + 1))-$((steps / 2)) | $((steps / 2 + 1))-$((steps * 3 / 4)) | $((steps * 3 / 4 + 1))-$steps |"
echo "|---|---|---|---|---|"
for run in $runs; do
  case $run in
    distill4 | mono3) ;;
    mono) train_loss mono $(loss_files mono) ;;
    *) train_loss "$run experts" $(loss_files "$run") ;;
  esac
done
if [ "${ROUTING:-0}" = 1 ]; then
  echo
  echo "| k4 routing | seeds | GFLOP/image | FD-fmnist | KID | precision | recall | class acc |"
  echo "|---|---|---|---|---|---|---|---|"
  for s in $strategies; do summarize "$s" "$out/k4-s*/eval/routing-${s//:/}-$eval_stem.json" gflop; done
fi
if [ -n "$cfgs" ]; then
  echo
  echo "| guidance scale | seeds | FD-fmnist | KID | precision | recall | class acc |"
  echo "|---|---|---|---|---|---|---|"
  for scale in $(printf '%s\n' $cfgs 2 | sort -n -u); do
    stem=$(stem_at "$scale")
    summarize "mono, CFG $scale" "$out/mono-s*/eval/$stem.json"
    summarize "k4 top1, CFG $scale" "$out/k4-s*/eval/routing-top1-$stem.json"
  done
fi
