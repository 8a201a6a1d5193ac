#!/usr/bin/env bash
# Fuzzes the wire decoders, the prompts-file parser and the config loader with libFuzzer
# (tests/fuzz/fuzz_entries.h): builds the fuzz targets with clang and AddressSanitizer in their own
# build directory (BUILD_DIR, default build-fuzz), then runs each for SECONDS (default 60) from a
# copy of the committed corpus (tests/fuzz/corpus/ and regressions/). A crash or a broken property
# stops the run with libFuzzer's report and the input that caused it (crash-*, in the build
# directory); commit that input under tests/fuzz/regressions/<entry>/ with the fix.
# Usage: scripts/fuzz.sh [SECONDS]   (clang-14 comes from scripts/install_deps.sh)
set -euo pipefail
seconds="${1:-60}"
src="$(cd "$(dirname "$0")/.." && pwd)"
build="${BUILD_DIR:-$src/build-fuzz}"
cxx="${CXX_FUZZ:-clang++-14}"
cc="${CC_FUZZ:-clang-14}"
command -v "$cxx" >/dev/null || { echo "fuzz.sh: $cxx not found (scripts/install_deps.sh installs clang-14)" >&2; exit 2; }
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
cmake -S "$src" -B "$build" -G Ninja -DTANDEM_CUDA=OFF -DTANDEM_FUZZ=ON -DTANDEM_SANITIZE=address \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" >/dev/null
nice ninja -C "$build" -j"${JOBS:-2}" fuzz_wire fuzz_prompts fuzz_config
status=0
for entry in wire prompts config; do
  corpus="$build/corpus-$entry"
  mkdir -p "$corpus"
  cp "$src/tests/fuzz/corpus/$entry/"* "$corpus/"
  cp "$src/tests/fuzz/regressions/$entry/"* "$corpus/" 2>/dev/null || true
  echo "fuzz.sh: $entry for $seconds s"
  (cd "$build" && ASAN_OPTIONS=detect_leaks=0 "./tests/fuzz/fuzz_$entry" -max_total_time="$seconds" \
    -max_len=65536 -timeout=5 -print_final_stats=1 "$corpus") || status=1
done
[ $status -eq 0 ] && echo "fuzz.sh: no crash" || echo "fuzz.sh: a target crashed (above)"
exit $status
