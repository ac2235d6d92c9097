# SPDX-License-Identifier: Apache-2.0
"""The suffix automaton against a brute-force longest-earlier-suffix search, and the draft-length policy."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.backend import COST_MARGIN, extra_cost_curve
from models.tt_transformers.speculative.draft_length import (
    PROBE_BUDGET,
    DraftLengthPolicy,
    MatchAcceptance,
    best_length,
    bucket_of,
    linear_cost,
)
from models.tt_transformers.speculative.drafters import ModelDrafter
from models.tt_transformers.speculative.copy_sources import implementations
from models.tt_transformers.speculative.copy_sources.suffix_automaton import ReferenceSuffixAutomaton
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import random_model

SuffixAutomaton = implementations().SuffixAutomaton  # the C port where it builds, else the reference


def longest_earlier_suffix(seq: list[int]) -> tuple[int, list[int]]:
    """Brute force: the longest L such that seq[-L:] also ends at an earlier position, and all those positions."""
    n = len(seq)
    for length in range(n - 1, 0, -1):
        suffix = seq[n - length:]
        ends = [e for e in range(length - 1, n - 1) if seq[e - length + 1 : e + 1] == suffix]
        if ends:
            return length, ends
    return 0, []


def occurrences(seq: list[int], sub: list[int]) -> list[int]:
    """End positions of `sub` in `seq`."""
    n = len(sub)
    return [e for e in range(n - 1, len(seq)) if seq[e - n + 1 : e + 1] == sub]


# Both implementations: the Python reference, and what drafting runs (its C port where that builds,
# test_suffix_native.py).
AUTOMATA = pytest.mark.parametrize("automaton", [ReferenceSuffixAutomaton, SuffixAutomaton],
                                   ids=["reference", "running"])


def state_string(sam, state: int) -> list[int]:
    """The longest string of a state: the last length[state] tokens before one of its end positions."""
    length, _, end, *_ = sam.state(state)
    return sam.tokens[end - length + 1 : end + 1]


def check_against_brute_force(seq: list[int], automaton=SuffixAutomaton) -> None:
    """After every token: the longest earlier match, and for the states a draft reads (the match and its
    suffix-link ancestors) their occurrence counts, continuations and most frequent next token."""
    sam = automaton()
    for i, token in enumerate(seq):
        sam.extend(token)
        prefix = seq[: i + 1]
        length, ends = longest_earlier_suffix(prefix)
        assert sam.match_len == length, (prefix, sam.match_len, length)
        if length:
            assert sam.match_end in ends
        for state, length in sam.anchors(sam.match_state, 1, 100):
            sub = state_string(sam, state)
            assert len(sub) == length
            ends = occurrences(prefix, sub)
            _, _, _, count, cont, best = sam.state(state)
            assert count == len(ends), (prefix, sub)
            followed = [e for e in ends if e + 1 < len(prefix)]
            assert cont == len(followed), (prefix, sub)
            if followed:
                nexts = [prefix[e + 1] for e in followed]
                most = max(nexts.count(t) for t in set(nexts))
                latest = max(e for e in followed if nexts.count(prefix[e + 1]) == most)  # ties: the most recent
                assert best == prefix[latest + 1], (prefix, sub, nexts)


@AUTOMATA
def test_matches_brute_force_on_random_and_repetitive_sequences(automaton):
    rng = random.Random(0)
    cases = [[rng.randrange(3) for _ in range(120)],  # small alphabet: many repeats and clones
             [rng.randrange(50) for _ in range(120)],  # few repeats
             [1] * 40,  # one run
             ([1, 2, 3, 4, 5] * 12)[:57] + [9] + [1, 2, 3, 4, 5] * 6,  # a period broken once
             [t for w in ["the", "cat", "the", "dog", "the", "cat", "sat"] * 6 for t in map(ord, w)]]
    for seq in cases:
        check_against_brute_force(seq, automaton)


@AUTOMATA
@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 4), min_size=1, max_size=60))
def test_matches_brute_force_generated(automaton, seq):
    check_against_brute_force(seq, automaton)


def state_of(sam, string: list[int]) -> int:
    state = 0
    for t in string:
        state = sam.transition(state, t)
    return state


@AUTOMATA
def test_continuation_follows_the_most_frequent_next_token(automaton):
    # "a b" is followed by c twice and by d once: its draft copies c, at frequency 2/3; "a b c" was followed by e
    # both times (frequency 1), and "a b c e" by a once and the end of the text once (1/1 of its continuations).
    a, b, c, d, e = 1, 2, 3, 4, 5
    sam = automaton([a, b, c, e, a, b, d, e, a, b, c, e, a, b])
    state = state_of(sam, [a, b])
    assert sam.state(state)[3:] == (4, 3, c)  # count, cont, best
    rates = [1.0] * 9
    tokens, freqs, probs = sam.continuation(state, 2, 3, rates, 0.0)
    assert tokens == [c, e, a] and freqs == [2 / 3, 1.0, 1.0]
    assert probs == pytest.approx([2 / 3, 2 / 3 * 0.99, 2 / 3 * 0.99 ** 2])  # P_i: product of each step (at most 0.99)
    assert sam.continuation(state, 2, 3, [0.5] * 9, 0.3)[0] == [c]  # 0.5 * 2/3, then 0.5 * 1 more: below the floor


@AUTOMATA
def test_continuation_stops_at_a_document_separator(automaton):
    sam = automaton([7, 8, 9, -1, 7, 8])
    assert sam.continuation(state_of(sam, [7, 8]), 2, 5, [1.0] * 9, 0.0)[0] == [9]


@AUTOMATA
def test_size_bounds(automaton):
    rng = random.Random(1)
    for seq in ([rng.randrange(2) for _ in range(3000)], [rng.randrange(30000) for _ in range(3000)]):
        sam = automaton(seq)
        n = len(seq)
        assert sam.n_states <= 2 * n - 1
        assert sam.n_transitions <= 3 * n - 4
        # Memory (what the draft memory's log line reports): lists of ints and a dict per state in the reference,
        # arrays and one hash table in C (capacities doubled as they grow).
        bound = 1200 if automaton is ReferenceSuffixAutomaton else 400
        assert sam.nbytes / n < bound, f"{sam.nbytes / n:.0f} bytes per token"


def test_policy_drafts_long_when_accepted_and_pauses_when_rejected():
    policy = DraftLengthPolicy(draft_cost=0.0)
    start = policy.next_length(16, linear_cost(0.07))
    assert 1 <= start < 16
    for _ in range(20):
        policy.update(drafted=8, accepted=8)
    assert policy.next_length(16, linear_cost(0.07)) == 16
    assert policy.next_length(5, linear_cost(0.07)) == 5
    for _ in range(60):
        policy.update(drafted=4, accepted=0)
    assert policy.acceptance < 0.1
    lengths = [policy.next_length(16, linear_cost(0.07)) for _ in range(60)]
    probes = [i for i, k in enumerate(lengths) if k]
    assert probes == [7, 23, 55] and lengths[7] == 1  # paused; one-token probes after 8, then 16, then 32 idle
    for _ in range(10):
        policy.update(drafted=1, accepted=1)  # a probe that passes: drafting resumes, the wait resets
    assert policy.next_length(16, linear_cost(0.07)) >= 1 and policy.wait == policy.probe_every


def test_policy_learned_from_earlier_requests():
    """A draft model that was always rejected starts the next request paused, at the prior's weight."""
    fresh = DraftLengthPolicy(draft_cost=0.4)
    assert fresh.next_length(4, linear_cost(0.09)) >= 1  # the optimistic prior tries an unknown draft model
    earlier = [DraftLengthPolicy(draft_cost=0.4) for _ in range(2)]
    for p in earlier:
        for _ in range(20):
            p.update(drafted=1, accepted=0)
        for _ in range(120):  # paused; probes (0.49 of a step each, after 49 idle iterations) double the wait
            p.next_length(4, linear_cost(0.09))
    learned = DraftLengthPolicy.learned_from(earlier, 0.4)
    assert learned.acceptance < 0.05 and learned.wait == 32
    assert abs(learned.accepted + learned.rejected - 4.0) < 1e-9
    assert [learned.next_length(4, linear_cost(0.09)) for _ in range(8)] == [0] * 8
    good = DraftLengthPolicy(draft_cost=0.4)
    for _ in range(20):
        good.update(drafted=4, accepted=4)
    assert DraftLengthPolicy.learned_from([good], 0.4).next_length(4, linear_cost(0.09)) == 4
    assert DraftLengthPolicy.learned_from([], 0.4).acceptance == fresh.acceptance


