# SPDX-License-Identifier: Apache-2.0
"""Which CPU path runs (cpu_isa.py): chosen from the CPU's flags, forced with TT_CPU_ISA (one clear line where this CPU
cannot run it), and a forced path behaving as such a CPU would: no oneDNN bf16 prepacking where that CPU lacks it."""
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from models.tt_transformers.torch_backend import cpu_isa
from models.tt_transformers.torch_backend.cpu_isa import CpuIsaError, chosen_path, runnable_paths

from ..conftest import REPO_ROOT

# /proc/cpuinfo flags of the CPU families the issue names (trimmed to what the paths read)
ZEN3 = frozenset("sse4_2 avx f16c fma avx2 bmi2".split())  # AMD EPYC Zen 3: AVX2, no AVX-512
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # AVX-512 without BF16
ZEN4 = SKYLAKE_X | {"avx512_bf16", "avx512_vnni"}
SANDY_BRIDGE = frozenset("sse4_2 avx".split())  # AVX, no AVX2 / FMA
GRAVITON3 = frozenset("fp asimd aes sha2 crc32 atomics asimddp sve bf16".split())


def names(paths):
    return [p.name for p in paths]


@pytest.mark.parametrize("flags,machine,expected", [
    (ZEN4, "x86_64", ["avx512bf16", "avx512", "avx2", "portable"]),
    (SKYLAKE_X, "x86_64", ["avx512", "avx2", "portable"]),
    (ZEN3, "x86_64", ["avx2", "portable"]),
    (SANDY_BRIDGE, "x86_64", ["portable"]),
    (GRAVITON3, "aarch64", ["neon", "portable"]),
    (frozenset(), "riscv64", ["portable"]),
])
def test_each_cpu_family_gets_its_paths(flags, machine, expected):
    assert names(runnable_paths(flags, machine)) == expected


def test_the_fastest_path_runs_and_the_line_says_why(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ZEN3)
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    path, why = chosen_path.__wrapped__(None)
    assert path.name == "avx2"
    assert why == "the fastest this CPU runs; avx512 needs avx512f, avx512bw, avx512vl, avx512dq"


@pytest.mark.parametrize("forced,message", [
    ("neon", "TT_CPU_ISA=neon: it is for aarch64 and this is x86_64; this CPU runs avx2, portable"),
    ("avx512", "TT_CPU_ISA=avx512: this CPU lacks avx512f, avx512bw, avx512vl, avx512dq; this CPU runs avx2, portable"),
    ("AVX2", "TT_CPU_ISA='AVX2' is not one of avx512bf16, avx512, avx2, neon, portable"),
])
def test_a_path_this_cpu_cannot_run_is_one_clear_line(monkeypatch, forced, message):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ZEN3)
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    with pytest.raises(CpuIsaError) as error:
        chosen_path.__wrapped__(forced)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_torch_saying_no_bf16_turns_off_onednn_prepacking(monkeypatch):
    """On an AVX2-only CPU torch's bf16 prepacking raises (`mkldnn_reorder_linear_weight: bf16 path needs the cpu
    support avx_ne_convert or avx512bw, avx512vl and avx512dq`): where torch's own check says no, loading a model on
    torch ops uses plain linears (a forced path's half: test_tt_cpu_isa_caps_torch_onednn_and_the_kernels_alike)."""
    from models.tt_transformers.torch_backend.model import PackedLinear, can_prepack

    from ..conftest import random_model

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not can_prepack(torch.bfloat16, "cpu")
    model = random_model(torch.bfloat16)
    if can_prepack(torch.bfloat16, "cpu"):
        model.prepack_linears()
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


