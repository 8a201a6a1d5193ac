#!/usr/bin/env bash
# Tokens per dollar, colocated against disaggregated: the same model and trace replayed with
# `tandem bench` on the colocated engine (one GPU; data-parallel scales it linearly) and on the
# deployments this machine can host, then every layout priced twice from deploy/prices.yaml: the
# memory role as the same GPU, and as a memory-optimised device (MEMORY_OFFER). Prints one table
# last; writes every bench.json, the plots and summary.md to OUTDIR.
#
# Usage: bench/tokens_per_dollar.sh OUTDIR
#   one GPU:   colocated, and the one-GPU deployment (memory rank a thread of compute rank 0)
#   G >= 2:    also 1 compute GPU + (G-1) memory GPUs (transport auto: p2p)
#   no GPU:    the same on the CPU with a tiny preset (a smoke run of the script; figures are not
#              GPU figures)
# Environment (defaults in brackets):
#   MODEL [llama3-8b on a GPU, tiny-gqa on the CPU]  TRACE [tests/data/traces/azure_conv_head1000.csv]
#   REQUESTS [400]  MAX_INPUT [4096]  MAX_OUTPUT [1024]  SLO [ttft=5,tpot=200ms]
#   ARRIVAL [all: maximum throughput; "trace" replays the trace's times, TIME_SCALE [1] scales them]
#   BATCH [256] TOKENS [2048] KV_FRACTION [0.9]: scheduler.max_batch_size, max_tokens_per_step and
#   kv.memory_fraction, the same for every layout; CONCURRENCY [256] requests in flight at most
# Layouts: colocated (in process), colocated_http (tandem serve, measured over HTTP as the
# deployments are: the baseline of the "vs colocated" columns), deploy_1gpu, deploy_multi.
#   GPU_OFFER [h100 on an H100, h200 on an H200]  MEMORY_OFFER [h20]  MEMORY_GPUS [all but one]
#   BUILD_DIR [build]  (built with scripts/build.sh when $BUILD_DIR/tandem is missing)
set -uo pipefail
out=${1:?usage: bench/tokens_per_dollar.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
cd "$src" || exit 1
BUILD_DIR=${BUILD_DIR:-build}
if [ ! -x "$BUILD_DIR/tandem" ]; then
  echo "tokens_per_dollar: building into $BUILD_DIR (log $out/build.log)"
  BUILD_DIR=$BUILD_DIR BUILD_TYPE=Release bash scripts/build.sh -DTANDEM_WERROR=OFF >"$out/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$out/build.log" | head -20; exit 1; }
fi
TANDEM=$src/$BUILD_DIR/tandem
if command -v nvidia-smi >/dev/null 2>&1 && "$TANDEM" devices 2>&1 | grep -q "built without the CUDA backend"; then
  echo "tokens_per_dollar: $BUILD_DIR/tandem has no CUDA backend on a GPU machine; give BUILD_DIR=build-gpu (built here)"
  exit 1
fi
GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l); fi
if [ "$GPUS" -gt 0 ]; then
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  case "$GPU_NAME" in *H200*) DEFAULT_OFFER=h200 ;; *) DEFAULT_OFFER=h100 ;; esac
  MODEL=${MODEL:-llama3-8b}
  DEVICE=cuda
else
  GPU_NAME="none (CPU smoke run)"
  DEFAULT_OFFER=h100
  MODEL=${MODEL:-tiny-gqa}
  DEVICE=cpu
fi
GPU_OFFER=${GPU_OFFER:-$DEFAULT_OFFER}
MEMORY_OFFER=${MEMORY_OFFER:-h20}
TRACE=${TRACE:-tests/data/traces/azure_conv_head1000.csv}
REQUESTS=${REQUESTS:-400}
MAX_INPUT=${MAX_INPUT:-4096}
MAX_OUTPUT=${MAX_OUTPUT:-1024}
SLO=${SLO:-ttft=5,tpot=200ms}
ARRIVAL=${ARRIVAL:-all}
TIME_SCALE=${TIME_SCALE:-1}
BATCH=${BATCH:-256}
TOKENS=${TOKENS:-2048}
KV_FRACTION=${KV_FRACTION:-0.9}
CONCURRENCY=${CONCURRENCY:-256}
MEMORY_GPUS=${MEMORY_GPUS:-$((GPUS > 1 ? GPUS - 1 : 0))}
if [ "$DEVICE" = cpu ]; then
  # The CPU smoke run: short prompts so that it ends in seconds.
  SCALE=${LENGTH_SCALE:-0.05}
  REQUESTS=${REQUESTS_CPU:-40}
