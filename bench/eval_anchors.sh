#!/usr/bin/env bash
# Reference points for ddm's sample-quality metrics and a sampler sweep, as one markdown table:
#   - real train images against the test split (the floor), at N and at SWEEP_N images;
#   - per-pixel Gaussian noise with the data's mean and variance (a ceiling);
#   - RUN_DIR's model with its own sampler settings, at N images;
#   - RUN_DIR's model with Euler, Heun and DDIM at NFE 4, 8, 16, 32, 64, 100, at SWEEP_N images
#     (Heun uses 2 steps - 1 evaluations, so it runs at the odd NFE just below).
# Every row comes from `ddm eval`; its JSON lands in OUT. The "eval s" column is the time for
# features and statistics (sampling excluded).
# usage: bench/eval_anchors.sh RUN_DIR [N=10000] [SWEEP_N=2000] [OUT=eval-anchors]
#        SWEEP_SAMPLERS="euler" SWEEP_NFE="4 8" bench/eval_anchors.sh ...   (a smaller sweep)
#        MODEL_N=0 bench/eval_anchors.sh ...   (skip the model at N images, the slowest row)
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: bench/eval_anchors.sh RUN_DIR [N] [SWEEP_N] [OUT]}
n=${2:-10000}
sweep_n=${3:-2000}
out=${4:-eval-anchors}
py=/usr/bin/python3
mkdir -p "$out"

evaluate() {  # evaluate NAME ARGS...: runs ddm eval quietly, prints one table row
  local name=$1
  shift
  build/ddm eval "$@" --out "$out/$name" > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  $py - "$name" "$out/$name" <<'EOF'
import glob, json, sys
name, d = sys.argv[1], sys.argv[2]
r = json.load(open(sorted(glob.glob(d + "/*.json"))[0]))
i = r.get("info", {})
acc = "%.3f" % r["mean_class_accuracy"] if "mean_class_accuracy" in r else "-"
print("| %s | %s | %s | %d | %.3f | %.5f +- %.5f | %.3f | %.3f | %s | %.1f |" % (
    name, i.get("sampler", "-"), i.get("nfe", "-"), r["n"], r["fd_fmnist"], r["kid_mean"], r["kid_std"],
    r["precision"], r["recall"], acc, r["seconds"]))
EOF
}

echo "| what | sampler | NFE | n | FD-fmnist | KID | precision | recall | class acc | eval s |"
echo "|---|---|---|---|---|---|---|---|---|---|"
evaluate "train-$n" --anchor train --n "$n"
evaluate "train-$sweep_n" --anchor train --n "$sweep_n"
evaluate "noise-$sweep_n" --anchor noise --n "$sweep_n"
evaluate "noise-$n" --anchor noise --n "$n"
model_n=${MODEL_N:-$n}
[ "$model_n" -gt 0 ] && evaluate "model-$model_n" --ckpt "$run" --n "$model_n"
for sampler in ${SWEEP_SAMPLERS:-euler heun ddim}; do
  for nfe in ${SWEEP_NFE:-4 8 16 32 64 100}; do
    steps=$nfe
    [ "$sampler" = heun ] && steps=$((nfe / 2))
    evaluate "$sampler-nfe$nfe" --ckpt "$run" --n "$sweep_n" --sampler "$sampler" --steps "$steps"
  done
done
