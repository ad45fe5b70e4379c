#!/usr/bin/env bash
# Partitioning speed and cluster quality on the Fashion-MNIST train split (60000 images), one
# markdown row per setting: wall time of `ddm partition` (features, both k-means stages, writing),
# the k-means part alone, cluster sizes, and agreement with the class labels (for information only;
# the partition never sees labels, except through the feature network, which was trained with them).
# The issue's target is the first row: 60000 x 256 features into K = 8 via 1024 fine centroids.
# usage: bench/partition.sh [THREADS=2] [OUT=bench-partition]
#        SETTINGS="pixels:256,8 autoencoder:32,8" bench/partition.sh   (a subset)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
out=${2:-bench-partition}
settings=${SETTINGS:-"pixels:256,8 pixels:64,4 pixels:64,8 pixels:64,16 feature-net,8 autoencoder:32,8 random,8"}
mkdir -p "$out"
echo "| features | K | total s | k-means s | sizes | purity | NMI |"
echo "|---|---|---|---|---|---|---|"
for s in $settings; do
  features=${s%,*}
  k=${s#*,}
  name="${features//[:\/]/-}-k$k"
  method=kmeans
  [ "$features" = random ] && method=random
  start=$(date +%s.%N)
  build/ddm partition --k "$k" --features "${features/random/pixels}" --method "$method" --threads "$threads" \
    --force --out "$out/$name" > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  end=$(date +%s.%N)
  python3 - "$out/$name" "$start" "$end" "$features" "$k" <<'PY'
import json, re, sys
d, start, end, features, k = sys.argv[1:]
s = json.load(open(d + "/summary.json"))
log = open(d + ".log").read()
km = sum(float(x) for x in re.findall(r"k-means: .*?, ([0-9.]+) s", log))
print(f"| {features} | {k} | {float(end) - float(start):.1f} | {km:.1f} | {s['min_size']}-{s['max_size']} "
      f"| {s['purity']:.3f} | {s['nmi']:.3f} |")
PY
done
