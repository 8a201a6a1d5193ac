#!/usr/bin/env bash
# Soak test (not in ctest): a CPU deployment behind `tandem serve --deploy` under Poisson load
# with cancellations for MINUTES (default 30), every rank's RSS sampled; prints the p99 latency
# of the first and last 5 minutes, memory growth after warm-up and stuck requests, and exits
# non-zero when a target is missed (scripts/soak_client.py states them).
# Usage: scripts/soak.sh [MINUTES]   (TANDEM=path/to/tandem, RATE=requests/s, DEPLOY=yaml,
#        MEMORY_RANKS=n, KV_TOKENS=n to change the defaults: build/tandem, 4,
#        deploy/examples/cpu.yaml, 2, 512)
# KV_TOKENS is small on purpose: a CPU memory rank leaves its KV pool's pages untouched until a slot
# is first used (cpu_attention_executor.cc), so a pool that the load fills only slowly grows the
# rank's RSS for the whole run and hides what the memory check is for. 512 slots of `small` are
# 12 MiB per rank, under the check's 16 MiB: the pool alone cannot trip it (a 30-minute run with
# 2048 slots, 48 MiB, saw one memory rank's RSS still rising into its pool after warm-up while the
# other, its pool touched early, stayed within 0.2 MiB). Every sample is kept in LOGS/rss.json.
set -euo pipefail
minutes="${1:-30}"
src="$(cd "$(dirname "$0")/.." && pwd)"
tandem="${TANDEM:-$src/build/tandem}"
deploy="${DEPLOY:-$src/deploy/examples/cpu.yaml}"
[ -x "$tandem" ] || { echo "soak: $tandem is not built (TANDEM=... to choose another)" >&2; exit 2; }
tmp="$(mktemp -d /tmp/tandem-soak.XXXXXX)"
key="soak-$RANDOM$RANDOM"
"$tandem" serve --deploy "$deploy" --model small --ready-file "$tmp/ready" \
  --set memory.ranks="${MEMORY_RANKS:-2}" --set launch.run_dir="$tmp/run" --set api.port=0 \
  --set api.key="$key" --set api.served_model_name=soak --set kv.capacity_tokens="${KV_TOKENS:-512}" \
  --set scheduler.max_batch_size=16 >"$tmp/serve.log" 2>&1 &
serve=$!
cleanup() { kill -TERM "$serve" 2>/dev/null || true; wait "$serve" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 600); do
  [ -s "$tmp/ready" ] && break
  kill -0 "$serve" 2>/dev/null || { cat "$tmp/serve.log" >&2; echo "soak: tandem serve exited" >&2; exit 2; }
  sleep 0.1
done
[ -s "$tmp/ready" ] || { echo "soak: tandem serve did not become ready" >&2; exit 2; }
url="$(cat "$tmp/ready")"
url="${url%/v1}"
echo "soak: $minutes min against $url (logs in $tmp)"
set +e
python3 "$src/scripts/soak_client.py" --url "$url" --pid "$serve" --key "$key" --model soak \
  --duration-s "$((minutes * 60))" --rate "${RATE:-4}" --samples-out "$tmp/rss.json"
rc=$?
set -e
if grep -h " E \[" "$tmp/serve.log" "$tmp"/run/latest/*.log 2>/dev/null | head -5; then
  echo "soak: errors in the logs (above)"
  rc=1
fi
exit $rc
