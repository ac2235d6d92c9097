#!/usr/bin/env bash
# What tests/test_cpu_kernels_aarch64.py and the emulated-CPU tests need: Debian's aarch64 cross compiler and
# qemu-user (qemu-aarch64, qemu-x86_64). Installed with apt-get where this machine allows it (root, or sudo without a
# password); otherwise those tests are skipped with the reason. Always exits 0: the suite decides what to skip.
set -u
have() { command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null && command -v qemu-x86_64 >/dev/null; }
have && exit 0
if ! command -v apt-get >/dev/null; then
  echo "tests/cross/setup.sh: no apt-get here: the aarch64 and emulated-CPU tests will be skipped"; exit 0
fi
if [ "$(id -u)" -eq 0 ]; then as_root=(); elif sudo -n true 2>/dev/null; then as_root=(sudo -n); else
  echo "tests/cross/setup.sh: not root (and no password-less sudo): the aarch64 and emulated-CPU tests will be skipped"
  exit 0
fi
packages=(gcc-aarch64-linux-gnu qemu-user)
echo "tests/cross/setup.sh: installing ${packages[*]} (the aarch64 kernels' tests)"
if ! "${as_root[@]}" apt-get install -y -q "${packages[@]}" >/tmp/tt-cross-apt.log 2>&1; then
  "${as_root[@]}" apt-get update -q >>/tmp/tt-cross-apt.log 2>&1
  "${as_root[@]}" apt-get install -y -q "${packages[@]}" >>/tmp/tt-cross-apt.log 2>&1 ||
    echo "tests/cross/setup.sh: apt-get could not install ${packages[*]} (/tmp/tt-cross-apt.log): those tests will be skipped"
fi
exit 0
