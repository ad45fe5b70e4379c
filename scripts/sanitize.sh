#!/usr/bin/env bash
# The sanitizer build and the fuzzers (see docs/testing.md). Configures and builds build-san/ with
# clang++ 14: ddm_lib, the tests and the `ddm` binary with AddressSanitizer + UndefinedBehaviorSanitizer
# (every finding fatal), and one libFuzzer target per parser of outside input (fuzz/fuzz_*.cpp). Then
#   tests: runs the unit tests labelled `sanitize` under the sanitizers (each executable once): those
#          of the code that handles bytes and pointers by hand (CMakeLists.txt lists them and says why);
#          `tests all` runs every unit test there (about 25 minutes on 2 cores: not in CI);
#   fuzz:  runs each fuzz target for FUZZ_SECONDS (default 12) seconds, starting from its corpus
#          fuzz/corpus/<target>/, which it only reads (new inputs go to a temporary directory); as many
#          targets at once as there are cores;
#   build: only configures and builds what `tests` and `fuzz` run.
# Usage: scripts/sanitize.sh [tests [all] | fuzz [fuzz_X ...] | build]   (no argument: tests and fuzz,
# what CI runs).
# Exits non-zero on any finding. A fuzzer's crashing input is kept in build-san/fuzz-artifacts/;
# replay it with build-san/fuzz_X FILE. Run scripts/setup.sh once first (it installs clang).
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-all}
[ $# -gt 0 ] && shift
case "$what" in all | tests | fuzz | build) ;; *) echo "usage: $0 [tests [all] | fuzz [fuzz_X ...] | build]" >&2; exit 2 ;; esac
seconds=${FUZZ_SECONDS:-12}
jobs=$(nproc)

# -O0 with line tables (reports name the source lines). Not -O1: optimizing LibTorch's inline code
# in every file made a cold build of this directory 661 s instead of 489 s, while the tests here
# spend their time starting LibTorch, not running our code; the fuzzers execute about half as many
# inputs in a given time at -O0 (docs/testing.md has both counts). No OpenMP: see CMakeLists.txt (our
# own parallel loops run serially here, with the same results).
source scripts/torch-env.sh  # the LibTorch scripts/setup.sh installed
source scripts/reference-env.sh  # the reference environment it made (reference_env_python)
args=$(torch_cmake_args)
generator=$(cmake_generator_args build-san)
# shellcheck disable=SC2086
cmake -S . -B build-san $generator $args -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -gline-tables-only" \
  "-DDDM_REFERENCE_PYTHON=$(reference_env_python)" -DDDM_SANITIZE=ON -DDDM_OPENMP=OFF -DDDM_BUILD_BENCH=OFF >/dev/null
all_tests=0
if [ "$what" = tests ] && [ "${1:-}" = all ]; then all_tests=1; shift; fi
# Only what runs here: the chosen unit tests (with the ddm binary and the helpers they start) and the
# fuzz targets (target ddm_sanitize_checks), or every unit test.
build_targets=(ddm_sanitize_checks)
if ((all_tests)); then
  for f in $(find tests/unit -name 'test_*.cpp'); do build_targets+=("$(basename "$f" .cpp)"); done
fi
cmake --build build-san -j"$jobs" --target "${build_targets[@]}"
[ "$what" = build ] && exit 0

if [ -x /usr/lib/llvm-14/bin/llvm-symbolizer ]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
fi
# LeakSanitizer is on (ASan's default here), with suppressions for two leaks inside LibTorch 2.11's
# c10d alone (scripts/lsan-libtorch.supp says which and why); neither LibTorch's static
# initialization nor Gloo's show up as leaks in these programs.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:check_initialization_order=1:strict_init_order=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/scripts/lsan-libtorch.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