FORCED = """
import models.tt_transformers.torch_backend.cpu_isa as c, torch
from models.tt_transformers.torch_backend.model import can_prepack
torch.randn(8, 64).to_mkldnn()  # one oneDNN primitive: ONEDNN_VERBOSE names the ISA oneDNN dispatches to
print("paths", torch.backends.cpu.get_cpu_capability(), [p.name for p in c.this_process_paths()],
      can_prepack(torch.bfloat16, "cpu"), torch.ops.mkldnn._is_mkldnn_bf16_supported())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 only: the caps are x86's (cpu_caps.X86_CAPS)")
@pytest.mark.parametrize("forced,capability,paths,onednn_isa", [
    ("avx2", "AVX2", ["avx2", "portable"], "isa:Intel AVX2"),
    ("portable", "DEFAULT", ["portable"], "isa:Intel SSE4.1"),
])
def test_tt_cpu_isa_caps_torch_onednn_and_the_kernels_alike(forced, capability, paths, onednn_isa):
    """A process started with TT_CPU_ISA runs what such a CPU runs, on every CPU that can run the path: torch's own
    kernels (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA: on an AMX CPU, torch's flash attention otherwise packs
    for AMX from an avx2 kernel and raises), no oneDNN bf16 nor its prepacking, and the paths this process offers."""
    if forced not in names(runnable_paths()):
        pytest.skip(f"this CPU cannot run {forced}")
    out = subprocess.run([sys.executable, "-c", FORCED], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "TT_CPU_ISA": forced, "ONEDNN_VERBOSE": "1"}).stdout
    (isa,) = [line for line in out.splitlines() if ",info,cpu,isa:" in line]
    assert isa.endswith(onednn_isa)
    (line,) = [line for line in out.splitlines() if line.startswith("paths ")]
    assert line == f"paths {capability} {paths} False False"


LATE = """
import torch
torch.ones(2) + 1  # torch reads its capability here, before the package has capped it
capability = torch.backends.cpu.get_cpu_capability()
from models.tt_transformers.torch_backend.cpu_isa import CpuIsaError, check_cpu_isa
try:
    check_cpu_isa()
    print(capability, "ran")
except CpuIsaError as e:
    print(capability, e)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 only: the caps are x86's (cpu_caps.X86_CAPS)")
def test_caps_that_came_too_late_refuse_the_forced_path_in_one_line():
    """torch run before the package loads has read its capability: the forced path is refused in one line naming the
    fix, unless torch runs that path's kernels anyway (an AVX2-only CPU)."""
    if "avx2" not in names(runnable_paths()):
        pytest.skip("this CPU cannot run avx2")
    out = subprocess.run([sys.executable, "-c", LATE], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "TT_CPU_ISA": "avx2"}).stdout.strip()
    capability, said = out.split(" ", 1)
    assert said == "ran" if capability == "AVX2" else said == (
        f"TT_CPU_ISA=avx2 came after torch had chosen its kernels (torch runs {capability}, not AVX2): import "
        "models.tt_transformers before torch runs anything, or start Python with ATEN_CPU_CAPABILITY=avx2 "
        "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2")


EMULATED_AVX2_CPU = """
import sys, numpy as np, torch
from models.tt_transformers.torch_backend import cpu_isa
from models.tt_transformers.checkpoints.cache import cache_root
from models.tt_transformers.torch_backend.cpu_kernels import load_cpu_kernels
from models.tt_transformers.torch_backend.model import can_prepack
kernels = load_cpu_kernels(cache_root() / "kernels")
torch.manual_seed(0)
w, x = torch.randn(200, 576, dtype=torch.bfloat16), torch.randn(5, 576, dtype=torch.bfloat16)
np.save(sys.argv[1], kernels.linear(x, kernels.pack_weight(w), 200, torch.float32).numpy())
w, x = torch.randn(960, 576, dtype=torch.bfloat16), torch.randn(17, 576, dtype=torch.bfloat16)
alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(17)])  # torch ops' bf16 matmul here
rows_invariant = all(torch.equal(torch.nn.functional.linear(x[:m], w), alone[:m]) for m in (2, 5, 17))
print(torch.backends.cpu.get_cpu_capability(), kernels.path.name, can_prepack(torch.bfloat16, "cpu"), rows_invariant)
"""


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("qemu-x86_64"),
                    reason="needs an x86-64 machine with qemu-user (qemu-x86_64; make test installs it where it can)")
def test_an_avx2_only_cpu_emulated_by_qemu(tmp_path):
    """This process as it runs on an AVX2-only CPU (qemu-x86_64 -cpu Haswell: cpuid says AVX2, FMA, F16C and no
    AVX-512): torch sees AVX2 and no oneDNN bf16, the package picks the avx2 kernels by itself (no TT_CPU_ISA), keeps
    oneDNN prepacking off, and the kernels run there (no AVX-512 instruction in them: qemu would stop at one) to the
    same float32 outputs as the avx2 kernels here; torch's own bf16 matmul there (the torch-ops fallback, without
    oneDNN) gives each row the result it gives that row alone."""
    from ..conftest import kernels_of

    kernels_of("avx2")  # built natively (the compiler qemu's Python calls runs natively too)
    out = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", EMULATED_AVX2_CPU,
                          str(tmp_path / "y.npy")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["AVX2", "avx2", "False", "True"]
    kernels = kernels_of("avx2")
    torch.manual_seed(0)
    w, x = torch.randn(200, 576, dtype=torch.bfloat16), torch.randn(5, 576, dtype=torch.bfloat16)
    import numpy as np
    assert np.array_equal(np.load(tmp_path / "y.npy"), kernels.linear(x, kernels.pack_weight(w), 200, torch.float32).numpy())
