# SPDX-License-Identifier: Apache-2.0
"""What a forced CPU path (TT_CPU_ISA, torch_backend/cpu_isa.py) lets each library that dispatches on the CPU use, so that the
process runs what a CPU with only that path runs: torch's own kernels, oneDNN (torch's bf16 matmuls and the brgemm
behind its CPU flash attention) and MKL (torch's float32 BLAS). Without the oneDNN cap, an AMX CPU forced to avx2 ends
in `pack_vnni2 is only supported when avx512 is supported` in scaled_dot_product_attention: torch's avx2 kernel
packs for the AMX that oneDNN still sees.

Imports no torch: the package's __init__ sets the caps before torch loads, as each library reads its variable once,
at its first dispatch; cpu_isa.caps_missed tells a process where they came too late.
"""
import os

# TT_CPU_ISA -> the variables, on x86-64. ATEN_CPU_CAPABILITY: torch's values (default, avx2, avx512; AVX512 is
# torch's highest, so avx512bf16 is capped there too). ONEDNN_MAX_CPU_ISA: oneDNN's CPU dispatcher control (SSE41 is
# its lowest; AVX512_CORE_BF16 is AVX-512 with BF16 and without FP16 or AMX: avx512bf16 stands for a Zen 4 or Cooper
# Lake). MKL_ENABLE_INSTRUCTIONS: oneMKL's (SSE4_2 its lowest, AVX512_E3 AVX-512 with DL Boost and bf16; MKL honours
# it on Intel CPUs only, and takes AVX2 paths on AMD's anyway).
X86_CAPS = {
    "avx512bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
# Elsewhere (aarch64: neon is every such CPU's path, nothing to cap) only portable caps torch's kernels.
OTHER_CAPS = {"portable": {"ATEN_CPU_CAPABILITY": "default"}}


def library_caps(path: str, machine: str) -> dict[str, str]:
    """The variables that cap the libraries for the path named `path` (a TT_CPU_ISA value) on `machine`."""
    return (X86_CAPS if machine == "x86_64" else OTHER_CAPS).get(path, {})


def cap_libraries(path: str, machine: str) -> None:
    """Set the caps for `path` in this process's environment (a value already set there wins: a deliberate one)."""
    for name, value in library_caps(path, machine).items():
        os.environ.setdefault(name, value)
