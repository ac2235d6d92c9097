# SPDX-License-Identifier: Apache-2.0
"""The EAGLE-3 draft head (issues 14, 24): the target's taps, heads in both published layouts (and a hub id), the
training pass equal to drafting, the head's drafts whatever the step shapes, lossless greedy and sampled decoding
with head chains and EAGLE-2 trees, the hybrid's choice, the shipped head and its card. Numerics against
`speculators`: `make check-eagle3`; the demo's head modes, bad --draft_head folders and the training command end to
end: tests/demo/test_draft_modes.py."""
import hashlib
import json
import math
import shutil
import sys
from itertools import accumulate

import pytest
import torch

from models.tt_transformers.errors import UserError
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.speculative.draft_length import linear_cost
from models.tt_transformers.speculative.drafters import Draft, HybridDrafter, ModelDrafter, SuffixDrafter, Verified
from models.tt_transformers.speculative.drafters.eagle3 import HeadDrafter
from models.tt_transformers.speculative.drafters.eagle3_base import RunCost
from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams
from models.tt_transformers.torch_backend import load
from models.tt_transformers.checkpoints.eagle3_format import DRAFT_HEADS, read_draft_head
from models.tt_transformers.torch_backend.attention import ExactToken
from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, load_draft_head
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.checkpoints.model_shape import ModelShape

from ..conftest import (REPO_ROOT, every_cpu_path_and_torch_ops, kernels_of, needs_cpu_kernels, random_head,
                       random_model, write_eagle3_head)
from .test_lossless_greedy import RecordingDrafter, head_drafter, make_eager, run, run_results
from .test_lossless_sampling import (
    ALPHA,
    N_DRAFT,
    SETTINGS,
    chi_square_p_value,
    exact_joint,
    sampled_counts,
)

SHIPPED = DRAFT_HEADS / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def shipped_head(embedded_bf16):
    return load_draft_head(SHIPPED, embedded_bf16)


# ---- the target's taps --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_cpu_kernels), False], ids=["cpu-kernels", "torch-ops"])
def test_taps_are_the_inputs_of_the_named_layers(embedded_checkpoint, embedded_bf16, kernels):
    """Tap i is the residual stream entering layer i: tap 0 is the token embedding; tap 12 equals the last layer's
    output of the model's first 12 layers (a separate forward); tap N, the last layer's output, gives the LM head's
    logits through the final norm; the blocks come in the order asked; a verification step's rows equal the same
    positions decoded one at a time."""
    model = embedded_bf16 if kernels else load.load_model(embedded_checkpoint, torch.bfloat16, 256,
                                                                cpu_kernels=False)
    n, dim = model.args.n_layers, model.args.dim
    lm = TorchCausalLM(model, n, 1)
    prompt = [1, 504, 3575, 282, 314, 2115, 30]
    pre = lm.prefill(0, prompt, taps=(0, 12, n))
    assert pre.hidden[0].shape == (len(prompt), 3 * dim)
    assert torch.equal(pre.hidden[0][:, :dim], model.tok_embeddings(torch.tensor(prompt)))
    first_12 = TorchCausalLM(model, 12, 1).prefill(0, prompt, taps=(12,)).hidden[0]
    assert torch.equal(pre.hidden[0][:, dim : 2 * dim], first_12)
    logits = model.output(model.norm(pre.hidden[0][-1:, 2 * dim :])).float()
    assert torch.equal(logits.argmax(-1), torch.tensor(pre.ids[0]))
    swapped = lm.prefill(0, prompt, taps=(n, 0)).hidden[0]
    assert torch.equal(swapped, torch.cat([pre.hidden[0][:, 2 * dim :], pre.hidden[0][:, :dim]], dim=-1))
    many = lm.step([UserRows(0, [11, 12, 13, 14], len(prompt))], taps=(2, 15, 27)).hidden[0]
    lm.prefill(0, prompt)
    one_by_one = torch.cat([lm.step([UserRows(0, [t], len(prompt) + i)], taps=(2, 15, 27)).hidden[0]
                            for i, t in enumerate([11, 12, 13, 14])])
    assert torch.equal(many, one_by_one)
    with pytest.raises(ValueError, match=r"taps \[31\]: layer ids must be in \[0, 30\]"):
        lm.step([UserRows(0, [11], len(prompt))], taps=(31,))


# ---- the published layouts ------------------------------------------------------------------------------------------

def head_logits(head, taps, tokens, steps=3):
    """A chain as drafting runs it: the true rows, then `steps` draft steps on the head's own states and argmax."""
    runner = HeadRunner(head, 1, 64, head.args)
    out, logits = runner.run([0], [0], [taps], [tokens])[0]
    rows, state = [logits], out[-1:]
    for k in range(steps):
        state, logits = runner.run([0], [len(tokens) + k], [state], [[int(head.vocab[rows[-1].argmax()])]])[0]
        rows.append(logits)
    return torch.stack(rows)


