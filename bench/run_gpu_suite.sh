#!/usr/bin/env bash
# Builds tandem with the CUDA backend and runs, on a GPU machine, the GPU tests and/or the
# benchmarks, writing logs and JSON to OUTDIR and printing a short summary last.
# Usage: bench/run_gpu_suite.sh OUTDIR [tests] [kernels] [engine] [hf] [deploy] [prefix] [transport] [steps]
#                              [pipeline]
#   tests    ctest (all tests, the gpu-labelled ones included)
#   kernels  decode and prefill attention benchmarks, torch SDPA baseline
#   engine   colocated engine decode throughput (llama3-8b, llama-13b presets)
#   hf       Hugging Face transformers generate baseline for the same shapes
#   deploy   the one-GPU deployment (deploy/examples/gpu.yaml) against the colocated CUDA engine:
#            same tokens on the reference models and the small preset, then tokens/s of both
#   prefix   shared-prefix attention: cascade vs plain kernel and the crossover, then the engine
#            with the prefix cache and sharing on and off (bench/prefix_sharing_bench.sh)
#   transport  transport one-way latency and bandwidth between two processes (cuda:0 and cuda:1),
#            host-driven and device-polled, for p2p, nccl and ucx (KINDS, SIZES, ITERS override)
#   steps    a deployment's decode step (compute rank cuda:0, memory ranks cuda:1..) split into
#            compute, attention, exchange and idle per transport, beside the colocated engine
#            (llama3-8b, llama-13b; MODELS, BATCHES, CONTEXTS, TRANSPORTS, MEMORY_RANKS override)
#   pipeline the pipeline report of a deployment's decode steps (compute, attention, exchange, idle
#            and efficiency, per layout): memory ranks on the compute GPU (local, p2p), then 1 + 1
#            and 1 + 3 GPUs (p2p, nccl) with the request and the head partition, as the machine's
#            GPU count allows (MODEL, BATCHES, CONTEXTS override), each with pipeline.mode none
#            and pingpong over 2 and 4 micro-batches (PIPELINE_BATCHES overrides "1,2,4"; over p2p
#            and nccl alike); from 3 GPUs also compute replicas (fixed: 2 compute
#            GPUs, the rest memory GPUs; FIXED_BATCHES overrides "2,4"; p2p and nccl) and the rotational pipeline
#            (2 compute GPUs and 3 micro-batches, ROTATIONAL_BATCHES overrides; from 4 GPUs also 3
#            compute GPUs and 4 micro-batches; slices of SLICE_LAYERS layers, default 1)
set -uo pipefail
out=${1:?usage: run_gpu_suite.sh OUTDIR [tests] [kernels] [engine] [hf]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-/tmp/tandem-build}
if [ -f .device/sysroot.sh ]; then eval "$(bash .device/sysroot.sh)"; fi
# Warnings are errors in CI (g++ 12); the GPU machines' newer compilers add false positives.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DTANDEM_WERROR=OFF \
  >"$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
