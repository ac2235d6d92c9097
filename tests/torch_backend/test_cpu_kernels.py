# SPDX-License-Identifier: Apache-2.0
"""The bf16 CPU kernels (cpu_kernels.c) on every path this CPU runs: bit for bit the arithmetic of the Python reference
(tests/cpu_kernels_reference.py), close to torch's results, and bit-exact however a step is packed (the property
lossless verification rests on); a failed build falls back to torch ops and leaves nothing behind."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from models.tt_transformers.torch_backend import cpu_kernels
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.torch_backend.attention import ExactToken
from models.tt_transformers.torch_backend.cpu_kernels import StepTable
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.torch_backend.model import Transformer

from .. import cpu_kernels_reference as reference
from ..conftest import CPU_KERNELS, CPU_PATHS, every_cpu_path, kernels_of, needs_cpu_kernels, random_model

pytestmark = needs_cpu_kernels


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bit patterns (what the reference reads)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def odd_first(cpu_path: str) -> bool:
    """vdpbf16ps adds a pair's odd product first; the widened paths add the even one first."""
    return cpu_path == "avx512bf16"


@every_cpu_path
@pytest.mark.parametrize("n_out,n_in", [(960, 576), (576, 1536), (50, 64), (49152, 576)])
def test_linear_close_to_float_and_row_invariant(cpu_path, n_out, n_in):
    kernels = kernels_of(cpu_path)
    torch.manual_seed(0)
    w = torch.randn(n_out, n_in, dtype=torch.bfloat16)
    x = torch.randn(70, n_in, dtype=torch.bfloat16)
    packed = kernels.pack_weight(w)
    full = kernels.linear(x, packed, n_out, torch.float32)
    reference_matmul = x.float() @ w.float().T
    assert (full - reference_matmul).abs().max() <= 1e-5 * reference_matmul.abs().max()  # only the order differs
    for m in (1, 2, 3, 4, 5, 6, 9, 17, 65):
        assert torch.equal(kernels.linear(x[:m], packed, n_out, torch.float32), full[:m]), m
    assert torch.equal(kernels.linear(x, packed, n_out, torch.bfloat16), full.bfloat16())
    threads = torch.get_num_threads()
    try:  # each output is summed by one thread in one order: the thread count cannot change it
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, packed, n_out, torch.float32), full)
    finally:
        torch.set_num_threads(threads)


@every_cpu_path
def test_linear_is_the_reference_arithmetic(cpu_path):
    """Float32 outputs equal the reference's bit for bit, and the pair order matters: the other order would not."""
    kernels = kernels_of(cpu_path)
    torch.manual_seed(1)
    w = torch.randn(96, 160, dtype=torch.bfloat16)
    x = torch.randn(7, 160, dtype=torch.bfloat16)
    got = kernels.linear(x, kernels.pack_weight(w), 96, torch.float32).numpy()
    assert np.array_equal(got, reference.linear(bits(x), bits(w), odd_first(cpu_path)))
    assert not np.array_equal(got, reference.linear(bits(x), bits(w), not odd_first(cpu_path)))


