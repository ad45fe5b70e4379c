#!/usr/bin/env bash
# The shard loader against the same pipeline in Python (webdataset + Pillow under a PyTorch
# DataLoader), side by side on the same JPEG shards and worker count: decoded, centre-cropped,
# resized, flipped, batched float images per second (bench/loader_reference.py says what each step
# does). The shards are procedural colour JPEGs (bench/make_jpeg_shards.py): 80x80 sources for 64x64,
# 320x288 for 256x256. Each pair runs ROUNDS times, alternating; the table gives the best of each.
# usage: bench/loader.sh [ROUNDS] [WORKERS...]      (defaults: 2 1 2)
#        DIR=... where the shards are made (default /tmp/ddm-loader-bench; kept between runs)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
shift 2>/dev/null || true
workers=("$@")
[ ${#workers[@]} -gt 0 ] || workers=(1 2)
source scripts/torch-env.sh
py=$venv/bin/python
"$py" -c "import webdataset, PIL" 2>/dev/null || "$venv/bin/pip" install -q webdataset==0.2.100 pillow==13.0.0
dir=${DIR:-/tmp/ddm-loader-bench}
[ -f "$dir/64/bench-000015.tar" ] || "$py" bench/make_jpeg_shards.py "$dir/64" --n 8000 --width 80 --height 80
[ -f "$dir/256/bench-000015.tar" ] || "$py" bench/make_jpeg_shards.py "$dir/256" --n 3000 --width 320 --height 288
field() { "$py" -c "import json,sys; print(json.loads(sys.argv[1])['$2'])" "$1"; }
echo "| resolution | workers | ddm img/s | Python img/s | ddm / Python |"
echo "|---|---|---|---|---|"
for res in 64 256; do
  steps=$([ "$res" = 64 ] && echo 30 || echo 10)
  shards="$dir/$res/bench-{000000..000015}.tar"
  for w in "${workers[@]}"; do
    best_c=0 best_p=0
    for _ in $(seq "$rounds"); do
      c=$(build/ddm_bench loader "$shards" --resolution "$res" --threads "$w" --batch 256 --steps "$steps" --warmup 3)
      p=$("$py" bench/loader_reference.py "$shards" --resolution "$res" --workers "$w" --batch 256 --steps "$steps" --warmup 3)
      best_c=$("$py" -c "print(max($best_c, $(field "$c" img_per_s)))")
      best_p=$("$py" -c "print(max($best_p, $(field "$p" img_per_s)))")
    done
    "$py" -c "print('| %d | %d | %.0f | %.0f | %.2f |' % ($res, $w, $best_c, $best_p, $best_c / $best_p))"
  done
done
