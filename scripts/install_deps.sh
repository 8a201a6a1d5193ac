#!/usr/bin/env bash
# Installs what tandem builds with, from Debian 12 packages (README, "Dependencies").
# Skips apt-get when everything is already installed. Uses sudo when not run as root.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config python3 git clang-format
      libabsl-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libspdlog-dev
      libgtest-dev libgmock-dev libopenblas-dev libucx-dev libibverbs-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#pkgs[@]} packages present"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