def layer_case(head_dim, n_heads, n_kv_heads, tokens, seed=0):
    """A one-layer bf16 model, a packed step's tokens, its residual stream and caches filled with earlier keys. The
    numbers come from numpy's PCG64, the same on every machine and torch version (torch's normal_ is not)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, std):
        return torch.from_numpy(rng.normal(0.0, std, shape).astype(np.float32)).bfloat16()
    table = StepTable.of(tokens)
    slots = max(96, table.slots_needed)
    model = random_model(torch.bfloat16, max_seq_len=slots, dim=256, n_layers=1, head_dim=head_dim, n_heads=n_heads,
                         n_kv_heads=n_kv_heads, hidden_dim=512, vocab_size=100)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(normal(*p.shape, std=0.3))
    caches = [normal(2, n_kv_heads, slots + 1, head_dim, std=0.5) for _ in range(2)]
    return model, table, normal(1, len(tokens), 256, std=1.0), caches


# 32 chain tokens of two users, and a token tree rooted at slot 5 (as TorchCausalLM._exact_tokens makes it): two
# children of the root, and a child of the second
CHAINS = [ExactToken(i, i % 2, 40 + i // 2, 40 + i // 2, 0, 41 + i // 2) for i in range(32)]
TREE = [ExactToken(0, 0, 5, 5, 0, 5, (5,)), ExactToken(1, 0, 6, 6, 0, 5, (5, 6)), ExactToken(2, 0, 7, 6, 0, 5, (5, 7)),
        ExactToken(3, 0, 8, 7, 0, 5, (5, 7, 8))]
WINDOWED = [ExactToken(i, 1, 60 + i, 60 + i, 60 + i - 7, 61 + i) for i in range(5)]  # a sliding window of 8
# One user's verification step of 1 + 8 rows over 76-84 keys (blocks of 16 positions, the last crossing 80), beside
# another user's token tree in a sliding window of 58, whose nodes' keys start off a block boundary and at different
# positions (3, 4, 5 by depth): each user's rows attend in one pass over its cache
VERIFY = [ExactToken(i, 0, 75 + i, 75 + i, 0, 76 + i) for i in range(9)] + [
    ExactToken(9, 1, 60, 60, 3, 60, (60,)), ExactToken(10, 1, 61, 61, 4, 60, (60, 61)),
    ExactToken(11, 1, 62, 61, 4, 60, (60, 62)), ExactToken(12, 1, 63, 62, 5, 60, (60, 62, 63))]
# Keys in both of the kernel's first splits of the cache (1,024 positions each): a verification step of 1 + 4 rows over
# 1,021-1,025 keys (the last reaching the second split), beside another user's window of 31 keys across the split
# boundary and a tree node whose ancestors cross it (positions 1,022-1,024: slots 1,022, 1,024, 1,025)
LONG = [ExactToken(i, 0, 1020 + i, 1020 + i, 0, 1021 + i) for i in range(5)] + [
    ExactToken(5, 1, 1030, 1030, 1000, 1031), ExactToken(6, 1, 1025, 1024, 0, 1022, (1022, 1024, 1025))]


@every_cpu_path
@pytest.mark.parametrize("head_dim,n_heads,n_kv_heads,tokens", [
    (64, 3, 1, CHAINS), (32, 4, 2, CHAINS), (96, 6, 1, TREE), (128, 2, 1, WINDOWED), (64, 6, 2, VERIFY)],
    ids=["chains-d64", "chains-d32", "tree-d96", "window-d128", "verify-d64"])
def test_decoder_layer_is_the_reference_arithmetic(cpu_path, head_dim, n_heads, n_kv_heads, tokens):
    """A whole decoder layer of a packed step (norms, linears, rotary, cache writes, attention over chains, a tree and
    a sliding window, a user's verification rows in one pass over its cache, SiLU) equals the reference bit for bit:
    the residual stream and both caches."""
    kernels = kernels_of(cpu_path)
    model, table, x, (k_cache, v_cache) = layer_case(head_dim, n_heads, n_kv_heads, tokens)
    layer = model.layers[0]
    weights = [bits(t.data) for t in (layer.attention_norm.weight, layer.attention.wqkv.weight, layer.attention.wo.weight,
                                      layer.ffn_norm.weight, layer.feed_forward.w_gate_up.weight,
                                      layer.feed_forward.w_down.weight)]
    want_k, want_v = bits(k_cache).copy(), bits(v_cache).copy()
    want = reference.decoder_layer(bits(x[0]), model.args, weights, table.tensor.numpy(), table.ancestors.numpy(),
                                   bits(model.rope_cos), bits(model.rope_sin), want_k, want_v, odd_first(cpu_path))
    model.use_cpu_kernels(kernels)
    got = kernels.decoder_layer(x, model.args, model.layers[0].kernel_weights, table, model.rope_cos, model.rope_sin,
                                k_cache, v_cache)
    assert np.array_equal(bits(got[0]), want)
    assert np.array_equal(bits(k_cache), want_k) and np.array_equal(bits(v_cache), want_v)


def step_qkv(model, n, seed=5):
    """A packed step's projections [n, (H + 2 Hk) D], bf16 from numpy's PCG64."""
    args = model.args
    width = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    return torch.from_numpy(np.random.default_rng(seed).normal(0.0, 1.0, (n, width)).astype(np.float32)).bfloat16()


def kernel_attention(kernels, model, qkv, tokens, k_cache, v_cache) -> torch.Tensor:
    """cpu_kernels.c attention_f32 of a step (its float32 output [n, H, D], before decoder_layer rounds it to bf16,
    which would hide almost any change of order); writes the step's keys and values into the caches."""
    return kernels.step_attention(qkv, model.args.n_heads, StepTable.of(tokens), model.rope_cos, model.rope_sin,
                                  k_cache, v_cache)


ATTENTION_CASES = pytest.mark.parametrize("head_dim,n_heads,n_kv_heads,tokens", [
    (64, 3, 1, CHAINS), (96, 6, 1, TREE), (128, 2, 1, WINDOWED), (64, 6, 2, VERIFY), (32, 16, 2, VERIFY),
    (64, 6, 2, LONG)], ids=["chains-d64", "tree-d96", "window-d128", "verify-d64", "verify-d32-g8", "splits-d64"])


@every_cpu_path
@ATTENTION_CASES
def test_attention_is_the_reference_arithmetic(cpu_path, head_dim, n_heads, n_kv_heads, tokens):
    """The attention of a packed step in float32 (each user's rows in one pass over its cache, blocks of 16
    positions, online softmax) equals the reference bit for bit, and so do the caches it writes."""
    kernels = kernels_of(cpu_path)
    model, table, _, (k_cache, v_cache) = layer_case(head_dim, n_heads, n_kv_heads, tokens)
    qkv = step_qkv(model, len(tokens))
    want_k, want_v = bits(k_cache).copy(), bits(v_cache).copy()
    want = reference.attention(reference.widen(bits(qkv)), model.args, table.tensor.numpy(), table.ancestors.numpy(),
                               bits(model.rope_cos), bits(model.rope_sin), want_k, want_v, odd_first(cpu_path))
    got = kernel_attention(kernels, model, qkv, tokens, k_cache, v_cache).numpy()
    assert np.array_equal(got, want)
    assert np.array_equal(bits(k_cache), want_k) and np.array_equal(bits(v_cache), want_v)


def test_the_attention_reference_tells_block_alignments_apart(monkeypatch):
    """The negative control of the test above: blocks counted from each token's first key instead of from multiples of
    16 change the tree nodes' float32 results (their keys start at 3, 4 and 5), so the test sees the block order."""
    model, table, _, caches = layer_case(64, 6, 2, VERIFY)
    qkv = reference.widen(bits(step_qkv(model, len(VERIFY))))

    def run():
        return reference.attention(qkv, model.args, table.tensor.numpy(), table.ancestors.numpy(),
                                   bits(model.rope_cos), bits(model.rope_sin), *[bits(c).copy() for c in caches], False)
    aligned = run()
    attend = reference.attend
    monkeypatch.setattr(reference, "attend", lambda q, k, v, first, order: attend(q, k, v, 0, order))
    unaligned = run()
    assert np.array_equal(aligned[:9], unaligned[:9])  # the verification rows' keys start at 0 either way
    assert all(not np.array_equal(aligned[t], unaligned[t]) for t in range(9, 13))


@every_cpu_path
@pytest.mark.parametrize("steps,rows", [(VERIFY, 9), (LONG, 5)], ids=["verify", "splits"])
def test_rows_in_one_pass_equal_each_row_alone(cpu_path, steps, rows):
    """The rows of a user that attend in one pass over its cache (a verification step's 1 + K rows, a token tree's
    nodes), over one split of it or several, each get, bit for bit in float32, what they get alone (a one-token step)
    and beside any number of others, on any number of threads: the lossless contract of the shared pass."""
    kernels = kernels_of(cpu_path)
    model, _, _, caches = layer_case(64, 6, 2, steps)
    qkv = step_qkv(model, len(steps))

    def step(picked, caches):  # the tokens steps[picked] as one step on copies of `caches`
        tokens = [dataclasses.replace(steps[i], index=n) for n, i in enumerate(picked)]
        k, v = (c.clone() for c in caches)
        return kernel_attention(kernels, model, qkv[picked].contiguous(), tokens, k, v), (k, v)

    full, written = step(list(range(len(steps))), caches)  # every row's keys in the cache, as a row alone finds them
    subsets = [[i] for i in range(len(steps))]  # alone
    subsets += [list(range(rows - m, rows)) for m in range(2, rows)]  # the last verification row with earlier rows
    others = list(range(rows, len(steps)))  # the other user's tokens
    subsets += [[0, rows - 1], [others[0], others[-1]], others[1:], [3, others[0]], list(range(len(steps)))]
    threads = torch.get_num_threads()
    try:  # 1 thread: every head of a key/value head in one pass; 8: single heads where there are fewer work items
        for n_threads in (threads, 1, 8):
            torch.set_num_threads(n_threads)
            for picked in subsets:
                assert torch.equal(step(picked, written)[0], full[picked]), (n_threads, picked)
    finally:
        torch.set_num_threads(threads)


def test_the_layer_reference_tells_the_pair_orders_apart():
    """The negative control of the test above: on its first case the two pair orders give different residual streams,
    so a path summing in the other order could not pass it."""
    model, table, x, caches = layer_case(64, 3, 1, CHAINS)
    layer = model.layers[0]
    weights = [bits(t.data) for t in (layer.attention_norm.weight, layer.attention.wqkv.weight, layer.attention.wo.weight,
                                      layer.ffn_norm.weight, layer.feed_forward.w_gate_up.weight,
                                      layer.feed_forward.w_down.weight)]
    outs = [reference.decoder_layer(bits(x[0]), model.args, weights, table.tensor.numpy(), table.ancestors.numpy(),
                                    bits(model.rope_cos), bits(model.rope_sin), *[bits(c).copy() for c in caches], order)
            for order in (False, True)]
    assert not np.array_equal(*outs)


@pytest.mark.skipif(len([p for p in CPU_PATHS if p != "avx512bf16"]) < 2, reason="fewer than two widened paths here")
def test_widened_paths_agree_at_the_embedded_models_shapes():
    """The widened paths do the same operations in the same order: the LM head's float32 logits and a decoder layer of
    SmolLM2-135M's shape over 300 cached keys (9 query heads on 3 key/value heads, head_dim 64) come out identical."""
    widened = [kernels_of(p) for p in CPU_PATHS if p != "avx512bf16"]
    torch.manual_seed(2)
    w, x = torch.randn(49152, 576, dtype=torch.bfloat16), torch.randn(5, 576, dtype=torch.bfloat16)
    logits = [k.linear(x, k.pack_weight(w), 49152, torch.float32) for k in widened]
    assert all(torch.equal(logits[0], other) for other in logits[1:])
    tokens = [ExactToken(i, 0, 300 + i, 300 + i, 0, 301 + i) for i in range(5)]
    outs = []
    for kernels in widened:
        model = random_model(torch.bfloat16, max_seq_len=320, std=0.05, dim=576, n_layers=1, head_dim=64, n_heads=9,
                             n_kv_heads=3, hidden_dim=1536, vocab_size=64)
        model.use_cpu_kernels(kernels)
        torch.manual_seed(3)
        k_cache, v_cache = [(torch.randn(1, 3, 321, 64) * 0.5).bfloat16() for _ in range(2)]
        out = kernels.decoder_layer(torch.randn(1, 5, 576).bfloat16(), model.args, model.layers[0].kernel_weights,
                                    StepTable.of(tokens), model.rope_cos, model.rope_sin, k_cache, v_cache)
        outs.append((out, k_cache))
    assert all(torch.equal(outs[0][0], o) and torch.equal(outs[0][1], k) for o, k in outs[1:])


def tiny_bf16_model(head_dim, n_kv_heads, sliding_window, n_heads=4) -> Transformer:
    return random_model(torch.bfloat16, max_seq_len=96, std=0.3, dim=64, n_layers=2, head_dim=head_dim,
                        n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=96, vocab_size=100, tie_word_embeddings=True,
                        sliding_window=sliding_window, model_type="mistral")


@every_cpu_path
@pytest.mark.parametrize("head_dim,n_kv_heads,sliding_window,n_heads", [
    (32, 2, None, 4), (32, 2, 5, 4), (64, 4, None, 4), (128, 1, None, 4), (64, 1, None, 3), (96, 1, None, 6)])
def test_packed_steps_bit_exact_and_close_to_torch_ops(cpu_path, head_dim, n_kv_heads, sliding_window, n_heads):
    """A ragged two-user verification step equals one-token steps bit for bit, and the torch-ops model closely
    (query heads per key/value head: 1, 2, 3 as in SmolLM2, 4, and 6, which the kernel attends in groups of 4 and 2;
    head_dim 96 weighs values in chunks of 64 and 32 lanes)."""
    torch_ops = tiny_bf16_model(head_dim, n_kv_heads, sliding_window, n_heads)
    kernel_model = copy.deepcopy(torch_ops)
    kernel_model.use_cpu_kernels(kernels_of(cpu_path))
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82]]
    drafts = [[32, 38, 46, 26, 43], [83]]

    def fresh(model):
        lm = TorchCausalLM(model, model.args.n_layers, 2)
        for user, prompt in enumerate(prompts):
            lm.forward_logits([prompt], [0], [user], last_only=True)
        return lm

    packed = fresh(kernel_model).forward_logits(drafts, [len(p) for p in prompts], [0, 1])
    one_by_one = fresh(kernel_model)
    for user, (prompt, draft) in enumerate(zip(prompts, drafts)):
        singles = [one_by_one.forward_logits([[t]], [len(prompt) + i], [user])[0] for i, t in enumerate(draft)]
        assert torch.equal(packed[user], torch.cat(singles)), user
    reference = fresh(torch_ops).forward_logits(drafts, [len(p) for p in prompts], [0, 1])
    for got, want in zip(packed, reference):
        assert (got - want).abs().max() <= 0.03 * want.abs().max()  # bf16 roundings in different places