def test_both_layouts_and_a_hub_id_load_the_same_head(tmp_path, monkeypatch):
    """The same weights written in speculators' layout (safetensors, `layers.0.*`) and the EAGLE authors'
    (pytorch_model.bin, `midlayer.*`, a Llama config.json) give one head: the same drafts; a hub id resolves from
    the local Hugging Face cache as HF_MODEL does; the config's taps and draft vocabulary are used."""
    model = random_model(torch.float32, n_layers=6, max_seq_len=64)
    heads = {layout: load_draft_head(write_eagle3_head(tmp_path / layout, model.args, layout, draft_vocab=40,
                                                       taps=(1, 3, 6)), model) for layout in ("speculators", "eagle")}
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--eagle3-head" / "snapshots" / "abc123"
    shutil.copytree(tmp_path / "speculators", snapshot)
    (cache / "models--someone--eagle3-head" / "refs").mkdir()
    (cache / "models--someone--eagle3-head" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    heads["hub"] = load_draft_head("someone/eagle3-head", model)
    taps, tokens = torch.randn(5, 3 * model.args.dim), [3, 9, 27, 1, 50]
    reference = head_logits(heads["speculators"], taps, tokens)
    for name, head in heads.items():
        assert head.config.taps == (1, 3, 6) and len(head.vocab) == 40, name
        assert torch.equal(head_logits(head, taps, tokens), reference), name
    assert heads["eagle"].config.layout == "eagle"


def test_unsorted_taps_are_read_in_ascending_layer_order(tmp_path):
    """Issue 31's finding 8: fc reads the tapped states in ascending layer order whatever order
    eagle_aux_hidden_state_layer_ids lists them in (vLLM and sglang capture while walking the layers, speculators
    trains on that): a head listing [6, 1, 3] taps (1, 3, 6), as the same head listing them sorted."""
    model = random_model(torch.float32, n_layers=6, max_seq_len=64)
    unsorted = load_draft_head(write_eagle3_head(tmp_path / "a", model.args, "speculators", draft_vocab=40,
                                                 taps=(6, 1, 3)), model)
    ordered = load_draft_head(write_eagle3_head(tmp_path / "b", model.args, "speculators", draft_vocab=40,
                                                taps=(1, 3, 6)), model)
    assert unsorted.config.taps == ordered.config.taps == (1, 3, 6)
    taps, tokens = torch.randn(5, 3 * model.args.dim), [3, 9, 27, 1, 50]
    assert torch.equal(head_logits(unsorted, taps, tokens), head_logits(ordered, taps, tokens))


def test_llama8b_shaped_head_is_lossless_in_both_layouts(tmp_path):
    """A Llama-3.1-8B-shaped target (32 layers, 4:1 grouped-query attention, Llama-3 rope scaling; narrow layers)
    and random EAGLE-3 heads in both layouts with no tap list in their config: the drafter asks the backend for
    vLLM's default taps (2, 16, 29), and greedy output with head chains and head trees equals plain decoding."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    model = random_model(torch.float32, max_seq_len=96, n_layers=32, dim=64, n_heads=8, n_kv_heads=2, head_dim=8,
                         hidden_dim=96, vocab_size=300, rope_theta=500000.0, rope_scaling=rope, std=0.3)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    plain = run(model, prompts, 0, 0, 30)
    for layout in ("speculators", "eagle"):
        folder = write_eagle3_head(tmp_path / layout, model.args, layout, draft_vocab=200, taps=(2, 16, 29))
        config = json.loads((folder / "config.json").read_text())
        config.pop("eagle_aux_hidden_state_layer_ids")
        (folder / "config.json").write_text(json.dumps(config))
        head = load_draft_head(folder, model)
        for trees in (False, True):
            target = TorchCausalLM(model, 32, 2)
            target.supports_trees = trees
            target.step_cost = lambda n_users, n_rows, context_len: 1.0  # rows are free: trees grow as far as they may
            drafter = head_drafter(target, head)
            assert drafter.taps == (2, 16, 29)
            recording = RecordingDrafter(drafter)
            results = SpeculativeGenerator(target, recording, 4, ()).generate(prompts, 30)
            assert [r.output_tokens for r in results] == plain, (layout, trees)
            assert sum(len(d) for _, d, _ in recording.log) > 0


def test_training_time_test_is_what_drafting_computes():
    """The training pass (tools/train_draft_head.py, every position and level at once with EAGLE-3's diagonal
    attention pattern) gives the logits the head gives when it drafts chains step by step: level j at position p
    equals the j-th draft step of the chain started at p - j + 1 (float32, torch ops for both)."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import train_draft_head

    model = random_model(torch.float32, n_layers=6, max_seq_len=64)
    vocab = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40].sort().values
    head = train_draft_head.initial_head(model, vocab, (1, 3, 4))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
    B, T, levels = 2, 12, 4
    taps = torch.randn(B, T, 3 * model.args.dim)
    tokens = torch.randint(0, 64, (B, T + 2), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = train_draft_head.ttt_forward(head, taps, tokens[:, 1 : T + 1], levels)
    runner = HeadRunner(head, B, 64, model.args)
    worst = 0.0
    for b in range(B):
        for t in range(T - levels):
            out, logits = runner.run([b], [0], [taps[b, : t + 1]], [tokens[b, 1 : t + 2].tolist()])[0]
            worst = max(worst, float((logits - trained[0][b, t]).abs().max()))
            state = out[-1:]
            for j in range(2, levels + 1):  # the draft token fed at position t + j - 1 is the true token there
                pos = t + j - 1
                state, logits = runner.run([b], [pos], [state], [[int(tokens[b, pos + 1])]])[0]
                worst = max(worst, float((logits - trained[j - 1][b, pos]).abs().max()))
    assert worst < 1e-4, worst


# ---- the head's drafts ---------------------------------------------------------------------------------------------

@needs_cpu_kernels
def test_head_drafts_do_not_depend_on_step_shapes(embedded_bf16, shipped_head, sample_prompt_tokens):
    """The same text reached by one-token steps (plain decoding) or by one verification step of many tokens, and
    the head fed in one catch-up run or in chunks: the same features, so the same drafts and confidences."""
    prompt = sample_prompt_tokens[0]
    text = run(embedded_bf16, [prompt], 0, 0, 12)[0]

    def drafts_after(step_sizes, max_rows):
        target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
        runner = HeadRunner(shipped_head, 1, embedded_bf16.max_seq_len, embedded_bf16.args)
        runner.max_rows = max_rows
        drafter = HeadDrafter(runner)
        drafter.cost = RunCost(0.0, measure=False)
        out = target.prefill(0, prompt, taps=drafter.taps)
        drafter.start([0], [prompt], KeyedSampler(SamplingParams()), out.hidden)
        context, fed = list(prompt) + text[:1], 1
        for n in step_sizes:  # the target verifies text[fed - 1 : fed + n - 1], accepting all but the last row's
            rows = text[fed - 1 : fed - 1 + n]
            step = target.step([UserRows(0, rows, len(context) - 1)], taps=drafter.taps)
            drafter.accept(0, Verified(rows[1:] + step.ids[0][-1:], list(range(n - 1)), rows, None, step.hidden[0]))
            context += rows[1:] + step.ids[0][-1:]
            fed += n
        assert context == list(prompt) + text[:fed]
        draft = drafter.propose([0], [context], [6], linear_cost(0.0))[0]
        return draft.tokens, drafter.pending[0].confidences, sum(len(chunk) for chunk in drafter.known[0]), drafter.fed_len[0]

    reference = drafts_after([1] * 8, 256)
    assert reference[0], "the shipped head drafts after a chat prompt's first tokens"
    assert drafts_after([8], 256) == reference
    assert drafts_after([3, 1, 4], 256) == reference
    assert drafts_after([2, 6], 5) == reference  # the prompt's catch-up in runs of 5 rows


def test_hybrid_takes_the_draft_expected_to_bring_more():
    """The copied draft when its value (tokens per unit of work) beats the head's, else the head's; a copied draft
    that is withdrawn learns nothing from the head's verification."""
    class Fixed:
        top_k, taps = 0, (0,)

        def __init__(self, expected):
            self.expected, self.calls, self.accepted = expected, [], []

        def start(self, users, prompts, sampling, hidden=None):
            pass

        def draft_value(self, user, n, extra_cost):
            return (1 + self.expected) / (1 + extra_cost(n))

        def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
            self.calls.append(dict(zip(users, max_tokens)))
            return [Draft([7, 7], "head", expected=self.expected) for _ in users]

        def accept(self, user, verified):
            self.accepted.append(user)

    context = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # the automaton copies "4 1 2 3" with a long match
    for head_expected, source in ((0.5, "suffix"), (6.0, "head")):
        suffix, head = SuffixDrafter(1), Fixed(head_expected)
        hybrid = HybridDrafter(suffix, head)
        hybrid.start([0, 1], [context, [9]], KeyedSampler(SamplingParams()))
        drafts = hybrid.propose([0, 1], [context, [9, 8]], [4, 4], linear_cost(0.0))
        assert drafts[0].source == source and drafts[1].source == "head"  # user 1 has nothing to copy
        assert (head.calls[0][0] > 0) == (source == "head")  # told of every user, 0 tokens where the copy wins
        assert (0 in suffix.pending) == (source == "suffix")
        hybrid.accept(0, Verified([4], [], [3] + drafts[0].tokens))
        assert head.accepted == [0]


# ---- the head's own cache and what a run costs --------------------------------------------------------------------

def small_model_and_head(cpu_path):
    """A small random target (bf16 on a CPU kernel path, float32 on torch ops) and a random head beside it."""
    dtype = torch.bfloat16 if cpu_path else torch.float32
    model = random_model(dtype, max_seq_len=96, dim=64, head_dim=32, hidden_dim=96, vocab_size=50)
    if cpu_path:
        model.use_cpu_kernels(kernels_of(cpu_path))
    return dtype, model, random_head(model)


def attended_keys(head, monkeypatch) -> list[list[int]]:
    """Per call of the kernels' step attention by the head (on the CPU kernels), the number of keys each row sees."""
    calls, step_attention = [], head.kernels.step_attention

    def recording(qkv, n_heads, table, *args):
        t = table.tensor
        calls.append((t[:, 4] - t[:, 3] + t[:, 6]).tolist())  # run_end - first + the ancestors' count
        return step_attention(qkv, n_heads, table, *args)

    monkeypatch.setattr(head.kernels, "step_attention", recording)
    return calls


@needs_cpu_kernels
def test_a_head_the_kernels_do_not_fit_runs_on_torch_ops_beside_a_target_on_them():
    """The kernels' attention takes head_dims that are multiples of 32 up to 256: a head whose layer has another
    (here 16, beside a target of 32) runs on torch ops, drafting as it should, instead of reading past each row; the
    kernels' step attention refuses such a shape in one line."""
    from models.tt_transformers.torch_backend.cpu_kernels import StepTable

    model = random_model(torch.bfloat16, max_seq_len=96, dim=64, head_dim=32, hidden_dim=96, vocab_size=50)
    model.use_cpu_kernels(kernels_of(None))
    head = random_head(model, head_dim=16, n_heads=4, n_kv_heads=2)
    assert head.kernels is None and head.layer.attention.kernels is None
    out, logits = HeadRunner(head, 1, 96, model.args).run([0], [0], [torch.randn(5, 3 * 64).bfloat16()], [[1] * 5])[0]
    assert out.shape == (1, 64) and torch.isfinite(logits).all()
    cache = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim a multiple of 32 up to 256"):
        model.kernels.step_attention(torch.zeros(1, 8 * 16, dtype=torch.bfloat16), 4,
                                     StepTable.of([ExactToken(0, 0, 0, 0, 0, 1)]), model.rope_cos, model.rope_sin,
                                     cache, cache.clone())


def same_on(cpu_path):
    """Bit for bit on the kernels (row-invariant); to rounding on float32 torch ops (oneDNN's results depend on M)."""
    return torch.equal if cpu_path else (lambda a, b: torch.allclose(a, b, atol=1e-4, rtol=1e-4))


@every_cpu_path_and_torch_ops
def test_a_head_row_attends_its_window_alone(cpu_path):
    """HeadRunner's window: a row sees the `window` positions up to its own. Rows within the first window equal the
    whole-context head's; a later row's results do not depend on anything before its window (other states and tokens
    there give the same bits on the kernels), and differ from the whole-context head's."""
    dtype, model, head = small_model_and_head(cpu_path)
    gen = torch.Generator().manual_seed(3)
    n, window = 60, 16
    taps = torch.randn(n, 3 * model.args.dim, generator=gen).to(dtype)
    tokens = torch.randint(0, 50, (n + 1,), generator=gen).tolist()
    whole, _ = HeadRunner(head, 1, 96, model.args, window=None).run([0], [0], [taps], [tokens[1:]], every_row=True)[0]
    out, _ = HeadRunner(head, 1, 96, model.args, window=window).run([0], [0], [taps], [tokens[1:]], every_row=True)[0]
    same = same_on(cpu_path)
    assert same(out[:window], whole[:window]) and not torch.allclose(out[-1], whole[-1], atol=1e-3)
    cut = n - window  # the last row's window starts here
    other_taps = torch.cat([torch.randn(cut, 3 * model.args.dim, generator=gen).to(dtype), taps[cut:]])
    other_tokens = torch.randint(0, 50, (cut,), generator=gen).tolist() + tokens[cut:]
    again, _ = HeadRunner(head, 1, 96, model.args, window=window).run([0], [0], [other_taps], [other_tokens[1:]],
                                                                      every_row=True)[0]
    assert same(again[-1], out[-1])
    with pytest.raises(UserError, match="window"):
        HeadRunner(head, 1, 96, model.args, window=0)


@every_cpu_path_and_torch_ops
def test_head_cache_after_rejected_drafts_equals_an_uncached_run(cpu_path):
    """The head reads its own KV cache, fed once per verified row: fed in steps with a rejected drafted chain
    written past the fed rows after each (the next feed rewrites those slots before any row reads them), every fed
    row's state and logits are those of one uncached run over the whole text from a fresh cache: bit for bit on the
    kernels (a row's result does not depend on what shares its run), to rounding on float32 torch ops."""
    dtype, model, head = small_model_and_head(cpu_path)
    gen = torch.Generator().manual_seed(0)
    n = 80
    taps = torch.randn(n, 3 * model.args.dim, generator=gen).to(dtype)
    tokens = torch.randint(0, 50, (n + 1,), generator=gen).tolist()
    want_out, want_logits = HeadRunner(head, 1, 96, model.args).run([0], [0], [taps], [tokens[1:]], every_row=True)[0]
    same = same_on(cpu_path)
    runner, fed = HeadRunner(head, 1, 96, model.args), 0
    for rows in (37, 1, 3, 2, 5, 1, 4, 8, 19):
        out, logits = runner.run([0], [fed], [taps[fed : fed + rows]], [tokens[fed + 1 : fed + rows + 1]],
                                 every_row=True)[0]
        assert same(out, want_out[fed : fed + rows]) and same(logits, want_logits[fed : fed + rows]), (cpu_path, fed)
        fed += rows
        state = out[-1:]  # a chain drafted on the head's own states at positions fed, fed + 1, fed + 2: rejected
        for k in range(3):
            state, _ = runner.run([0], [fed + k], [state], [[int(torch.randint(0, 50, (1,), generator=gen))]])[0]
    assert fed == n


@every_cpu_path_and_torch_ops
def test_head_feed_attends_only_each_users_last_row(cpu_path, monkeypatch):
    """A feed (a prompt's catch-up, a verified step's rows) attends only each user's last row, whose state and
    logits the drafter reads: one attention call per user and run instead of one per row (over the whole cache: a
    cost quadratic in the prompt; on the kernels, one call where the other rows see their own key alone), and only
    those rows go through the output projection and the MLP (the others write their K/V alone); its results those of
    a run where every row attends (bit for bit on the kernels), and the cache the same."""
    from models.tt_transformers.torch_backend import attention

    dtype, model, head = small_model_and_head(cpu_path)
    gen = torch.Generator().manual_seed(1)
    taps = [torch.randn(n, 3 * model.args.dim, generator=gen).to(dtype) for n in (40, 7)]
    tokens = [torch.randint(0, 50, (len(t),), generator=gen).tolist() for t in taps]
    every = HeadRunner(head, 2, 96, model.args)
    want = every.run([0, 1], [0, 0], taps, tokens, every_row=True)
    calls = []
    sdpa = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    mlp_rows, mlp = [], head.layer.feed_forward.forward
    monkeypatch.setattr(head.layer.feed_forward, "forward", lambda x: mlp_rows.append(x.shape[1]) or mlp(x))
    kernel_calls = attended_keys(head, monkeypatch) if cpu_path else []
    last = HeadRunner(head, 2, 96, model.args)
    got = last.run([0, 1], [0, 0], taps, tokens)
    assert len(calls) == (0 if cpu_path else 2) and mlp_rows == [2]
    assert kernel_calls == ([[1] * 39 + [40] + [1] * 6 + [7]] if cpu_path else [])
    same = same_on(cpu_path)
    for (out, logits), (want_out, want_logits) in zip(got, want):
        assert out.shape[0] == 1 and same(out, want_out[-1:]) and same(logits, want_logits[-1])
    assert all(torch.equal(a, b) for a, b in zip(last.cache.k + last.cache.v, every.cache.k + every.cache.v))


@pytest.mark.parametrize("window", [None, 16, 1], ids=["whole-context", "window-16", "window-1"])
@every_cpu_path_and_torch_ops
def test_head_tree_nodes_read_the_cache_in_place_as_their_chains(cpu_path, window, monkeypatch):
    """A tree node's attention reads the head's cache where it lies, as a chain token's does: each node's keys are a
    view of its user's row (no copy of the context per node: gathered, a run's bytes grew as 3 passes over the cache
    per node; on the kernels, the cache before the tree and its ancestors' slots, as the target's tree nodes), its
    position + 1 of them, or the window's; and each node's state and logits are those of the chain of its path, bit
    for bit (window 1: a path longer than the window). Two users, a second depth whose nodes share the first's."""
    import torch.nn.functional as F

    dtype, model, head = small_model_and_head(cpu_path)
    gen = torch.Generator().manual_seed(2)
    fed = {0: 41, 1: 23}
    taps = {u: torch.randn(n, 3 * model.args.dim, generator=gen).to(dtype) for u, n in fed.items()}
    tokens = {u: torch.randint(0, 50, (n + 3,), generator=gen).tolist() for u, n in fed.items()}
    trees, chains = (HeadRunner(head, 2, 96, model.args, window=window) for _ in range(2))
    roots = {}
    for runner in (trees, chains):
        for u, n in fed.items():
            out, _ = runner.run([u], [0], [taps[u]], [tokens[u][1 : n + 1]])[0]
            roots[u] = out[-1:]
    storage, seen, sdpa = trees.cache.k[0].untyped_storage().data_ptr(), [], F.scaled_dot_product_attention

    def counting_sdpa(q, k, v, *args, **kwargs):
        seen.append((k.untyped_storage().data_ptr() == storage, k.shape[-2]))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    kernel_calls = attended_keys(trees.head, monkeypatch) if cpu_path else []
    # depth 1: nodes 0, 1 (user 0) and 2 (user 1) at each user's next position; depth 2: nodes 3, 4 under 1 and 0
    depth1 = [(0, fed[0], 0, ()), (0, fed[0], 1, ()), (1, fed[1], 2, ())]
    states1 = torch.cat([roots[0], roots[0], roots[1]])
    out1, logits1 = trees.run_tree(depth1, states1, [7, 9, 11])
    depth2 = [(0, fed[0] + 1, 3, (1,)), (0, fed[0] + 1, 4, (0,))]
    out2, logits2 = trees.run_tree(depth2, torch.cat([out1[1:2], out1[0:1]]), [5, 6])
    keys = [min(pos + 1, window or 96) for _, pos, *_ in depth1 + depth2]
    assert (seen, kernel_calls) == (([], [keys[:3], keys[3:]]) if cpu_path else ([(True, k) for k in keys], []))
    same = torch.equal if cpu_path else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    for u, path, tree_out, tree_logits in ((0, [7], out1[0], logits1[0]), (0, [9], out1[1], logits1[1]),
                                           (1, [11], out1[2], logits1[2]), (0, [9, 5], out2[0], logits2[0]),
                                           (0, [7, 6], out2[1], logits2[1])):
        state = roots[u]
        for k, token in enumerate(path):  # the chain of the node's path, one run a token, as _chains drafts
            state, logits = chains.run([u], [fed[u] + k], [state], [[token]])[0]
        assert same(state[0], tree_out) and same(logits, tree_logits), (cpu_path, u, path)


class TimedHead:
    """A stand-in head on a fake clock: a chain run takes 1 ms per row it carries (fed or drafted), a tree's run 1 ms,
    and it proposes token 3 with a probability of nearly 1."""

    vocab, vocab_size, taps, draft_cost = torch.arange(8), 8, (0,), 0.05
    max_rows, max_tree_nodes, window = 256, 64, 4096

    def __init__(self, clock: list):
        self.clock = clock

    @staticmethod
    def _outputs(rows: int):
        logits = torch.full((rows, 8), -30.0)
        logits[:, 3] = 30.0
        return torch.zeros(rows, 4), logits

    def run(self, users, start_pos, hidden, next_tokens):
        self.clock[0] += 1e-3 * sum(map(len, next_tokens))
        return [(out, logits[-1]) for out, logits in map(self._outputs, map(len, next_tokens))]

    def run_tree(self, nodes, states, tokens):
        self.clock[0] += 1e-3
        return self._outputs(len(nodes))


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_head_run_cost_leaves_out_the_feed(trees, monkeypatch):
    """The run cost the policy prices is a drafting run's, measured apart from the feed, against a plain step: after
    a 1,000-token prompt (the head's prefill, fed at its first proposal) and 30-token gaps between proposals, a
    drafting run still measures at 1 ms against the target's 10 ms plain step, which the verification step of k
    drafted rows takes (1 + extra_cost(k)) times."""
    from models.tt_transformers.speculative.drafters import eagle3_base

    clock = [0.0]
    monkeypatch.setattr(eagle3_base.time, "perf_counter", lambda: clock[0])  # the `time` module eagle3.py reads too
    drafter = HeadDrafter(TimedHead(clock))
    monkeypatch.setattr(drafter, "catch_up_pays", lambda *args: True)  # when a catch-up pays: tested below
    context = list(range(1000))
    drafter.start([0], [context], KeyedSampler(SamplingParams()), [torch.zeros(1000, 4)])
    for _ in range(6):
        draft = drafter.propose([0], [context], [4], linear_cost(0.25), trees)[0]
        assert draft.tokens
        parents = draft.parents or list(range(-1, len(draft.tokens) - 1))
        path = [0]  # the target accepts the path of token 3s (the root's first child, then each node's first child)
        while path[-1] in parents:
            path.append(parents.index(path[-1]))
        assert set(draft.tokens[i] for i in path) == {3}
        clock[0] += 1e-2 * (1 + 0.25 * len(draft.tokens))  # the target's verification step
        accepted = [3] * len(path) + [5]
        drafter.accept(0, Verified(accepted, path, [context[-1], *draft.tokens], None,
                                   torch.zeros(1 + len(draft.tokens), 4)))
        gap = list(range(30))  # steps the head did not draft for (a hybrid's copied drafts): fed at the next proposal
        drafter.known[0].append(torch.zeros(len(gap), 4))
        context += accepted + gap
    assert drafter.draft_cost == pytest.approx(0.1)


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_a_head_whose_runs_find_no_token_worth_drafting_stops_running(trees, monkeypatch):
    """A head that is run (its gate says its drafts pay) but whose first token is never likely enough to pay for
    its row drafts nothing; each such proposal costs a feed and a run. The gate learns it as a rejection, so the head
    stops running but for its probes, instead of running every step at a loss. (A fake clock: a head run 1 ms, the
    target's step 10 ms.)"""
    from models.tt_transformers.speculative.drafters import eagle3_base

    clock = [0.0]
    monkeypatch.setattr(eagle3_base.time, "perf_counter", lambda: clock[0])
    head = TimedHead(clock)
    monkeypatch.setattr(TimedHead, "_outputs", staticmethod(lambda rows: (torch.zeros(rows, 4), torch.zeros(rows, 8))))
    runs = []
    monkeypatch.setattr(head, "run", lambda users, *a, run=head.run: runs.append(len(users)) or run(users, *a))
    monkeypatch.setattr(head, "run_tree", lambda *a, run=head.run_tree: runs.append(1) or run(*a))
    drafter = HeadDrafter(head)
    context = list(range(20))
    drafter.start([0], [context], KeyedSampler(SamplingParams()), [torch.zeros(20, 4)])
    steps_run = []
    for step in range(40):
        before = len(runs)
        draft = drafter.propose([0], [context], [4], linear_cost(0.25), trees)[0]
        steps_run.append(len(runs) > before)
        clock[0] += 1e-2 * (1 + 0.25 * len(draft.tokens))  # the target's verification step
        drafter.accept(0, Verified([5], [], [context[-1], *draft.tokens], None, torch.zeros(1 + len(draft.tokens), 4)))
        context.append(5)
    assert steps_run[0] and sum(steps_run[10:]) <= 4, steps_run


def test_a_traced_head_whose_chains_find_no_token_worth_drafting_stops_drafting():
    """The same for a head that drafts a whole chain in one replay where its target keeps the taps (a TT device's,
    here a stand-in on the host): chains of unlikely tokens draft nothing, and the gate stops asking for them (the
    rows are still fed every step: the device's tap tile is rewritten by the next step)."""
    from models.tt_transformers.speculative.backend import DeviceRows
    from models.tt_transformers.speculative.drafters.eagle3_device import TracedHeadDrafter

    class UnlikelyChains:  # a stand-in for ttnn_backend/eagle3_head.py's head: chains of tokens at probability 0.05
        vocab, vocab_size, taps, draft_cost, chain_len, last_draft_s = torch.arange(8), 8, (0,), 0.05, 4, 1e-3

        def __init__(self):
            self.chains = 0

        def draft(self, feeds, chain_users, k):
            self.chains += bool(chain_users)
            return {u: ([3] * k, [0.05] * k) for u in chain_users}

    head = UnlikelyChains()
    drafter = TracedHeadDrafter(head)
    drafter.cost.measure = False
    context = list(range(20))
    drafter.start([0], [context], KeyedSampler(SamplingParams()), [torch.zeros(20, 4)])
    chains = []
    for step in range(40):
        before = head.chains
        draft = drafter.propose([0], [context], [4], linear_cost(0.25))[0]
        chains.append(head.chains > before)
        drafter.accept(0, Verified([5], [], [context[-1], *draft.tokens], None, DeviceRows(0, len(context) - 1)))
        context.append(5)
    assert chains[0] and sum(chains[10:]) <= 4, chains


def test_a_long_prompt_is_fed_to_the_head_once_the_request_has_made_enough_tokens_to_pay_for_it(monkeypatch):
    """The head's catch-up over a long prompt (rows x a catch-up row's measured cost, in plain steps) waits until
    the tokens the request has made, at the head's expected gain per token, cover it: a 5-token answer after a
    1,000-token prompt never pays for the head's prefill, a long answer pays it after a few tokens. The steps before
    run nothing on the head; the catch-up then feeds every row once, and the head drafts."""
    from models.tt_transformers.speculative.drafters import eagle3_base

    clock = [0.0]
    monkeypatch.setattr(eagle3_base.time, "perf_counter", lambda: clock[0])
    head = TimedHead(clock)
    runs = []
    monkeypatch.setattr(head, "run", lambda users, start, hidden, tokens, run=head.run: runs.append(
        sum(map(len, tokens))) or run(users, start, hidden, tokens))
    drafter = HeadDrafter(head)
    drafter.cost.feed_row_s, drafter.cost.step_s = 2e-4, 1e-2  # a catch-up row at 0.02 of a plain step
    prompt = list(range(1000))
    drafter.start([0], [prompt], KeyedSampler(SamplingParams()), [torch.zeros(1000, 4)])
    context, extra_cost, made = prompt + [7], linear_cost(0.25), []
    while not runs:
        assert len(context) - len(prompt) < 100, "the head never started"
        value = drafter.draft_value(0, 4, extra_cost)
        pays = (len(context) - len(prompt)) * (1 - 1 / value) >= (len(context) - 1) * drafter.cost.feed_row_value
        draft = drafter.propose([0], [context], [4], extra_cost)[0]
        assert bool(draft.tokens) == pays == bool(runs)
        if not runs:  # the target's plain step: its row's state waits for the head
            drafter.accept(0, Verified([5], [], [context[-1]], None, torch.zeros(1, 4)))
            context.append(5)
            made.append(len(context) - len(prompt))
    assert len(made) > 10 and drafter.fed_len[0] == len(context) - 1  # every row fed, once: in runs of up to 256
    assert sum(r for r in runs if r > 1) == len(context) - 1 and max(runs) == 256


def test_after_a_long_prompt_the_head_is_fed_its_last_window_rows_alone(monkeypatch):
    """Rows further back than the head's window are never attended: after a 1,000-token prompt a head with a
    300-position window is fed the prompt's last 300 rows (in runs of up to max_rows, from the first state in the
    window), none before, and drafts."""
    head = TimedHead([0.0])
    head.window = 300
    drafter = HeadDrafter(head)
    monkeypatch.setattr(drafter, "catch_up_pays", lambda *args: True)
    feeds, feed = [], drafter._feed
    monkeypatch.setattr(drafter, "_feed", lambda users, rows: feeds.extend(
        (start, states[0, 0].item(), len(states)) for start, states, _ in rows) or feed(users, rows))
    prompt = list(range(1000))
    drafter.start([0], [prompt], KeyedSampler(SamplingParams()), [torch.arange(1000.0).view(-1, 1).expand(-1, 4)])
    context = prompt + [7]
    assert drafter.propose([0], [context], [4], linear_cost(0.25))[0].tokens
    first = len(context) - 1 - 300
    assert feeds[0][:2] == (first, first) and sum(n for *_, n in feeds) == 300 and max(n for *_, n in feeds) <= 256
    assert drafter.fed_len[0] == len(context) - 1


def test_a_long_gap_is_priced_at_the_head_window_rows_at_most():
    """catch_up_pays prices a gap at the rows the head will be fed: with a 300-position window, 999 rows behind cost
    what 300 do, so the catch-up pays once the request's tokens cover 300 rows (at a catch-up row's 0.02 of a step and
    the head's expected gain), not 999."""
    head = TimedHead([0.0])
    head.window = 300
    drafter = HeadDrafter(head)
    drafter.cost.feed_row_s, drafter.cost.step_s = 2e-4, 1e-2
    prompt = list(range(1000))
    drafter.start([0], [prompt], KeyedSampler(SamplingParams()), [torch.zeros(1000, 4)])
    extra_cost = linear_cost(0.25)
    gain = 1 - 1 / drafter.draft_value(0, 4, extra_cost)
    made = [n for n in range(1, 200) if drafter.catch_up_pays(0, prompt + [5] * n, 4, extra_cost)][0]
    assert made == math.ceil(300 * 0.02 / gain - 1e-9) < 999 * 0.02 / gain


def test_head_feeds_each_verified_row_once_and_drafts_one_row_a_run(monkeypatch):
    """Counting the head's work over a generation (two users, a prompt caught up in chunks): each position's true
    row is fed exactly once, in order; a drafting run carries one row per user, and each such row attends its own
    cache up to its position (position + 1 keys): nothing is recomputed or fed again. After drafts were rejected, the
    fed slots of the head's cache hold what one run over the true rows writes (no rejected draft kept). Outputs equal
    plain decoding."""
    import torch.nn.functional as F

    model = random_model(torch.float32, max_seq_len=256, dim=64, head_dim=32, hidden_dim=96, vocab_size=50)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in (150, 60)]
    plain = [run(model, [p], 0, 0, 40)[0] for p in prompts]
    target = TorchCausalLM(model, model.args.n_layers, 2)
    drafter = head_drafter(target)
    drafter.head.max_rows = 32
    fed, drafting, keys, feeding, in_run = {0: [], 1: []}, [], [], [False], [False]
    feed, head_run, sdpa = drafter._feed, drafter.head.run, F.scaled_dot_product_attention

    def recording_feed(users, rows):
        feeding[0] = True
        for u, (start, states, tokens) in zip(users, rows):
            fed[u].append((start, len(states), states.clone(), tokens))
        try:
            return feed(users, rows)
        finally:
            feeding[0] = False

    def recording_run(users, start_pos, hidden, next_tokens, every_row=False):
        if not feeding[0]:
            drafting.append((list(start_pos), [len(t) for t in next_tokens]))
            keys.append([])
        in_run[0] = True
        try:
            return head_run(users, start_pos, hidden, next_tokens, every_row)
        finally:
            in_run[0] = False

    def counting_sdpa(q, k, v, *args, **kwargs):
        if in_run[0] and not feeding[0]:
            keys[-1].append(k.shape[-2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(drafter, "_feed", recording_feed)
    monkeypatch.setattr(drafter.head, "run", recording_run)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    results = SpeculativeGenerator(target, drafter, 4, (), trees=False).generate(prompts, 40)
    assert [r.output_tokens for r in results] == plain
    assert any(it.accepted < it.drafted for r in results for it in r.iterations)  # rejected drafts to roll back
    fresh = HeadRunner(drafter.head.head, 2, model.max_seq_len, model.args)
    for u, prompt in enumerate(prompts):
        starts = [start for start, *_ in fed[u]]
        assert starts == list(accumulate([0] + [rows for _, rows, *_ in fed[u]][:-1])), u  # contiguous, never twice
        n = sum(rows for _, rows, *_ in fed[u])
        assert n < len(prompt) + 40
        fresh.run([u], [0], [torch.cat([states for *_, states, _ in fed[u]])], [[t for *_, ts in fed[u] for t in ts]])
        for live, want in ((drafter.head.cache.k[0], fresh.cache.k[0]), (drafter.head.cache.v[0], fresh.cache.v[0])):
            assert torch.allclose(live[u, :, :n], want[u, :, :n], atol=1e-5, rtol=1e-5), u
    assert drafting and all(set(rows) == {1} for _, rows in drafting)
    assert keys == [[pos + 1 for pos in starts] for starts, _ in drafting]


# ---- lossless ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["head", "hybrid-head"])
def test_shipped_head_identical_to_plain_and_accepted(embedded_bf16, embedded_tokenizer, sample_prompt_tokens, mode,
                                                      shipped_head, monkeypatch):
    """The shipped head on the sample prompts, batched, with the length policy as the demo runs it: outputs equal
    plain greedy decoding, and its drafts are accepted (it agrees with the target far more than chance). 64 tokens a
    prompt: over fewer, the share accepted moved by 5 points between CPU paths (their sums round differently). The
    share depends on the draft lengths the policy picks from the step costs (longer drafts accept a smaller share),
    so the bound says far more than chance (1 in 49,152), not a rate; the hybrid gives the head only the steps its
    copies do not win, a few dozen drafted tokens. Rows are priced at avx512bf16's step costs on every path: at a
    forced path's own (avx2's rows cost 3x) the head drafts too few tokens to count."""
    from models.tt_transformers.torch_backend import causal_lm

    path = embedded_bf16.kernels.path.name if embedded_bf16.kernels else "avx512bf16"
    monkeypatch.setitem(causal_lm.STEP_COSTS, path, causal_lm.STEP_COSTS["avx512bf16"])
    eos = [embedded_tokenizer.eos_token_id]
    prompts = sample_prompt_tokens
    plain = [run(embedded_bf16, [p], 0, 0, 64, eos=eos)[0] for p in prompts]
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, len(prompts))
    head = head_drafter(target, shipped_head, eager=False)
    head.cost = RunCost(head.cost.estimate, measure=False)  # at this CPU's measured run cost the head rarely pays
    drafter = head if mode == "head" else HybridDrafter(SuffixDrafter(1, recycle=4), head)
    results = SpeculativeGenerator(target, drafter, 6, eos).generate(prompts, 64)
    assert [r.output_tokens for r in results] == plain
    steps = [it for r in results for it in r.iterations if it.draft_source == "head"]
    drafted, accepted = sum(it.drafted for it in steps), sum(it.accepted for it in steps)
    assert accepted >= 3 and accepted / drafted > 0.1, (accepted, drafted)


@every_cpu_path_and_torch_ops
def test_random_heads_identical_to_plain(cpu_path, monkeypatch):
    """Random heads over part of the vocabulary on random models: greedy output is plain decoding's, batched, at the
    end of the cache, with every draft length, in chains and in EAGLE-2 trees, and some drafts are accepted. Rows are
    priced cheap on every path (a row 0.03 of a step): at the fitted costs a random head's drafts seldom pay, and its
    probes alone came too rarely to be accepted."""
    from models.tt_transformers.torch_backend import causal_lm

    monkeypatch.setitem(causal_lm.STEP_COSTS, cpu_path or "avx512bf16", causal_lm.StepCost(0.03, 1e-4, 0.0))
    steps = []
    for seed in range(3):
        model = random_model(torch.bfloat16, seed=seed, dim=64, head_dim=32, hidden_dim=96, vocab_size=50)
        if cpu_path:
            model.use_cpu_kernels(kernels_of(cpu_path))
        prompts = [[1, 2, 3, 4, 1, 2], [5], [7, 8, 9, 10, 11, 12, 13]]
        plain = [run(model, [p], 0, 0, 60)[0] for p in prompts]
        for n_draft in (1, 4, 9):
            for trees in (False, True):
                results = run_results(model, prompts, n_draft, 1, 60, mode="head", trees=trees)
                assert [r.output_tokens for r in results] == plain, (seed, n_draft, trees)
                steps += [it for r in results for it in r.iterations]
    assert sum(it.drafted for it in steps) > 0 and sum(it.accepted for it in steps) > 0


@pytest.mark.parametrize("kind", ["head", "head-trees", "head-negative-control"])
def test_sampling_with_head_drafts_matches_the_target(kind, monkeypatch):
    """Chi-square over the first 5 sampled tokens of a 4-token model with a random head over 3 of the 4 tokens (q is
    zero on the fourth, mapped to the target's ids through d2t): verification against the target's keyed draws keeps
    the target's distribution, with chains (drawn from the head's q with the target's keys) and trees (the head's top
    tokens); accepting every draft does not."""
    from models.tt_transformers.speculative import generator as speculative_generator

    from .test_lossless_sampling import make_tiny_model

    tiny = make_tiny_model()
    # a flatter head for trees, so siblings outrank grandchildren and trees branch
    head = random_head(tiny, seed=5, std=0.15 if kind == "head-trees" else 0.6, vocab_share=0.75)
    assert len(head.vocab) == 3 and head.config.draft_vocab_size < tiny.args.vocab_size
    if kind == "head-negative-control":
        monkeypatch.setattr(speculative_generator, "verify_chain", lambda draft, target: list(draft) + [
            target[len(draft)]])
    branching = []

    class Branches(RecordingDrafter):
        def propose(self, *args, **kwargs):
            drafts = super().propose(*args, **kwargs)
            branching.extend(d.parents is not None and len(set(d.parents)) < len(d.parents) for d in drafts)
            return drafts

    def drafter(target):
        target.supports_trees = kind == "head-trees"
        return Branches(head_drafter(target, head))

    counts, full_chains, *_ = sampled_counts(tiny, drafter, N_DRAFT, SETTINGS, 100)
    p_value = chi_square_p_value(counts, exact_joint(tiny, SETTINGS))
    if kind == "head-negative-control":
        assert p_value < ALPHA
        return
    assert p_value > ALPHA
    if kind == "head":
        assert full_chains >= 100 * 32 // 4, full_chains  # whole chains of N_DRAFT head drafts were verified
    else:  # branching trees (of up to N_DRAFT nodes) were verified
        assert sum(branching) > 100, sum(branching)


# ---- the shipped head, its card and bad files ---------------------------------------------------------------------

def test_shipped_head_matches_its_card(embedded_checkpoint):
    """The head in the repository is the one its card describes (hash, draft vocabulary, parameter count, taps), an
    EAGLE-3 head in speculators' layout for the embedded model, with the acceptance the training command measured."""
    card = json.loads((SHIPPED / "card.json").read_text())
    config, weights = read_draft_head(SHIPPED, ModelShape.from_hf_config(embedded_checkpoint.config))
    assert config.layout == "speculators" and list(config.taps) == card["taps"] == [2, 15, 27]
    assert card["weights_sha256"] == hashlib.sha256((SHIPPED / "model.safetensors").read_bytes()).hexdigest()
    assert card["draft_vocabulary"]["size"] == config.draft_vocab_size
    assert card["parameters"] == sum(t.numel() for name, t in weights.items() if name not in ("d2t", "t2d"))
    assert card["target"] == embedded_checkpoint.name and card["command"].startswith("make train-draft-head")
    assert card["measured_on_held_out_topics"]["tokens_per_target_forward"] > 1.5
    assert set(card["measured_on_benchmark_sets"]) == {"chat", "qa", "translation", "summarization"}


# ---- the library's head mode: SpeculativeConfig.draft_head and make_drafter alone ------------------------------------

def test_head_mode_from_the_config_alone_is_the_shipped_head_and_lossless(embedded_bf16, embedded_tokenizer,
                                                                         sample_prompt_tokens):
    """make_drafter(SpeculativeConfig(draft_mode="head"), target) on the embedded model: the head shipped for it,
    built by the backend, drafting greedy output equal to plain decoding; the default config is the hybrid with
    it, and a draft model given to a hybrid with no draft_head named drafts instead."""
    from models.tt_transformers.speculative import SpeculativeConfig, make_drafter

    eos, prompts = [embedded_tokenizer.eos_token_id], sample_prompt_tokens[:2]
    plain = [run(embedded_bf16, [p], 0, 0, 32, eos=eos)[0] for p in prompts]
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, len(prompts))
    drafter = make_drafter(SpeculativeConfig(draft_mode="head", n_draft_tokens=6), target)
    shipped = read_draft_head(SHIPPED, embedded_bf16.args)[0]
    assert isinstance(drafter, HeadDrafter) and drafter.head.head.config == shipped
    drafter.cost = RunCost(drafter.cost.estimate, measure=False)  # drafts whatever this CPU's timing
    results = SpeculativeGenerator(target, drafter, 6, eos).generate(prompts, 32)
    assert [r.output_tokens for r in results] == plain
    assert sum(it.accepted for r in results for it in r.iterations if it.draft_source == "head") > 0
    default = make_drafter(SpeculativeConfig(), target)
    assert isinstance(default, HybridDrafter) and default.fallback.head.head.config == shipped
    view = target.draft_view(4)
    assert make_drafter(SpeculativeConfig(), target, draft_lm=view).fallback.lm is view


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_a_published_head_folder_drafts_through_the_config(tmp_path, layout):
    """A head in speculators' layout or the EAGLE authors', named by SpeculativeConfig.draft_head (head mode and the
    hybrid), is the head make_drafter drafts with: its taps and draft vocabulary, greedy output equal to plain."""
    from models.tt_transformers.speculative import SpeculativeConfig, make_drafter

    model = random_model(torch.float32, n_layers=6, max_seq_len=64)
    folder = write_eagle3_head(tmp_path / layout, model.args, layout, draft_vocab=40, taps=(1, 3, 6))
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    plain = run(model, prompts, 0, 0, 30)
    for mode in ("head", "hybrid"):
        target = TorchCausalLM(model, 6, 2)
        drafter = make_drafter(SpeculativeConfig(draft_mode=mode, draft_head=folder), target)
        head = drafter if mode == "head" else drafter.fallback
        assert isinstance(head, HeadDrafter) and head.taps == (1, 3, 6) and len(head.vocab) == 40
        assert head.head.head.config.layout == layout
        make_eager(head)
        results = SpeculativeGenerator(target, drafter, 4, ()).generate(prompts, 30)
        assert [r.output_tokens for r in results] == plain, mode
    assert isinstance(make_drafter(SpeculativeConfig(), target).fallback, ModelDrafter)  # no head ships for it


