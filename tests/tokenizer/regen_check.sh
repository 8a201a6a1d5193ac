#!/usr/bin/env bash
# Regenerates the tokenizer reference ids with HF tokenizers / sentencepiece and compares them
# with the committed ones (tests/data/tokenizer). Exits 77 (ctest: skipped, with the reason)
# where the Python libraries or the tokenizer files are missing. Usage: regen_check.sh SOURCE_DIR
set -u
src="$1"
# scripts/install_deps.sh unpacks the pinned libraries here; an installed copy works too.
[ -d "$src/.cache/pip-models/py" ] && export PYTHONPATH="$src/.cache/pip-models/py${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import tokenizers, sentencepiece" 2>/dev/null ||
  { echo "skipped: python packages tokenizers and sentencepiece not installed (scripts/install_deps.sh unpacks them into .cache/pip-models/py)"; exit 77; }
[ -d "$src/.cache/tokenizers" ] || { echo "skipped: $src/.cache/tokenizers absent (scripts/install_deps.sh)"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 "$src/tests/tokenizer/make_tokenizer_reference.py" --files "$src/.cache/tokenizers" --out "$out" || exit 1
status=0
for f in "$src"/tests/data/tokenizer/*.json; do
  n=$(basename "$f")
  if [ ! -f "$out/$n" ]; then
    echo "not regenerated: $n (its tokenizer file is absent)"
    continue
  fi
  # The library versions may differ; the ids and texts may not.
  if ! python3 - "$f" "$out/$n" <<'PY'
import json, sys
a, b = (json.load(open(p, encoding="utf-8")) for p in sys.argv[1:3])
bad = [i for i, (x, y) in enumerate(zip(a["cases"], b["cases"])) if x != y]
if a["texts"] != b["texts"] or bad:
    print(f"{sys.argv[1]}: differs from {a['library']} -> {b['library']} on lines {bad[:10]}")
    sys.exit(1)
PY
  then status=1; else echo "same: $n"; fi
done
exit $status