else
  SCALE=${LENGTH_SCALE:-1}
fi
echo "tokens_per_dollar: GPU $GPU_NAME x $GPUS; model $MODEL; trace $TRACE ($REQUESTS requests, arrival $ARRIVAL)"
echo "tokens_per_dollar: priced with deploy/prices.yaml: GPU as $GPU_OFFER, memory-optimised device as $MEMORY_OFFER"
common=(--trace "$TRACE" --num-requests "$REQUESTS" --max-input "$MAX_INPUT" --max-output "$MAX_OUTPUT"
        --max-concurrency "$CONCURRENCY"
        --length-scale "$SCALE" --slo "$SLO" --arrival "$ARRIVAL" --compute-device "$GPU_OFFER" --quiet
        --set "scheduler.max_batch_size=$BATCH" --set "scheduler.max_tokens_per_step=$TOKENS"
        --set "kv.memory_fraction=$KV_FRACTION")
[ "$ARRIVAL" = trace ] && common+=(--time-scale "$TIME_SCALE")
fail=0
run() {  # run NAME ARGS...: one tandem bench run into $out/NAME
  local name=$1; shift
  echo "tokens_per_dollar: $name ..."
  if "$TANDEM" bench "${common[@]}" "$@" --out "$out/$name" >"$out/$name.txt" 2>"$out/$name.err"; then
    sed -n '/^run /,$p' "$out/$name.txt" | head -4
  else
    echo "FAIL $name: $(tail -3 "$out/$name.err")"; fail=1
  fi
}
layouts=()
run colocated --model "$MODEL" --device "$DEVICE"
layouts+=("colocated:1:0")
# The deployments are measured over their HTTP API: so is this colocated run (tandem serve), the
# baseline they are compared with.
"$TANDEM" serve --model "$MODEL" --device "$DEVICE" --set api.port=0 --ready-file "$out/serve.url" \
  --set "scheduler.max_batch_size=$BATCH" --set "scheduler.max_tokens_per_step=$TOKENS" \
  --set "kv.memory_fraction=$KV_FRACTION" --log-level warn >"$out/serve.log" 2>&1 &
serve_pid=$!
rm -f "$out/serve.url"
for _ in $(seq 1200); do [ -s "$out/serve.url" ] && break; kill -0 $serve_pid 2>/dev/null || break; sleep 0.5; done
if [ -s "$out/serve.url" ]; then
  run colocated_http --url "$(cat "$out/serve.url")" --model "$MODEL"
  layouts+=("colocated_http:1:0")
else
  echo "FAIL colocated_http: tandem serve did not start: $(tail -3 "$out/serve.log")"; fail=1
fi
kill $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null
if [ "$DEVICE" = cuda ]; then
  run deploy_1gpu --deploy deploy/examples/gpu.yaml --model "$MODEL" --set "launch.run_dir=$out/deploy_1gpu/run"
else
  run deploy_1gpu --deploy deploy/examples/cpu.yaml --model "$MODEL" --set "launch.run_dir=$out/deploy_1gpu/run"
fi
layouts+=("deploy_1gpu:1:0")
if [ "$MEMORY_GPUS" -ge 1 ]; then
  devs=$(seq -s, 1 "$MEMORY_GPUS" | sed 's/\([0-9]\+\)/cuda:\1/g')
  cat >"$out/multi.yaml" <<EOF
# 1 compute GPU + $MEMORY_GPUS memory GPUs (written by bench/tokens_per_dollar.sh)
model:
  path: $MODEL
compute:
  device: cuda:0
memory:
  ranks: $MEMORY_GPUS
  devices: $devs
launch:
  run_dir: $out/deploy_multi/run
EOF
  run deploy_multi --deploy "$out/multi.yaml" --memory-device "$GPU_OFFER" --memory-count "$MEMORY_GPUS"
  layouts+=("deploy_multi:1:$MEMORY_GPUS")
