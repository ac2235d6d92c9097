# SPDX-License-Identifier: Apache-2.0
"""The CPU kernels' prefill attention (cpu_kernels.c prefill_attention) on every path this CPU runs: bit for bit the
Python reference's arithmetic (tests/cpu_kernels_reference.py) over causal prompts, a cached prefix, a sliding window
and a ragged two-user batch, the same at any thread count; and a model's prefill on it close to torch ops'."""
import copy
from functools import lru_cache

import numpy as np
import pytest
import torch

from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.torch_backend.cpu_kernels import PrefillTable

from .. import cpu_kernels_reference as reference
from ..conftest import CPU_PATHS, every_cpu_path, kernels_of, needs_cpu_kernels, random_model
from .test_cpu_kernels import bits, odd_first

pytestmark = needs_cpu_kernels

SLOTS = 97
# name: (cache row of each batch entry, each query's position, sliding window; 0: none). Causal from position 0 over
# three key blocks of 32; 40 queries after a cached prefix of 45 (their keys all visible, the first block starting
# inside a query's past); a window of 20; two users of 60 and 25 tokens (the second after 10 cached ones, padded with
# the batch's last position as TorchCausalLM._padded_step pads).
PREFILL_CASES = {
    "causal": ([0], [list(range(70))], 0),
    "prefix": ([2], [list(range(45, 85))], 0),
    "window": ([1], [list(range(80))], 20),
    "ragged": ([2, 0], [list(range(60)), list(range(10, 35)) + [59] * 35], 0),
}
# (head_dim, query heads, key/value heads): SmolLM2's group of 3 heads, no grouping, head_dim 96 (output chunks of 64
# and 32 lanes) in a group of 6, and a group of 8 at head_dim 128
SHAPES = pytest.mark.parametrize("head_dim,n_heads,n_kv_heads", [(64, 6, 2), (32, 4, 4), (96, 6, 1), (128, 16, 2)],
                                 ids=["d64-g3", "d32-g1", "d96-g6", "d128-g8"])


@lru_cache(maxsize=None)
def prefill_inputs(case: str, head_dim: int, n_heads: int, n_kv_heads: int):
    """The case's queries [B, T, H, D] (a view of projections [B, T, H + 2 Hk, D], tokens strided as the model's),
    caches [3, Hk, SLOTS, D] and table; numbers from numpy's PCG64, the same on every machine."""
    rows, positions, window = PREFILL_CASES[case]
    rng = np.random.default_rng(7)

    def normal(*shape, std):
        return torch.from_numpy(rng.normal(0.0, std, shape).astype(np.float32)).bfloat16()
    qkv = normal(len(rows), len(positions[0]), n_heads + 2 * n_kv_heads, head_dim, std=1.0)
    caches = [normal(3, n_kv_heads, SLOTS, head_dim, std=1.0) for _ in range(2)]
    return qkv[:, :, :n_heads], caches, PrefillTable.of(torch.tensor(rows), torch.tensor(positions), window)


@lru_cache(maxsize=None)
def prefill_reference(case: str, head_dim: int, n_heads: int, n_kv_heads: int, order: bool) -> np.ndarray:
    q, (k_cache, v_cache), table = prefill_inputs(case, head_dim, n_heads, n_kv_heads)
    return reference.prefill_attention(bits(q), table.rows.numpy(), table.positions.numpy(), table.window,
                                       bits(k_cache), bits(v_cache), order)


@every_cpu_path
@SHAPES
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention_is_the_reference_arithmetic(cpu_path, case, head_dim, n_heads, n_kv_heads):
    """Float32 outputs equal the reference's bit for bit (bf16 ones are them rounded), at any thread count."""
    kernels = kernels_of(cpu_path)
    q, (k_cache, v_cache), table = prefill_inputs(case, head_dim, n_heads, n_kv_heads)
    want = prefill_reference(case, head_dim, n_heads, n_kv_heads, odd_first(cpu_path))
    threads = torch.get_num_threads()
    try:
        for n in (threads, 1, 3):
            torch.set_num_threads(n)
            got = kernels.prefill_attention(q, k_cache, v_cache, table, torch.float32).numpy()
            assert np.array_equal(got, want), n
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(bits(kernels.prefill_attention(q, k_cache, v_cache, table)), reference.to_bf16(want))