def test_failed_build_falls_back_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TT_CPU_KERNELS", "0")
    assert cpu_kernels.load_cpu_kernels(tmp_path) is None


# ---- the boundary between Python and C: nothing the C code trusts can be wrong ----

def prefilled_kernel_model(n_users=2):
    model = tiny_bf16_model(32, 2, None)
    model.use_cpu_kernels(CPU_KERNELS)
    lm = TorchCausalLM(model, model.args.n_layers, n_users)
    lm.forward_logits([[3, 14, 15, 92]], [0], [0], last_only=True)
    return model, lm


def test_bad_cache_row_is_one_clear_error_not_memory_corruption():
    """On torch ops a bad row is an IndexError; on the kernels it would write outside the cache. Both paths now
    refuse it before any work, and the kernels refuse a step table that reaches past the cache they are given."""
    model, lm = prefilled_kernel_model()
    for users, start in (([2], [4]), ([-1], [4]), ([0], [-3])):
        with pytest.raises(IndexError, match="rows must be distinct and in \\[0, 2\\)"):
            lm.forward_logits([[5]], start, users)
    with pytest.raises(IndexError, match="bad kernel step entry"):
        StepTable.of([ExactToken(0, 0, 5, 5, 6, 5)])  # first visible key after the end of its run
    with pytest.raises(IndexError, match="bad kernel step entry"):
        StepTable.of([ExactToken(0, 0, 5, 5, 0, 3, (4, -2))])  # an ancestor slot below 0
    table = StepTable.of([ExactToken(0, 3, 4, 4, 0, 5)])  # row 3 of a 2-row cache
    x = torch.zeros(1, 1, model.args.dim, dtype=torch.bfloat16)
    layer = model.layers[0]
    with pytest.raises(IndexError, match="reaches cache row 3"):
        CPU_KERNELS.decoder_layer(x, model.args, layer.kernel_weights, table, model.rope_cos, model.rope_sin,
                                  lm.cache.k[0], lm.cache.v[0])
    with pytest.raises(ValueError, match="caches"):  # a float32 cache would be read as bf16
        CPU_KERNELS.decoder_layer(x, model.args, layer.kernel_weights, StepTable.of([ExactToken(0, 0, 4, 4, 0, 5)]), model.rope_cos,
                                  model.rope_sin, lm.cache.k[0].float(), lm.cache.v[0])


