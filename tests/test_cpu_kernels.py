# SPDX-License-Identifier: Apache-2.0
"""The bf16 CPU kernels (cpu_kernels.c): close to torch's results, and bit-exact however a step is packed (the
property lossless verification rests on); a failed build falls back to torch ops and leaves nothing behind."""
import copy

import pytest
import torch

from models.tt_transformers.torch_backend import cpu_kernels
from models.tt_transformers.torch_backend.generator import TorchCausalLM
from models.tt_transformers.torch_backend.model import Transformer

from .conftest import CPU_KERNELS, needs_cpu_kernels, random_model

pytestmark = needs_cpu_kernels


@pytest.mark.parametrize("n_out,n_in", [(960, 576), (576, 1536), (50, 64), (49152, 576)])
def test_linear_close_to_float_and_row_invariant(n_out, n_in):
    torch.manual_seed(0)
    w = torch.randn(n_out, n_in, dtype=torch.bfloat16)
    x = torch.randn(70, n_in, dtype=torch.bfloat16)
    packed = CPU_KERNELS.pack_weight(w)
    full = CPU_KERNELS.linear(x, packed, n_out, torch.float32)
    reference = x.float() @ w.float().T
    assert (full - reference).abs().max() <= 1e-5 * reference.abs().max()  # only the summation order differs
    for m in (1, 2, 3, 5, 17, 65):
        assert torch.equal(CPU_KERNELS.linear(x[:m], packed, n_out, torch.float32), full[:m]), m
    assert torch.equal(CPU_KERNELS.linear(x, packed, n_out, torch.bfloat16), full.bfloat16())
    threads = torch.get_num_threads()
    try:  # each output is summed by one thread in one order: the thread count cannot change it
        torch.set_num_threads(1)
        assert torch.equal(CPU_KERNELS.linear(x, packed, n_out, torch.float32), full)
    finally:
        torch.set_num_threads(threads)


def tiny_bf16_model(head_dim, n_kv_heads, sliding_window) -> Transformer:
    return random_model(torch.bfloat16, max_seq_len=96, std=0.3, dim=64, n_layers=2, head_dim=head_dim,
                        n_kv_heads=n_kv_heads, hidden_dim=96, vocab_size=100, tie_word_embeddings=True,
                        sliding_window=sliding_window, model_type="mistral")


@pytest.mark.parametrize("head_dim,n_kv_heads,sliding_window", [(32, 2, None), (32, 2, 5), (64, 4, None),
                                                                (128, 1, None)])
def test_packed_steps_bit_exact_and_close_to_torch_ops(head_dim, n_kv_heads, sliding_window):
    """A ragged two-user verification step equals one-token steps bit for bit, and the torch-ops model closely."""
    torch_ops = tiny_bf16_model(head_dim, n_kv_heads, sliding_window)
    kernel_model = copy.deepcopy(torch_ops)
    kernel_model.use_cpu_kernels(CPU_KERNELS)
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82]]
    drafts = [[32, 38, 46, 26, 43], [83]]

    def fresh(model):
        lm = TorchCausalLM(model, model.args.n_layers, 2)
        for user, prompt in enumerate(prompts):
            lm.logits([prompt], [0], [user], last_only=True)
        return lm

    packed = fresh(kernel_model).logits(drafts, [len(p) for p in prompts], [0, 1])
    one_by_one = fresh(kernel_model)
    for user, (prompt, draft) in enumerate(zip(prompts, drafts)):
        singles = [one_by_one.logits([[t]], [len(prompt) + i], [user])[0] for i, t in enumerate(draft)]
        assert torch.equal(packed[user], torch.cat(singles)), user
    reference = fresh(torch_ops).logits(drafts, [len(p) for p in prompts], [0, 1])
    for got, want in zip(packed, reference):
        assert (got - want).abs().max() <= 0.03 * want.abs().max()  # bf16 roundings in different places


def test_failed_build_falls_back_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TT_CPU_KERNELS", "0")
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None