def test_the_prefill_reference_tells_the_pair_orders_apart():
    """The negative control of the test above: the two pair orders give different float32 results on every case."""
    for case in PREFILL_CASES:
        assert not np.array_equal(prefill_reference(case, 64, 6, 2, False), prefill_reference(case, 64, 6, 2, True))


def test_prefill_attention_is_close_to_softmax_attention():
    """The kernel's float32 result is softmax attention's over each query's visible keys, to the bf16 rounding of the
    weights p (the reference's operations are the kernel's; this checks they compute attention)."""
    q, (k_cache, v_cache), table = prefill_inputs("ragged", 64, 6, 2)
    got = kernels_of(CPU_PATHS[0]).prefill_attention(q, k_cache, v_cache, table, torch.float32)
    for b, row in enumerate(table.rows.tolist()):
        for t, pos in enumerate(table.positions[b].tolist()):
            keys, values = k_cache[row, :, : pos + 1].float(), v_cache[row, :, : pos + 1].float()  # [Hk, n, D]
            scores = torch.einsum("hgd,hnd->hgn", q[b, t].float().view(2, 3, 64), keys) / 8.0
            want = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), values).reshape(6, 64)
            assert (got[b, t] - want).abs().max() < 0.02, (b, t)


def test_bad_prefill_inputs_are_refused_before_the_kernel():
    """What the C code trusts is checked: a cache row or position past the cache, strided heads, a float32 cache."""
    kernels = kernels_of(CPU_PATHS[0])
    q, (k_cache, v_cache), table = prefill_inputs("causal", 64, 6, 2)
    with pytest.raises(IndexError, match="reaches cache row 5"):
        kernels.prefill_attention(q, k_cache, v_cache, PrefillTable.of(torch.tensor([5]), table.positions, 0))
    with pytest.raises(IndexError, match="slot 99"):
        kernels.prefill_attention(q, k_cache, v_cache, PrefillTable.of(table.rows, table.positions + 30, 0))
    with pytest.raises(IndexError, match="all >= 0"):
        PrefillTable.of(table.rows, table.positions - 1, 0)
    with pytest.raises(ValueError, match="heads contiguous"):
        spread = torch.zeros(*q.shape[:3], 2 * q.shape[3], dtype=q.dtype)[..., : q.shape[3]]  # heads 2 D apart
        kernels.prefill_attention(spread.copy_(q), k_cache, v_cache, table)
    with pytest.raises(ValueError, match="heads contiguous"):
        kernels.prefill_attention(q, k_cache.float(), v_cache, table)


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]).double())[0, 1].item()


@every_cpu_path
@pytest.mark.parametrize("sliding_window", [None, 24], ids=["causal", "window-24"])
def test_prefill_on_the_kernels_is_as_close_as_torch_ops_and_deterministic(cpu_path, sliding_window):
    """A model's prefill on the kernels (rotary, cache writes, attention, norms and SwiGLU in C): two users of a ragged
    batch, then one continuing after its cached prefix. Its logits are as close to the float32 model's as the bf16
    torch-ops model's (chunked, masked SDPA), the same run to run, and close at another thread count (oneDNN's matmuls
    promise the same bits only at one count; the kernels' attention gives them at any)."""
    kw = dict(max_seq_len=256, dim=64, head_dim=32, hidden_dim=96, n_heads=6, n_kv_heads=2,
              sliding_window=sliding_window, model_type="mistral" if sliding_window else "llama")
    torch_ops = random_model(torch.bfloat16, **kw)
    exact = random_model(torch.float32, **kw)
    exact.load_state_dict({name: t.float() for name, t in torch_ops.state_dict().items()})
    on_kernels = copy.deepcopy(torch_ops)
    on_kernels.use_cpu_kernels(kernels_of(cpu_path))
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(3)).tolist()

    def prefill(model):
        lm = TorchCausalLM(model, model.args.n_layers, 2)
        first = lm.forward_logits([tokens[:150], tokens[:90]], [0, 0], [1, 0])
        return [t.float() for t in [*first, lm.forward_logits([tokens[150:]], [150], [1])[0]]]
    truth, bf16_torch = prefill(exact), prefill(torch_ops)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (threads, threads, 1):
            torch.set_num_threads(n)
            runs.append(prefill(on_kernels))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    for got, other, want, theirs in zip(runs[0], runs[2], truth, bf16_torch):
        assert pcc(got, want) > min(0.998, pcc(theirs, want) - 5e-4)
        assert pcc(got, other) > 0.9999


