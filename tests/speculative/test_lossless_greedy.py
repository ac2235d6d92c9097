# SPDX-License-Identifier: Apache-2.0
"""Greedy speculative decoding is token-identical to plain greedy decoding of the same target (bf16 and fp32)."""
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.tt_transformers.speculative import SpeculativeConfig, make_drafter
from models.tt_transformers.speculative.draft_length import LENGTH_BUCKETS, MatchAcceptance
from models.tt_transformers.speculative.drafters import ModelDrafter, SuffixDrafter
from models.tt_transformers.speculative.drafters.eagle3 import HeadDrafter
from models.tt_transformers.speculative.drafters.eagle3_base import RunCost
from models.tt_transformers.speculative.sampling import probabilities
from models.tt_transformers.torch_backend.eagle3_head import HeadRunner
from models.tt_transformers.speculative.verification import verify_chain
from models.tt_transformers.speculative.backend import UserRows
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.prompts import encode
from models.tt_transformers.speculative.generator import SpeculativeGenerator

from ..conftest import CPU_PATHS, every_cpu_path, kernels_of, random_head, random_model

N_TOKENS = 32


def make_eager(drafter: HeadDrafter) -> HeadDrafter:
    """Every chain runs while its tokens have any chance (no price per head run, acceptance trusted): tests
    verification, not the length policy."""
    drafter.cost = RunCost(0.0, measure=False)
    drafter.acceptance = MatchAcceptance(prior=[0.99] * len(LENGTH_BUCKETS), decay=1.0, prior_weight=1e9)
    return drafter


def head_runner(target, head=None) -> HeadRunner:
    """A draft head beside the target (a random head unless given)."""
    return HeadRunner(head or random_head(target.model), target.max_batch_size, target.max_seq_len, target.model.args)


def head_drafter(target, head=None, eager=True):
    """A draft head's drafter (a random head unless given), eager (make_eager) unless told otherwise."""
    drafter = make_drafter(SpeculativeConfig(draft_mode="head"), target, head=head_runner(target, head))
    return make_eager(drafter) if eager else drafter


def drafter_for_mode(target, mode, draft_layers, sa_threshold=4, shared_cache=True, memory=False, recycle=0):
    """The drafter the demo builds for --draft_mode, through the library's make_drafter (hybrid: with an adaptive
    model draft; head / hybrid-head: a random draft head, eager, alone / with the copied drafts). shared_cache: the
    draft is a view of the target's first layers and cache (as the demo builds it), else it has a cache of its own;
    memory / recycle: the copied drafts also come from earlier responses / the target's top `recycle` tokens."""
    config = SpeculativeConfig(draft_mode="hybrid" if mode == "hybrid-head" else mode, sa_threshold=sa_threshold,
                               draft_memory=4096 if memory else 0, recycle_top_k=recycle, draft_layers=draft_layers,
                               draft_head="none" if mode == "hybrid" else None)  # hybrid: the draft model's
    if mode in ("head", "hybrid-head"):
        drafter = make_drafter(config, target, head=head_runner(target))
        make_eager(drafter.fallback if mode == "hybrid-head" else drafter)
        return drafter
    lm = None if shared_cache else TorchCausalLM(target.model, draft_layers, target.max_batch_size)
    return make_drafter(config, target, draft_lm=lm, draft_cost=draft_layers / target.n_layers)


def run_results(model, prompts, n_draft, draft_layers, max_tokens=N_TOKENS, eos=(), batch=None, mode="model",
                sa_threshold=4, shared_cache=True, memory=False, recycle=0, trees=True):
    batch = batch or len(prompts)
    target = TorchCausalLM(model, model.args.n_layers, batch)
    drafter = (drafter_for_mode(target, mode, draft_layers, sa_threshold, shared_cache, memory, recycle)
               if n_draft else None)
    return SpeculativeGenerator(target, drafter, n_draft, eos, trees=trees).generate(prompts, max_tokens)


def run(*args, **kwargs):
    return [r.output_tokens for r in run_results(*args, **kwargs)]


@pytest.fixture(scope="module")
def plain_outputs(embedded_bf16, sample_prompt_tokens, embedded_tokenizer):
    eos = [embedded_tokenizer.eos_token_id]
    return [run(embedded_bf16, [p], 0, 0, eos=eos)[0] for p in sample_prompt_tokens]


