#!/usr/bin/env bash
# Install, build (warnings are errors), run every test. GPU tests skip themselves without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh -DTANDEM_WERROR=ON "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
