#!/usr/bin/env bash
# Prints the N slowest tests of the last `ctest` run in BUILD_DIR (default: build, 15), slowest
# first, with their share of the summed test time: where CI's test time goes (.ci/run prints it at
# the end of every run). Reads CTest's own record of that run, Testing/Temporary/LastTest.log.
# Usage: scripts/slowest-tests.sh [BUILD_DIR [N]]
set -euo pipefail
dir=${1:-build}
n=${2:-15}
log="$dir/Testing/Temporary/LastTest.log"
[ -f "$log" ] || { echo "slowest-tests: no $log (has ctest run in $dir?)" >&2; exit 1; }
# Each test's record opens with "I/M Test: NAME" and holds "Test time = S sec".
times=$(awk '/^[0-9]+\/[0-9]+ Test: / { sub(/^[0-9]+\/[0-9]+ Test: /, ""); name = $0 }
             /^Test time = / { print $4, name }' "$log" | sort -rn)
[ -n "$times" ] || { echo "slowest-tests: $log records no test"; exit 0; }
total=$(awk '{ s += $1 } END { printf "%.0f", s }' <<<"$times")
echo "the $n slowest of $(wc -l <<<"$times") tests (${total} s of test time in all; ctest -j runs several at once):"
head -n "$n" <<<"$times" | awk -v t="$total" '{ printf "  %7.1f s  %4.1f%%  %s\n", $1, 100 * $1 / (t > 0 ? t : 1), $2 }'
