#!/usr/bin/env bash
# Runs openai_test.py with the Python that has the `openai` client (.cache/venv, made by
# scripts/install_deps.sh); exits 77 (ctest: skipped, with the reason) where it is missing.
# Usage: run_openai_test.sh SOURCE_DIR TANDEM_BINARY
set -u
py="$1/.cache/venv/bin/python"
if [ ! -x "$py" ]; then
  echo "skipped: $py is missing (scripts/install_deps.sh makes it)"
  exit 77
fi
exec "$py" "$1/tests/server/openai_test.py" "$2"
