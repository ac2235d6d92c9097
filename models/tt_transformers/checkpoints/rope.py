# SPDX-License-Identifier: Apache-2.0
"""Rotary position embeddings' tables (Hugging Face rotate-half layout), with linear and Llama-3 frequency scaling
(applying them: torch_backend/attention.py apply_rope)."""
import math

import torch

from .model_shape import ModelShape


def rope_inv_freq(args: ModelShape) -> torch.Tensor:
    """Per-pair inverse frequencies, computed exactly as transformers does so float32 logits match."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # Llama 3: scale low frequencies by `factor`, keep high ones, interpolate in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args: ModelShape, n_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n_positions, head_dim], computed in float32 and cast once."""
    freqs = torch.outer(torch.arange(n_positions, dtype=torch.float32), rope_inv_freq(args))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


