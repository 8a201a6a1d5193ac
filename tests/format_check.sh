#!/usr/bin/env bash
# Fails if any C++/CUDA source differs from what clang-format (the repository's .clang-format)
# would write. Usage: format_check.sh SOURCE_DIR
# Exits 77 (ctest: skipped, with the reason) where clang-format or a git checkout is missing;
# scripts/install_deps.sh installs clang-format, so CI always runs it.
set -u
cd "$1" || exit 2
command -v clang-format >/dev/null || { echo "skipped: clang-format not installed (scripts/install_deps.sh installs it)"; exit 77; }
files=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' 2>/dev/null)
[ -n "$files" ] || { echo "skipped: $1 is not a git checkout"; exit 77; }
# shellcheck disable=SC2086
if clang-format --dry-run --Werror $files 2>"${TMPDIR:-/tmp}/tandem_format.log"; then
  echo "$(echo "$files" | wc -l) files formatted"
else
  grep -E "error:" "${TMPDIR:-/tmp}/tandem_format.log" | head -20
  echo "run: clang-format -i \$(git ls-files '*.cc' '*.h' '*.cu')"
  exit 1
fi
