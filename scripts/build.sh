#!/usr/bin/env bash
# Configures and builds tandem into ${BUILD_DIR:-build}. Extra arguments go to cmake's configure
# step, e.g. scripts/build.sh -DTANDEM_CUDA=OFF. CUDA code is compiled where nvcc is found.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