@pytest.mark.parametrize("n_draft", [1, 2, 4, 8])
@pytest.mark.parametrize("draft_layers", [4, 15, 28])
def test_sample_prompts_identical_to_plain(embedded_bf16, sample_prompt_tokens, embedded_tokenizer, plain_outputs,
                                           n_draft, draft_layers):
    """All sample prompts in one batch: each user's speculative output equals its own batch-1 plain output."""
    outs = run(embedded_bf16, sample_prompt_tokens, n_draft, draft_layers, eos=[embedded_tokenizer.eos_token_id])
    assert outs == plain_outputs


@pytest.mark.parametrize("shared_cache", [True, False])
def test_batch1_speculative_identical_to_plain(embedded_bf16, sample_prompt_tokens, embedded_tokenizer, plain_outputs,
                                               shared_cache):
    for prompt, expected in zip(sample_prompt_tokens, plain_outputs):
        assert run(embedded_bf16, [prompt], 4, 20, eos=[embedded_tokenizer.eos_token_id],
                   shared_cache=shared_cache)[0] == expected


@pytest.mark.parametrize("mode", ["suffix", "hybrid"])
@pytest.mark.parametrize("n_draft", [4, 16])
def test_suffix_and_hybrid_identical_to_plain(embedded_bf16, embedded_tokenizer, sample_prompt_tokens, mode, n_draft):
    """Sample prompts plus a copy-heavy one, batched, with the copied drafts as the demo builds them (memory of
    earlier responses, recycling, token trees): copied drafts must actually be made and accepted."""
    eos = [embedded_tokenizer.eos_token_id]
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    copy = encode(embedded_tokenizer, f"Rename w to width and h to height in this code:\n{code}", True)
    prompts = sample_prompt_tokens[:3] + [copy]
    plain = [run(embedded_bf16, [p], 0, 0, 48, eos=eos)[0] for p in prompts]
    results = run_results(embedded_bf16, prompts, n_draft, 8, 48, eos=eos, mode=mode, memory=True, recycle=4)
    assert [r.output_tokens for r in results] == plain
    copied = [it for it in results[-1].iterations if it.draft_source in ("suffix", "tree")]
    assert copied and sum(it.accepted for it in copied) > 0
    assert all(it.match_len >= 4 for it in results[-1].iterations if it.draft_source == "suffix")


@st.composite
def tiny_models(draw):
    model = random_model(draw(st.sampled_from([torch.bfloat16, torch.float32])), seed=draw(st.integers(0, 2**16)),
                         n_layers=draw(st.integers(2, 4)), n_kv_heads=draw(st.sampled_from([1, 2, 4])),
                         head_dim=draw(st.sampled_from([8, 32])), vocab_size=draw(st.sampled_from([7, 64])),
                         tie_word_embeddings=draw(st.booleans()), sliding_window=draw(st.sampled_from([None, 3, 8])))
    if CPU_PATHS and model.supports_cpu_kernels():  # on one of the CPU paths this machine runs
        model.use_cpu_kernels(kernels_of(draw(st.sampled_from(CPU_PATHS))))
    return model


def check_case(model, prompts, n_draft, draft_layers, max_tokens, eos, tally, **drafting):
    """One generated case: speculative output equals the written-out reference loop's for every user; the tally
    counts what the case exercised (accepted drafts per source, an EOS inside accepted drafts, users stopped by the
    end of the cache)."""
    plain = [reference_decode(TorchCausalLM(model, model.args.n_layers, 1), [p], max_tokens, eos)[0] for p in prompts]
    results = run_results(model, prompts, n_draft, draft_layers, max_tokens, eos, **drafting)
    assert [r.output_tokens for r in results] == plain
    for prompt, r in zip(prompts, results):
        for it in r.iterations:
            tally[it.draft_source] += it.accepted
        if r.iterations:  # what the last iteration appended: an EOS among its accepted drafts cuts before the bonus
            last = r.iterations[-1]
            appended = len(r.output_tokens) - 1 - sum(it.accepted + 1 for it in r.iterations[:-1])
            tally["EOS inside accepted drafts"] += r.output_tokens[-1] in eos and appended <= last.accepted
        tally["end of cache"] += len(prompt) + len(r.output_tokens) == model.max_seq_len


