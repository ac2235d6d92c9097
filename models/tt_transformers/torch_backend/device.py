# SPDX-License-Identifier: Apache-2.0
"""Which torch device runs a model fastest: `--device auto` estimates decode time on each and picks the lower.

Decoding one token streams every weight once, so on a CPU it costs about weight bytes / the rate this backend
streams them. Our eager CUDA path is launch-bound instead: each layer is a few dozen small kernel launches, so it
costs about a fixed time per layer until the weights are large enough for bandwidth to matter. The rates are
measured figures (README, "Measured results"; the CUDA ones on an H100, ../shared/notes/environment.md):
SmolLM2-135M in bf16 ran at 10.7 ms/token on the CPU kernels (269 MB), 28.6 ms on torch ops, 104 ms in float32 on
the 2-core CI machine, and 27 ms/token on an H100 (30 layers), where a Llama-3.1-8B shape took 34 ms (32 layers).
"""
from dataclasses import dataclass

import torch

from ..checkpoints.model_shape import ModelShape
from ..errors import UserError

CPU_GB_S = {"kernels": 25.0, "torch_bf16": 9.4, "torch_fp32": 5.2}  # weight bytes streamed per second, 2-core CPU
CUDA_MS_PER_LAYER = 0.9  # eager, launch-bound: 27 ms / 30 layers and 34 ms / 32 layers (H100)
CUDA_GB_S = 2000.0  # effective HBM rate once the weights dominate
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceChoice:
    device: str
    reason: str


def estimated_ms_per_token(device: str, args: ModelShape, dtype: torch.dtype, cpu_kernels: bool) -> float:
    weight_bytes = args.weight_bytes_per_token(args.n_layers, dtype.itemsize)
    if device == "cuda":
        return max(CUDA_MS_PER_LAYER * args.n_layers, weight_bytes / CUDA_GB_S / 1e6)
    rate = CPU_GB_S["kernels" if cpu_kernels else "torch_bf16" if dtype == torch.bfloat16 else "torch_fp32"]
    return weight_bytes / rate / 1e6


def choose_device(requested: str, args: ModelShape, dtype: torch.dtype, cpu_kernels: bool,
                  cuda_available: bool) -> DeviceChoice:
    """`requested` is --device; cpu_kernels: whether the bf16 CPU kernels would run this model here."""
    if requested not in DEVICES:
        raise UserError(f"--device {requested!r} is not one of {', '.join(DEVICES)}")
    if requested == "cuda" and not cuda_available:
        raise UserError(f"--device cuda: torch {torch.__version__} sees no CUDA device here; use --device cpu "
                         "(or auto)")
    if requested != "auto":
        return DeviceChoice(requested, "--device " + requested)
    cpu_ms = estimated_ms_per_token("cpu", args, dtype, cpu_kernels)
    cpu_path = "the bf16 CPU kernels" if cpu_kernels else "torch ops"
    if not cuda_available:
        return DeviceChoice("cpu", f"no CUDA device; about {cpu_ms:.0f} ms/token on {cpu_path}")
    cuda_ms = estimated_ms_per_token("cuda", args, dtype, cpu_kernels)
    device = "cuda" if cuda_ms < cpu_ms else "cpu"
    return DeviceChoice(device, f"estimated {cpu_ms:.1f} ms/token on CPU ({cpu_path}) vs {cuda_ms:.1f} ms/token on "
                                f"CUDA (eager decoding is launch-bound at ~{CUDA_MS_PER_LAYER} ms per layer)")
