# SPDX-License-Identifier: Apache-2.0
"""bf16 CPU kernels (cpu_kernels.c) for the steps that decide decode speed: linear layers and the attention of
packed decode/verification steps.

They run where torch's own ops fall short on a small CPU: oneDNN streams bf16 weights at about half the
memory bandwidth for a few rows, and attention in a verification step takes one SDPA call per token. The kernels
stream the weights once per step at close to bandwidth, attend every token of a step in one call, and keep
each output's accumulation order independent of how many tokens share a step, so verification stays bit-exact.

Built with the system C compiler (`CC`, default `cc`) for this CPU on first use and cached under TT_CACHE_PATH;
they need x86-64 with AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids, AMD Zen 4 and later). Elsewhere, or
with TT_CPU_KERNELS=0, the model runs on torch ops.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

SOURCE = Path(__file__).with_name("cpu_kernels.c")
BLOCK = 16  # output rows per packed weight block (cpu_kernels.c)


class CpuKernels:
    """The loaded library; tensors go in as data pointers, so every argument must be contiguous."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.linear_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        lib.decoder_layer.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float] + [ptr] * 11 + [i64]
        self.lib = lib

    @staticmethod
    def pack_weight(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> blocks of 16 output rows with k pairs interleaved (the layout of cpu_kernels.c)."""
        n, k = weight.shape
        padded = torch.zeros(-(-n // BLOCK) * BLOCK, k, dtype=torch.bfloat16)
        padded[:n] = weight.detach()
        return padded.view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n_out: int, out_dtype: torch.dtype) -> torch.Tensor:
        """x [..., K] bf16 -> [..., n_out] in out_dtype (bf16 or float32)."""
        x = x.contiguous()
        y = torch.empty(*x.shape[:-1], n_out, dtype=out_dtype)
        self.lib.linear_bf16(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                             n_out, int(out_dtype == torch.float32))
        return y

    def decoder_layer(self, x: torch.Tensor, layer_args: tuple, step_table: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One TransformerBlock over a packed step x [1, n, dim]: returns the new residual stream.

        layer_args: (dim, hidden, heads, kv heads, head dim, eps, weight pointers...) from
        Transformer.use_cpu_kernels; step_table [n, 3] int64: each token's cache row, slot and first visible key.
        """
        x = x.clone()
        self.lib.decoder_layer(x.data_ptr(), x.shape[1], *layer_args, step_table.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2])
        return x


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def load_cpu_kernels(build_dir: Path) -> Optional[CpuKernels]:
    """Build (first time on this CPU and compiler) and load the kernels; None where they cannot run."""
    if os.environ.get("TT_CPU_KERNELS", "1") == "0":
        return None
    flags = _cpu_flags()
    cc = os.environ.get("CC", "cc")
    if platform.machine() != "x86_64" or " avx512_bf16" not in flags or not shutil.which(cc):
        logger.info("bf16 CPU kernels need x86-64 with AVX512-BF16 and a C compiler; using torch ops")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + flags.encode()).hexdigest()[:16]
    path = build_dir / f"cpu_kernels-{key}.so"
    if not path.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(tmp), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            logger.warning(f"building the bf16 CPU kernels failed ({' '.join(cmd)}): {result.stderr.strip()}; "
                           "using torch ops")
            return None
        tmp.replace(path)  # atomic: a concurrent or interrupted build never leaves a half-written library
    # Loaded after torch, the library's libgomp.so.1 is torch's own, so both share one OpenMP thread pool.
    return CpuKernels(ctypes.CDLL(str(path)))