def test_deep_copy_owns_its_weights_and_moves_are_refused():
    """The kernels take tensor addresses at each call: a deep copy runs on its own tensors after the original is
    gone, and .to() / casts (which would leave the kernels reading moved memory) raise instead."""
    import gc

    model, lm = prefilled_kernel_model(1)
    expected = lm.forward_logits([[5, 6]], [4], [0])[0]
    clone = copy.deepcopy(model)
    del model, lm
    gc.collect()
    lm = TorchCausalLM(clone, clone.args.n_layers, 1)
    lm.forward_logits([[3, 14, 15, 92]], [0], [0], last_only=True)
    assert torch.equal(lm.forward_logits([[5, 6]], [4], [0])[0], expected)
    for move in (lambda m: m.to(torch.float32), lambda m: m.float(), lambda m: m.layers[0].to("cpu")):
        with pytest.raises(RuntimeError, match="cannot be moved or cast"):
            move(clone)


def test_scratch_memory_is_allocated_once():
    """One workspace for every layer and step, grown only when a larger step arrives (no allocation per token and
    head inside the parallel loop: the C file has no malloc at all)."""
    _, lm = prefilled_kernel_model(1)
    lm.forward_logits([[5, 6, 7]], [4], [0])
    workspace = CPU_KERNELS.workspace
    lm.forward_logits([[8]], [7], [0])
    lm.forward_logits([[9, 10]], [8], [0])
    assert CPU_KERNELS.workspace is workspace
    assert "malloc" not in cpu_kernels.SOURCE.read_text()