if [ "$what" != fuzz ]; then
  # Each test executable runs once, all its tests in one process, two executables at a time: an
  # instrumented process takes about 1 s to start (LibTorch's libraries under ASan), which was most of
  # the 95 s that running the 140 tests one process each took (now about 20 s). Leaks are checked
  # when each process ends. The Release run (ctest) runs each unit executable once too.
  if ((all_tests)); then
    executables=("${build_targets[@]:1}")
  else
    mapfile -t executables < build-san/sanitize_tests.txt
  fi
  echo "sanitize: ${#executables[@]} unit test executables under ASan + UBSan"
  # Two tests are left to the Release run: they push thousands of large tensors through LibTorch
  # (uninstrumented, so ASan checks little there), and ASan's allocator maps fresh pages for every
  # allocation over 128 KB, which makes them take 4-5 minutes each here instead of seconds.
  skip='Evaluate.ScoresAreDeterministicOrderedAndBadInputsAreClear:Sampler.ExactGaussianDenoiserReproducesMoments'
  # (and the check that generated files are what their generator writes: Python alone)
  skip="$skip:TextTables.*"
  # Of the chosen files, CI leaves out the tests that are numerics through LibTorch's ops alone (a
  # model overfitting a batch, gradient checks in float64, whole networks): 2 of the 5 minutes there.
  if ((!all_tests)); then skip="$skip:FlatAdamW.OverfitsOneBatch:GradCheck.*:Nets.*"; fi
  logs=$(mktemp -d)
  run_one() {  # EXECUTABLE: runs its tests; its exit status goes to $logs/EXECUTABLE.rc
    local rc=0
    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE build-san/"$1" --gtest_brief=1 "--gtest_filter=-$skip" \
      >"$logs/$1.log" 2>&1 || rc=$?
    echo "$rc" >"$logs/$1.rc"
  }
  busy=0
  for e in "${executables[@]}"; do
    run_one "$e" &
    busy=$((busy + 1))
    if [ "$busy" -ge "$jobs" ]; then wait -n; busy=$((busy - 1)); fi
  done
  wait
  failed=()
  for e in "${executables[@]}"; do
    if [ "$(cat "$logs/$e.rc")" = 0 ]; then
      echo "sanitize: $e: $(grep -E '^\[==========\]' "$logs/$e.log" | tail -1 | sed -E 's/^\[=*\] ([0-9]+ tests?).*/\1/'), no finding"
    else
      echo "sanitize: $e FAILED (exit $(cat "$logs/$e.rc")):"
      cat "$logs/$e.log"
      failed+=("$e")
    fi
  done
  rm -rf "$logs"
  if [ ${#failed[@]} -gt 0 ]; then
    echo "sanitize: findings in ${failed[*]}; rerun one with build-san/TEST --gtest_filter=NAME" >&2
    exit 1
  fi
fi

if [ "$what" != tests ]; then
  targets=("$@")
  if [ ${#targets[@]} -eq 0 ]; then
    for f in fuzz/fuzz_*.cpp; do targets+=("$(basename "$f" .cpp)"); done
  fi
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  for t in "${targets[@]}"; do
    [ -d "fuzz/corpus/${t#fuzz_}" ] || { echo "sanitize: $t has no corpus directory fuzz/corpus/${t#fuzz_}" >&2; exit 1; }
    mkdir -p "$scratch/$t" "build-san/fuzz-artifacts/$t"
  done
  fuzz_one() {  # TARGET: fuzzes it for $seconds s; its exit status goes to $scratch/TARGET.rc
    local rc=0
    # A single allocation over 256 MB or a 10 s input from a few-KB file is a finding too.
    build-san/"$1" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
      -artifact_prefix="build-san/fuzz-artifacts/$1/" -print_final_stats=1 \
      "$scratch/$1" "fuzz/corpus/${1#fuzz_}" >"$scratch/$1.log" 2>&1 || rc=$?
    echo "$rc" >"$scratch/$1.rc"
  }
  # One target per core at a time (each fuzzer is one single-threaded process), reported in order.
  busy=0
  for t in "${targets[@]}"; do
    fuzz_one "$t" &
    busy=$((busy + 1))
    if [ "$busy" -ge "$jobs" ]; then wait -n; busy=$((busy - 1)); fi
  done
  wait
  failed=()
  for t in "${targets[@]}"; do
    if [ "$(cat "$scratch/$t.rc")" = 0 ]; then
      echo "sanitize: $t: $(grep -E '^stat::number_of_executed_units' "$scratch/$t.log" | awk '{print $2}') inputs" \
           "in ${seconds} s, $(find "$scratch/$t" -type f | wc -l) new, no finding"
    else
      # The report from its first line (ASan's shadow-byte map at the end is of little use here).
      first=$(grep -n -m1 -E 'ERROR: |runtime error: |terminate called' "$scratch/$t.log" | cut -d: -f1 || true)
      echo "sanitize: $t FAILED:"
      if [ -n "$first" ]; then sed -n "${first},$((first + 45))p" "$scratch/$t.log"; else tail -n 45 "$scratch/$t.log"; fi
      grep -E '^(SUMMARY|artifact_prefix|Test unit written)' "$scratch/$t.log" || true
      failed+=("$t")
    fi
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "sanitize: findings in ${failed[*]}; crashing inputs are in build-san/fuzz-artifacts/" >&2
    exit 1
  fi
fi
echo "sanitize: no findings"
