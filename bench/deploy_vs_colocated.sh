#!/usr/bin/env bash
# The disaggregated runtime on one GPU (deploy/examples/gpu.yaml: compute rank 0 with its memory
# rank as a thread, transport local; also p2p between processes, the head partition, and the
# pipeline modes) against the colocated CUDA engine: the same tokens, then tokens/s.
# Usage: bench/deploy_vs_colocated.sh path/to/tandem OUTDIR
# (ONLY=REGEX runs the equality cases whose names match; SPECS="" skips the throughput runs.)
set -uo pipefail
TANDEM=${1:?usage: deploy_vs_colocated.sh TANDEM OUTDIR}
out=${2:?usage: deploy_vs_colocated.sh TANDEM OUTDIR}
mkdir -p "$out"
src=$(cd "$(dirname "$0")/.." && pwd)
LIMIT=${LIMIT:-240}  # seconds per run
SPECS=${SPECS-"small 64 512 64;llama3-8b 64 512 64"}  # model batch prompt_tokens generated_tokens
cd "$out" || exit 1
fail=0
# Mixed requests: prompt lengths 1-300, some end early, greedy and sampled.
python3 - >mixed.jsonl <<'PY'
import json, random
r = random.Random(7)
for i in range(24):
    n = r.choice([1, 3, 17, 64, 150, 200])
    print(json.dumps({"prompt_ids": [r.randrange(1, 250) for _ in range(n)], "max_tokens": r.choice([2, 9, 24]),
                      "temperature": r.choice([0.0, 0.8]), "top_k": r.choice([0, 20]), "seed": i}))
PY
same() {  # same NAME ARGS...: deploy vs colocated, identical JSON output expected (DEPLOY_SETS: deployment only)
  local name=$1; shift
  [[ "$name" =~ ${ONLY:-.} ]] || return 0  # ONLY: a regex of the cases to run
  # shellcheck disable=SC2086
  timeout "$LIMIT" "$TANDEM" generate --deploy "$src/deploy/examples/gpu.yaml" "$@" ${DEPLOY_SETS:-} --json --logprobs --set launch.run_dir="$out/run-$name" \
    >"$name.deploy.json" 2>"$name.deploy.err" || { echo "FAIL $name: deploy run failed: $(tail -3 "$name.deploy.err")"; fail=1; return; }
  timeout "$LIMIT" "$TANDEM" generate --device cuda "$@" --json --logprobs --set scheduler.max_batch_size=64 \
    --set scheduler.max_tokens_per_step=1024 >"$name.colocated.json" 2>"$name.colocated.err" ||
    { echo "FAIL $name: colocated run failed: $(tail -3 "$name.colocated.err")"; fail=1; return; }
  if cmp -s "$name.deploy.json" "$name.colocated.json"; then
    echo "same tokens and logprobs: $name ($(wc -l <"$name.deploy.json") requests)"
  elif [ -n "${TOL:-}" ] && python3 "$src/tests/cli/compare_results.py" "$name.deploy.json" "$name.colocated.json" "$TOL" \
      >"$name.cmp" 2>&1; then
    echo "same tokens, logprobs within $TOL: $name ($(cat "$name.cmp"))"
  else
    echo "FAIL $name: deployment and colocated outputs differ"; diff "$name.deploy.json" "$name.colocated.json" | head -4; fail=1
  fi
}
same small --model small --prompts-file mixed.jsonl
for m in llama3-gqa-tied llama2-mha mqa-headdim; do
  same "$m" --model "$src/tests/data/reference/$m" --prompts-file mixed.jsonl
done
# gpu.yaml's transport is auto (local: the memory rank is a thread of compute-0); the same over p2p
# between two processes on the GPU, and the head partition over two memory ranks.
DEPLOY_SETS="--set transport.kind=p2p" same small-p2p --model small --prompts-file mixed.jsonl
DEPLOY_SETS="--set memory.ranks=2 --set memory.partition=head" same llama2-mha-head2 \
  --model "$src/tests/data/reference/llama2-mha" --prompts-file mixed.jsonl
DEPLOY_SETS="--set memory.ranks=2 --set memory.partition=head --set transport.kind=p2p" same small-head2-p2p \
  --model small --prompts-file mixed.jsonl
# Pipelining (pipeline.mode pingpong): micro-batches interleaved with attention, same tokens; the
# log-probabilities may differ in the last bits of bf16 (each micro-batch's GEMMs have fewer rows).
export TOL=0.02
DEPLOY_SETS="--set pipeline.mode=pingpong" same small-pingpong --model small --prompts-file mixed.jsonl
DEPLOY_SETS="--set pipeline.mode=pingpong --set pipeline.batches=3" same llama3-gqa-tied-pingpong3 \
  --model "$src/tests/data/reference/llama3-gqa-tied" --prompts-file mixed.jsonl
DEPLOY_SETS="--set pipeline.mode=pingpong --set transport.kind=p2p" same small-pingpong-p2p --model small \
  --prompts-file mixed.jsonl
