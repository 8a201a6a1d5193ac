#!/usr/bin/env bash
# End-to-end effect of the prefix cache and of shared-prefix attention on the colocated CUDA
# engine: the same requests with kv.prefix_cache off, with the cache but kv.prefix_sharing off,
# and with both (on), checking that greedy tokens are equal and printing tokens/s.
#
# Workloads:
#   trace   a window of the Mooncake conversation trace (TRACE=path/to/mooncake_conversation_trace.jsonl,
#           the FAST'25 release's JSON lines: timestamp, input_length, output_length, hash_ids): each
#           request's hash_ids become token blocks, equal ids giving equal tokens, so requests that
#           share leading ids share that prefix. Blocks are scaled from 512 to BLOCK tokens
#           (default 64) so that a window of WINDOW requests (default 256) fits one GPU's KV.
#   fanout  BATCH requests (default 256) that share one PREFIX-token prompt (default 4096) and
#           each add SUFFIX own tokens (default 64): a few-shot or document prompt served to many.
# Usage: bench/prefix_sharing_bench.sh path/to/tandem OUTDIR [MODEL]   (MODEL default llama3-8b)
set -uo pipefail
TANDEM=${1:?usage: prefix_sharing_bench.sh TANDEM OUTDIR [MODEL]}
out=${2:?usage: prefix_sharing_bench.sh TANDEM OUTDIR [MODEL]}
MODEL=${3:-llama3-8b}
src=$(cd "$(dirname "$0")/.." && pwd)
TRACE=${TRACE:-}
WINDOW=${WINDOW:-256} START=${START:-0} BLOCK=${BLOCK:-64} GEN=${GEN:-64}
MAXPROMPT=${MAXPROMPT:-8000}  # prompts are cut to the model's context (llama3-8b: 8192)
BATCH=${BATCH:-256} PREFIX=${PREFIX:-4096} SUFFIX=${SUFFIX:-64}
LIMIT=${LIMIT:-300}  # seconds per run
mkdir -p "$out" && cd "$out" || exit 1
fail=0

if [ -f "$TRACE" ]; then
  python3 - "$TRACE" "$START" "$WINDOW" "$BLOCK" "$GEN" "$MAXPROMPT" >trace.jsonl <<'PY'
import json, random, sys
path, start, window, block, gen, max_prompt = sys.argv[1], *map(int, sys.argv[2:])
rows = [json.loads(l) for l in open(path)][start:start + window]
def block_tokens(h):  # the same hash id always gives the same tokens
    r = random.Random(h * 7919 + 1)
    return [r.randrange(2, 30000) for _ in range(block)]
shared = total = 0
seen = set()
for row in rows:
    n = max(1, min(row["input_length"] * block // 512, max_prompt))
    ids = row["hash_ids"]
    prompt = [t for h in ids for t in block_tokens(h)][:n]
    prompt += block_tokens(10**9 + len(seen))[: max(0, n - len(prompt))]
    k = 0
    while k < len(ids) and tuple(ids[: k + 1]) in seen:
        k += 1
    seen.update(tuple(ids[: i + 1]) for i in range(len(ids)))
    shared += min(k * block, n)
    total += n
    print(json.dumps({"prompt_ids": prompt, "max_tokens": max(1, min(gen, row["output_length"]))}))
print(f"trace window: {len(rows)} requests, {total} prompt tokens, {shared} in blocks an earlier request "
      f"of the window has ({100.0 * shared / max(total, 1):.1f}%)", file=sys.stderr)
PY
else
  echo "TRACE is not set to a Mooncake trace file: skipping the trace workload"
fi
python3 - "$BATCH" "$PREFIX" "$SUFFIX" >fanout.jsonl <<'PY'
import json, random, sys
b, p, s = map(int, sys.argv[1:])
r = random.Random(3)
prefix = [r.randrange(2, 30000) for _ in range(p)]
for i in range(b):
    print(json.dumps({"prompt_ids": prefix + [r.randrange(2, 30000) for _ in range(s)]}))
PY

run() {  # run WORKLOAD NAME ARGS...
  local w=$1 name=$2; shift 2
  timeout "$LIMIT" "$TANDEM" generate --device cuda --model "$MODEL" --prompts-file "$w.jsonl" --ignore-eos --json \
    --set scheduler.max_batch_size="${MAXB:-256}" --set scheduler.max_tokens_per_step=4096 "$@" \
    >"$w.$name.json" 2>"$w.$name.err" || { echo "FAIL $w $name: $(tail -2 "$w.$name.err")"; fail=1; return; }
  echo "$w $name: $(grep 'tandem generate:' "$w.$name.err" | sed 's/tandem generate: //')"
}
for w in trace fanout; do
  [ -f "$w.jsonl" ] && [ -s "$w.jsonl" ] || continue
  [ "$w" = fanout ] && gen=(--max-tokens "$GEN") || gen=()
  run "$w" nocache "${gen[@]}" --logprobs --set kv.prefix_cache=false
  run "$w" cache "${gen[@]}" --logprobs --set kv.prefix_cache=true --set kv.prefix_sharing=off
  run "$w" shared "${gen[@]}" --logprobs --set kv.prefix_cache=true --set kv.prefix_sharing=on
  run "$w" auto "${gen[@]}" --logprobs --set kv.prefix_cache=true --set kv.prefix_sharing=auto
  # Greedy tokens against the run without the cache. Reused KV was computed in another batch and
  # the cascade sums in another order, so bf16 rounding differs; on random-weight presets, whose
  # logits are nearly flat, that can flip a near-tie. Report how many requests match, and the
  # logprob difference up to each request's first differing token.
  python3 - "$w" <<'PY'
import json, sys
w = sys.argv[1]
def load(n):
    try:
        return [json.loads(l) for l in open(f"{w}.{n}.json")]
    except FileNotFoundError:
        return None
base = load("nocache")
for n in ["cache", "shared", "auto"]:
    got = load(n)
    if base is None or got is None:
        continue
    same, first, diff = 0, [], 0.0
    for a, b in zip(base, got):
        if a["token_ids"] == b["token_ids"]:
            same += 1
        k = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), len(a["token_ids"]))
        if k < len(a["token_ids"]):
            first.append(k)
        diff = max([diff] + [abs(x - y) for x, y in zip(a["logprobs"][:k], b["logprobs"][:k])])
    cached = sum(r["usage"]["cached_tokens"] for r in got)
    print(f"{w} {n}: {same}/{len(base)} requests with tokens equal to nocache (others first differ at token "
          f"{sorted(first)[:8]}), max |logprob difference| before that {diff:.3g}, {cached} prompt tokens reused")
PY
done
exit $fail