@pytest.mark.parametrize("n_out,n_in", [(960, 576), (50, 64)])
def test_unpacked_weight_is_the_weight(n_out, n_in):
    """KernelLinear's prefill rows go through torch's matmul on the weight unpacked by one strided copy
    (CpuKernels.unpack_weight, no second copy kept): it is the original matrix, a last block of under 16 rows too."""
    from models.tt_transformers.torch_backend.cpu_kernels import CpuKernels

    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(CpuKernels.unpack_weight(CpuKernels.pack_weight(w), n_out), w)


@pytest.mark.skipif("avx512" not in CPU_PATHS or "avx512bf16" not in CPU_PATHS, reason="needs an AVX512-BF16 CPU")
def test_prefill_linears_leave_onednn_where_it_widens_bf16(monkeypatch):
    """A prompt's linear layers go through torch's oneDNN only where it multiplies bf16 with dot products: under the
    avx512bf16 path, not under avx512 (oneDNN capped to AVX512_CORE widens bf16 to float, 3 times slower than the
    kernels there)."""
    flags = {}
    for path in ("avx512bf16", "avx512"):
        monkeypatch.setenv("TT_CPU_ISA", path)
        model = random_model(torch.bfloat16, dim=64, head_dim=32, hidden_dim=96)
        model.use_cpu_kernels(kernels_of(path))
        flags[path] = model.layers[0].feed_forward.w_down.onednn
    assert flags == {"avx512bf16": True, "avx512": False}


@every_cpu_path
def test_prefill_norms_and_swiglu_are_the_decode_steps_arithmetic(cpu_path):
    """A prefill on the kernels takes its RMSNorms and SwiGLU from the C functions decoder_layer uses: bit for bit the
    reference's, for a prompt's many rows."""
    kernels = kernels_of(cpu_path)
    rng = np.random.default_rng(3)
    x, w = (torch.from_numpy(rng.normal(0, 1, shape).astype(np.float32)).bfloat16() for shape in ((2, 40, 96), (96,)))
    assert np.array_equal(bits(kernels.rms_norm(x, w, 1e-5)).reshape(80, 96),
                          reference.rms_norm(bits(x).reshape(80, 96), bits(w), 1e-5))
    assert np.array_equal(bits(kernels.silu_mul(x)).reshape(80, 48), reference.silu_mul(bits(x).reshape(80, 96)))


@every_cpu_path
def test_prefill_rotary_and_cache_writes_are_the_decode_steps_arithmetic(cpu_path):
    """A prefill's queries and keys are rotated at each token's slot as a decode step's are (bit for bit the
    reference's rotate), its keys and values written to its cache row there (a padding token's: the scratch slot), and
    nothing else in the caches changes."""
    kernels = kernels_of(cpu_path)
    model = random_model(torch.bfloat16, max_seq_len=96, dim=64, head_dim=32, hidden_dim=96, n_heads=6, n_kv_heads=2)
    rng = np.random.default_rng(4)
    qkv = torch.from_numpy(rng.normal(0, 1, (2, 7, 10 * 32)).astype(np.float32)).bfloat16()
    slots = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 96, 96, 96, 96]])  # the second user padded
    table = PrefillTable.of(torch.tensor([2, 0]), slots.clamp(max=22), 0, slots=slots)
    k_cache, v_cache = (torch.from_numpy(rng.normal(0, 1, (3, 2, 97, 32)).astype(np.float32)).bfloat16() for _ in "kv")
    want_k, want_v = bits(k_cache).copy(), bits(v_cache).copy()
    q = kernels.prefill_rotate(qkv, 6, table, model.rope_cos, model.rope_sin, k_cache, v_cache)
    cos, sin = reference.widen(bits(model.rope_cos)), reference.widen(bits(model.rope_sin))
    for b, row in enumerate((2, 0)):
        for t, slot in enumerate(slots[b].tolist()):
            heads = reference.widen(bits(qkv[b, t])).reshape(10, 32)
            assert np.array_equal(bits(q[b, t]), reference.rotate(heads[:6], cos[slot], sin[slot]))
            want_k[row, :, slot] = reference.rotate(heads[6:8], cos[slot], sin[slot])
            want_v[row, :, slot] = bits(qkv[b, t]).reshape(10, 32)[8:]
    assert np.array_equal(bits(k_cache), want_k) and np.array_equal(bits(v_cache), want_v)
