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


def test_a_forced_path_turns_off_onednn_prepacking_as_such_a_cpu_would(monkeypatch):
    """On an AVX2-only CPU torch's bf16 prepacking raises (`mkldnn_reorder_linear_weight: bf16 path needs the cpu
    support avx_ne_convert or avx512bw, avx512vl and avx512dq`); TT_CPU_ISA=avx2 and portable make this process take the
    same decision, and loading a model on torch ops then uses plain linears."""
    from models.tt_transformers.torch_backend.model import PackedLinear, can_prepack

    from ..conftest import random_model

    for forced in [p.name for p in cpu_isa.this_process_paths() if not p.onednn_bf16]:
        monkeypatch.setenv("TT_CPU_ISA", forced)
        assert not can_prepack(torch.bfloat16, "cpu"), forced
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # torch's own check says no
    monkeypatch.delenv("TT_CPU_ISA")
    assert not can_prepack(torch.bfloat16, "cpu")
    model = random_model(torch.bfloat16)
    if can_prepack(torch.bfloat16, "cpu"):
        model.prepack_linears()
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 only: ATEN_CPU_CAPABILITY caps torch's x86 kernels")
def test_tt_cpu_isa_caps_torch_and_the_kernels_alike():
    """Set before torch loads, TT_CPU_ISA=avx2 also caps torch's own kernels (ATEN_CPU_CAPABILITY) and the paths this
    process offers; TT_CPU_ISA=portable takes torch to its default kernels."""
    code = ("import models.tt_transformers.torch_backend.cpu_isa as c, torch; "
            "print(torch.backends.cpu.get_cpu_capability(), [p.name for p in c.this_process_paths()])")
    runnable = names(runnable_paths())
    for forced, capability, paths in (("avx2", "AVX2", ["avx2", "portable"]), ("portable", "DEFAULT", ["portable"])):
        if forced not in runnable:
            continue
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                             env={"PATH": "/usr/bin:/bin", "TT_CPU_ISA": forced}).stdout.split(None, 1)
        assert out[0] == capability and eval(out[1]) == paths, forced


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
