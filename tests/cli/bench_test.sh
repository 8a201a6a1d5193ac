#!/usr/bin/env bash
# `tandem bench` and `tandem plan` end to end on the CPU: a tiny preset model replays 20 requests
# of the committed trace excerpts (tests/data/traces/), in process, through a deployment on this
# host and through `tandem serve`'s HTTP API; every output file must exist and agree with itself
# (metrics recomputed from the per-request timings, prices from deploy/prices.yaml); Ctrl-C must
# write what was measured; bad input must fail with one line naming the file, line or flag; the
# plot script runs where matplotlib is installed (.cache/venv).
# Usage: bench_test.sh path/to/tandem
set -u
TANDEM=$1
SRC=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
cd "$SRC" || exit 1
passed=0
failed=0
ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }
expect_ok() {
  if "$@" >"$TMP/out" 2>"$TMP/err"; then ok; else bad "command failed: $* -- $(tail -5 "$TMP/err")"; fi
}
expect_fail() {
  local needle=$1; shift
  "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$? last
  last=$(tail -n 1 "$TMP/err")
  if [ $rc -eq 0 ]; then bad "expected failure: $*"; return; fi
  case "$last" in
    tandem*"$needle"*) ok ;;
    *) bad "last stderr line of '$*' lacks '$needle': $(cat "$TMP/err")" ;;
  esac
}
# check_json FILE N [extra python]: the result file is consistent (tests/cli/check_bench_json.py).
check_json() {
  if python3 "$SRC/tests/cli/check_bench_json.py" "$@" >"$TMP/check" 2>&1; then ok; else bad "$1: $(cat "$TMP/check")"; fi
}
AZURE=tests/data/traces/azure_conv_head40.csv
MOON=tests/data/traces/mooncake_conv_head40.jsonl

# --- help -------------------------------------------------------------------------------------------
expect_ok "$TANDEM" bench --help
for flag in --model --deploy --url --trace --synthetic --arrival --rate --burstiness --time-scale --slo --out \
            --compute-device --memory-device --memory-count --prices --max-input --length-scale; do
  grep -qF -- "$flag" "$TMP/out" || bad "bench --help lacks $flag"
done
expect_ok "$TANDEM" plan --help

# --- in process: the Azure excerpt at its own (scaled) times, priced, with SLOs ---------------------
expect_ok "$TANDEM" bench --model tiny-gqa --trace $AZURE --num-requests 20 --time-scale 0.01 --max-input 512 \
  --slo ttft=2,tpot=500ms --compute-device h100 --out "$TMP/azure"
grep -q "output tok/s" "$TMP/out" || bad "no table on stdout: $(cat "$TMP/out")"
grep -q "ETA" "$TMP/err" || bad "no progress with ETA on stderr"
[ -s "$TMP/azure/summary.txt" ] && ok || bad "summary.txt missing"
cmp -s "$TMP/out" "$TMP/azure/summary.txt" && ok || bad "summary.txt differs from the table printed"
check_json "$TMP/azure/bench.json" 20 --priced --slo
grep -q "prompts cut to --max-input 512" "$TMP/out" || bad "the cap is not stated: $(cat "$TMP/out")"

# --- Mooncake hash blocks: shared prompt blocks hit the prefix cache; a rate sweep ------------------
expect_ok "$TANDEM" bench --model tiny-gqa --trace $MOON --num-requests 20 --length-scale 0.125 --max-input 448 \
  --max-output 16 --arrival poisson --rate 50,200 --burstiness 0.5 --out "$TMP/moon" --quiet
check_json "$TMP/moon/bench.json" 20 --runs 2 --prefix-hits
grep -q "prompts built from hash_ids blocks of 64 tokens" "$TMP/out" || bad "hash block note missing"

# --- plots ----------------------------------------------------------------------------------------
PY="$SRC/.cache/venv/bin/python"
if [ -x "$PY" ] && "$PY" -c "import matplotlib" 2>/dev/null; then
  expect_ok "$PY" bench/plot_bench.py "$TMP/azure/bench.json" "$TMP/moon/bench.json" --out "$TMP/plots" --labels a,m
  for f in latency_cdf throughput_vs_rate cost_vs_latency; do
    [ -s "$TMP/plots/$f.png" ] && ok || bad "plot $f.png missing"
  done
else
  echo "bench_test: matplotlib not in .cache/venv (scripts/install_deps.sh); plot check skipped"
fi

