# SPDX-License-Identifier: Apache-2.0
"""The kernel property lossless bf16 verification rests on (see TorchCausalLM._forward).

If a torch upgrade breaks it, this fails before any speculative output silently drifts from plain decoding.
"""
import torch
import torch.nn.functional as F


def test_bf16_linear_rows_do_not_depend_on_batch_rows():
    torch.manual_seed(0)
    for out_f, in_f in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:  # SmolLM2-135M's shapes
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        x = torch.randn(17, in_f, dtype=torch.bfloat16)
        alone = torch.cat([F.linear(x[i : i + 1].expand(2, -1), w)[:1] for i in range(17)])
        for m in (2, 3, 5, 9, 17):
            assert torch.equal(F.linear(x[:m], w), alone[:m]), (out_f, in_f, m)