def test_generated_cases_identical_to_plain():
    """Random small models (torch ops or the bf16 CPU kernels), prompts, draft modes (random draft heads too), draft
    lengths and depths, drafts with their own cache or the target's, memory, recycling and token trees on or off,
    batch sizes, EOS and cache limits (derandomized: the same cases every run), against the written-out reference;
    the cases together must have accepted drafts from every source, an EOS inside accepted drafts and users stopped by
    the end of the cache (the tally)."""
    tally = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(model=tiny_models(), data=st.data())
    def generated(model, data):
        vocab = model.args.vocab_size
        n_users = data.draw(st.integers(1, 3))
        prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)) for _ in range(n_users)]
        check_case(model, prompts, data.draw(st.integers(1, 8)), data.draw(st.integers(1, model.args.n_layers - 1)),
                   data.draw(st.integers(1, 60)),  # up to past max_seq_len=64: must stop cleanly at the cache end
                   data.draw(st.sampled_from([(), (0,)])), tally,
                   mode=data.draw(st.sampled_from(["model", "suffix", "hybrid", "head", "hybrid-head"])),
                   sa_threshold=data.draw(st.integers(1, 4)), shared_cache=data.draw(st.booleans()),
                   memory=data.draw(st.booleans()), recycle=data.draw(st.sampled_from([0, 3])),
                   trees=data.draw(st.booleans()))
    generated()
    # Pinned: drafts from the memory of earlier responses need a second request through the same drafter
    model = random_model(torch.float32, seed=5)
    target = TorchCausalLM(model, model.args.n_layers, 1)
    drafter = drafter_for_mode(target, "suffix", 1, sa_threshold=2, memory=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = reference_decode(TorchCausalLM(model, model.args.n_layers, 1), [prompt], 40)
    for _ in range(2):
        (result,) = SpeculativeGenerator(target, drafter, 4).generate([prompt], 40)
        assert result.output_tokens == plain[0]
        for it in result.iterations:
            tally[it.draft_source] += it.accepted
    # Pinned: an EOS that a 2-of-3-layer draft model drafts and the target accepts (the 4th token of plain decoding)
    model = random_model(torch.float32, seed=0)
    eos = reference_decode(TorchCausalLM(model, model.args.n_layers, 1), [prompt], 40)[0][3]
    check_case(model, [prompt], 4, 2, 40, (eos,), tally, mode="model")
    for feature in ("model", "suffix", "tree", "memory", "recycle", "head", "EOS inside accepted drafts",
                    "end of cache"):
        assert tally[feature] > 0, (feature, tally)


def test_verify_chain():
    assert verify_chain([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus token
    assert verify_chain([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # first mismatch: the target's correction
    assert verify_chain([5], [4, 1]) == [4]
    assert verify_chain([], [3]) == [3]  # no draft: plain decoding
    with pytest.raises(AssertionError):
        verify_chain([1, 2], [1, 2])


class RecordingDrafter:
    """Wraps a drafter and records every proposal (context length, draft) and how much of it was accepted."""

    def __init__(self, inner):
        self.inner, self.log, self.pending = inner, [], {}

    def start(self, users, prompts, sampling, hidden=None):
        self.inner.start(users, prompts, sampling, hidden)

    @property
    def top_k(self):
        return self.inner.top_k

    @property
    def taps(self):
        return self.inner.taps

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        drafts = self.inner.propose(users, contexts, max_tokens, extra_cost, trees)
        self.pending = {u: (len(ctx), d.tokens) for u, ctx, d in zip(users, contexts, drafts)}
        return drafts

    def accept(self, user, verified):
        self.log.append((*self.pending.pop(user), verified.n_accepted))
        self.inner.accept(user, verified)


def test_eos_inside_accepted_draft_stops(embedded_bf16):
    """An EOS inside an accepted run of drafts ends generation at the EOS, as plain decoding would."""
    prompt = [1, 504, 3575, 282]
    plain = run(embedded_bf16, [prompt], 0, 0, 40)[0]
    eos = plain[5]  # a token plain decoding emits mid-sequence, used as EOS: plain stops there
    expected = plain[: plain.index(eos) + 1]
    assert run(embedded_bf16, [prompt], 0, 0, 40, eos=[eos])[0] == expected
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
    drafter = RecordingDrafter(ModelDrafter(target.draft_view(29)))
    assert SpeculativeGenerator(target, drafter, 8, [eos]).generate([prompt], 40)[0].output_tokens == expected
    eos_at = len(prompt) + plain.index(eos)  # its position in the context
    assert any(start <= eos_at < start + n_accepted and draft[eos_at - start] == eos
               for start, draft, n_accepted in drafter.log), drafter.log  # it came as an accepted draft token


def test_longest_drafts_are_lossless(embedded_bf16, embedded_tokenizer):
    """--n_draft_tokens 64, the maximum: a copy task where the automaton drafts long chains (priced as on a TT
    device, where rows are nearly free, so its drafts run long) and the 28-layer draft model drafts 64 tokens at
    every iteration, identical to plain decoding."""
    eos = [embedded_tokenizer.eos_token_id]
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"
    prompt = encode(embedded_tokenizer, f"Repeat exactly, twice: {text} {text}", True)
    plain = run(embedded_bf16, [prompt], 0, 0, 96, eos=eos)[0]
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
    target.step_cost = lambda n_users, n_rows, context_len: 1.0
    suffix = SpeculativeGenerator(target, SuffixDrafter(1), 64, eos, trees=False).generate([prompt], 96)[0]
    model = run_results(embedded_bf16, [prompt], 64, 28, 96, eos=eos, mode="model")[0]
    for result, longest in ((suffix, 32), (model, 64)):
        assert result.output_tokens == plain
        assert max(it.drafted for it in result.iterations) >= longest


@every_cpu_path
def test_every_cpu_path_at_the_embedded_shapes(embedded_checkpoint, embedded_tokenizer, sample_prompt_tokens,
                                               cpu_path, monkeypatch):
    """The real model on each CPU path this machine runs (what an AVX2, AVX-512 or older CPU runs): model, suffix and
    hybrid drafts for three users at once give each user's batch-1 plain decode on that path, with drafts accepted
    (priced at avx512bf16's step costs on every path: where verified rows cost more, the policy drafts too little in
    24 tokens for the check to see drafts)."""
    from models.tt_transformers.torch_backend import causal_lm
    from models.tt_transformers.torch_backend.load import load_model

    monkeypatch.setitem(causal_lm.STEP_COSTS, cpu_path, causal_lm.STEP_COSTS["avx512bf16"])

    eos = [embedded_tokenizer.eos_token_id]
    prompts = sample_prompt_tokens[1:4]
    model = load_model(embedded_checkpoint, torch.bfloat16, 256, cpu_kernels=cpu_path)
    assert model.kernels.path.name == cpu_path
    plain = [run(model, [p], 0, 0, 24, eos=eos)[0] for p in prompts]
    for mode in ("model", "suffix", "hybrid"):
        results = run_results(model, prompts, 4, 20, 24, eos=eos, mode=mode, sa_threshold=1)
        assert [r.output_tokens for r in results] == plain, mode
        assert sum(it.accepted for r in results for it in r.iterations) > 0, mode


def test_torch_ops_path_at_the_embedded_shapes(embedded_checkpoint, embedded_tokenizer, sample_prompt_tokens):
    """The fallback without a C compiler (and TT_CPU_KERNELS=0), bf16 and float32, on the real model: decode and
    verification steps of three users at once equal each user's batch-1 plain decode."""
    from models.tt_transformers.torch_backend.load import load_model

    eos = [embedded_tokenizer.eos_token_id]
    prompts = sample_prompt_tokens[1:4]
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(embedded_checkpoint, dtype, 256, cpu_kernels=False)
        assert model.kernels is None
        plain = [run(model, [p], 0, 0, 20, eos=eos)[0] for p in prompts]
        for mode in ("model", "suffix"):
            results = run_results(model, prompts, 4, 20, 20, eos=eos, mode=mode, sa_threshold=1)
            assert [r.output_tokens for r in results] == plain, (dtype, mode)
            assert sum(it.drafted for r in results for it in r.iterations) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["model", "suffix", "hybrid"])
def test_cuda_greedy_identical_to_plain(mode):
    """On CUDA (eager torch ops), 135M-shaped and small random models: speculative == plain, batched."""
    for model in (random_model(torch.bfloat16, max_seq_len=128, seed=1, std=0.05, dim=576, n_layers=4, n_heads=9,
                               n_kv_heads=3, head_dim=64, hidden_dim=1536, vocab_size=4096).cuda(),
                  random_model(torch.float32, seed=2).cuda()):
        prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [9, 10, 9, 10, 9]]
        plain = [run(model, [p], 0, 0, 40)[0] for p in prompts]
        assert run(model, prompts, 4, 2, 40, mode=mode, sa_threshold=2) == plain


def reference_decode(lm, prompts, max_tokens, eos=(), sampler=None):
    """Plain decoding written out over the backend's own prefill and step, one token per user per step, with none of
    the generator's code: the independent anchor for every lossless comparison. Each token is the target's argmax,
    or with a KeyedSampler its keyed draw at its position. A user stops at an EOS (kept), at max_tokens, or when its
    context fills the cache."""
    def token(u, out, i, position):
        if sampler is None:
            return out.ids[i][0]
        return sampler.sample(probabilities(out.logits[i][0], sampler.params), u, position)
    logits = sampler is not None
    outs = [[token(u, lm.prefill(u, p, logits=logits), 0, len(p))] for u, p in enumerate(prompts)]
    contexts = [list(p) + out for p, out in zip(prompts, outs)]

    def done(u):
        return len(outs[u]) >= max_tokens or outs[u][-1] in eos or len(contexts[u]) >= lm.max_seq_len
    active = [u for u in range(len(prompts)) if not done(u)]
    while active:
        step = lm.step([UserRows(u, [contexts[u][-1]], len(contexts[u]) - 1) for u in active], logits=logits)
        for i, u in enumerate(active):
            t = token(u, step, i, len(contexts[u]))
            outs[u].append(t)
            contexts[u].append(t)
        active = [u for u in active if not done(u)]
    return outs


class ScriptedTree:
    """A drafter that proposes one token tree at its first iteration and nothing after: a wrong first branch, then
    the given chain as the second branch (from the context's last token)."""

    top_k, taps = 0, ()

    def __init__(self, wrong: int, chain: list[int]):
        self.tokens = [wrong, *chain]
        self.parents = [-1, -1, *range(1, len(chain))]
        self.proposed = False

    def start(self, users, prompts, sampling, hidden=None):
        pass

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        from models.tt_transformers.speculative.drafters import Draft

        assert trees, "the target must verify token trees"
        drafts = [Draft(self.tokens, "tree", parents=self.parents) if not self.proposed else Draft([], "none")
                  for _ in users]
        self.proposed = True
        return drafts

    def accept(self, user, verified):
        pass


@pytest.mark.parametrize("batch", [1, 2])
def test_tree_with_a_deep_second_branch_accepted(embedded_bf16, batch):
    """A token tree whose second branch (3 deep) is the target's own continuation and whose first branch is wrong:
    the accepted path is moved to its true positions (commit_path), so what follows equals plain decoding."""
    prompts = [[1, 504, 3575, 282], [1, 9690, 198, 2683]][:batch]
    lm = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, batch)
    plain = reference_decode(lm, prompts, 24)
    chain = plain[0][1:4]
    wrong = next(t for t in range(10, 20) if t != chain[0])
    results = SpeculativeGenerator(lm, ScriptedTree(wrong, chain), 4).generate(prompts, 24)
    assert [r.output_tokens for r in results] == plain
    first = results[0].iterations[0]
    assert first.draft_source == "tree" and first.accepted == 3


def test_independent_reference_and_exact_end_of_cache(embedded_bf16, embedded_checkpoint, sample_prompt_tokens):
    """Plain decoding through the generator equals the written-out reference loop, batched; and with a cache that
    ends mid-answer, plain and speculative decoding both stop exactly at its last position."""
    prompts = sample_prompt_tokens[:3]
    lm = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 3)
    reference = reference_decode(lm, prompts, N_TOKENS)
    assert [r.output_tokens for r in SpeculativeGenerator(lm, None, 0).generate(prompts, N_TOKENS)] == reference
    eos = [reference[0][5]]  # a token the first answer emits mid-way, as EOS: that answer stops there, EOS kept
    reference = reference_decode(lm, prompts, N_TOKENS, eos)
    assert reference[0][-1] == eos[0] and len(reference[0]) == 6
    for drafter in (None, ModelDrafter(lm.draft_view(29)), SuffixDrafter(1)):
        results = SpeculativeGenerator(lm, drafter, 8 if drafter else 0, eos).generate(prompts, N_TOKENS)
        assert [r.output_tokens for r in results] == reference
    from models.tt_transformers.torch_backend.load import load_model

    short = load_model(embedded_checkpoint, torch.bfloat16, len(prompts[0]) + 20)  # a cache that ends mid-answer
    lm = TorchCausalLM(short, short.args.n_layers, 1)
    reference = reference_decode(lm, prompts[:1], 1000)
    assert len(prompts[0]) + len(reference[0]) == short.max_seq_len
    for drafter in (SuffixDrafter(1), ModelDrafter(lm.draft_view(20))):
        results = SpeculativeGenerator(lm, drafter, 8).generate(prompts[:1], 1000)
        assert [r.output_tokens for r in results] == reference
