#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the SFPI compiler (riscv-tt-elf-g++) so that tt-metal's Mock Device opens on a machine without it.

Opening a device, mock or not, JIT-builds the firmware and every kernel with the SFPI toolchain, which the ttnn wheel
does not ship (ttnn/download_sfpi.py fetches it from GitHub, which this machine cannot reach). On the Mock Device no
kernel ever runs, so any well-formed rv32 ELF will do:
- `--version`: an SFPI-like version string (tt-metal parses it);
- `-x c++-header ... -o X.gch`: an empty file;
- `-c ... -o X.o [-MF X.d]`: a tiny rv32 object with a weak `main` (firmware, -DFW_BUILD) or `kernel_main`, doing a
  lui/addi pair against a weak .data word so the ELF carries a relocation section (tt-metal's XIP pass needs one);
- otherwise a link: the real `riscv64-unknown-elf-ld -m elf32lriscv` (Debian's binutils-riscv64-unknown-elf) with the
  linker script, the `-Wl,` options (--just-symbols=<firmware>, --emit-relocs, ...) and objects; undefined symbols
  ignored. An empty output fails later ("cannot map elf file").
Follows the reference set-up in shared/tools/ttnn-mock/setup.sh (measured there on this kind of machine).
"""
import os
import subprocess
import sys
import tempfile

AS, LD = "riscv64-unknown-elf-as", "riscv64-unknown-elf-ld"


def compile_stub(args: list[str], out: str, depfile) -> int:
    sym = "main" if "-DFW_BUILD" in args else "kernel_main"  # firmware's crt0 calls main
    data = f"__fake_data_{os.getpid()}"
    asm = (f"  .section .text\n  .weak {sym}\n  .type {sym}, @function\n{sym}:\n  .option push\n  .option norelax\n"
           f"  lui a0, %hi({data})\n  addi a0, a0, %lo({data})\n  .option pop\n  ret\n"
           f"  .section .data\n  .weak {data}\n{data}:\n  .word 0\n  .section .bss\n  .word 0\n")
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write(asm)
    try:
        done = subprocess.run([AS, "-march=rv32im", "-mabi=ilp32", "-o", out, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if done.returncode:
        sys.stderr.write(done.stderr)
        return 1
    if depfile:
        sources = [a for a in args if not a.startswith("-") and a.endswith((".cc", ".cpp", ".c", ".S"))]
        with open(depfile, "w") as f:
            f.write(f"{out}: {' '.join(sources)}\n")
    return 0


def link(args: list[str], out: str) -> int:
    script, objects, options = None, [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-o" or a == "-MF":
            i += 2
            continue
        if a.startswith("-T"):
            script = a[2:] or args[i + 1]
            i += 1 if len(a) > 2 else 2
            continue
        if a.startswith("-Wl,"):
            options += [w for w in a[4:].split(",") if w]
        elif a == "-Xlinker":
            options.append(args[i + 1].strip('"'))
            i += 1
        elif a.startswith("-L"):
            options.append(a if len(a) > 2 else "-L" + args[i + 1])
            i += 0 if len(a) > 2 else 1
        elif not a.startswith("-") and a.endswith((".o", ".elf", ".a")):
            objects.append(a)
        i += 1
    cmd = [LD, "-m", "elf32lriscv", "--unresolved-symbols=ignore-all", *options]
    cmd += ["-T", script] if script else []
    done = subprocess.run(cmd + objects + ["-o", out], capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr)
    return done.returncode


def main(args: list[str]) -> int:
    if "--version" in args:
        print("riscv-tt-elf-g++ (tenstorrent/sfpi:7.9.0) 15.1.0")
        return 0
    out = args[args.index("-o") + 1] if "-o" in args else None
    if out is None:
        return 0
    if "c++-header" in args:
        open(out, "wb").close()
        return 0
    if "-c" in args:
        return compile_stub(args, out, args[args.index("-MF") + 1] if "-MF" in args else None)
    return link(args, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
