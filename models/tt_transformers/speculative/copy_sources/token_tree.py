# SPDX-License-Identifier: Apache-2.0
"""Recycled target predictions and the token tree the suffix drafter verifies.

The Python here is the reference; drafting runs its port in suffix_native.c (native.py) where that builds, which
tests/speculative/test_suffix_native.py holds to the same tables and trees (`implementations()`: whichever runs).
"""
import heapq
import itertools
from typing import Optional, Sequence

from ..draft_length import bucket_of


class ReferenceRecycledTokens:
    """Token Recycling's adjacency table (Luo et al. 2024, arXiv 2408.08696): for each token, the target's top-k
    next tokens from the last time it computed them after that token, in any request. Every verification step
    computes them anyway; the rows kept are those whose context is the actual text (the last token and the accepted
    drafts), not rejected branches."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self.table: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.table)

    def observe(self, fed: Sequence[int], top_ids: Sequence[Sequence[int]]) -> None:
        for token, ids in zip(fed, top_ids):
            if len(ids) > self.k:
                raise ValueError(f"{len(ids)} top ids for a table of k={self.k}")
            if ids:
                self.table[token] = list(ids)

    def get(self, token: int) -> Optional[list[int]]:
        return self.table.get(token)

    def chain(self, last: int, n: int, p_step: float, floor: float) -> tuple[list[int], list[float]]:
        """The target's top next token after `last`, after that one, and so on: up to n tokens while P_i (p_step to
        the power i) stays at or above floor."""
        tokens, probs, p, token = [], [], 1.0, last
        while len(tokens) < n and token in self.table and p * p_step >= floor:
            token, p = self.table[token][0], p * p_step
            tokens.append(token)
            probs.append(p)
        return tokens, probs


def reference_build_tree(last: int, candidates: Sequence[tuple[Sequence[int], Sequence[float]]],
                         table: Optional[ReferenceRecycledTokens], recycle_rates: Optional[Sequence[float]], n: int,
                         floor: float) -> tuple[list[int], list[int], list[float], list[int], list[int]]:
    """Merge the candidates (copied continuations: tokens and P_i, most valuable first) into a trie below `last`,
    grow it with recycled predictions from `table` (a rank-r prediction is accepted with MatchAcceptance.prob(r, 1.0)
    at the rates per length bucket `recycle_rates`), most probable first, and return its n most probable nodes in
    order of probability, so parents come first, as (tokens, parents, probs, origins, offsets): parents[i] indexes the returned nodes (-1: a child of `last`);
    node i is token offsets[i] of candidate origins[i], or (origin -1) the rank offsets[i] + 1 recycled prediction.

    Siblings are exclusive (the target accepts one next token), so their probabilities may not sum to more than
    their parent's: each candidate's node keeps its own conditional rate but at most what its earlier siblings
    leave (`room`), and its descendants scale with it. Without this, two sources proposing different next tokens
    with 0.6 each would count 1.2 expected tokens where at most one can be accepted, and trees grew past what pays."""
    tokens, parents, probs, origins, offsets = [], [], [], [], []
    index: dict[tuple[int, int], int] = {}
    taken: dict[int, float] = {}  # node (-1: the root) -> sum of its children's probabilities

    def room(parent: int) -> float:
        return (probs[parent] if parent >= 0 else 1.0) - taken.get(parent, 0.0)

    def add(parent: int, token: int, p: float, origin: int, offset: int) -> int:
        index[parent, token] = len(tokens)
        for column, value in zip((tokens, parents, probs, origins, offsets), (token, parent, p, origin, offset)):
            column.append(value)
        taken[parent] = taken.get(parent, 0.0) + p
        return len(tokens) - 1

    for c, (candidate_tokens, candidate_probs) in enumerate(candidates):
        parent, before = -1, 1.0
        for j, (token, p) in enumerate(zip(candidate_tokens, candidate_probs)):
            parent_prob = probs[parent] if parent >= 0 else 1.0
            p, before = parent_prob * p / before, p  # this candidate's rate, applied below the node's parent
            at = index.get((parent, token))
            if at is None:
                p = min(p, room(parent))
                if p < floor:
                    break
                at = add(parent, token, p, c, j)
            elif p > probs[at]:
                p = min(p, room(parent) + probs[at])
                taken[parent] += p - probs[at]
                probs[at] = p
            parent = at
    if table is not None:
        rank_probs = [min(0.99, recycle_rates[bucket_of(rank)] * 1.0) for rank in range(1, table.k + 1)]
        heap, order = [], itertools.count()

        def push_children(parent: int, token: int, p: float):
            for rank, child in enumerate(table.get(token) or ()):
                q = p * rank_probs[rank]
                if q >= floor and (parent, child) not in index:
                    heapq.heappush(heap, (-q, next(order), parent, child, rank))
        push_children(-1, last, 1.0)
        for i in range(len(tokens)):
            push_children(i, tokens[i], probs[i])
        limit = len(tokens) + n  # recycled nodes compete with the copied ones for the n places
        while heap and len(tokens) < limit:
            q, _, parent, token, rank = heapq.heappop(heap)
            if (parent, token) in index:
                continue
            if -q > room(parent):  # siblings took part of the parent's probability since: try again lower
                if room(parent) >= floor:
                    heapq.heappush(heap, (-room(parent), next(order), parent, token, rank))
                continue
            at = add(parent, token, -q, -1, rank)
            push_children(at, token, -q)
    order = sorted(range(len(tokens)), key=lambda i: -probs[i])[:max(n, 0)]  # a child is never more probable
    where = {old: new for new, old in enumerate(order)}
    return ([tokens[i] for i in order], [where.get(parents[i], -1) for i in order], [probs[i] for i in order],
            [origins[i] for i in order], [offsets[i] for i in order])