def bad_draft_head(case, tmp_path, model):
    """(SpeculativeConfig keywords, n_layers the target runs) of a head that does not fit `model` (6 layers)."""
    shape = model.args
    if case == "other-width":
        shape = ModelShape(**{**shape.__dict__, "dim": 48, "head_dim": 12})
    if case == "other-vocabulary":
        shape = ModelShape(**{**shape.__dict__, "vocab_size": 80})
    taps = {"taps-out-of-range": (1, 3, 9), "taps-a-truncated-target-lacks": (1, 3, 5)}.get(case, (1, 3, 6))
    folder = write_eagle3_head(tmp_path / case, shape, "speculators", draft_vocab=40, taps=taps)
    return {"no-head-ships": ({"draft_mode": "head"}, 6), "not-a-head": ({"draft_head": 3}, 6),
            "none-in-head-mode": ({"draft_mode": "head", "draft_head": "none"}, 6),
            "missing": ({"draft_head": tmp_path / "nowhere"}, 6),
            "taps-a-truncated-target-lacks": ({"draft_head": folder}, 4)}.get(case, ({"draft_head": folder}, 6))


@pytest.mark.parametrize("case,message", [
    ("other-width", r"draft_head .*: the head reads hidden size 48 \(its own 48\), but this target's is 32"),
    ("other-vocabulary", r"draft_head .*: the head's vocabulary has 80 tokens, this target's 64 \(another tokenizer\)"),
    ("taps-out-of-range", r"draft_head .*: eagle_aux_hidden_state_layer_ids \[1, 3, 9\] must be layers of this "
                          r"6-layer target"),
    ("taps-a-truncated-target-lacks", r"draft_head .* reads layers \[1, 3, 5\], but the target's n_layers keeps "
                                      r"4; keep all 6 layers or pass a draft_head for 4 layers"),
    ("no-head-ships", r"draft_mode head: no draft head ships for a target of no known checkpoint; pass draft_head"),
    ("not-a-head", r"draft_head 3 is not a head: give a folder or a cached hub id"),
    ("none-in-head-mode", r"draft_head 'none' with draft_mode 'head', which drafts with a head only"),
    ("missing", r"draft_head '.*nowhere' does not exist; give the head's folder or a hub id"),
])
def test_a_head_that_does_not_fit_is_refused_in_one_line(tmp_path, case, message):
    """make_drafter refuses a draft_head that cannot draft for the target in one UserError naming draft_head (or
    draft_mode) and the fix, before any head is built."""
    from models.tt_transformers.speculative import SpeculativeConfig, make_drafter
    from models.tt_transformers.torch_backend import eagle3_head

    model = random_model(torch.float32, n_layers=6, max_seq_len=64)
    config, n_layers = bad_draft_head(case, tmp_path, model)
    target = TorchCausalLM(model, n_layers, 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eagle3_head.Eagle3Head, "__init__", lambda *a, **k: pytest.fail("a head was built"))
        with pytest.raises(UserError, match=message) as error:
            make_drafter(SpeculativeConfig(**config), target)
    assert "\n" not in str(error.value)


