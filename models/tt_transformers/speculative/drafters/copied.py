# SPDX-License-Identifier: Apache-2.0
"""Copied drafts (no model): continuations of the request's own text, of earlier responses and a corpus, and the
target's recycled predictions, as chains or token trees, over the copy sources (copy_sources/)."""
from dataclasses import dataclass
from typing import Optional, Sequence

from ...errors import UserError
from ..config import DEFAULT_SA_THRESHOLD, MAX_TREE_NODES
from ..copy_sources import implementations
from ..copy_sources.draft_memory import DraftMemory
from ..draft_length import LENGTH_BUCKETS, DraftLengthPolicy, MatchAcceptance, best_length
from .base import Draft


@dataclass
class Candidate:
    """A copied continuation: its tokens, the probability P_i that the first i are all accepted, and what it was
    scored with (to learn from the verification)."""

    tokens: list[int]
    probs: list[float]
    source: str
    match_len: int
    freqs: list[float]
    acceptance: MatchAcceptance


@dataclass
class PendingTree:
    """A proposed tree awaiting verification: its nodes' parents, and where each came from (build_tree's origins
    and offsets: a candidate's token, or a recycled prediction's rank - 1), to learn from what was accepted."""

    candidates: list[Candidate]
    parents: list[int]
    origins: list[int]
    offsets: list[int]

    def scored_by(self, node: int, recycle: MatchAcceptance) -> tuple[MatchAcceptance, int, float]:
        """What scored the node: (its source's acceptance, the length key it was scored at, its frequency)."""
        c, j = self.origins[node], self.offsets[node]
        if c < 0:
            return recycle, j + 1, 1.0
        candidate = self.candidates[c]
        return candidate.acceptance, candidate.match_len + j, candidate.freqs[j]


