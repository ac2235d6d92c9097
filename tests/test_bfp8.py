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
