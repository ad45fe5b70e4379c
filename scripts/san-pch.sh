#!/usr/bin/env bash
# The sanitizer build's precompiled header (CMakeLists.txt runs this; see DDM_SANITIZE there).
# clang records the directory it was run in and the header's path in a precompiled header, so one
# compiled inside a checkout differs from the same header compiled in another, and ccache, which
# hashes the precompiled header into every compile that uses it, would then serve no fresh clone.
# This compiles it once per machine instead, in a directory named by the hash of the compiler's
# version, its flags and the header, always from that directory: the same bytes for every clone.
# Usage: scripts/san-pch.sh STAMP LINK HEADER -- COMPILER FLAGS...
#   LINK (in the build directory) is made a symbolic link to the compiled header; STAMP holds the
#   hash and is rewritten only when it changes, so that nothing is rebuilt while the header is the same.
set -euo pipefail
stamp=$1 link=$2 header=$3
shift 3
[ "${1:-}" = -- ] && shift
key=$({ "$1" --version; printf '%s\n' "$@"; cat "$header"; } | sha256sum | cut -c1-16)
root=${XDG_CACHE_HOME:-$HOME/.cache}/ddm/pch
dir=$root/$key
if [ ! -f "$dir/torch_pch.h.pch" ]; then
  echo "san-pch: compiling the precompiled header into $dir (once per machine)"
  mkdir -p "$dir"
  cp "$header" "$dir/torch_pch.h"
  tmp=$(mktemp "$dir/.torch_pch.h.pch.XXXXXX")
  if ! (cd "$dir" && "$@" -x c++-header torch_pch.h -o "$tmp"); then
    rm -f "$tmp"
    exit 1
  fi
  mv "$tmp" "$dir/torch_pch.h.pch"
  # Headers of other flags or versions unused for 30 days go (about 120 MB each).
  find "$root" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -mtime +30 -exec rm -rf {} + || true
fi
touch "$dir"
ln -sfn "$dir/torch_pch.h.pch" "$link"
if [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then echo "$key" >"$stamp"; fi
