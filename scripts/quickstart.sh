#!/usr/bin/env bash
# The main job on a fresh machine: install, build, then start a local disaggregated deployment
# (compute rank 0 and two memory ranks as separate processes, on the GPU if there is one, else on
# the CPU; deploy/examples/local.yaml) and generate tokens with the `small` preset (random weights,
# ~125M parameters) for a batch of prompts, printing tokens and tokens/s. Rank logs go to
# tandem-run/local/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
cat > "${BUILD_DIR:-build}/quickstart_prompts.jsonl" <<'J'
{"prompt_ids": [1, 450, 4996, 17354, 1701, 29916], "max_tokens": 32}
{"prompt_ids": [1, 15043, 3186, 29892, 920, 526, 366]}
{"prompt_ids": [1, 29871, 29896, 29974, 29896, 29922], "temperature": 0.8, "seed": 7}
{"prompt_ids": [1, 3439, 17443, 373, 278, 4088, 310, 3186, 29892, 1105, 263]}
J
"${BUILD_DIR:-build}/tandem" generate --deploy deploy/examples/local.yaml --model small --prompts-file "${BUILD_DIR:-build}/quickstart_prompts.jsonl" \
  --max-tokens 32 --ignore-eos "$@"