def test_tied_embedding_reads_the_packed_head():
    """A tied model on the kernels keeps one copy of the embedding matrix: lookups gather its packed rows."""
    model = tiny_bf16_model(32, 2, None)
    tokens = torch.tensor([[0, 1, 15, 16, 17, 99]])
    expected = model.tok_embeddings(tokens)
    model.use_cpu_kernels(CPU_KERNELS)
    assert torch.equal(model.tok_embeddings(tokens), expected)
    vocab_by_dim = (model.args.vocab_size, model.args.dim)
    assert not any(tuple(t.shape) == vocab_by_dim for t in [*model.parameters(), *model.buffers()])  # no unpacked copy


@every_cpu_path
@pytest.mark.parametrize("k", [0, 1, 4, 16])
def test_argmax_topk_as_torch(cpu_path, k):
    """The greedy ids are torch.argmax's (the first index on ties, a NaN row as torch has it) and the top k are the
    k largest, descending, ties by lower index; vocabularies not a multiple of the 16-lane vectors included."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49159).round(decimals=1)  # many equal values: ties everywhere in the top k
    logits[1, [5, 900, 49158]] = 50.0  # the maximum three times
    logits[2] = float("-inf")
    logits[2, 49157] = 0.0
    logits[3, 17] = float("nan")
    logits[4] = 1.0  # every value tied
    short = torch.randn(2, 7)
    for x in (logits, short):
        ids, top = kernels_of(cpu_path).argmax_topk(x, min(k, x.shape[1]))
        assert ids == x.argmax(dim=-1).tolist()
        if k == 0:
            assert top is None
            continue
        for r, row in enumerate(x):
            if row.isnan().any():
                continue
            want = sorted(range(len(row)), key=lambda i: (-row[i].item(), i))[: min(k, x.shape[1])]
            assert top[r] == want, r


def test_greedy_ids_on_kernels_equal_torch_argmax():
    """A step on the kernels returns the argmax of the logits the same step computes (torch's own argmax)."""
    model = tiny_bf16_model(32, 2, None)
    model.use_cpu_kernels(CPU_KERNELS)
    lm = TorchCausalLM(model, model.args.n_layers, 1)
    prompt = [3, 14, 15, 92, 65, 35]
    logits = lm.forward_logits([prompt], [0], [0])[0]
    out = TorchCausalLM(model, model.args.n_layers, 1).step([UserRows(0, prompt, 0)], top_k=3)
    assert out.ids == [logits.argmax(dim=-1).tolist()]
    assert out.top_ids == [logits.topk(3, dim=-1).indices.tolist()]
