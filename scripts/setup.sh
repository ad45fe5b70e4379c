#!/usr/bin/env bash
# Installs ddm's Debian packages (if missing), then configures and builds Release into build/.
# Idempotent: re-running only rebuilds what changed. Works on a fresh Debian 12 machine.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake g++ ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-openmp
  dataset-fashion-mnist
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev libstb-dev zlib1g-dev libssl-dev
  libgtest-dev libbenchmark-dev
  python3-torch
  clang-14 libclang-rt-14-dev llvm-14   # the sanitizer build and fuzzers (scripts/sanitize.sh)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
echo "setup: built build/ddm"
