#!/bin/bash
# Builds .fi/site (in the repository root): flashinfer-python and the dependencies its import needs,
# for Python 3.12, with the attention kernels bench/flashinfer_baseline.py uses compiled ahead of
# time for sm_90a, so that a GPU machine without network or compiler time runs the bench at once.
# Needs nvcc (CUDA 13) and network; no GPU. About 35 minutes on 2 cores (fa3 prefill is most of it).
# Env: PY (required): a Python 3.11 with torch, which drives FlashInfer's JIT builder (its CUDA
#        libraries on LD_LIBRARY_PATH if torch needs them);
#      PY312 (required): a Python 3.12, to check that tvm_ffi's 3.12 core imports;
#      FI_BUILD_SITE / FI_BUILD_WS: reuse an existing full install / JIT workspace.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
FI=$(cd "$HERE/../.." && pwd)/.fi
mkdir -p "$FI"
PY=${PY:?set PY to a Python 3.11 with torch}
PY312=${PY312:?set PY312 to a Python 3.12}
W=$FI/wheels
mkdir -p "$W" "$FI/build"
dl() { pip download -q --no-deps --only-binary=:all: -d "$W" "$@"; }
ls "$W"/flashinfer_python-0.7.2.post1-*.whl >/dev/null 2>&1 || {
  dl --python-version 3.12 --platform manylinux_2_28_x86_64 flashinfer-python==0.7.2.post1 \
     apache-tvm-ffi==0.1.15.post2 einops requests urllib3 idna certifi nvidia-ml-py typing_extensions
  dl --platform any --implementation py --python-version 3 charset_normalizer
}
# 1. A full install for this machine's Python (3.11): FlashInfer's JIT builder and headers.
BSITE=${FI_BUILD_SITE:-$FI/build/site311}
if [ ! -d "$BSITE/flashinfer" ]; then
  mkdir -p "$FI/build/w311"
  pip download -q --no-deps --only-binary=:all: -d "$FI/build/w311" --python-version 3.11 \
     --platform manylinux_2_28_x86_64 apache-tvm-ffi==0.1.15.post2
  $PY -m pip install -q --no-deps --no-index --target "$BSITE" "$FI/build/w311"/*.whl \
     $(ls "$W"/*.whl | grep -v apache_tvm_ffi)
fi
# 2. The kernels (sm_90a), each module as FlashInfer's JIT builder makes it.
WS=${FI_BUILD_WS:-$FI/build/ws}
FLASHINFER_WORKSPACE_BASE=$WS FI_SITE=$BSITE nice -n 10 $PY "$HERE/prep.py" build
# 3. The carried tree: Python 3.12 wheels, pruned to what the bench imports and opens.
rm -rf "$FI/site" "$FI/build/test311"
$PY -m pip install -q --no-deps --no-index --only-binary=:all: --python-version 3.12 \
   --platform manylinux_2_28_x86_64 --target "$FI/site" "$W"/*.whl
# (what is used is recorded on the 3.11 install: the same flashinfer files, a tvm_ffi this Python loads)
FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE=$FI/build/ws-record \
  $PY "$HERE/record_used.py" "$BSITE" "$FI/build/used.txt"
$PY "$HERE/prune.py" "$FI/site" "$FI/build/used.txt"
for so in "$WS"/.cache/flashinfer/*/90a/cached_ops/*/*.so; do
  name=$(basename "$so" .so)
  mkdir -p "$FI/site/flashinfer/data/aot/$name"
  cp "$so" "$FI/site/flashinfer/data/aot/$name/"
done
# 4. Checks: the pruned tree imports and loads every module without compiling (3.11 copy with the
#    3.11 tvm_ffi core), and tvm_ffi's 3.12 core imports under Python 3.12.
cp -r "$FI/site" "$FI/build/test311"
rm -rf "$FI/build/test311/tvm_ffi" && cp -r "$BSITE/tvm_ffi" "$FI/build/test311/"
FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE=$FI/build/ws-check \
  $PY "$HERE/check_load.py" "$FI/build/test311"
PYTHONPATH=$FI/site $PY312 -c "import tvm_ffi, einops, requests, pynvml; print('python3.12: tvm_ffi', tvm_ffi.__version__)"
du -sh "$FI/site"
