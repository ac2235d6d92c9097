# SPDX-License-Identifier: Apache-2.0
"""The C port of drafting (suffix_native.c) against its Python references: the same automaton states, matches,
counts and continuations, the same recycled tables and the same token trees (floats bit for bit), and a suffix
drafter that drafts exactly the same either way. Where the extension cannot be built drafting runs the references,
which the other tests cover."""
import os
import random
import shutil
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.tt_transformers.speculative import drafters
from models.tt_transformers.speculative.copy_sources import draft_memory, implementations, native
from models.tt_transformers.speculative.draft_length import LENGTH_BUCKETS, linear_cost
from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams
from models.tt_transformers.speculative.copy_sources.suffix_automaton import ReferenceSuffixAutomaton
from models.tt_transformers.speculative.copy_sources.token_tree import ReferenceRecycledTokens, reference_build_tree

NATIVE = native.suffix_native()  # built here, on first use
needs_native = pytest.mark.skipif(NATIVE is None, reason="the drafting extension was not built (no C compiler or "
                                  "Python headers, or TT_NATIVE_DRAFTING=0): drafting runs the Python references")


def test_extension_builds_where_a_compiler_and_headers_are():
    """Guards against a silent fallback: on a machine that can build it, drafting runs the C port."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    buildable = shutil.which(os.environ.get("CC", "cc")) and headers.is_file()
    if not buildable or os.environ.get("TT_NATIVE_DRAFTING") == "0":
        pytest.skip("no C compiler or Python headers here (or TT_NATIVE_DRAFTING=0)")
    assert NATIVE is not None
    running = implementations()
    assert running.SuffixAutomaton is NATIVE.SuffixAutomaton and running.build_tree is NATIVE.build_tree


def test_failed_build_falls_back_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert native.load_suffix_native() is None
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TT_NATIVE_DRAFTING", "0")
    assert native.load_suffix_native() is None


def same_automaton(tokens: list[int], probes: random.Random) -> None:
    ref, fast = ReferenceSuffixAutomaton(), NATIVE.SuffixAutomaton()
    for t in tokens:
        ref.extend(t)
        fast.extend(t)
        assert (fast.match_state, fast.match_len, fast.match_end) == (ref.match_state, ref.match_len, ref.match_end)
    assert fast.tokens == ref.tokens and fast.n_states == ref.n_states and fast.n_transitions == ref.n_transitions
    alphabet = sorted(set(tokens)) + [max(tokens, default=0) + 1]
    for s in range(ref.n_states):
        assert fast.state(s) == ref.state(s)
        assert [fast.transition(s, t) for t in alphabet] == [ref.transition(s, t) for t in alphabet]
        anchor_args = (s, probes.randint(1, 3), probes.randint(1, 4))
        assert fast.anchors(*anchor_args) == ref.anchors(*anchor_args)
        rates = [probes.random() * 1.2 for _ in LENGTH_BUCKETS]
        args = (s, ref.state(s)[0], probes.randint(0, 20), rates, probes.choice([0.0, 0.01, 0.1, 0.4]))
        assert fast.continuation(*args) == ref.continuation(*args)  # floats bit for bit
        length = probes.randint(0, ref.state(s)[0])
        token = probes.choice(alphabet)
        assert fast.advance(s, length, token) == ref.advance(s, length, token)


@needs_native
def test_automaton_equals_reference_on_text_like_sequences():
    rng = random.Random(0)
    words = [[rng.randrange(1000) for _ in range(rng.randint(1, 4))] for _ in range(40)]
    text = [t for _ in range(300) for t in rng.choice(words)]
    docs = [t for d in range(5) for t in [*text[d * 60 : d * 60 + 50], -1 - d]]  # separators, as the memory has
    for tokens in (text, docs, [7] * 200, ([1, 2, 3] * 40)[:100] + [9] + [1, 2, 3] * 20):
        same_automaton(tokens, random.Random(1))


@needs_native
@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(-3, 5), max_size=80), seed=st.integers(0, 2**16))
def test_automaton_equals_reference_generated(tokens, seed):
    same_automaton(tokens, random.Random(seed))


def recycled_pair(k: int, rows: list[tuple[int, list[int]]]):
    ref, fast = ReferenceRecycledTokens(k), NATIVE.RecycledTokens(k)
    for table in (ref, fast):
        for token, ids in rows:
            table.observe([token], [ids])
    return ref, fast


@needs_native
@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 4), data=st.data())
def test_recycled_table_and_chains_equal_reference(k, data):
    rows = data.draw(st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(0, 12), max_size=k)), max_size=30))
    ref, fast = recycled_pair(k, rows)
    assert len(fast) == len(ref) and fast.k == ref.k
    for token in range(14):
        assert fast.get(token) == ref.get(token)
        args = (token, data.draw(st.integers(0, 10)), data.draw(st.floats(0.0, 1.0)), data.draw(st.floats(0.0, 0.5)))
        assert fast.chain(*args) == ref.chain(*args)


@needs_native
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_token_tree_equals_reference(data):
    """Random candidates (shared prefixes, sibling conflicts) and recycled tables: the same nodes, parents,
    probabilities (bit for bit), origins and order."""
    candidates = []
    for _ in range(data.draw(st.integers(0, 4))):
        tokens = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
        probs, p = [], 1.0
        for _ in tokens:
            p *= data.draw(st.floats(0.05, 0.99))
            probs.append(p)
        candidates.append((tokens, probs))
    k = data.draw(st.integers(1, 4))
    rows = data.draw(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 6), min_size=1, max_size=k,
                                                                     unique=True)), max_size=12))
    ref_table, fast_table = recycled_pair(k, rows)
    rates = [data.draw(st.floats(0.0, 1.2)) for _ in LENGTH_BUCKETS]
    recycled = data.draw(st.booleans())
    args = (data.draw(st.integers(0, 6)), candidates)
    rest = (rates, data.draw(st.integers(0, 20)), data.draw(st.sampled_from([0.0, 0.02, 0.05, 0.2])))
    want = reference_build_tree(*args, ref_table if recycled else None, *rest)
    got = NATIVE.build_tree(*args, fast_table if recycled else None, *rest)
    assert got == want


@needs_native
def test_suffix_drafter_drafts_the_same_either_way(monkeypatch):
    """A drafter with memory, recycling and trees over a stream of requests: every draft and every learned rate is
    the same on the C port and on the references."""
    rng = random.Random(3)
    phrases = [[rng.randrange(200) for _ in range(rng.randint(2, 6))] for _ in range(25)]

    def run() -> list:
        drafter = drafters.SuffixDrafter(1, draft_memory.DraftMemory(400), recycle=3)
        stream, out = random.Random(4), []
        for request in range(6):
            text = [t for _ in range(40) for t in stream.choice(phrases)]
            prompt, pos = text[:80], 80
            drafter.start([0], [prompt], KeyedSampler(SamplingParams()))
            while pos < len(text) - 1:
                context = text[:pos]
                draft = drafter.propose([0], [context], [8], linear_cost(0.08), trees=request % 2 == 0)[0]
                path, parent = [], -1
                for i, (token, up) in enumerate(zip(draft.tokens, draft.parents or range(-1, len(draft.tokens) - 1))):
                    if up == parent and pos + len(path) < len(text) and token == text[pos + len(path)]:
                        path.append(i)
                        parent = i
                new = text[pos : pos + len(path) + 1]
                fed = [context[-1], *draft.tokens]
                top = [[text[min(pos + 1, len(text) - 1)], stream.randrange(200), stream.randrange(200)] for _ in fed]
                drafter.accept(0, drafters.Verified(new, path, fed, top))
                out.append((draft.tokens, draft.parents, draft.source, draft.match_len, draft.expected))
                pos += len(new)
        return out + [tuple(a.rates()) for a in drafter.acceptance.values()]

    fast = run()
    monkeypatch.setattr(native, "suffix_native", lambda: None)  # the Python references throughout
    assert implementations() == (ReferenceSuffixAutomaton, ReferenceRecycledTokens, reference_build_tree)
    reference = run()
    assert sum(len(d[0]) for d in fast[:-5]) > 100  # it drafted
    assert fast == reference