for what in "$@"; do
  case "$what" in
    tests)
      ctest --test-dir "$BUILD" --output-on-failure -j 4 >"$out/ctest.log" 2>&1
      grep -E "tests passed|Failed|\*\*\*|Not Run|Skipped" "$out/ctest.log" | tail -20
      "$BUILD/tests/hf_reference_test" 2>&1 | grep -E "compared|FAILED" ;;
    kernels)
      "$BUILD/bench/decode_attention_bench" --json "$out/decode_attention.json" 2>&1 | tee "$out/decode_attention.txt" | tail -60
      python3 bench/sdpa_baseline.py --json "$out/sdpa.json" 2>&1 | tee "$out/sdpa.txt" | tail -60
      "$BUILD/bench/prefill_attention_bench" --json "$out/prefill_attention.json" 2>&1 | tee "$out/prefill.txt" | tail -20 ;;
    engine)
      for m in llama3-8b llama-13b; do
        "$BUILD/bench/engine_decode_bench" --model "$m" --batches "${BATCHES:-1,16,64,256}" \
          --contexts 1024,4096 --json "$out/engine_$m.json" 2>&1 | tee "$out/engine_$m.txt"
      done ;;
    hf)
      for m in llama3-8b llama-13b; do
        python3 bench/hf_generate_bench.py --model "$m" --batches "${BATCHES:-1,16,64,256}" --contexts 1024,4096 \
          --json "$out/hf_$m.json" 2>&1 | grep -v Warning | tee "$out/hf_$m.txt"
      done ;;
    deploy)
      bash bench/deploy_vs_colocated.sh "$BUILD/tandem" "$out/deploy" 2>&1 | tee "$out/deploy.txt" | tail -30 ;;
    prefix)
      "$BUILD/bench/prefix_attention_bench" 2>&1 | tee "$out/prefix_attention.txt" | tail -40
      "$BUILD/bench/prefix_attention_bench" --crossover 2>&1 | tee "$out/prefix_crossover.txt" | tail -30
      bash bench/prefix_sharing_bench.sh "$BUILD/tandem" "$out/prefix" "${PREFIX_MODEL:-llama3-8b}" 2>&1 |
        tee "$out/prefix_sharing.txt" | tail -20 ;;
    transport)
      "$BUILD/bench/transport_bench" --kinds "${KINDS:-p2p,nccl,ucx}" \
        --sizes "${SIZES:-16,4096,65536,1048576,16777216,67108864}" --iters "${ITERS:-200}" \
        --json "$out/transport.json" >"$out/transport.txt" 2>"$out/transport.log"
      rc=$?
      cat "$out/transport.txt"
      [ $rc -eq 0 ] || { echo "transport_bench failed (exit $rc):"; tail -20 "$out/transport.log"; } ;;
    steps)
      models=${MODELS:-llama3-8b,llama-13b}
      for m in ${models//,/ }; do
        "$BUILD/bench/deploy_step_bench" --model "$m" --tandem "$BUILD/tandem" \
          --transports "${TRANSPORTS:-ucx,p2p,nccl}" --batches "${BATCHES:-64,256}" \
          --contexts "${CONTEXTS:-1024,4096}" --decode-tokens 16 --memory-ranks "${MEMORY_RANKS:-1}" \
          --json "$out/steps_$m.json" >"$out/steps_$m.txt" 2>"$out/steps_$m.log"
        rc=$?
        cat "$out/steps_$m.txt"
        [ $rc -eq 0 ] || { echo "deploy_step_bench $m failed (exit $rc):"; tail -20 "$out/steps_$m.log"; }
      done ;;
    pipeline)
      gpus=$(nvidia-smi --list-gpus | wc -l)
      m=${MODEL:-llama3-8b}
      run_steps() {  # NAME ARGS...: one deploy_step_bench run, its table and efficiency column
        local name=$1; shift
        echo "== pipeline: $name"
        "$BUILD/bench/deploy_step_bench" --model "$m" --tandem "$BUILD/tandem" --batches "${BATCHES:-64,256}" \
          --contexts "${CONTEXTS:-1024,4096}" --decode-tokens 16 "$@" \
          --json "$out/pipeline_$name.json" >"$out/pipeline_$name.txt" 2>"$out/pipeline_$name.log"
        local rc=$?
        cat "$out/pipeline_$name.txt"
        [ $rc -eq 0 ] || { echo "deploy_step_bench ($name) failed (exit $rc):"; tail -20 "$out/pipeline_$name.log"; }
      }
      pp=${PIPELINE_BATCHES:-1,2,4}
      run_steps one_gpu --shared-gpu 1 --transports local,p2p --pipeline-batches "$pp"
      if [ "$gpus" -ge 2 ]; then
        run_steps two_gpus --transports p2p,nccl --memory-ranks 1 --pipeline-batches "$pp"
      fi
      if [ "$gpus" -ge 3 ]; then
        # Compute replicas (pipeline.mode fixed): 2 compute GPUs, the rest memory GPUs.
        run_steps fixed_2_compute --transports p2p,nccl --compute-ranks 2 --memory-ranks $((gpus - 2)) \
          --pipeline-batches "${FIXED_BATCHES:-2,4}"
        # The rotational pipeline, the paper's layout: 3 micro-batches on 2 compute GPUs.
        run_steps rotational_2_compute --transports p2p,nccl --compute-ranks 2 --memory-ranks $((gpus - 2)) \
          --slice-layers "${SLICE_LAYERS:-1}" --pipeline-batches "${ROTATIONAL_BATCHES:-3}"
      fi
      if [ "$gpus" -ge 4 ]; then
        run_steps rotational_3_compute --transports p2p,nccl --compute-ranks 3 --memory-ranks $((gpus - 3)) \
          --slice-layers "${SLICE_LAYERS:-1}" --pipeline-batches 4
      fi
      if [ "$gpus" -ge 4 ]; then
        run_steps four_gpus_request --transports p2p,nccl --memory-ranks 3 --pipeline-batches "$pp"
        # Head partition over 2 memory ranks on 3 GPUs: equal slices of the 8 KV heads.
        run_steps three_gpus_head --transports p2p --memory-ranks 2 --partition head --pipeline-batches "$pp"
      fi ;;
    *) echo "unknown part: $what"; exit 2 ;;
  esac
done
