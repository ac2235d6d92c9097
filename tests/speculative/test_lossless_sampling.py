# SPDX-License-Identifier: Apache-2.0
"""Speculative sampling follows the target's distribution exactly (every token the target's keyed draw at its
position, sampling.py), for model, suffix, tree and hybrid drafts.

Each statistical test is a chi-square goodness-of-fit test at significance ALPHA against probabilities computed
exactly from the target, with enough samples that a plainly wrong verifier (one that accepts every draft token)
fails the same test: the negative controls below prove the tests can fail. tests/speculative/test_seeded_sampling.py checks that
the same seed gives the very tokens of plain sampling.
"""
from collections import Counter

import pytest
import torch

from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.draft_length import LENGTH_BUCKETS, MatchAcceptance
from models.tt_transformers.speculative.drafters import HybridDrafter, ModelDrafter, SuffixDrafter
from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams, TargetSamples, probabilities
from models.tt_transformers.speculative.verification import verify_chain
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import random_model

ALPHA = 1e-3


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of observed counts to probabilities; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    if (~keep & (obs > 0)).any():
        return 0.0  # a sample where the target has no probability at all
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# ---- keyed draws and verification on hand-made distributions ----

P = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
Q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])  # very unlike P, and puts mass where P has none


def first_tokens(draft_of, verify=verify_chain, n=20000):
    """Counts of the first token appended after a one-token draft, over n positions (each its own key), and how many
    drafts were accepted. draft_of(sampler, position) -> the draft token."""
    sampler = KeyedSampler(SamplingParams(1.0, seed=0))
    logits = P.log().expand(2, -1)  # after the last token and after the draft: probabilities() gives P back
    counts, accepted = torch.zeros(len(P)), 0
    for t in range(n):
        draft = [draft_of(sampler, t)]
        out = verify(draft, TargetSamples(sampler, 0, logits, [t, t + 1]))
        counts[out[0]] += 1
        accepted += len(out) > 1
    return counts, accepted / n


def coupled(sampler, position):
    """A draft drawn from Q with the target's key, as a draft model or a head draws."""
    return sampler.sample(Q, 0, position)


def exact_coupling(p, q) -> float:
    """P(argmax p_i / E_i == argmax q_i / E_i) for shared exponentials E: sum over i of 1 / sum_j max(p_j/p_i, q_j/q_i)."""
    both = (p > 0) & (q > 0)
    return sum(1 / float(torch.maximum(p / p[i], q / q[i]).sum()) for i in both.nonzero().flatten())


def test_keyed_draws_with_coupled_drafts_preserve_p():
    """Drafts drawn from Q with the target's key: the appended token follows P, and the drafts are accepted as often as
    shared noise makes the two draws agree (0.447 here: independent draws would agree 0.2 of the time, rejection
    sampling accepts 1 - TV = 0.5)."""
    counts, accepted = first_tokens(coupled)
    assert chi_square_p_value(counts, P) > ALPHA
    assert abs(accepted - exact_coupling(P, Q)) < 0.02, accepted


@pytest.mark.parametrize("token", [0, 1, 3, 4])
def test_point_mass_drafts_preserve_p(token):
    """A copied draft always proposes the same token, likely or not (4 has target probability 0)."""
    counts, accepted = first_tokens(lambda sampler, t: token)
    assert chi_square_p_value(counts, P) > ALPHA
    assert abs(accepted - float(P[token])) < 0.02


def test_negative_control_accepting_every_draft_is_detected():
    """With the comparison removed (keep every draft), the same check must fail."""
    counts, _ = first_tokens(coupled, verify=lambda draft, target: list(draft) + [target[len(draft)]])
    assert chi_square_p_value(counts, P) < ALPHA


