# SPDX-License-Identifier: Apache-2.0
"""The torch-ops properties lossless bf16 verification rests on where the bf16 CPU kernels do not run (see
TorchCausalLM._packed_step and PackedLinear; tests/test_cpu_kernels.py checks the same of the kernels).

If a torch upgrade breaks them, this fails before any speculative output silently drifts from plain decoding.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.tt_transformers.torch_backend.model import PackedLinear, can_prepack

SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M's shapes


def test_bf16_linear_rows_do_not_depend_on_batch_rows():
    torch.manual_seed(0)
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        x = torch.randn(17, in_f, dtype=torch.bfloat16)
        alone = torch.cat([F.linear(x[i : i + 1].expand(2, -1), w)[:1] for i in range(17)])
        for m in (2, 3, 5, 9, 17):
            assert torch.equal(F.linear(x[:m], w), alone[:m]), (out_f, in_f, m)


@pytest.mark.skipif(not can_prepack(torch.bfloat16, "cpu"), reason="this torch build has no oneDNN weight prepacking")
def test_packed_linear_equals_f_linear_and_is_row_invariant():
    torch.manual_seed(0)
    for out_f, in_f in SHAPES[:3]:
        linear = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
        packed = PackedLinear(linear)
        x = torch.randn(1, 17, in_f, dtype=torch.bfloat16)
        with torch.no_grad():
            out = packed(x)
            assert torch.equal(out, F.linear(x, linear.weight))
            for m in (1, 2, 3, 5, 9):
                assert torch.equal(packed(x[:, :m]), out[:, :m]), (out_f, in_f, m)


def test_exact_attention_takes_non_contiguous_queries_and_outputs(monkeypatch):
    """Issue 32 (CUDA): on an H100 the exact-attention path's `.view` failed ("view size is not compatible with input
    tensor's size and stride") on query rows and SDPA outputs that were not contiguous there. The CPU path reaches it
    the same way here: rotary and SDPA handing back the same values in transposed memory; the step's logits are
    unchanged."""
    from models.tt_transformers.speculative.backend import UserRows
    from models.tt_transformers.torch_backend import attention
    from models.tt_transformers.torch_backend.generator import TorchCausalLM

    from .conftest import random_model

    def transposed(t):  # the same values, the last two dims' strides swapped
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    def run():
        lm = TorchCausalLM(random_model(), 3, 2)
        lm.prefill(0, [1, 2, 3])
        lm.prefill(1, [4, 5])
        return lm.step([UserRows(0, [6, 7, 8], 3), UserRows(1, [9, 10], 2)], logits=True).logits
    reference = run()
    rope, sdpa = attention.apply_rope, attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention, "apply_rope", lambda *a: transposed(rope(*a)))
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: transposed(sdpa(*a, **k)))
    for got, want in zip(run(), reference):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
