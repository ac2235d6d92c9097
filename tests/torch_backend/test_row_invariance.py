# SPDX-License-Identifier: Apache-2.0
"""The torch-ops properties lossless bf16 verification rests on where the bf16 CPU kernels do not run (see
TorchCausalLM._packed_step and PackedLinear; tests/torch_backend/test_cpu_kernels.py checks the same of the kernels), and on the
embedded model with either, the property seeded sampling rests on: a row's logits do not depend on its step.

If a torch upgrade breaks them, this fails before any speculative output silently drifts from plain decoding.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.tt_transformers.torch_backend.model import PackedLinear, can_prepack

from ..conftest import every_cpu_path_and_torch_ops

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
    from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

    from ..conftest import random_model

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


@every_cpu_path_and_torch_ops
def test_verification_logits_equal_one_token_steps_on_the_embedded_model(embedded_checkpoint, sample_prompt_tokens,
                                                                          cpu_path):
    """Seeded sampling equals plain sampling only if a row's float32 logits, not just its argmax, do not depend on what
    shares its step: three users' chains of 5 in one step, and a token tree beside two chains, give each row the logits
    of the same position decoded alone, one token per step, bit for bit."""
    from models.tt_transformers.speculative.backend import UserRows
    from models.tt_transformers.torch_backend.load import load_model
    from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

    model = load_model(embedded_checkpoint, torch.bfloat16, 256, cpu_kernels=cpu_path or False)
    assert (model.kernels.path.name if model.kernels else None) == cpu_path
    prompts, n = sample_prompt_tokens[:3], 5
    tokens, alone = [], []
    for p in prompts:
        lm = TorchCausalLM(model, model.args.n_layers, 1)
        out = [lm.prefill(0, p).ids[0][0]]
        logits = []
        for i in range(n):
            step = lm.step([UserRows(0, [out[-1]], len(p) + i)], logits=True)
            logits.append(step.logits[0][0])
            out.append(step.ids[0][0])
        tokens.append(out[:n])
        alone.append(torch.stack(logits))
    lm = TorchCausalLM(model, model.args.n_layers, len(prompts))
    for u, p in enumerate(prompts):
        lm.prefill(u, p)
    chains = lm.step([UserRows(u, tokens[u], len(p)) for u, p in enumerate(prompts)], logits=True).logits
    assert all(torch.equal(got, want) for got, want in zip(chains, alone))
    # user 0 as a tree: a wrong sibling (row 1) beside the true path t0 -> t1 -> t2 (rows 0, 2, 3)
    t = tokens[0]
    tree = UserRows(0, [t[0], (t[1] + 1) % model.args.vocab_size, t[1], t[2]], len(prompts[0]), [-1, 0, 0, 2])
    steps = lm.step([tree] + [UserRows(u, tokens[u], len(p)) for u, p in enumerate(prompts) if u], logits=True).logits
    assert torch.equal(steps[0][[0, 2, 3]], alone[0][:3])
    assert all(torch.equal(got, want) for got, want in zip(steps[1:], alone[1:]))
