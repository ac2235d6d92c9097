# SPDX-License-Identifier: Apache-2.0
"""Which build of the CPU kernels (cpu_kernels.c) this CPU runs, and whether torch's oneDNN bf16 path may run.

Checked before anything is used: a CPU gets the fastest path its flags allow, or the one TT_CPU_ISA names (refused in
one line if this CPU cannot run it). A forced path makes the process behave as on a CPU that has only it: the
kernels are built for it alone, torch's oneDNN bf16 prepacking is off unless that CPU would have it, and, set before
torch loads (models/tt_transformers/__init__.py), its caps (../cpu_caps.py) hold torch's own kernels, oneDNN and MKL to
it alike; a process where they came too late is refused in one line.
"""
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from ..errors import UserError
from ..cpu_caps import library_caps

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
AVX2_FLAGS = ("avx2", "fma", "f16c")


@dataclass(frozen=True)
class CpuPath:
    """One build of cpu_kernels.c: the flags /proc/cpuinfo must list, what the compiler is told, and whether torch's
    oneDNN bf16 matmul runs on such a CPU (it needs AVX-512 BW/VL/DQ on x86-64, BF16 on aarch64)."""

    name: str  # the TT_CPU_ISA value
    machine: str  # platform.machine() it runs on ("": any)
    needs: tuple[str, ...]
    cc_flags: tuple[str, ...]
    describe: str
    onednn_bf16: bool


PATHS = (  # fastest first
    CpuPath("avx512bf16", "x86_64", AVX512_FLAGS + ("avx512_bf16",) + AVX2_FLAGS,
            ("-DTT_ISA_AVX512BF16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2",
             "-mfma", "-mf16c"), "AVX512-BF16 dot products", True),
    CpuPath("avx512", "x86_64", AVX512_FLAGS + AVX2_FLAGS,
            ("-DTT_ISA_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
            "AVX-512, bf16 widened to float", True),
    CpuPath("avx2", "x86_64", AVX2_FLAGS, ("-DTT_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"),
            "AVX2 + FMA, bf16 widened to float", False),
    CpuPath("neon", "aarch64", ("asimd",), ("-DTT_ISA_NEON",), "NEON, bf16 widened to float", True),
    CpuPath("portable", "", (), (), "portable C", False),
)
BY_NAME = {p.name: p for p in PATHS}


class CpuIsaError(UserError):
    """TT_CPU_ISA names a path this CPU cannot run, or none at all."""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them ("flags" on x86-64, "Features" on aarch64), less the
    vector extensions torch finds missing: torch asks the CPU itself (cpuid, through cpuinfo) and honours
    ATEN_CPU_CAPABILITY, so under an emulator that hides AVX-512, or with torch capped, the kernels follow."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.split(":")[0].strip() in
                      ("flags", "Features")), []))
    if platform.machine() == "x86_64":
        capability = torch.backends.cpu.get_cpu_capability()
        if not capability.startswith("AVX512"):
            flags -= {f for f in flags if f.startswith("avx512")}
        if capability == "DEFAULT":
            flags -= set(AVX2_FLAGS)
    return frozenset(flags)


def runnable_paths(flags: Optional[frozenset[str]] = None, machine: Optional[str] = None) -> list[CpuPath]:
    """Every path this CPU can run, fastest first (portable C always)."""
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine() if machine is None else machine
    return [p for p in PATHS if p.machine in ("", machine) and set(p.needs) <= flags]


def missing(path: CpuPath, flags: frozenset[str], machine: str) -> str:
    if path.machine not in ("", machine):
        return f"it is for {path.machine} and this is {machine}"
    return "this CPU lacks " + ", ".join(f for f in path.needs if f not in flags)