class SuffixDrafter:
    """Model-free drafts: copied continuations of the context and recycled target predictions, scored by their
    estimated acceptance, as a chain or (where the target verifies trees) a token tree.

    Sources: the request's own text (one `SuffixAutomaton` per user over prompt + generated tokens, extended with
    every new token); when given, a `DraftMemory` of earlier responses and a corpus; with `recycle` > 0, the
    target's own top next tokens after each token (RecycledTokens). Each proposal takes the most frequent
    continuation after the longest match and after the next shorter one (a shorter context may continue more
    predictably), and after the longest match in each memory store; each token gets the probability that it
    is accepted given the ones before it (MatchAcceptance, learned online per source and match length, or per
    recycling rank). A chain is the candidate with the most expected accepted tokens, cut at the length that pays
    for its verification (best_length with the backend's extra cost); a tree merges the candidates and the recycled
    predictions below each of their tokens and keeps the nodes, most probable first, for as long as they pay
    (each node is accepted with the probability of its path, so expected tokens = 1 + the sum over nodes). When
    nothing pays there is no draft and the target decodes one token exactly as plain decoding does (with a 1-token
    probe now and then, DraftLengthPolicy.gate).

    Copy mode (edits): while the text follows an earlier passage token by token (CopyCursor), an edit (a token the
    passage does not have there) does not end the copy: the cursor re-anchors at once, past the replaced token or
    at the edit token's next occurrence a few tokens ahead, and while the automaton's match is short it drafts the
    passage's next tokens (source "copy") without waiting for a new long match. Its tokens are scored by the
    length of the copied run before the edit; the copy ends after a few edits in a row.
    """

    ANCHORS = 2  # the longest match and one shorter: more anchors measured no better
    MAX_TREE_NODES = MAX_TREE_NODES

    def __init__(self, threshold: int = DEFAULT_SA_THRESHOLD, memory: Optional[DraftMemory] = None,
                 recycle: int = 0):
        if threshold < 1:
            raise UserError(f"sa_threshold must be >= 1, got {threshold}", "sa_threshold")
        self.threshold, self.memory = threshold, memory
        self.sources = implementations()  # the C port where it builds (built here, on first use), else the references
        self.recycled = self.sources.RecycledTokens(recycle) if recycle else None
        self.top_k, self.taps = recycle, ()
        # Copy mode's prior is flat and low: its runs are keyed by the copied run's length, which spreads its few
        # verifications over long-match buckets whose default prior (0.9) scored its drafts well above how often they
        # were accepted on chat, QA and JSON.
        self.acceptance = {"suffix": MatchAcceptance(), "memory": MatchAcceptance(), "corpus": MatchAcceptance(),
                           "copy": MatchAcceptance(prior=[0.3] * len(LENGTH_BUCKETS)),
                           "recycle": MatchAcceptance(prior=[0.45, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02, 0.02])}
        self.automata: dict = {}  # user -> its request's suffix automaton
        self.unsent: dict[int, int] = {}  # user -> where its response not yet in the draft memory starts
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.cursors: dict[int, CopyCursor] = {}
        self.pending: dict = {}  # user -> (Candidate, length) for a chain, or the tree's nodes

    def start(self, users, prompts, sampler, hidden=None):
        if self.memory is not None:
            self.memory.start_request([sam.tokens[self.unsent[u]:] for u, sam in self.automata.items()])
        self.automata, self.unsent, self.policies, self.cursors, self.pending = {}, {}, {}, {}, {}
        for u, p in zip(users, prompts):
            self.start_request(u, p)

    def start_request(self, user, prompt: Sequence[int]) -> None:
        """One request's state on its own: a server admits and ends requests one at a time (start() begins a whole
        batch). `user` is any hashable key."""
        self.automata[user] = self.sources.SuffixAutomaton(prompt)
        self.unsent[user] = len(prompt)
        self.policies[user] = DraftLengthPolicy(0.0)
        self.cursors[user] = CopyCursor()
        self.pending.pop(user, None)

    def send_response(self, user) -> None:
        """The request's response so far joins the draft memory now, its state stays, and stop_request sends only
        what follows: for a server told that a request ended before it may drop the request's state (serving/
        proposer.py). Nothing new: no change."""
        tokens = self.automata[user].tokens
        if self.memory is not None and len(tokens) > self.unsent[user]:
            self.memory.start_request([tokens[self.unsent[user]:]])
            self.unsent[user] = len(tokens)

    def stop_request(self, user) -> None:
        """The request ended: its state goes and its response (what followed the prompt, less what send_response
        sent) joins the draft memory."""
        response = self.automata[user].tokens[self.unsent[user]:]
        for state in (self.automata, self.unsent, self.policies, self.cursors, self.pending):
            state.pop(user, None)
        if self.memory is not None:
            self.memory.start_request([response])

    def warm_up(self, logits: bool = False) -> dict[str, float]:
        return {}  # host only

    def _candidates(self, user: int, context: Sequence[int], n: int, floor: float) -> list[Candidate]:
        sam = self.automata[user]
        out = []
        stores = [("suffix", sam, sam.anchors(sam.match_state, self.threshold, self.ANCHORS))]
        if self.memory is not None:
            for source, store in self.memory.stores:
                if store.n_tokens:
                    state, match_len = store.match(user, context)
                    stores.append((source, store.sam, [(state, match_len)] if match_len >= self.threshold else []))
        for source, automaton, anchors in stores:
            acceptance = self.acceptance[source]
            rates = acceptance.rates()
            for state, match_len in anchors:
                tokens, freqs, probs = automaton.continuation(state, match_len, n, rates, floor)
                if tokens:
                    out.append(Candidate(tokens, probs, source, match_len, freqs, acceptance))
        cursor = self.cursors[user]
        if cursor.run and sam.match_len < cursor.MIN_RUN:  # a short match: the edited passage goes on where it was
            tokens = sam.tokens[cursor.src : cursor.src + n]
            acceptance, probs, p = self.acceptance["copy"], [], 1.0
            for j in range(len(tokens)):
                p *= acceptance.prob(cursor.run + j, 1.0)
                if p < floor:
                    break
                probs.append(p)
            if probs:
                out.append(Candidate(tokens[: len(probs)], probs, "copy", cursor.run, [1.0] * len(probs), acceptance))
        return out

    def _recycled_chain(self, last: int, n: int, floor: float) -> Optional[Candidate]:
        """The target's top next token after `last`, after that one, and so on."""
        acceptance = self.acceptance["recycle"]
        tokens, probs = self.recycled.chain(last, n, acceptance.prob(1, 1.0), floor)
        return Candidate(tokens, probs, "recycle", 1, [1.0] * len(tokens), acceptance) if tokens else None

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        floor = max(0.02, 0.5 * extra_cost(1))  # a token less likely than this is never worth a row
        drafts = []
        for u, ctx, n in zip(users, contexts, max_tokens):
            sam = self.automata[u]
            for t in ctx[len(sam.tokens):]:
                sam.extend(t)
                self.cursors[u].follow(sam)
            draft = (self._tree_draft if trees else self._chain_draft)(u, ctx, n, floor, extra_cost) if n else None
            drafts.append(draft or Draft([], "none"))
        return drafts

    def _chain_draft(self, user, context, n, floor, extra_cost) -> Optional[Draft]:
        """The candidate with the most expected accepted tokens, cut where it stops paying."""
        candidates = self._candidates(user, context, n, floor)
        if self.recycled is not None:
            candidates += [c for c in [self._recycled_chain(context[-1], n, floor)] if c is not None]
        best = max(candidates, key=lambda c: sum(c.probs), default=None)
        k = self.policies[user].gate(best_length(best.probs, extra_cost) if best else 0, n,
                                     extra_cost(1) - (best.probs[0] if best else 0.0))
        if best is None or k == 0:
            return None
        self.pending[user] = best, k
        return Draft(best.tokens[:k], best.source, best.match_len if best.source != "recycle" else 0,
                     expected=sum(best.probs[:k]))

    def _tree_draft(self, user, context, n, floor, extra_cost) -> Optional[Draft]:
        """A token tree over all candidates and recycled predictions (token_tree.build_tree), its most probable
        nodes while they pay."""
        candidates = sorted(self._candidates(user, context, n, floor), key=lambda c: -sum(c.probs))
        recycle = self.acceptance["recycle"]
        tokens, parents, probs, origins, offsets = self.sources.build_tree(
            context[-1], [(c.tokens, c.probs) for c in candidates], self.recycled, recycle.rates(),
            min(n, self.MAX_TREE_NODES), floor)  # at most n nodes, parents first
        k = self.policies[user].gate(best_length(probs, extra_cost), n, extra_cost(1) - (probs[0] if probs else 0.0))
        if k == 0 or not tokens:
            return None
        tree = self.pending[user] = PendingTree(candidates, parents[:k], origins[:k], offsets[:k])
        if tree.parents == list(range(-1, k - 1)):  # a chain: one Draft source if it has one
            sources = {candidates[c].source if c >= 0 else "recycle" for c in tree.origins}
            if len(sources) == 1:
                source = sources.pop()
                match_len = tree.scored_by(0, recycle)[1] if source != "recycle" else 0
                return Draft(tokens[:k], source, match_len, expected=sum(probs[:k]))
        return Draft(tokens[:k], "tree", parents=tree.parents, expected=sum(probs[:k]))

    def withdraw(self, user: int) -> None:
        """The user's proposed draft will not be verified (another source drafts instead): nothing to learn."""
        self.pending.pop(user, None)

    def accept(self, user, verified):
        if self.recycled is not None and verified.top_ids is not None:
            rows = verified.true_rows
            self.recycled.observe([verified.fed[r] for r in rows], [verified.top_ids[r] for r in rows])
        pending = self.pending.pop(user, None)
        if isinstance(pending, tuple):  # a chain: its tokens up to the first rejected one were tested
            candidate, k = pending
            for j in range(min(k, verified.n_accepted + 1)):  # recycled chains: every token is a rank-1 guess
                key = candidate.match_len + (j if candidate.source != "recycle" else 0)
                candidate.acceptance.observe(key, candidate.freqs[j], j < verified.n_accepted)
        elif pending:  # a tree: a node was tested when its parent was accepted
            accepted = set(verified.path)
            reached = {-1} | accepted
            for i, parent in enumerate(pending.parents):
                if parent in reached:
                    acceptance, key, freq = pending.scored_by(i, self.acceptance["recycle"])
                    acceptance.observe(key, freq, i in accepted)


