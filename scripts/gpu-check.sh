#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA GPU and PyTorch 2.11 (+cu130) in its python3. Two steps:
#   scripts/gpu-check.sh pack DIR     (here, after scripts/setup.sh) copies what the checks run,
#                                     stripped and xz-compressed (the test binaries, ddm, ddm_bench,
#                                     ddm_bench_sd, and libddm_cuda.so beside them), the system
#                                     libraries they link (a GPU machine may lack them), Fashion-MNIST
#                                     (20000 of its training images), a small text encoder and the SD
#                                     parts' pure-Python wheels into DIR, to carry there (43 MB: a call
#                                     carries 64 MiB with the tree);
#   scripts/gpu-check.sh run DIR OUT  (there) runs them against that machine's LibTorch (the torch of
#                                     its python3, or $TORCH_LIB) and writes each one's output to OUT:
#       test_torch_build  the LibTorch build: 2.11, libtorch_cuda loaded, Gloo from the wheel;
#       test_cuda_module  libddm_cuda.so loads there, exporting its one function;
#       test_cuda         the `gpu` tests (the hand-written kernels on, as by default): CUDA results equal the CPU's within float32 rounding, and
#                         ddm trains, resumes and samples there (tests/gpu/test_cuda.cpp);
#       test_cuda_models  routers, ControlNets, image-embedding and latent models, and Stable Diffusion from
#                         a diffusers pipeline (made there by tests/reference/diffusers_pipeline.py where
#                         that python has diffusers, transformers and open_clip) train on CUDA what they
#                         train on the CPU and sample its images (tests/gpu/test_cuda_models.cpp);
#                     then the U-Nets' GPU tests again with their activations channels-last;
#   (TESTS=0 skips those four)
#   then (unless GPU_BENCH=0) the GPU benchmark side by side: ddm's training step (ddm_bench train;
#   for dit-b also with DDM_FUSED_CUDA=0, without its hand-written kernels, for unet-small without the
#   GroupNorm kernel and with its activations channels-last (DDM_CHANNELS_LAST=1, training and
#   sampling); and with train.cuda_graphs)
#   and PyTorch's (bench/reference.py) for dit-b and unet-small (BENCH_PRESETS) at batch 256 in bf16,
#   PyTorch eager and torch.compile, default and "reduce-overhead" (unless REF_COMPILE=0; "max-autotune" too
#   with REF_AUTOTUNE=1, minutes of autotuning: a call of its own, BENCH_PRESETS=dit-b), dit-b in
#   fp32; and sampling 256 images in 20 steps for each preset: eager, from CUDA graphs, a routed
#   ensemble of 4 experts both ways (its experts side by side, and one after another), PyTorch eager
#   and "reduce-overhead"; one JSON line each in
#   OUT/bench.jsonl;
#   then (with BENCH_TEXT=T:D, e.g. 77:1024) the same presets as text models (--text T:D of ddm_bench and
#   reference.py: cross-attention on T token states of width D instead of class labels): ddm's training
#   step and sampling, eager and from CUDA graphs, beside PyTorch eager and compiled, in OUT/bench.jsonl;
#   then (unless QUICKSTART=0) the single-model quickstart on the GPU (configs/quickstart.toml: train
#   in bf16, then sample), timed, its grid in OUT/quickstart-gpu.png, and the decentralized
#   `ddm quickstart --device cuda`, its grid in OUT/quickstart-ddm-gpu.png;
#   then (unless LOADER=0; the pack has JPEG shards where this machine has Pillow, in the torch venv
#   or the reference environment) the shard loader on that machine's cores (ddm_bench loader at 64x64 and 256x256, several thread counts) and
#   the trainer's wait for data (metrics.jsonl's data_wait) training DiTs on the GPU from JPEG shards;
#   then (unless SHARDS_E2E=0) experts, a router and a distilled student over shards on CUDA, latent
#   shards written by `ddm encode` on CUDA and a latent model trained from them, and with
#   Pillow and numpy there (unless COLOUR_E2E=0), the 50k colour end-to-end run (bench/colour_e2e.sh), its grid in OUT;
#   then (unless SD_MEMORY=0) Stable Diffusion 2.1's UNet (its config, random weights) training steps
#   at 768 px in bf16 at several batches, without and with train.checkpoint_activations: the step time
#   and the peak GPU memory (ddm_bench_sd --memory), in OUT/sd-memory.jsonl;
#   then (unless SD_COMPARE=0; where this python3 imports diffusers) the same step of SD 2.1's UNet in
#   ddm beside diffusers eager (bench/sd_reference.py --step) at batch SD_BATCH (8) in bf16, and the
#   UNet's forward + backward, the VAE's encoder and the VAE's forward + backward at 768 px, batch 2,
#   in both (sd_reference.py DIR ... cuda bf16, then ddm_bench_sd DIR --device cuda), and (unless
#   SD_CONTROLNET=0) ControlNet v1.0's training step on SD 1.5's locked UNet at 512 px in both
#   (ddm_bench_sd --memory --controlnet on, sd_reference.py --controlnet-step); with
#   SD_COMPILE=1 diffusers' training step under torch.compile too (minutes of compilation: give it a
#   call of its own, with SD_PIECES=0 leaving the pieces out), SD_COMPILE=2 the pieces compiled as well;
#   in OUT/sd-compare.jsonl;
#   then (with SD_PLAN=1; about 10 GB of disk) full-size SD 2.1 and ControlNet v1.0 on SD 1.5 with
#   random weights (bench/sd_pipeline.py) profiled by `ddm plan` on the GPU in bf16 at micro-batches of
#   ROWS ("2 8") rows, SD 2.1 at 512 and 768 px, the ControlNet at 512 (PLAN=1 bench/sd_phases.sh):
#   their units, the frozen work's share beside DiffusionPipe's 44% and 89%, and plans for 2 devices;
#   then (with SD_LINKS=1; the same pipeline) SD 2.1 trained by 2 processes on the host's CPUs, data
#   parallel against its 2-stage pipeline without and with bubble filling (bench/pipeline_links.sh at
#   128 px, global batch 8, SD_LINKS_THREADS=8 threads each, SD_LINKS_RUNS="dp serial filled"; about
#   7 minutes), in OUT/sd-links.log: the comparison a 24 GB machine cannot hold;
#   then (with PROFILE=1) where dit-b's training step and its sampling (256 images, 20 steps) spend
#   their GPU time, kernel by kernel, in ddm and under torch.compile (sampling also a routed ensemble of
#   4 dit-b experts), with the kernels launched and the GPU's idle share (DDM_BENCH_TRACE, reference.py
#   --trace, bench/op_profile.py --gpu), ddm's kernels by the op that launched them (--by-op), and
#   unet-small's training step in ddm (NCHW and channels-last) and under torch.compile, in OUT/profile.txt.
# Exits non-zero if any check fails. Everything at once outlasts one call (10 minutes) and a lease
# (15): a lease fits two or three calls, e.g. TESTS alone (GPU_BENCH=0 and the rest off; about 3
# minutes with the channels-last rerun, estimated 4 with test_cuda_models, which has not run there yet), then GPU_BENCH alone (about 5 for dit-b and unet-small with
# REF_COMPILE=1); then PROFILE=1 alone (about 6); then SD_COMPARE and SD_PLAN (about 5 before
# SD_PLAN took the ControlNet too: give that call up to 10). Calls of their own, each turning every
# other part off: SD_COMPARE=1 SD_COMPILE=1 SD_PIECES=0 (diffusers compiled), SD_LINKS=1 (SD 2.1 data
# parallel against its pipeline on the host's CPUs), GPU_BENCH=0 BENCH_TEXT=77:1024 BENCH_PRESETS=dit-b
# (the text DiT; about 4 minutes, estimated from the dit-b rows).
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-}
case "$what" in
  pack)
    dir=${2:?usage: $0 pack DIR}
    mkdir -p "$dir/lib" "$dir/bin" "$dir/fashion-mnist"
    for b in test_torch_build test_cuda_module test_cuda test_cuda_models; do
      [ -x "build/$b" ] || { echo "gpu-check: build/$b is missing: run scripts/setup.sh first" >&2; exit 1; }
      strip -o "$dir/$b" "build/$b"
    done
    for b in ddm ddm_bench ddm_bench_sd; do
      [ -x "build/$b" ] || { echo "gpu-check: build/$b is missing: run scripts/setup.sh first" >&2; exit 1; }
      strip -o "$dir/bin/$b" "build/$b"
    done
    # LibTorch's CUDA half as ddm uses it (core/cuda_module.h), beside every binary that loads it.
    [ -f build/libddm_cuda.so ] || { echo "gpu-check: build/libddm_cuda.so is missing: run scripts/setup.sh first" >&2; exit 1; }
    strip -o "$dir/libddm_cuda.so" build/libddm_cuda.so && cp "$dir/libddm_cuda.so" "$dir/bin/"
    # Every library the binaries link from the system, but the C and C++ runtimes (a GPU machine has
    # those), compressed: libarchive's dependencies (ICU's data above all) would not fit uncompressed.
    ldd "$dir"/test_* "$dir"/bin/* | awk '$3 ~ /^\// {print $3}' | sort -u |
      grep -v -E '/(libc|libm|libdl|libpthread|librt|libutil|libgcc_s|libstdc\+\+)\.so|torch|site-packages' |
      while read -r lib; do cp -L "$lib" "$dir/lib/"; done
    XZ_OPT=-9 tar -cJf "$dir/lib.tar.xz" -C "$dir" lib && rm -rf "$dir/lib"
    # The binaries compressed too: what a call carries is limited. xz -9's 64 MiB window spans several
    # binaries, so the copy of ddm's CUDA kernels (8 MB for seven architectures) that each links is
    # stored once: 5.9 MB instead of 14.4 with xz's default 8 MiB window, in the same 20-odd seconds.
    (cd "$dir" && XZ_OPT=-9 tar -cJf bin.tar.xz test_* bin libddm_cuda.so && rm -rf test_* bin libddm_cuda.so)
    # Fashion-MNIST's test split and the first 20000 training images (the IDX headers' counts
    # rewritten): what a call carries is limited. The GPU tests read at most 600 of them; the
    # quickstarts on the GPU train on these 20000.
    cp /usr/share/datasets/fashion-mnist/t10k-*.gz "$dir/fashion-mnist/"
    python3 - "$dir/fashion-mnist" <<'PY'
import gzip, struct, sys
for name, head, size in (("train-images-idx3-ubyte", 16, 784), ("train-labels-idx1-ubyte", 8, 1)):
    raw = gzip.open(f"/usr/share/datasets/fashion-mnist/{name}.gz").read()
    n = 20000
    with gzip.open(f"{sys.argv[1]}/{name}.gz", "wb") as f:
        f.write(raw[:4] + struct.pack(">I", n) + raw[8:head] + raw[head:head + n * size])
PY
    # Procedural colour JPEG shards for the loader checks (bench/make_jpeg_shards.py), small enough
    # to carry: the loader cycles through them epoch after epoch.
    # Made by a python with Pillow and numpy: the torch venv's, or the reference environment's
    # (scripts/reference-env.sh, which scripts/setup.sh makes).
    source scripts/reference-env.sh
    shards_py=""
    for py in "$venv/bin/python" "$(reference_env_python)"; do
      if [ -x "$py" ] && "$py" -c "import PIL, numpy" 2>/dev/null; then shards_py=$py; break; fi
    done
    if [ -n "$shards_py" ]; then
      "$shards_py" bench/make_jpeg_shards.py "$dir/shards/64" --n 400 --width 80 --height 80 --shards 4
      "$shards_py" bench/make_jpeg_shards.py "$dir/shards/256" --n 200 --width 320 --height 288 --shards 4
    else
      echo "gpu-check: no JPEG shards packed (neither $venv/bin/python nor the reference environment has Pillow and numpy: run scripts/setup.sh); the loader and shards checks will be skipped" >&2
    fi
    # A small sentence encoder (2 layers of width 32, random, in sentence-transformers' layout) for the
    # text-model checks: the real MiniLM (90 MB) does not fit what a check carries.
    rm -rf "$dir/text-encoder"
    "$(bash scripts/reference-env.sh)" tests/reference/tiny_bert.py "$dir/text-encoder" >/dev/null 2>&1 ||
      echo "gpu-check: no text encoder packed (tests/reference/tiny_bert.py failed); the text GPU check will be skipped" >&2
    # What the SD parts import where the GPU machine's python lacks it (pure-Python wheels, the
    # reference environment's pins): diffusers, and for SD_PLAN open_clip's tokenizer files.
    rm -rf "$dir/wheels"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$dir/wheels" diffusers==0.42.1 importlib_metadata==8.7.0 \
      open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.2.13 ||
      echo "gpu-check: no wheels packed; the SD parts need diffusers (and open_clip) on the GPU machine" >&2
    # Stable Diffusion 2.1's UNet config (diffusers writes it; no weights) for the memory check.
    "$(bash scripts/reference-env.sh)" bench/sd_reference.py --config-only "$dir/sd21" ||
      echo "gpu-check: no SD 2.1 UNet config packed; the SD memory check will be skipped" >&2
    # SD 1.5's, the ControlNet step's locked UNet.
    "$(bash scripts/reference-env.sh)" bench/sd_reference.py --config-only "$dir/sd15" sd15 ||
      echo "gpu-check: no SD 1.5 UNet config packed; the ControlNet step's comparison will be skipped" >&2
    du -sh "$dir"
    ;;
  run)
    dir=${2:?usage: $0 run DIR OUT}
    out=${3:?usage: $0 run DIR OUT}
    mkdir -p "$out"
    [ ! -f "$dir/bin.tar.xz" ] || { tar -xJf "$dir/bin.tar.xz" -C "$dir" && rm "$dir/bin.tar.xz"; }
    torch_lib=${TORCH_LIB:-$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')}
    libs=$(mktemp -d) && tar -xJf "$dir/lib.tar.xz" -C "$libs"
    export LD_LIBRARY_PATH="$libs/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export DDM_BINARY="$(cd "$dir" && pwd)/bin/ddm"  # what the tests run as `ddm` (test_util.h)
    export DDM_FASHION_MNIST="$(cd "$dir" && pwd)/fashion-mnist"  # the data the GPU tests read
    [ -d "$dir/text-encoder" ] && export DDM_TEST_TEXT_ENCODER="$(cd "$dir" && pwd)/text-encoder"  # the text checks' encoder
    # The hand-written GroupNorm kernel (opt-in until a GPU has checked it, model/fused_gpu.h) on in the
    # tests, the benchmarks and the profiles; FUSED_GN=0 leaves it off. The U-Nets' steps are also
    # measured without it, side by side.
    export DDM_FUSED_GROUPNORM=${FUSED_GN:-1}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true
    # The packed wheels, where this python lacks them (installed into a folder of their own).
    if ! python3 -c "import diffusers, open_clip" 2>/dev/null && [ -d "$dir/wheels" ]; then
      site=$(mktemp -d)
      python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target "$site" "$dir"/wheels/*.whl &&
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # A small Stable Diffusion pipeline written by diffusers itself, for test_cuda_models' SD check: made
    # here, because its weights (random, incompressible) do not fit what a call carries beside the pack.
    if [ "${TESTS:-1}" != 0 ]; then
      sd_pipeline=$(mktemp -d) && sd_log=$(mktemp)
      if python3 tests/reference/diffusers_pipeline.py "$sd_pipeline" >"$sd_log" 2>&1; then
        export DDM_TEST_SD_PIPELINE=$sd_pipeline
      else
        echo "gpu-check: no SD pipeline made (tests/reference/diffusers_pipeline.py: $(tail -1 "$sd_log")); test_cuda_models' SD check will be skipped"
      fi
    fi
    failed=()
    for t in "$dir"/test_*; do
      [ "${TESTS:-1}" != 0 ] || break
      name=$(basename "$t")
      start=$(date +%s)
      # With the hand-written DiT kernels on (model/fused_gpu.h; the default), so that the DiT tests
      # against the CPU check them too.
      if DDM_FUSED_CUDA=1 "$t" --gtest_brief=1 >"$out/$name.log" 2>&1; then status=ok; else status=FAILED; failed+=("$name"); fi
      echo "gpu-check: $name $status ($(($(date +%s) - start)) s): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')"
    done
    if [ "${TESTS:-1}" != 0 ] && [ -x "$dir/test_cuda" ]; then
      # The U-Nets' GPU checks again with their activations channels-last (DDM_CHANNELS_LAST=1, model/ops.h:
      # the GroupNorm kernel in NHWC order, the attention block on tokens), CPU sides included.
      start=$(date +%s)
      if DDM_FUSED_CUDA=1 DDM_CHANNELS_LAST=1 "$dir/test_cuda" --gtest_brief=1 \
           --gtest_filter='*FusedGroupNorm*:*TrainingOnCudaTrainsWhatTheCpuTrains*:*Bf16AutocastFollowsFp32*:*CudaGraphStepsTrainWhatEager*:*SamplingOnCudaGivesTheCpusImages*:*SamplingFromCudaGraphsGivesTheEagerImages*' \
           >"$out/test_cuda_channels_last.log" 2>&1; then status=ok; else status=FAILED; failed+=(test_cuda_channels_last); fi
      echo "gpu-check: test_cuda, channels-last $status ($(($(date +%s) - start)) s): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/test_cuda_channels_last.log" | tr '\n' ' ')"
    fi
    peak=989  # dense bf16 TFLOP/s of an H100 SXM and of an H200 (the same compute)
    bench() {  # one bounded run, its JSON line appended (a failure is reported, not fatal)
      local line
      if line=$(timeout "${BENCH_TIMEOUT:-240}" "$@" 2>"$out/bench.err"); then echo "$line" | tail -1 | tee -a "$out/bench.jsonl"
      else echo "gpu-check: $* failed: $(tail -3 "$out/bench.err")"; fi
    }
    if [ "${GPU_BENCH:-1}" != 0 ]; then
      for preset in ${BENCH_PRESETS:-dit-b unet-small}; do
        bench "$dir/bin/ddm_bench" train $preset --batch 256 --device cuda --precision bf16 --steps 20 --warmup 3 --threads 8 --peak $peak
        # The same without the hand-written DiT kernels (model/fused_gpu.h): LibTorch's ops instead.
        [ "$preset" != dit-b ] || bench env DDM_FUSED_CUDA=0 "$dir/bin/ddm_bench" train $preset --batch 256 --device cuda \
          --precision bf16 --steps 20 --warmup 3 --threads 8 --peak $peak
        # A U-Net's without the GroupNorm kernel, and with its activations channels-last (DDM_CHANNELS_LAST=1,
        # model/ops.h), eager and from a CUDA graph.
        if [ "${preset#unet}" != "$preset" ]; then
          for graphs in off on; do
            [ "$DDM_FUSED_GROUPNORM" != 1 ] || bench env DDM_FUSED_GROUPNORM=0 "$dir/bin/ddm_bench" train $preset --batch 256 \
              --device cuda --precision bf16 --steps 20 --warmup 3 --threads 8 --peak $peak --cuda-graphs $graphs
            bench env DDM_CHANNELS_LAST=1 "$dir/bin/ddm_bench" train $preset --batch 256 --device cuda --precision bf16 \
              --steps 20 --warmup 3 --threads 8 --peak $peak --cuda-graphs $graphs
          done
        fi
        # The step captured as a CUDA graph and replayed (train.cuda_graphs, train/step_graph.cpp).
        bench "$dir/bin/ddm_bench" train $preset --batch 256 --device cuda --precision bf16 --steps 20 --warmup 3 \
          --threads 8 --peak $peak --cuda-graphs on
        bench python3 bench/reference.py $preset --batch 256 --precision bf16 --steps 20 --warmup 3 --device cuda --threads 8
        [ "${REF_COMPILE:-1}" = 0 ] || bench python3 bench/reference.py $preset --batch 256 --precision bf16 --steps 20 --warmup 3 --device cuda --threads 8 --compile
        # torch.compile's CUDA graphs ("reduce-overhead"): the comparison for train.cuda_graphs.
        [ "${REF_COMPILE:-1}" = 0 ] || bench python3 bench/reference.py $preset --batch 256 --precision bf16 --steps 20 --warmup 3 --device cuda --threads 8 --compile-mode reduce-overhead
        # "max-autotune" (issue 55's target reports it): minutes of autotuning, so only with REF_AUTOTUNE=1.
        [ "${REF_AUTOTUNE:-0}" = 0 ] || BENCH_TIMEOUT=450 bench python3 bench/reference.py $preset --batch 256 --precision bf16 \
          --steps 20 --warmup 3 --device cuda --threads 8 --compile-mode max-autotune
      done
      bench "$dir/bin/ddm_bench" train dit-b --batch 256 --device cuda --precision fp32 --steps 10 --warmup 2 --threads 8 --peak $peak
      # Sampling 256 images with 20 Euler steps: eager, from CUDA graphs (`ddm sample --cuda-graphs`), a
      # routed ensemble of 4 experts both ways, and PyTorch's eager and compiled samplers.
      for preset in ${BENCH_PRESETS:-dit-b unet-small}; do
        bench "$dir/bin/ddm_bench" sample $preset --n 256 --nfe 20 --device cuda --precision bf16 --steps 3 --warmup 1 --threads 8
        bench "$dir/bin/ddm_bench" sample $preset --n 256 --nfe 20 --device cuda --precision bf16 --steps 3 --warmup 1 --threads 8 \
          --cuda-graphs on
        # In fp16 (`ddm sample --precision fp16`, for GPUs without bfloat16 tensor cores; the hand-written
        # kernels take float32 and bfloat16 only, so LibTorch's ops run): what it costs on a GPU that has both.
        bench "$dir/bin/ddm_bench" sample $preset --n 256 --nfe 20 --device cuda --precision fp16 --steps 3 --warmup 1 --threads 8
        # A U-Net's sampling with its activations channels-last, eager and from CUDA graphs.
        if [ "${preset#unet}" != "$preset" ]; then
          for graphs in off on; do
            bench env DDM_CHANNELS_LAST=1 "$dir/bin/ddm_bench" sample $preset --n 256 --nfe 20 --device cuda --precision bf16 \
              --steps 3 --warmup 1 --threads 8 --cuda-graphs $graphs
          done
        fi
        # A routed top-1 ensemble of 4 experts of the preset, eager and from graphs (padded groups):
        # against one model's sampling above (the issue's target: at least 0.9x); the experts side by
        # side (each on a stream of its own, the default) and one after another.
        for graphs in off on; do
          for side in on off; do
            bench "$dir/bin/ddm_bench" sample $preset --n 256 --nfe 20 --device cuda --precision bf16 --steps 3 --warmup 1 \
              --threads 8 --experts 4 --cuda-graphs $graphs --side-by-side $side
          done
        done
        bench python3 bench/reference.py $preset --sample 20 --batch 256 --precision bf16 --steps 3 --warmup 1 --device cuda --threads 8
        [ "${REF_COMPILE:-1}" = 0 ] || bench python3 bench/reference.py $preset --sample 20 --batch 256 --precision bf16 \
          --steps 3 --warmup 1 --device cuda --threads 8 --compile-mode reduce-overhead
      done
    fi
    if [ -n "${BENCH_TEXT:-}" ]; then
      # Text models (issue 55's item 5): each of BENCH_PRESETS attending to T token states of width D
      # (BENCH_TEXT=T:D; 77:1024 is SD 2.1's OpenCLIP text states) instead of class labels, with
      # PixArt-alpha's cross-attention in a DiT (SD's spatial transformer in a U-Net): ddm's training
      # step and sampling, eager and from CUDA graphs, beside PyTorch's eager and compiled
      # (bench/reference.py --text, the same model).
      tx=(--text "$BENCH_TEXT")
      for preset in ${BENCH_PRESETS:-dit-b unet-small}; do
        for graphs in off on; do
          bench "$dir/bin/ddm_bench" train $preset --batch 256 --device cuda --precision bf16 --steps 20 --warmup 3 \
            --threads 8 --peak $peak --cuda-graphs $graphs "${tx[@]}"
        done
        bench python3 bench/reference.py $preset --batch 256 --precision bf16 --steps 20 --warmup 3 --device cuda --threads 8 "${tx[@]}"
        [ "${REF_COMPILE:-1}" = 0 ] || bench python3 bench/reference.py $preset --batch 256 --precision bf16 --steps 20 \
          --warmup 3 --device cuda --threads 8 --compile "${tx[@]}"
        [ "${REF_COMPILE:-1}" = 0 ] || bench python3 bench/reference.py $preset --batch 256 --precision bf16 --steps 20 \
          --warmup 3 --device cuda --threads 8 --compile-mode reduce-overhead "${tx[@]}"
        for graphs in off on; do
          bench "$dir/bin/ddm_bench" sample $preset --n 256 --nfe 20 --device cuda --precision bf16 --steps 3 --warmup 1 \
            --threads 8 --cuda-graphs $graphs "${tx[@]}"
        done
        bench python3 bench/reference.py $preset --sample 20 --batch 256 --precision bf16 --steps 3 --warmup 1 --device cuda \
          --threads 8 "${tx[@]}"
        [ "${REF_COMPILE:-1}" = 0 ] || bench python3 bench/reference.py $preset --sample 20 --batch 256 --precision bf16 \
          --steps 3 --warmup 1 --device cuda --threads 8 --compile-mode reduce-overhead "${tx[@]}"
      done
    fi
    if [ "${QUICKSTART:-1}" != 0 ]; then
      # The single-model quickstart on the GPU: ddm train + ddm sample, each timed.
      q=$(mktemp -d)
      start=$(date +%s.%N)
      if "$dir/bin/ddm" train --config configs/quickstart.toml --out "$q/run" --set data.root="$dir/fashion-mnist" \
           --set train.device=cuda --set train.precision=bf16 >"$out/quickstart-train.log" 2>&1; then
        mid=$(date +%s.%N)
        "$dir/bin/ddm" sample --ckpt "$q/run" --out "$out/quickstart-gpu.png" --device cuda >"$out/quickstart-sample.log" 2>&1 || failed+=(quickstart-sample)
        end=$(date +%s.%N)
        echo "gpu-check: quickstart on the GPU: train $(awk "BEGIN{printf \"%.1f\", $mid - $start}") s, sample $(awk "BEGIN{printf \"%.1f\", $end - $mid}") s; $(grep -E 'step 1200/' "$out/quickstart-train.log" | tail -1)"
      else
        failed+=(quickstart-train); tail -5 "$out/quickstart-train.log"
      fi
      # The decentralized quickstart on the GPU (partition, 4 experts, router, routed samples), timed.
      start=$(date +%s.%N)
      if timeout 400 "$dir/bin/ddm" quickstart --device cuda --data-root "$dir/fashion-mnist" --out "$q/ddm" \
           >"$out/quickstart-ddm.log" 2>&1; then
        cp "$q/ddm/samples.png" "$out/quickstart-ddm-gpu.png" 2>/dev/null || true
        echo "gpu-check: decentralized quickstart on the GPU: $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}") s; $(grep -E 'quickstart took' "$out/quickstart-ddm.log")"
      else
        failed+=(quickstart-ddm); tail -5 "$out/quickstart-ddm.log"
      fi
      rm -rf "$q"
    fi
    if [ "${LOADER:-1}" != 0 ] && [ -d "$dir/shards" ]; then
      # The loader alone: decoded, cropped, resized, batched images per second by decode threads.
      for res in 64 256; do
        for t in 1 4 8 15; do
          line=$("$dir/bin/ddm_bench" loader "$dir/shards/$res/bench-{000000..000003}.tar" --resolution $res \
                   --threads $t --batch 256 --steps $([ $res = 64 ] && echo 40 || echo 12) --warmup 3 2>&1 | tail -1)
          echo "$line" | tee -a "$out/loader.jsonl"
        done
      done
      # The trainer's wait for data on the GPU: DiTs at 64x64 RGB from the JPEG shards, bf16,
      # batch 256, with the default decode threads (a quarter of the cores) and with 8.
      for preset in dit-tiny dit-small; do
        for threads in 0 8; do
          r=$(mktemp -d)
          if timeout 200 "$dir/bin/ddm" train --config configs/quickstart.toml --out "$r/run" \
               --set model.preset=$preset --set data.source=shards \
               --set "data.root=$dir/shards/64/bench-{000000..000003}.tar" --set data.resolution=64 \
               --set data.hflip=true --set data.decode_threads=$threads --set train.device=cuda \
               --set train.precision=bf16 --set train.batch_size=256 --set train.steps=300 \
               --set train.log_every=50 --set train.ckpt_every=300 >"$out/wait-$preset-$threads.log" 2>&1; then
            cp "$r/run/metrics.jsonl" "$out/wait-$preset-$threads.jsonl"
            echo "gpu-check: $preset from shards, decode_threads=$threads: $(python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "data_wait" in l]
print("data_wait", [round(r["data_wait"], 4) for r in rows], "img/s", [round(r.get("img_per_s", 0)) for r in rows])' "$r/run/metrics.jsonl")"
          else
            failed+=("wait-$preset-$threads"); tail -5 "$out/wait-$preset-$threads.log"
          fi
          rm -rf "$r"
        done
      done
    fi
    if [ "${SHARDS_E2E:-1}" != 0 ] && [ -d "$dir/shards" ]; then
      # Decentralized training over shards on CUDA (partition --reshard, experts, a router with a
      # hold-out, an ensemble, a distilled student), then with Pillow and numpy in this python the
      # 50k colour end-to-end run (bench/colour_e2e.sh's steps, 3600 expert steps, islands 5 at a time).
      w=$(mktemp -d)
      printf '[data]\nsource = "shards"\nroot = "%s"\nresolution = 32\n[model]\npreset = "unet-tiny"\nnum_classes = 0\n[train]\nsteps = 30\nbatch_size = 64\ndevice = "cuda"\nckpt_every = 30\n' \
        "$dir/shards/64/bench-{000000..000003}.tar" > "$w/c.toml"
      step() {  # one bounded command, its output in OUT/NAME.log
        local name=$1; shift
        if timeout "${limit:-120}" "$@" >"$out/$name.log" 2>&1; then echo "gpu-check: over shards, $name: ok"
        else failed+=("$name"); echo "gpu-check: over shards, $name: FAILED"; tail -4 "$out/$name.log"; fi
      }
      step shards-partition "$dir/bin/ddm" partition --config "$w/c.toml" --k 2 --fine 16 --reshard --out "$w/p"
      step shards-expert0 "$dir/bin/ddm" train --config "$w/c.toml" --partition "$w/p" --expert 0 --out "$w/e0"
      step shards-expert1 "$dir/bin/ddm" train --config "$w/c.toml" --partition "$w/p" --expert 1 --out "$w/e1"
      step shards-router "$dir/bin/ddm" train-router --config "$w/c.toml" --partition "$w/p" --holdout 50 \
        --set model.patch=4 --out "$w/r"
      step shards-ensemble "$dir/bin/ddm" ensemble --out "$w/ens" --partition "$w/p" --router "$w/r" --expert "$w/e0" --expert "$w/e1"
      step shards-distill "$dir/bin/ddm" distill --ensemble "$w/ens" --set train.steps=20 --out "$w/s"
      # Latent shards on CUDA: an autoencoder (a few steps), every Fashion-MNIST image encoded once
      # there, a latent model trained from those shards in bf16, and its samples.
      fm=(--set "data.root=$dir/fashion-mnist")
      step latent-ae "$dir/bin/ddm" train-autoencoder --config configs/autoencoder.toml "${fm[@]}" \
        --set train.steps=50 --set train.device=cuda --n 256 --stats-n 1000 --out "$w/ae"
      step latent-encode "$dir/bin/ddm" encode --ae "$w/ae" --config configs/autoencoder.toml "${fm[@]}" \
        --device cuda --out "$w/lat"
      step latent-train "$dir/bin/ddm" train --config configs/latent-quickstart.toml --set model.latent="$w/ae" \
        --set data.source=latents --set "data.root=$w/lat" --set train.device=cuda --set train.precision=bf16 \
        --set train.steps=200 --set train.ckpt_every=200 --out "$w/lm"
      step latent-sample "$dir/bin/ddm" sample --ckpt "$w/lm" --device cuda --out "$out/latent-shards-gpu.png"
      rm -rf "$w"
      if [ "${COLOUR_E2E:-1}" != 0 ] && python3 -c "import PIL, numpy" 2>/dev/null; then
        e=$(mktemp -d) && start=$(date +%s)
        python3 bench/make_jpeg_shards.py "$e/data" --n 50000 --width 40 --height 40 --shards 50 --style shapes >/dev/null
        sed -n '/^\[data\]/,/^TOML$/p' bench/colour_e2e.sh | grep -v '^TOML$' |
          sed -e "s|\$dir/data|$e/data|" -e "s|\$steps|3600|" -e "s|\$device|cuda|" > "$e/colour.toml"
        printf 'out = "%s/isl"\nconfig = "%s/colour.toml"\n[partition]\npath = "%s/part"\nk = 4\nfeatures = "pixels:64"\n[experts]\nbudget = "split-batch"\n[router]\nholdout = 1000\nset = ["train.steps=1200", "model.patch=4"]\n[run]\nconcurrency = 5\n' \
          "$e" "$e" "$e" > "$e/islands.toml"
        limit=300 step colour-e2e-islands "$dir/bin/ddm" islands run "$e/islands.toml"
        step colour-e2e-sample "$dir/bin/ddm" sample --ensemble "$e/isl" --n 64 --device cuda --out "$out/colour-e2e-routed.png"
        echo "gpu-check: the colour end-to-end run took $(( $(date +%s) - start )) s (data, partition, 4 experts, router, samples)"
        rm -rf "$e"
      fi
    fi
    if [ "${SD_MEMORY:-1}" != 0 ] && [ -f "$dir/sd21/unet/config.json" ]; then
      # SD 2.1's UNet (865M parameters) at 768 px (96x96 latents, 77 text states) in bf16: a whole
      # training step (AdamW + EMA included) without and with activation checkpointing, by batch.
      for b in 1 8 16 32; do
        timeout 240 "$dir/bin/ddm_bench_sd" --memory "$dir/sd21/unet/config.json" --batch $b --latent 96 \
          --device cuda --precision bf16 --repeat 2 --threads 8 2>>"$out/sd-memory.err" | tee -a "$out/sd-memory.jsonl" ||
          echo "gpu-check: SD memory at batch $b failed: $(tail -3 "$out/sd-memory.err")"
      done
    fi
    if [ "${SD_COMPARE:-1}" != 0 ] && [ -f "$dir/sd21/unet/config.json" ] && python3 -c "import diffusers" 2>/dev/null; then
      # SD 2.1's UNet training step at 768 px in bf16: ddm, then diffusers eager, then compiled.
      b=${SD_BATCH:-8}
      timeout 120 "$dir/bin/ddm_bench_sd" --memory "$dir/sd21/unet/config.json" --batch $b --latent 96 --device cuda \
        --precision bf16 --repeat 3 --threads 8 --checkpoint off 2>>"$out/sd-compare.err" | tee -a "$out/sd-compare.jsonl" ||
        echo "gpu-check: ddm's SD step failed: $(tail -3 "$out/sd-compare.err")"
      for mode in none $([ "${SD_COMPILE:-0}" != 0 ] && echo default); do
        timeout $([ $mode = none ] && echo 180 || echo 450) python3 bench/sd_reference.py --step "$dir/sd21/unet/config.json" $b 96 cuda bf16 3 $mode \
          2>>"$out/sd-compare.err" | tee -a "$out/sd-compare.jsonl" ||
          echo "gpu-check: diffusers' SD step ($mode) failed: $(tail -3 "$out/sd-compare.err")"
      done
      # ControlNet v1.0's training step on SD 1.5's locked UNet at 512 px (64x64 latents) in bf16: ddm,
      # then diffusers as its train_controlnet.py steps (the locked UNet held in bf16), eager and compiled.
      if [ "${SD_CONTROLNET:-1}" != 0 ] && [ -f "$dir/sd15/unet/config.json" ]; then
        timeout 120 "$dir/bin/ddm_bench_sd" --memory "$dir/sd15/unet/config.json" --batch $b --latent 64 --device cuda \
          --precision bf16 --repeat 3 --threads 8 --checkpoint off --controlnet on 2>>"$out/sd-compare.err" |
          tee -a "$out/sd-compare.jsonl" || echo "gpu-check: ddm's ControlNet step failed: $(tail -3 "$out/sd-compare.err")"
        for mode in none $([ "${SD_COMPILE:-0}" != 0 ] && echo default); do
          timeout $([ $mode = none ] && echo 180 || echo 450) python3 bench/sd_reference.py --controlnet-step \
            "$dir/sd15/unet/config.json" $b 64 cuda bf16 3 $mode 2>>"$out/sd-compare.err" | tee -a "$out/sd-compare.jsonl" ||
            echo "gpu-check: diffusers' ControlNet step ($mode) failed: $(tail -3 "$out/sd-compare.err")"
        done
      fi
      # The pieces, on one seeded batch that diffusers writes with its networks (random weights).
      if [ "${SD_PIECES:-1}" != 0 ]; then
        s=$(mktemp -d)
        timeout 600 python3 bench/sd_reference.py "$s" 2 96 8 3 "$([ "${SD_COMPILE:-0}" = 2 ] && echo 1 || echo 0)" cuda bf16 2>>"$out/sd-compare.err" |
          tee -a "$out/sd-compare.jsonl" || echo "gpu-check: diffusers' SD pieces failed: $(tail -3 "$out/sd-compare.err")"
        timeout 120 "$dir/bin/ddm_bench_sd" "$s" --repeat 3 --threads 8 --device cuda --precision bf16 2>>"$out/sd-compare.err" |
          tee -a "$out/sd-compare.jsonl" || echo "gpu-check: ddm's SD pieces failed: $(tail -3 "$out/sd-compare.err")"
        rm -rf "$s"
      fi
    fi
    if [ "${SD_PLAN:-0}" = 1 ] || [ "${SD_LINKS:-0}" = 1 ]; then
      # SD 2.1 at full size (random weights), written once for both parts.
      s=$(mktemp -d) written=1
      timeout 300 python3 bench/sd_pipeline.py "$s/sd21" sd21 >"$out/sd-write.log" 2>&1 ||
        { written=0; failed+=(sd-write); tail -5 "$out/sd-write.log"; }
      if [ $written = 1 ] && [ "${SD_PLAN:-0}" = 1 ]; then
        # Profiled on the GPU by ddm plan (micro-batches of ROWS rows): the frozen share, for SD 2.1 at
        # 512 and 768 px and ControlNet v1.0 on SD 1.5 at 512 (written here too).
        timeout 300 python3 bench/sd_pipeline.py "$s/sd15-controlnet" sd15-controlnet >>"$out/sd-write.log" 2>&1 ||
          { failed+=(sd-write); tail -5 "$out/sd-write.log"; }
        for kind in sd21 sd15-controlnet; do
          [ -f "$s/$kind/model_index.json" ] || continue
          sizes="512 768" seed=44 limit=400
          [ $kind = sd21 ] || sizes=512 seed=89 limit=300
          seen=$(cat "$out/sd-plan.log" 2>/dev/null | wc -l)
          KIND=$kind PLAN=1 REPEATS=3 ROWS="${ROWS:-2 8}" DEVICE=cuda PRECISION=bf16 PYTHON=python3 BIN="$dir/bin" \
            SD_DIR="$s/$kind" timeout $limit bash bench/sd_phases.sh "$sizes" 1 8 >>"$out/sd-plan.log" 2>&1 || failed+=(sd-plan)
          tail -n +$((seen + 1)) "$out/sd-plan.log" | grep -E -i "frozen|best|stage|^  " | head -30 || true  # this kind's lines
          # The seed's statistic from each saved profile: the frozen work over the trainable forward + backward.
          for f in "$s/$kind"/profile-*.json; do
            [ -f "$f" ] || continue
            python3 - "$f" "$kind" "$seed" <<'PY' | tee -a "$out/sd-plan.log"
import json, sys
p = json.load(open(sys.argv[1]))
for i, c in enumerate(p["tasks"][0]["cost"]):
    unit = lambda u: u["samples"][i]["forward_ms"] + u["samples"][i]["input_grad_ms"] + u["samples"][i]["weight_grad_ms"]
    trainable = sum(unit(u) for u in p["units"])
    # A ControlNet's locked decoder is frozen but on the gradient path: counted with the trainable part.
    locked = sum(unit(u) for u in p["units"] if u["name"].startswith("locked."))
    print(f"gpu-check: {sys.argv[2]} {sys.argv[1].rsplit('/', 1)[-1]}, {c['rows']} row(s): frozen {c['ms']:.1f} ms, "
          f"trainable forward + backward {trainable:.1f} ms: {100 * c['ms'] / trainable:.0f}% (DiffusionPipe: {sys.argv[3]}%)"
          + (f"; the locked decoder {locked:.1f} ms of it; over the ControlNet's own forward + backward: "
             f"{100 * c['ms'] / (trainable - locked):.0f}%" if locked else ""))
PY
          done
        done
      fi
      if [ $written = 1 ] && [ "${SD_LINKS:-0}" = 1 ]; then
        # Data parallelism against the 2-stage pipeline, serial and filled, on this machine's CPUs: two
        # processes of SD_LINKS_THREADS threads each (two data-parallel copies of SD 2.1's training
        # state, about 40 GB, do not fit a 24 GB CI machine). Over a veth pair where namespaces can
        # be made, else over 127.0.0.1; both at memory speed.
        link=loopback
        if command -v tc >/dev/null && ip netns add "ddm-probe-$$" 2>/dev/null; then ip netns del "ddm-probe-$$"; link=veth; fi
        LINK=$link KIND=sd21 DDM="$dir/bin/ddm" PYTHON="$(command -v python3)" RATES=unlimited SCHEDULES=1f1b MICRO=4 ROUNDS=1 STEPS=8 \
          THREADS=${SD_LINKS_THREADS:-8} RUNS="${SD_LINKS_RUNS:-dp serial filled}" \
          timeout 520 bash bench/pipeline_links.sh "$s/sd21" "$s/links" >"$out/sd-links.log" 2>&1 || failed+=(sd-links)
        grep "^|\|^2 processes" "$out/sd-links.log" || tail -5 "$out/sd-links.log"
      fi
      rm -rf "$s"
    fi
    if [ "${PROFILE:-0}" = 1 ]; then
      # dit-b, batch 256, bf16: 3 steps under the profiler each, summed by kernel (the top 40).
      p=$(mktemp -d)
      DDM_BENCH_TRACE="$p/ddm.json" timeout 120 "$dir/bin/ddm_bench" train dit-b --batch 256 --device cuda \
        --precision bf16 --steps 5 --warmup 3 --threads 8 >/dev/null 2>>"$out/profile.err" || echo "gpu-check: ddm's trace failed"
      timeout 240 python3 bench/reference.py dit-b --batch 256 --precision bf16 --steps 5 --warmup 3 --device cuda \
        --threads 8 --compile --trace "$p/compile.json" >/dev/null 2>>"$out/profile.err" || echo "gpu-check: compile's trace failed"
      python3 bench/op_profile.py --gpu --top 40 ddm="$p/ddm.json" compile="$p/compile.json" | tee "$out/profile.txt" | head -60
      # Sampling 256 images in 20 Euler steps, one run each (op_profile's --steps 1: per run).
      DDM_BENCH_TRACE="$p/ddm-sample.json" timeout 120 "$dir/bin/ddm_bench" sample dit-b --n 256 --nfe 20 --device cuda \
        --precision bf16 --steps 1 --warmup 1 --threads 8 >/dev/null 2>>"$out/profile.err" || echo "gpu-check: ddm's sampling trace failed"
      timeout 240 python3 bench/reference.py dit-b --sample 20 --batch 256 --precision bf16 --steps 1 --warmup 1 --device cuda \
        --threads 8 --compile --trace "$p/compile-sample.json" >/dev/null 2>>"$out/profile.err" ||
        echo "gpu-check: compile's sampling trace failed"
      # The routed top-1 ensemble of 4 dit-b experts, eager (issue 55's target: 0.9x one model).
      DDM_BENCH_TRACE="$p/ddm-ensemble.json" timeout 120 "$dir/bin/ddm_bench" sample dit-b --n 256 --nfe 20 --device cuda \
        --precision bf16 --steps 1 --warmup 1 --threads 8 --experts 4 >/dev/null 2>>"$out/profile.err" ||
        echo "gpu-check: the ensemble's sampling trace failed"
      echo "--- sampling, one run of 20 steps" | tee -a "$out/profile.txt"
      python3 bench/op_profile.py --gpu --steps 1 --top 30 ddm="$p/ddm-sample.json" compile="$p/compile-sample.json" \
        ensemble="$p/ddm-ensemble.json" | tee -a "$out/profile.txt" | head -45
      # Which of ddm's ops launched each kernel (training step; one sampling run), for the elementwise
      # kernels that are not the hand-written ones.
      echo "--- ddm's kernels by the op that launched them: training step | sampling run" >>"$out/profile.txt"
      python3 bench/op_profile.py --gpu --by-op --top 30 train="$p/ddm.json" >>"$out/profile.txt"
      python3 bench/op_profile.py --gpu --by-op --steps 1 --top 30 sample="$p/ddm-sample.json" >>"$out/profile.txt"
      # unet-small's step (batch 256, bf16), host-bound where dit-b is not: ddm eager beside compile.
      DDM_BENCH_TRACE="$p/unet.json" timeout 120 "$dir/bin/ddm_bench" train unet-small --batch 256 --device cuda \
        --precision bf16 --steps 5 --warmup 3 --threads 8 >/dev/null 2>>"$out/profile.err" || echo "gpu-check: unet-small's trace failed"
      timeout 240 python3 bench/reference.py unet-small --batch 256 --precision bf16 --steps 5 --warmup 3 --device cuda \
        --threads 8 --compile --trace "$p/unet-compile.json" >/dev/null 2>>"$out/profile.err" ||
        echo "gpu-check: unet-small's compile trace failed"
      # The same with its activations channels-last (model/ops.h).
      DDM_CHANNELS_LAST=1 DDM_BENCH_TRACE="$p/unet-cl.json" timeout 120 "$dir/bin/ddm_bench" train unet-small --batch 256 \
        --device cuda --precision bf16 --steps 5 --warmup 3 --threads 8 >/dev/null 2>>"$out/profile.err" ||
        echo "gpu-check: unet-small's channels-last trace failed"
      echo "--- unet-small, training step (ddm-cl: channels-last)" | tee -a "$out/profile.txt"
      python3 bench/op_profile.py --gpu --top 25 ddm="$p/unet.json" ddm-cl="$p/unet-cl.json" compile="$p/unet-compile.json" |
        tee -a "$out/profile.txt" | tail -4
      python3 bench/op_profile.py --gpu --by-op --top 25 ddm="$p/unet.json" >>"$out/profile.txt"
      python3 bench/op_profile.py --gpu --by-op --top 25 ddm-cl="$p/unet-cl.json" >>"$out/profile.txt"
      rm -rf "$p"
    fi
    if [ ! -d "$dir/shards" ] && { [ "${LOADER:-1}" != 0 ] || [ "${SHARDS_E2E:-1}" != 0 ]; }; then
      echo "gpu-check: the loader and shards checks skipped: the pack has no JPEG shards"
    fi
    if [ ${#failed[@]} -gt 0 ]; then
      for f in "${failed[@]}"; do echo "--- $f"; grep -B2 -A12 -E 'Failure|FAILED' "$out/$f.log" | head -60; done
      echo "gpu-check: failed: ${failed[*]}" >&2
      exit 1
    fi
    echo "gpu-check: all passed"
    ;;
  *)
    echo "usage: $0 pack DIR | run DIR OUT" >&2
    exit 2
    ;;
esac
