# SPDX-License-Identifier: Apache-2.0
"""How a Tenstorrent device stores a bfloat8_b tensor, on the host in torch: for checks of what the device computes
(the stand-in's weights, the device head's agreement with the host head), not used on a device.

bfloat8_b is a block format: within each 32 x 32 tile, each 16-value row of a 16 x 16 face shares one 8-bit exponent
(that of its largest magnitude) and keeps a sign and 7 bits of mantissa with the hidden bit explicit, so every value
becomes a multiple of 2^(e - 6), rounded to nearest with ties to even and clamped to 127 steps. `bfp8_round` is the
Python reference of that conversion, checked value for value against ttnn 0.81.1's own host conversion
(`ttnn.from_torch(x, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT)` then `ttnn.to_torch`) by `make tt-mock`.
"""
import torch

TILE = 32
FACE = 16


def bfp8_round(x: torch.Tensor) -> torch.Tensor:
    """x's values as bfloat8_b stores them (float32, x's shape); the last two dims are tiled (padded with zeros to
    whole tiles, which changes no block's exponent)."""
    *lead, rows, cols = x.shape
    padded_rows, padded_cols = -(-rows // TILE) * TILE, -(-cols // TILE) * TILE
    t = torch.nn.functional.pad(x.float(), (0, padded_cols - cols, 0, padded_rows - rows))
    t = t.reshape(-1, padded_rows // TILE, TILE, padded_cols // TILE, 2, FACE)  # [.., tile row, row, tile col, face, 16]
    largest = t.abs().amax(dim=-1, keepdim=True)
    step = torch.pow(2.0, torch.floor(torch.log2(largest.clamp(min=torch.finfo(torch.float32).tiny))) - 6)
    q = torch.where(largest > 0, torch.round(t / step).clamp(-127, 127) * step, torch.zeros_like(t))
    return q.reshape(*lead, padded_rows, padded_cols)[..., :rows, :cols]