fi
# Plots of every layout together.
PY=.cache/venv/bin/python
if [ -x "$PY" ] && "$PY" -c "import matplotlib" 2>/dev/null; then
  files=(); labels=()
  for l in "${layouts[@]}"; do n=${l%%:*}; [ -f "$out/$n/bench.json" ] && files+=("$out/$n/bench.json") && labels+=("$n"); done
  [ ${#files[@]} -gt 0 ] && "$PY" bench/plot_bench.py "${files[@]}" --labels "$(IFS=,; echo "${labels[*]}")" --out "$out" >/dev/null
else
  echo "tokens_per_dollar: matplotlib missing (scripts/install_deps.sh); no plots"
fi
# The table: tokens/s measured once per layout, priced both ways.
python3 - "$out" "$GPU_OFFER" "$MEMORY_OFFER" "$GPU_NAME" "${layouts[@]}" <<'PY' | tee "$out/summary.md"
import json, os, re, sys
out, gpu, mem, gpu_name = sys.argv[1:5]
try:
    import yaml
    table = yaml.safe_load(open("deploy/prices.yaml"))
except ImportError:  # the flat layout of deploy/prices.yaml, read without PyYAML
    text = open("deploy/prices.yaml").read()
    table = {"date": re.search(r'^date:\s*"?([^"\n]+)"?', text, re.M).group(1),
             "amortize_years": float(re.search(r"^amortize_years:\s*(\S+)", text, re.M).group(1)), "offers": []}
    for block in re.split(r"\n\s*- name:", text)[1:]:
        o = {"name": block.split("\n")[0].strip()}
        for key in ("usd_per_hour", "usd_purchase"):
            m = re.search(rf"^\s*{key}:\s*(\S+)", block, re.M)
            if m:
                o[key] = float(m.group(1))
        table["offers"].append(o)
def hourly(name):
    for o in table["offers"]:
        if o["name"] == name:
            return o.get("usd_per_hour") or o["usd_purchase"] / (table.get("amortize_years", 3) * 8760)
    sys.exit(f"deploy/prices.yaml has no offer {name!r}")
g, m = hourly(gpu), hourly(mem)
rows = []
for spec in sys.argv[5:]:
    name, compute, memory = spec.split(":")
    path = os.path.join(out, name, "bench.json")
    if not os.path.exists(path):
        continue
    j = json.load(open(path))
    r = j["runs"][0]["metrics"]
    tps = r["output_throughput"]
    devices = int(compute) + int(memory)
    same = devices * g
    cheap = int(compute) * g + int(memory) * m
    rows.append((name, devices, tps, r["tpot"]["median"] * 1e3, r["ttft"]["p90"], r["goodput"], same, cheap))
if not rows:
    sys.exit("no layout ran")
# Colocated tokens per dollar (data-parallel: the same per GPU), measured over HTTP when it was.
base_row = next((r for r in rows if r[0] == "colocated_http"), rows[0])
base = base_row[2] / base_row[6]
print(f"## Tokens per dollar ({gpu_name}; prices deploy/prices.yaml dated {table['date']}: "
      f"GPU as {gpu} ${g:.2f}/h, memory role as {mem} ${m:.2f}/h)\n")
print(f"workload: {json.load(open(os.path.join(out, rows[0][0], 'bench.json')))['workload']['name']}, "
      f"{json.load(open(os.path.join(out, rows[0][0], 'bench.json')))['runs'][0]['arrivals']['description']}\n")
print("| layout | GPUs | output tok/s | TPOT p50 ms | TTFT p90 s | goodput req/s | $/M tok (memory = same GPU) "
      "| vs colocated | $/M tok (memory = " + mem + ") | vs colocated |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, devices, tps, tpot, ttft, good, same, cheap in rows:
    per_same = tps / same
    per_cheap = tps / cheap
    print(f"| {name} | {devices} | {tps:.1f} | {tpot:.2f} | {ttft:.3f} | {good:.3f} | {same / 3600 / tps * 1e6:.4f} "
          f"| {per_same / base:.2f}x | {cheap / 3600 / tps * 1e6:.4f} | {per_cheap / base:.2f}x |")
print(f"\n\"vs colocated\": tokens per dollar against {base_row[0]}. colocated data-parallel on N GPUs: N times the one-GPU tokens/s at N times the price (the same "
      "tokens per dollar). deploy_1gpu shares one GPU between the roles, so it is priced as one GPU both ways.")
PY
exit $fail