# --- a deployment on this host (CPU ranks), over its HTTP API -------------------------------------
expect_ok "$TANDEM" bench --deploy deploy/examples/cpu.yaml --synthetic shared-prefix --prefix-len 128 --input-len 16 \
  --output-len 8 --num-requests 20 --compute-device h100 --memory-device h20 --memory-count 2 --out "$TMP/deploy" --quiet
check_json "$TMP/deploy/bench.json" 20 --priced --prefix-hits
grep -q "2 x h20" "$TMP/out" || bad "memory devices not priced: $(cat "$TMP/out")"

# --- an OpenAI-compatible endpoint: tandem serve, multi-turn sessions -----------------------------
"$TANDEM" serve --model tiny-gqa --set api.port=0 --ready-file "$TMP/url" --log-level warn >"$TMP/serve.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 100); do [ -s "$TMP/url" ] && break; sleep 0.1; done
if [ -s "$TMP/url" ]; then
  expect_ok "$TANDEM" bench --url "$(cat "$TMP/url")" --model tiny-gqa --synthetic multi-turn --turns 4 --num-requests 20 \
    --prefix-len 64 --input-len 16 --output-len 8 --out "$TMP/url_run" --quiet
  check_json "$TMP/url_run/bench.json" 20 --prefix-hits --sessions
else
  bad "tandem serve did not become ready: $(cat "$TMP/serve.log")"
fi
expect_fail "cannot reach the server" "$TANDEM" bench --url http://127.0.0.1:1 --synthetic fixed --num-requests 2 \
  --out "$TMP/nourl" --warmup 0

# --- Ctrl-C writes what was measured so far ------------------------------------------------------
"$TANDEM" bench --model tiny-gqa --synthetic fixed --num-requests 400 --input-len 16 --output-len 8 --arrival poisson \
  --rate 20 --out "$TMP/int" >"$TMP/int.out" 2>"$TMP/int.err" &
pid=$!
sleep 2
kill -INT $pid
wait $pid
rc=$?
[ $rc -ne 0 ] && ok || bad "interrupted bench exited 0"
tail -n 1 "$TMP/int.err" | grep -q "interrupted" && ok || bad "no 'interrupted' line: $(tail -3 "$TMP/int.err")"
check_json "$TMP/int/bench.json" 400 --interrupted

# --- bad input fails with one line naming the file, line or flag -----------------------------------
printf 'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,10,5\n2023-11-16 18:15:47.0,ten,5\n' >"$TMP/bad.csv"
expect_fail "bad.csv:3: ContextTokens" "$TANDEM" bench --model tiny-gqa --trace "$TMP/bad.csv" --out "$TMP/x"
expect_fail "no price for \"b300\"" "$TANDEM" bench --model tiny-gqa --synthetic fixed --compute-device b300 --out "$TMP/x"
expect_fail "--arrival poisson needs --rate" "$TANDEM" bench --model tiny-gqa --synthetic fixed --arrival poisson --out "$TMP/x"
expect_fail "--slo: unknown key \"latency\"" "$TANDEM" bench --model tiny-gqa --synthetic fixed --slo latency=3 --out "$TMP/x"
expect_fail "exactly one workload" "$TANDEM" bench --model tiny-gqa --out "$TMP/x"
expect_fail "--prices: " "$TANDEM" bench --model tiny-gqa --synthetic fixed --compute-device h100 --prices "$TMP/none.yaml" --out "$TMP/x"

# --- tandem plan ----------------------------------------------------------------------------------
expect_ok "$TANDEM" plan --model llama-13b --context 512 --compute-device a100-80g@purchase \
  --memory-devices a100-80g@purchase,rtx3090@purchase --max-memory 4
grep -q "^best: " "$TMP/out" || bad "plan prints no best plan: $(cat "$TMP/out")"
grep -q "least link bandwidth" "$TMP/out" || bad "plan prints no link bandwidth"
expect_ok "$TANDEM" plan --model llama3-8b --trace $AZURE --compute-device h100 --slo tpot=50ms --json
if python3 -c "import json,sys; j=json.load(open('$TMP/out')); assert j['plans'][0]['feasible']; assert j['price_table_date']" 2>"$TMP/e"; then ok; else bad "plan --json: $(cat "$TMP/e")"; fi
expect_fail "unknown device \"b300\"" "$TANDEM" plan --model llama3-8b --context 1024 --compute-device b300
expect_fail "give one workload" "$TANDEM" plan --model llama3-8b

echo "bench_test: $passed passed, $failed failed"
[ $failed -eq 0 ]