@lru_cache(maxsize=None)
def chosen_path(forced: Optional[str] = None) -> tuple[CpuPath, str]:
    """(path, why) for this process: TT_CPU_ISA (`forced`) if set, else the fastest this CPU runs."""
    flags, machine = cpu_flags(), platform.machine()
    runnable = runnable_paths(flags, machine)
    names = ", ".join(p.name for p in runnable)
    if forced:
        path = BY_NAME.get(forced)
        if path is None:
            raise CpuIsaError(f"TT_CPU_ISA={forced!r} is not one of {', '.join(BY_NAME)}; this CPU runs {names} "
                              "(unset TT_CPU_ISA for the fastest)")
        if path not in runnable:
            raise CpuIsaError(f"TT_CPU_ISA={forced}: {missing(path, flags, machine)}; this CPU runs {names} (unset "
                              "TT_CPU_ISA for the fastest)")
        missed = caps_missed(path, machine)
        if missed:
            caps = " ".join(f"{name}={value}" for name, value in library_caps(forced, machine).items())
            raise CpuIsaError(f"TT_CPU_ISA={forced} came after torch had chosen its kernels ({missed}): import "
                              f"models.tt_transformers before torch runs anything, or start Python with {caps}")
        return path, f"TT_CPU_ISA={forced}"
    faster = [p for p in PATHS[: PATHS.index(runnable[0])] if p.machine in ("", machine)]
    return runnable[0], "the fastest this CPU runs" + (f"; {faster[-1].name} needs " + ", ".join(
        f for f in faster[-1].needs if f not in flags) if faster else "")


def caps_missed(path: CpuPath, machine: str) -> str:
    """What in this process runs above `path`'s caps ("" when they hold): torch's kernels, read from torch, and oneDNN,
    from torch's check of what it runs (bf16 only at AVX-512 and up; FP16, which AMX or AVX512-FP16 bring, under
    none of the caps). A library reads its cap once, at its first dispatch, so a process that ran torch before this
    package loaded may have missed them; MKL cannot be asked."""
    caps = library_caps(path.name, machine)
    missed = []
    capability = torch.backends.cpu.get_cpu_capability()
    if "ATEN_CPU_CAPABILITY" in caps and capability != caps["ATEN_CPU_CAPABILITY"].upper():
        missed.append(f"torch runs {capability}, not {caps['ATEN_CPU_CAPABILITY'].upper()}")
    if "ONEDNN_MAX_CPU_ISA" in caps and torch.backends.mkldnn.is_available() and (
            torch.ops.mkldnn._is_mkldnn_fp16_supported()
            or (not path.onednn_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        missed.append(f"oneDNN runs above {caps['ONEDNN_MAX_CPU_ISA']}")
    return "; ".join(missed)


def this_process_path() -> tuple[CpuPath, str]:
    return chosen_path(os.environ.get("TT_CPU_ISA") or None)


def this_process_paths() -> list[CpuPath]:
    """The paths this process may run: the chosen one and the slower ones this CPU runs (a CPU with only the forced
    path could run those too)."""
    chosen = this_process_path()[0]
    return [p for p in runnable_paths() if PATHS.index(p) >= PATHS.index(chosen)]


def check_cpu_isa() -> None:
    """Raise CpuIsaError, one line, if TT_CPU_ISA is set to a path this CPU cannot run (before any model loads)."""
    this_process_path()


def onednn_bf16_prepacking() -> bool:
    """Whether torch's oneDNN bf16 matmul (and its weight prepacking) may run: torch's own check of the CPU, and the
    path in force would have it (TT_CPU_ISA=avx2 or portable turns it off, as on such a CPU)."""
    return (this_process_path()[0].onednn_bf16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_bf16_dot_products() -> bool:
    """Whether torch's oneDNN multiplies bf16 with bf16 dot products (AVX512-BF16 or AMX under the avx512bf16 path,
    BF16 on aarch64) rather than widening it to float, where the kernels' own linear layer is the faster at a prompt's
    many rows (4,000 rows of the embedded model's MLP on one Zen 4 core under TT_CPU_ISA=avx512: 383 ms through
    oneDNN, 125 ms on the kernels; under avx512bf16 the two are level)."""
    return onednn_bf16_prepacking() and this_process_path()[0].name in ("avx512bf16", "neon")
