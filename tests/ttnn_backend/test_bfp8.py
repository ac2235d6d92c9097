# SPDX-License-Identifier: Apache-2.0
"""ttnn_backend/bfp8.py, the host reference of how a Tenstorrent device stores bfloat8_b (checked value for value
against ttnn 0.81.1's own conversion by `make tt-mock`): the values that conversion gave there."""
import torch

from models.tt_transformers.ttnn_backend.bfp8 import bfp8_round


def test_blocks_of_16_share_an_exponent_and_round_half_to_even():
    x = torch.zeros(32, 32)
    x[:, 0] = 64.0  # the block's exponent 6: a step of 1
    x[:, 1:16] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, 127.5, -127.5, 0.25, 0.75, 5.5, 6.5, 7.5])
    x[:, 16:] = 0.001  # the next block of the row: its own exponent
    # what ttnn 0.81.1's from_torch(..., bfloat8_b, TILE_LAYOUT) then to_torch gave for the first block (mock device)
    assert bfp8_round(x)[0, :16].tolist() == [64.0, 0.0, 2.0, 2.0, 0.0, -2.0, -2.0, 4.0, 126.0, 127.0, -127.0, 0.0,
                                              1.0, 6.0, 6.0, 8.0]
    assert torch.allclose(bfp8_round(x)[:, 16:], x[:, 16:], rtol=2 ** -7)


def test_shapes_and_zeros():
    x = torch.randn(3, 50, 70)
    y = bfp8_round(x)
    assert y.shape == x.shape and torch.equal(bfp8_round(torch.zeros(5, 40)), torch.zeros(5, 40))
    assert ((y - x).abs() <= x.abs().amax() * 2 ** -6).all()
    assert torch.equal(bfp8_round(y), y)  # stored values store as they are


def golden_fidelity_matmul(x: torch.Tensor, w: torch.Tensor, phases: int) -> torch.Tensor:
    """tt-llk's golden model of a Wormhole matmul's math fidelity (tests/python_tests/helpers/golden_generators.py,
    FidelityMasking): each operand's bf16 value as an 11-bit mantissa (the hidden bit, bf16's 7, 3 zeros) and its
    exponent; phase i multiplies the weight (srcA) and the activation (srcB) masked with its pair of masks; LoFi runs
    phase 0, HiFi2 phases 0-1, HiFi4 all four. Computed in float64 (exact for these products and sums)."""
    masks = [(0b11111000000, 0b11111110000), (0b00000111110, 0b11111110000), (0b11111000000, 0b00000001111),
             (0b00000111110, 0b00000001111)]  # (srcA, srcB)

    def part(t, mask):
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        exponent = (bits >> 7) & 0xFF
        value = ((((bits & 0x7F) << 3) | 0x400) & mask).double() / 1024 * torch.pow(2.0, exponent.double() - 127)
        value = torch.where(exponent == 0, 0.0, value)
        return torch.where(bits >> 15 == 1, -value, value)
    return sum(part(x, b) @ part(w, a) for a, b in masks[:phases])


def test_hifi2_is_the_activation_less_its_last_mantissa_bit():
    """tools/head_precision.py models HiFi2 as the activation with its last bf16 mantissa bit dropped times the whole
    weight: the golden model's first two phases, exactly (and HiFi4's four phases the exact product)."""
    import sys

    from ..conftest import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from head_precision import hifi2_activation

    torch.manual_seed(0)
    x = (torch.randn(8, 64) * torch.logspace(-3, 3, 64)).to(torch.bfloat16)
    w = bfp8_round(torch.randn(64, 16)).to(torch.bfloat16)  # a weight as the device stores it
    exact = x.double() @ w.double()
    assert torch.equal(golden_fidelity_matmul(x, w, 4), exact)
    hifi2 = golden_fidelity_matmul(x, w, 2)
    assert torch.equal(hifi2, hifi2_activation(x).double() @ w.double()) and not torch.equal(hifi2, exact)


def test_the_head_cache_rounds_as_the_devices_bfloat8_b_cache_tiles():
    """tools/head_precision.py rounds a host head's KV cache at each write (Bfp8Cache): each [kv heads, head_dim] row
    block of the written rows alone. The device's cache is [blocks, kv heads, 32 positions, head_dim] in tiles, each
    16-value row of a face (one position of one head) sharing an exponent: rounding the same values laid out as the
    device holds them gives the same cache, whatever else the tile holds."""
    import sys

    from ..conftest import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from head_precision import Bfp8Cache

    torch.manual_seed(0)
    users, heads, slots, head_dim = 1, 3, 40, 64
    k = (torch.randn(1, 7, heads, head_dim) * torch.logspace(-3, 2, head_dim)).to(torch.bfloat16)
    cache = torch.Tensor._make_subclass(Bfp8Cache, torch.zeros(users, heads, slots, head_dim, dtype=torch.bfloat16))
    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    cache[torch.tensor([[0]]), :, positions] = k
    device = torch.zeros(heads, slots, head_dim)  # one block of the device's layout, the rows at their positions
    device[:, 3:10] = k[0].transpose(0, 1).float()
    device[:, 20] = 1e4  # another position's values in the same tile: no effect on these rows
    assert torch.equal(cache[0, :, 3:10].float(), bfp8_round(device)[:, 3:10])
    assert not torch.equal(cache[0, :, 3:10], k[0].transpose(0, 1))  # rounded, not stored as written
    assert type(cache[0]) is torch.Tensor  # reads are plain tensors
