#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The venv `make tt-mock` and `make check-ttnn-api` run in: the real ttnn 0.81.1 wheel (cp310/cp312 only) with numpy<2
# and torch (ttnn.from_torch needs it; PyPI's build for these Pythons is the CUDA one, ~5 GB, run on the CPU), plus
# what tt-metal's Mock Device needs to open a device here: Debian's RISC-V binutils and our fake SFPI compiler
# (fake_sfpi_gxx.py) where tt-metal's JIT build looks for it. Idempotent; prints "tt-mock: skipped: <reason>" and exits 3 when
# this machine cannot have it (no Python 3.12/3.10, no binutils and no apt-get).
set -euo pipefail
VENV=${1:?usage: setup.sh VENV}
HERE=$(cd "$(dirname "$0")" && pwd)

find_python() {
  for py in ${PYTHON_TT:-} python3.12 python3.10; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; assert sys.version_info[:2] in ((3, 12), (3, 10))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  # pyenv installs that its shims do not put on PATH
  for py in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.1{2,0}*/bin/python3.1[20]; do
    [ -x "$py" ] && { echo "$py"; return 0; }
  done
  return 1
}

if ! command -v riscv64-unknown-elf-ld >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "tt-mock: skipped: tt-metal's mock device needs riscv64-unknown-elf binutils (Debian: binutils-riscv64-unknown-elf) and this machine has no apt-get"
    exit 3
  fi
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq binutils-riscv64-unknown-elf) >/dev/null
fi

if [ ! -f "$VENV/.installed" ]; then
  PY=$(find_python) || { echo "tt-mock: skipped: ttnn 0.81.1 ships cp310/cp312 wheels only and no Python 3.12 or 3.10 is on this machine (set PYTHON_TT)"; exit 3; }
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "ttnn==0.81.1" "numpy<2" "torch==2.13.0" safetensors
  touch "$VENV/.installed"
fi

# TT-Transformers' own Python dependencies, for the cases over tt-metal's real TT-Transformers (real_tree.py): tt-metal's
# pins at 622c6fb9 (tt_metal/python_env/requirements-dev.txt; model_config.py imports pytest)
if [ ! -f "$VENV/.installed-tt-transformers" ]; then
  "$VENV/bin/python" -m pip install -q "pydantic==2.9.2" "tqdm==4.66.3" "pytest" "transformers==5.10.2"
  touch "$VENV/.installed-tt-transformers"
fi

# tt-metal's JIT build looks for the SFPI toolchain in the wheel's runtime folder
BIN=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ttnn/runtime/sfpi/compiler/bin
mkdir -p "$BIN"
ln -sf "$HERE/fake_sfpi_gxx.py" "$BIN/riscv-tt-elf-g++"
ln -sf "$HERE/fake_sfpi_gxx.py" "$BIN/riscv32-tt-elf-g++"
for tool in nm objcopy objdump readelf size strip; do
  printf '#!/bin/sh\nexec riscv64-unknown-elf-%s "$@"\n' "$tool" > "$BIN/riscv-tt-elf-$tool"
  chmod +x "$BIN/riscv-tt-elf-$tool"
done