DEPLOY_SETS="--set pipeline.mode=pingpong --set memory.ranks=2 --set memory.partition=head" same \
  llama2-mha-head2-pingpong --model "$src/tests/data/reference/llama2-mha" --prompts-file mixed.jsonl
# Compute replicas (pipeline.mode fixed) as processes on the same GPU, over p2p (IPC events).
DEPLOY_SETS="--set compute.ranks=2 --set pipeline.mode=fixed --set transport.kind=p2p" same small-fixed2-p2p \
  --model small --prompts-file mixed.jsonl
DEPLOY_SETS="--set compute.ranks=2 --set pipeline.mode=fixed --set pipeline.batches=3 --set transport.kind=p2p \
  --set memory.ranks=2" same llama3-gqa-tied-fixed2-p2p --model "$src/tests/data/reference/llama3-gqa-tied" \
  --prompts-file mixed.jsonl
unset TOL
# The rotational pipeline (layer slices moving round a ring of compute ranks), processes on the
# same GPU, against fixed with the same micro-batches: byte-identical JSON expected (rotation moves
# where a micro-batch's layers run, not what they compute; against the colocated engine both may
# flip a late near-tied or sampled token, as 3 micro-batches round bf16 GEMMs differently).
same_deploy() {  # same_deploy NAME "SETS_A" "SETS_B" ARGS...: two deployments, identical JSON expected
  local name=$1 a=$2 b=$3; shift 3
  [[ "$name" =~ ${ONLY:-.} ]] || return 0
  local k sets
  for k in a b; do
    [ $k = a ] && sets=$a || sets=$b
    # shellcheck disable=SC2086
    timeout "$LIMIT" "$TANDEM" generate --deploy "$src/deploy/examples/gpu.yaml" "$@" $sets --json --logprobs \
      --set launch.run_dir="$out/run-$name-$k" >"$name.$k.json" 2>"$name.$k.err" ||
      { echo "FAIL $name: run $k failed: $(tail -3 "$name.$k.err")"; fail=1; return; }
  done
  if cmp -s "$name.a.json" "$name.b.json"; then
    echo "same tokens and logprobs: $name ($(wc -l <"$name.a.json") requests)"
  else
    echo "FAIL $name: the two deployments differ"; diff "$name.a.json" "$name.b.json" | head -4; fail=1
  fi
}
fixed3="--set compute.ranks=2 --set pipeline.mode=fixed --set pipeline.batches=3 --set transport.kind=p2p"
same_deploy small-rotational2-p2p "$fixed3" \
  "--set compute.ranks=2 --set pipeline.mode=rotational --set pipeline.batches=3 --set transport.kind=p2p" \
  --model small --prompts-file mixed.jsonl
same_deploy small-rotational2-ucx "$fixed3" \
  "--set compute.ranks=2 --set pipeline.mode=rotational --set pipeline.batches=3 --set transport.kind=ucx" \
  --model small --prompts-file mixed.jsonl
same_deploy small-rotational3-slices2 \
  "--set compute.ranks=3 --set pipeline.mode=fixed --set pipeline.batches=4 --set transport.kind=p2p" \
  "--set compute.ranks=3 --set pipeline.mode=rotational --set pipeline.batches=4 --set pipeline.slice_layers=2 --set transport.kind=p2p" \
  --model small --prompts-file mixed.jsonl
# Throughput: B requests of P prompt tokens, G generated tokens each (ignore EOS).
IFS=';' read -r -a specs <<<"$SPECS"
for spec in "${specs[@]}"; do
  set -- $spec
  model=$1 b=$2 p=$3 g=$4
  python3 -c "
import json, random
r = random.Random(1)
for i in range($b): print(json.dumps({'prompt_ids': [r.randrange(1, 30000) for _ in range($p)]}))" >tp.jsonl
  for mode in deploy pingpong colocated; do
    if [ $mode = deploy ] || [ $mode = pingpong ]; then
      args=(--deploy "$src/deploy/examples/gpu.yaml" --set scheduler.max_batch_size=$b --set scheduler.max_tokens_per_step=$((b > 1024 ? b : 1024)) --set launch.run_dir="$out/run-tp")
      [ $mode = pingpong ] && args+=(--set pipeline.mode=pingpong)
    else
      args=(--device cuda --set scheduler.max_batch_size=$b --set scheduler.max_tokens_per_step=$((b > 1024 ? b : 1024)))
    fi
    timeout "$LIMIT" "$TANDEM" generate "${args[@]}" --model "$model" --prompts-file tp.jsonl --max-tokens "$g" --ignore-eos >/dev/null 2>"tp.$mode.err" ||
      { echo "FAIL throughput $mode $spec: $(tail -2 "tp.$mode.err")"; fail=1; continue; }
    echo "$model batch $b prompt $p gen $g $mode: $(grep 'tandem generate:' "tp.$mode.err" | sed 's/.*tokens in/in/')"
  done
done
exit $fail