def test_probabilities_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0)), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.8)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.81)),
                          torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    cold = probabilities(logits, SamplingParams(0.5))
    assert torch.allclose(cold, torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- end to end: the first generated tokens of a small model ----

# The first token comes from the prefill; the next four from iterations that verify up to 3 drafts plus a bonus
# token, so whole chains of 3 drafted tokens pass through rejection sampling (checked below, not assumed).
VOCAB, BATCH, N_TOKENS, N_DRAFT = 4, 32, 5, 3
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so the suffix automaton drafts "3 1 2 ..." from the start
SETTINGS = SamplingParams(temperature=0.9, top_k=3)  # 3^5 = 243 sequences carry the probability


def make_tiny_model():
    return random_model(torch.float32, max_seq_len=32, seed=3, std=0.4, vocab_size=VOCAB, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model()


def sequence_index(tokens) -> int:
    index = 0
    for t in tokens:
        index = index * VOCAB + t
    return index


def exact_joint(model, params) -> torch.Tensor:
    """P(first N_TOKENS tokens) under target-only sampling, by enumerating every prefix: [VOCAB ** N_TOKENS]."""
    lm = TorchCausalLM(model, model.args.n_layers, 1)
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = [[]]
    for _ in range(N_TOKENS):
        rows = []
        for prefix in prefixes:
            logits = lm.forward_logits([PROMPT + prefix], [0], [0], last_only=True)[0][0]
            rows.append(probabilities(logits, params).double())
        joint = (joint.view(-1, 1) * torch.stack(rows)).view(-1)
        prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return joint


def sampled_counts(model, kind, n_draft, params, n_batches) -> tuple[torch.Tensor, int, int, Counter]:
    """kind: see draft_source, or a function target -> drafter. Counts of each sampled sequence, how many iterations verified a chain of N_DRAFT drafted tokens, and how
    many verified a branching token tree, and the accepted drafted tokens per source."""
    target = TorchCausalLM(model, model.args.n_layers, BATCH)
    # at batch 32 the CPU cost model would draft little; the tests need drafts
    target.step_cost = lambda n_users, n_rows, context_len: 1.0
    drafter = kind(target) if callable(kind) else draft_source(target, kind)
    counts = torch.zeros(VOCAB ** N_TOKENS)
    full_chains = trees = 0
    sources = Counter()
    for b in range(n_batches):
        gen = SpeculativeGenerator(target, drafter, n_draft, (), SamplingParams(
            params.temperature, params.top_k, params.top_p, seed=b))
        for r in gen.generate([PROMPT] * BATCH, N_TOKENS, stop_at_eos=False):
            counts[sequence_index(r.output_tokens)] += 1
            full_chains += sum(it.drafted >= N_DRAFT and it.draft_source != "tree" for it in r.iterations)
            trees += sum(it.draft_source == "tree" for it in r.iterations)
            for it in r.iterations:
                sources[it.draft_source] += it.accepted
    return counts, full_chains, trees, sources


def draft_source(target, kind):
    """model: the target's first layer, sharing its cache (as the demo builds it); model-own-cache: the same
    layer with a cache of its own; suffix: the automaton, trusting every copy (so its chains run to the length
    allowed: this tests verification, not the length policy), as chains; tree: the automaton and recycled target
    predictions as token trees, each trusted at an even rate; plain: none."""
    if kind == "model":
        return ModelDrafter(target.draft_view(1))
    if kind == "model-own-cache":
        return ModelDrafter(TorchCausalLM(target.model, 1, BATCH))
    if kind in ("suffix", "tree"):
        target.supports_trees = kind == "tree"
        drafter = SuffixDrafter(threshold=1, recycle=3 if kind == "tree" else 0)
        # trees: an even rate, so copied and recycled siblings share each parent's probability and trees branch
        rate = 0.99 if kind == "suffix" else 0.5
        trusting = MatchAcceptance(prior=[rate] * len(LENGTH_BUCKETS), decay=1.0, prior_weight=1e9)
        drafter.acceptance.update(suffix=trusting, recycle=trusting)
        return drafter
    return None


@pytest.mark.parametrize("kind", ["model", "model-own-cache", "suffix", "tree", "plain"])
def test_speculative_sampling_matches_target_distribution(tiny_model, kind):
    expected = exact_joint(tiny_model, SETTINGS)
    n_draft = {"plain": 0, "tree": 2 * N_DRAFT}.get(kind, N_DRAFT)  # a tree's nodes count against the cap
    counts, full_chains, trees, _ = sampled_counts(tiny_model, kind, n_draft, SETTINGS, n_batches=100)
    assert chi_square_p_value(counts, expected) > ALPHA
    if kind in ("model", "model-own-cache", "suffix"):  # most users verify a whole chain of N_DRAFT drafts at once
        assert full_chains >= 100 * BATCH // 2, full_chains
    if kind == "tree":  # branching trees (several candidates for a position) pass through rejection sampling
        assert trees >= 100 * BATCH // 10, trees


TOP_P = SamplingParams(temperature=0.8, top_p=0.7)


def hybrid(target):
    """Copied drafts (trusted, as draft_source's suffix) and the first layer's drafts competing per step."""
    return HybridDrafter(draft_source(target, "suffix"), ModelDrafter(target.draft_view(1), draft_cost=0.05))


@pytest.mark.parametrize("kind,params", [("model", TOP_P), ("suffix", TOP_P), (hybrid, SETTINGS)],
                         ids=["model-top_p", "suffix-top_p", "hybrid"])
def test_top_p_and_hybrid_sampling_match_target_distribution(tiny_model, kind, params):
    """--top_p end to end (the nucleus cut the same way for the target's p and the draft's q), with model and copied
    drafts, and hybrid drafting (copied and model drafts competing per step): the sampled sequences follow the
    target's exact distribution, whole chains pass through rejection sampling, and the hybrid's accepted drafts come
    from both of its sources."""
    expected = exact_joint(tiny_model, params)
    counts, full_chains, _, sources = sampled_counts(tiny_model, kind, N_DRAFT, params, n_batches=100)
    assert chi_square_p_value(counts, expected) > ALPHA
    assert full_chains >= 100 * BATCH // 4, full_chains
    if kind is hybrid:
        assert sources["model"] > 0 and sources["suffix"] > 0, sources


@pytest.mark.parametrize("kind", ["model", "suffix", "tree"])
def test_negative_control_end_to_end(tiny_model, kind, monkeypatch):
    """The same end-to-end test with a verifier that accepts every draft token must fail: the test has power."""
    from models.tt_transformers.speculative import generator as speculative_generator

    def accept_all(draft, target):
        return list(draft) + [target[len(draft)]]

    def accept_first_children(tokens, parents, target):  # down the first child of every node
        path = []
        while (child := next((i for i, p in enumerate(parents) if p == (path[-1] if path else -1)), None)) is not None:
            path.append(child)
        node = path[-1] if path else -1
        return [tokens[i] for i in path] + [target[node + 1]], path
    monkeypatch.setattr(speculative_generator, "verify_chain", accept_all)
    monkeypatch.setattr(speculative_generator, "verify_tree", accept_first_children)
    counts, *_ = sampled_counts(tiny_model, kind, N_DRAFT, SETTINGS, n_batches=100)
    assert chi_square_p_value(counts, exact_joint(tiny_model, SETTINGS)) < ALPHA


def test_seeded_run_is_reproducible(tiny_model):
    target = TorchCausalLM(tiny_model, tiny_model.args.n_layers, 4)
    drafter = ModelDrafter(TorchCausalLM(tiny_model, 1, 4))

    def run(seed):
        gen = SpeculativeGenerator(target, drafter, 3, (), SamplingParams(0.9, seed=seed))
        return [r.output_tokens for r in gen.generate([PROMPT, [3, 0], [0], PROMPT[:3]], 12)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_draft_model_as_deep_as_the_target_has_every_sampled_draft_accepted(tiny_model):
    """Its q is the target's p and it draws with the target's key for the drafted position, so its draws are the
    target's: a key off by a position, or noise of its own, would reject most of them."""
    target = TorchCausalLM(tiny_model, tiny_model.args.n_layers, 4)
    drafter = ModelDrafter(TorchCausalLM(tiny_model, tiny_model.args.n_layers, 4))
    gen = SpeculativeGenerator(target, drafter, 3, (), SamplingParams(1.0, seed=0))
    results = gen.generate([PROMPT, [3, 0], [0], PROMPT[:3]], 16, stop_at_eos=False)
    drafted = sum(it.drafted for r in results for it in r.iterations)
    assert drafted > 30 and sum(it.accepted for r in results for it in r.iterations) == drafted


# ---- keys ----

def test_unseeded_sampling_gives_each_request_its_own_draws(tiny_model):
    """No seed: the draws come from fresh entropy, keyed per request."""
    target = TorchCausalLM(tiny_model, tiny_model.args.n_layers, 4)
    gen = SpeculativeGenerator(target, SuffixDrafter(threshold=1), 3, (), SamplingParams(1.0))
    outs = [r.output_tokens for r in gen.generate([PROMPT] * 4, 24, stop_at_eos=False)]
    assert len({tuple(o) for o in outs}) > 1  # four identical prompts, four requests


def test_keys_fit_torch_for_any_seed_and_follow_the_request():
    for base in (0, 1, 2**63 - 1, 2**64 - 1, torch.seed()):
        sampler = KeyedSampler(SamplingParams(1.0, seed=base), requests=[5, 9])
        keys = {sampler.key(u, t) for u in (0, 1) for t in range(32)}
        assert len(keys) == 64 and all(0 <= k < 2**63 for k in keys)
    # request 7's key at a position is the same in whatever row it runs
    assert KeyedSampler(SamplingParams(seed=3), [7]).key(0, 10) == KeyedSampler(SamplingParams(seed=3), [1, 7]).key(1, 10)


@pytest.mark.cuda
def test_sampling_on_cuda_follows_the_probabilities_device():
    """On CUDA the logits stay on the GPU; the keyed noise is drawn on the CPU."""
    model = make_tiny_model().cuda()
    target = TorchCausalLM(model, model.args.n_layers, 4)
    drafter = ModelDrafter(TorchCausalLM(model, 1, 4))
    for seed in (None, 0):
        gen = SpeculativeGenerator(target, drafter, 3, (), SamplingParams(0.9, seed=seed))
        assert all(len(r.output_tokens) == 12 for r in gen.generate([PROMPT] * 4, 12, stop_at_eos=False))