def test_model_drafter_carries_acceptance_to_the_next_request():
    target = TorchCausalLM(random_model(seed=0), 3, 1)
    draft = TorchCausalLM(random_model(seed=1), 3, 1)  # unrelated weights: rarely agrees with the target
    gen = SpeculativeGenerator(target, ModelDrafter(draft, draft_cost=0.4), 4, ())
    first, second = (gen.generate([[1, 2, 3]], 40, stop_at_eos=False)[0] for _ in range(2))
    assert first.iterations[0].draft_source == "model"  # the prior tries it; its misses pause it
    assert all(it.draft_source == "none" for it in second.iterations[:5])
    assert first.output_tokens == second.output_tokens


def test_policy_costlier_drafts_are_shorter():
    cheap, costly = DraftLengthPolicy(draft_cost=0.0), DraftLengthPolicy(draft_cost=0.4)
    for p in (cheap, costly):
        for _ in range(10):
            p.update(drafted=4, accepted=2)  # per-token acceptance about 2/3
    assert cheap.next_length(16, linear_cost(0.07)) > costly.next_length(16, linear_cost(0.07)) >= 1


class TileBackend:
    """The cost shape of a TT device: a step costs one unit per 32-row tile it computes."""

    max_step_rows = 32

    @staticmethod
    def step_cost(n_users, n_rows, context_len):
        return float(-(-n_rows // 32))


def test_verification_cost_grows_with_batch_and_shortens_drafts():
    lm = TorchCausalLM(random_model(), 3, 32)
    curves = [extra_cost_curve(lm, b, 300) for b in (1, 2, 4, 8, 32)]
    costs = [c(1) for c in curves]
    assert costs == sorted(costs) and costs[-1] < 1
    assert all(abs(c(4) - 4 * c(1)) < 1e-12 for c in curves)  # linear on a CPU
    policy = DraftLengthPolicy()
    for _ in range(10):
        policy.update(drafted=4, accepted=2)
    lengths = [policy.next_length(16, c) for c in curves]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_tile_costs_make_drafts_inside_the_tile_free():
    """On a TT device the rows that fit the decode tile cost nothing more: the policy drafts as long as the row
    budget allows, even at an acceptance where a CPU would draft little."""
    tile = extra_cost_curve(TileBackend(), 4, 300)
    assert [tile(k) for k in (1, 10, 28)] == [0.0, 0.0, 0.0]
    assert tile(29) == pytest.approx(4.0 * (1 + COST_MARGIN))  # 33 rows: a second tile (priced with the margin)
    policy = DraftLengthPolicy()
    for _ in range(10):
        policy.update(drafted=4, accepted=1)
    assert policy.next_length(7, tile) == 7
    assert policy.next_length(7, linear_cost(0.45)) < 7


def test_best_length_weighs_each_tokens_probability():
    free = linear_cost(0.0)
    assert best_length([0.9, 0.8, 0.7], free) == 3  # on a device where rows are free, every likely token pays
    assert best_length([0.9, 0.8, 0.05], linear_cost(0.1)) == 2  # a 5 % token does not pay for 10 % of a step
    assert best_length([0.05], linear_cost(0.1)) == 0
    assert best_length([], free) == 0


def test_match_acceptance_learns_per_match_length():
    """Short matches that keep failing lose trust; long matches that pass gain it; each bucket apart."""
    acceptance = MatchAcceptance()
    short, long = acceptance.prob(1, 1.0), acceptance.prob(20, 1.0)
    assert short < long
    for _ in range(50):
        acceptance.observe(1, 1.0, False)
        acceptance.observe(20, 1.0, True)
    assert acceptance.prob(1, 1.0) < short / 3 and acceptance.prob(20, 1.0) > long
    rate = acceptance.rates()[bucket_of(20)]  # scaled by the continuation's frequency (capped at 0.99)
    assert acceptance.prob(20, 0.5) == pytest.approx(0.5 * rate) and acceptance.prob(20, 1.0) == min(0.99, rate)


def test_torch_backend_verification_cost_grows_with_batch_and_context():
    """A verified row's work is the same in any batch and grows with the context; priced in a user's share of a
    plain step, it weighs more in a larger batch (the share shrinks)."""
    lm = TorchCausalLM(random_model(), 3, 8)
    row = [lm.step_cost(b, b + 1, ctx) - lm.step_cost(b, b, ctx) for b, ctx in ((1, 100), (8, 100), (8, 1000))]
    assert row[0] == pytest.approx(row[1]) and row[1] < row[2]
    extra = [extra_cost_curve(lm, b, 100)(1) for b in (1, 8)]
    assert extra[0] < extra[1] < 1


def test_torch_step_cost_reads_each_users_cache_once(monkeypatch):
    """The CPU kernels attend a user's 1 + K rows in one pass over its cache: a step is priced by counting the users
    whose caches it reads and the rows it computes, so a verified row adds its own arithmetic, never a cache read."""
    from models.tt_transformers.torch_backend import causal_lm

    lm = TorchCausalLM(random_model(), 3, 8)
    lm.costs = causal_lm.StepCost(token=0.1, key=1e-4, read=3e-4)
    row, read = 0.1 + 1e-4 * 2000, 3e-4 * 2000  # a row's work and a user's cache read over 2,000 cached positions
    assert lm.step_cost(1, 1, 2000) == pytest.approx(1 + read + row)
    assert lm.step_cost(1, 9, 2000) == pytest.approx(1 + read + 9 * row)  # one user verifying 8 drafts: one read
    assert lm.step_cost(4, 12, 2000) == pytest.approx(1 + 4 * read + 12 * row)
    share = (1 + 4 * read + 4 * row) / 4  # a user's share of a plain step of 4 users
    assert extra_cost_curve(lm, 4, 2000)(3) == pytest.approx(3 * row / share * (1 + COST_MARGIN))


SHORT, LONG = 128, 8000  # cached tokens


def one_pass_curves() -> dict:
    """A user's extra cost at a short and a long context on a CPU whose kernels read a user's cache once per step
    (a made-up StepCost of that shape: the bench fits the real ones per path)."""
    from models.tt_transformers.torch_backend import causal_lm

    lm = TorchCausalLM(random_model(), 3, 1)
    lm.costs = causal_lm.StepCost(token=0.08, key=1e-4, read=5e-5)
    return {c: extra_cost_curve(lm, 1, c) for c in (SHORT, LONG)}


def simulate(policy: DraftLengthPolicy, curve, acceptance: float, iterations: int = 400) -> tuple[float, int]:
    """Speed against plain decoding (tokens per plain step's time) over `iterations` steps, each drafted token
    accepted with probability `acceptance` until one is not, a step costing 1 + what the policy's k draft tokens cost
    to make (draft_cost each) and, less the policy's margin, to verify; and the number of steps that drafted."""
    rng = random.Random(0)
    tokens = time = 0.0
    drafted = 0
    for _ in range(iterations):
        k = policy.next_length(8, curve)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policy.update(k, accepted)
        tokens += accepted + 1
        time += 1 + k * policy.draft_cost + curve(k) / (1 + COST_MARGIN)
        drafted += k > 0
    return tokens / time, drafted


def test_policy_never_drafts_at_a_loss_at_long_context():
    """At 8,000 cached tokens a verified row costs about 0.4 of a step: a draft source accepted at 45 % or less does
    not pay, and speculative decoding with it stays within 1.5 % of plain decoding (a fresh policy's optimistic prior
    and the probes included); one accepted at 90 % drafts every step; at 128 tokens, 45 % pays."""
    curves = one_pass_curves()
    assert 0.35 < curves[LONG](1) < 0.5 and curves[SHORT](1) < 0.11
    for acceptance in (0.0, 0.2, 0.35, 0.45):
        speed, drafted = simulate(DraftLengthPolicy(), curves[LONG], acceptance)
        assert speed > 0.985 and (drafted <= 15 or acceptance > 0.4), acceptance  # the prior's first drafts, probes
    speed, drafted = simulate(DraftLengthPolicy(), curves[LONG], 0.9)
    assert speed > 1.5 and drafted == 400
    speed, drafted = simulate(DraftLengthPolicy(), curves[SHORT], 0.45)
    assert speed > 1.15 and drafted > 200


def test_policy_probes_wait_until_the_steps_cover_their_loss():
    """A 1-token probe of a source that does not pay goes out after 8 idle iterations where it is expected to lose
    little (a cheap row, or a source that only just stopped paying), but only once the idle iterations' plain steps
    cover its expected loss at PROBE_BUDGET where it is expected to lose much (a long context, a draft model's run):
    a draft model (0.4 of a step a token) that never agrees, at 8,000 cached tokens, costs under 1.5 %."""
    for loss, first in ((0.05, 8), (0.45, 45), (0.9, 90)):
        policy = DraftLengthPolicy()
        probes = [i + 1 for i in range(200) if policy.gate(0, 8, loss)]
        assert probes[0] == first
        assert len(probes) * loss <= 200 * max(PROBE_BUDGET, loss / 8)
    long = one_pass_curves()[LONG]
    never = DraftLengthPolicy.learned_from([DraftLengthPolicy(0.4) for _ in range(2)], 0.4)
    for _ in range(30):
        never.update(drafted=1, accepted=0)  # an earlier request's misses: it starts paused
    speed, drafted = simulate(never, long, 0.0, 2000)
    assert speed > 0.985 and drafted <= 2000 * PROBE_BUDGET / (0.4 + long(1)) + 1