class CopyCursor:
    """Where the text is copying an earlier passage from: src, the index of the passage's next token, and run, how
    many tokens in a row followed it before the last edit (0: not copying)."""

    MIN_RUN = 4  # a match this long is a copy of its earlier occurrence
    LOOKAHEAD = 4  # an edit token found this close ahead in the passage is a deletion: skip to it
    MAX_EDITS = 2  # edits in a row before the copy is given up

    def __init__(self):
        self.src, self.run, self.aligned, self.edits = 0, 0, 0, 0

    def follow(self, sam) -> None:
        """After sam.extend(token): follow the passage, re-anchor after an edit, or start at a long match."""
        match_len = sam.match_len
        if match_len >= self.MIN_RUN:  # a long match: its earlier occurrence is the passage
            self.src, self.aligned, self.edits = sam.match_end + 1, match_len, 0
            self.run = self.aligned
            return
        if not self.run:
            return
        text = sam.tokens
        pos, token = len(text) - 1, text[-1]
        if self.src < pos and text[self.src] == token:
            self.src, self.aligned, self.edits = self.src + 1, self.aligned + 1, 0
            self.run = max(self.run, self.aligned)
        else:
            ahead = text[self.src + 1 : min(self.src + 1 + self.LOOKAHEAD, pos)]
            self.src += 2 + ahead.index(token) if token in ahead else 1  # deletion, else a substitution
            self.aligned, self.edits = 0, self.edits + 1
            if self.edits > self.MAX_EDITS or self.src >= pos:
                self.run = 0
