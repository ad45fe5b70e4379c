#!/usr/bin/env bash
# The precompiled header of LibTorch's headers (src/core/torch_pch.h), compiled once per machine
# (CMakeLists.txt runs this as a build step; see "precompiled header" there).
# A precompiled header records the paths it was made from (the checkout's header, and with clang
# the directory it ran in), so one compiled inside each checkout, as CMake makes them, differs between
# two clones of the same sources. ccache hashes the precompiled header into every compile that uses
# it, so then no fresh clone would be served from the cache. This compiles it instead in a
# directory named by the hash of the compiler's version, its flags, the header and this script,
# from that directory, and links the build directory to it: every clone on this machine uses the
# same file.
# Usage: scripts/pch.sh DIR HEADER -- COMPILER FLAGS...
#   DIR (in the build directory) gets torch_pch.h and torch_pch.h.gch (g++) or .pch (clang), links
#   into the cache, and `stamp`, which holds the hash and is rewritten only when it changes, so that
#   nothing is rebuilt while the header stays the same.
set -euo pipefail
out=$1 header=$2
shift 2
[ "${1:-}" = -- ] && shift
version=$("$1" --version)
ext=gch
case "$version" in *clang*) ext=pch ;; esac
key=$({ echo "$version"; printf '%s\n' "$@"; cat "$header" "$0"; } | sha256sum | cut -c1-16)
root=${XDG_CACHE_HOME:-$HOME/.cache}/ddm/pch
dir=$root/$key
if [ ! -f "$dir/torch_pch.h.$ext" ]; then
  echo "pch: compiling LibTorch's headers into $dir (once per machine and set of flags)"
  mkdir -p "$dir"
  grep -v "^#pragma once" "$header" >"$dir/torch_pch.h"  # compiled as the main file, where g++ warns of it
  tmp=$(mktemp "$dir/.torch_pch.h.$ext.XXXXXX")
  # Through ccache where CMake found it (PCH_CCACHE): should this directory go, the compile is
  # served with the same bytes, and so is every compile that uses them.
  if ! (cd "$dir" && ${PCH_CCACHE:+"$PCH_CCACHE"} "$@" -x c++-header torch_pch.h -o "$tmp"); then
    rm -f "$tmp"
    exit 1
  fi
  mv "$tmp" "$dir/torch_pch.h.$ext"
  # Those of other flags or versions unused for 30 days go (120-700 MB each).
  find "$root" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -mtime +30 -exec rm -rf {} + || true
fi
touch "$dir"
mkdir -p "$out"
ln -sfn "$dir/torch_pch.h" "$out/torch_pch.h"
ln -sfn "$dir/torch_pch.h.$ext" "$out/torch_pch.h.$ext"
if [ "$(cat "$out/stamp" 2>/dev/null)" != "$key" ]; then echo "$key" >"$out/stamp"; fi
