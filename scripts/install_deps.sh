#!/usr/bin/env bash
# Installs what tandem builds with, from Debian 12 packages (README, "Dependencies").
# Skips apt-get when everything is already installed. Uses sudo when not run as root.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config python3 git clang-format
      libabsl-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libspdlog-dev
      libgtest-dev libgmock-dev libopenblas-dev libucx-dev libibverbs-dev
      libcpp-httplib-dev python3-venv)
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

# Test tools from PyPI, in a virtual environment of the project's own (.cache/, ignored by git):
# the openai client, which tests/server/openai_test.py drives `tandem serve` with.
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.cache/venv"
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  echo "install_deps: making $venv with the openai client"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "openai==3.57.0"
fi