def test_a_built_head_and_a_named_one_are_refused_together(tmp_path):
    from models.tt_transformers.speculative import SpeculativeConfig, make_drafter

    model = random_model(torch.float32, n_layers=6, max_seq_len=64)
    target = TorchCausalLM(model, 6, 1)
    folder = write_eagle3_head(tmp_path / "head", model.args, draft_vocab=40, taps=(1, 3, 6))
    runner = HeadRunner(random_head(model), 1, 64, model.args)
    with pytest.raises(UserError, match=r"draft_head '.*head' and a built head \(head or device_head\) both given"):
        make_drafter(SpeculativeConfig(draft_mode="head", draft_head=folder), target, head=runner)


# ---- training ------------------------------------------------------------------------------------------------------


def test_a_head_slower_than_the_target_step_is_reported_once(monkeypatch):
    """A host-side head beside a fast target (a TT device's step): once its runs measure slower than the target's
    step, one warning names both times (the head still drafts only when its acceptance covers that)."""
    from loguru import logger

    from models.tt_transformers.speculative.drafters import eagle3_base

    clock = iter(range(0, 10_000, 1))
    monkeypatch.setattr(eagle3_base.time, "perf_counter", lambda: next(clock) * 1e-3)  # 1 ms a tick
    messages = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="WARNING")
    try:
        cost = RunCost(0.05)
        for _ in range(2 * RunCost.WARN_AFTER):
            cost.ran(0.004)  # a head run: 4 ms
            cost.proposed(linear_cost(0.0))
            cost.verified(0)  # the target's step: 1 ms
    finally:
        logger.remove(sink)
    assert cost.value == pytest.approx(4.0)
    assert len(messages) == 1 and "4.0 ms, 4.0x the target's step (1.0 ms)" in messages[0], messages
