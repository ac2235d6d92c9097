# SPDX-License-Identifier: Apache-2.0
"""Draft sources behind one small interface, so the generation loop never knows what drafted."""
import copy
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from ..errors import UserError
from .backend import CausalLM, UserRows
from .config import DEFAULT_SA_THRESHOLD, MAX_TREE_NODES
from .draft_length import LENGTH_BUCKETS, DraftLengthPolicy, ExtraCost, MatchAcceptance, best_length
from .draft_memory import DraftMemory
from .sampling import KeyedSampler, SamplingParams, probabilities
from .suffix_automaton import SuffixAutomaton
from .token_tree import RecycledTokens, build_tree


@dataclass
class Draft:
    """Draft tokens continuing a user's context: a chain, or a token tree when `parents` is given (parents[i] is the
    index of token i's parent among the draft tokens, -1 for a child of the context's last token; parents come
    before their children)."""

    tokens: list[int]
    source: str  # "suffix", "memory", "corpus", "copy", "recycle", "tree" (copied), "model", "head" or "none"
    match_len: int = 0  # length of the match behind a copied draft
    parents: Optional[list[int]] = None
    expected: float = 0.0  # accepted tokens the drafter expects from it (its own estimate; the hybrid compares them)


@dataclass
class Verified:
    """What a verification step did for one user: `new_tokens` were appended to its context, of which the draft
    tokens `path` (indices into the draft, root to leaf) were accepted; `fed` were the step's rows and `top_ids` the
    target's top-k next tokens after each row (when the drafter asked for them), `hidden` its tapped hidden states
    per row [rows, dim] (when the drafter wants them)."""

    new_tokens: list[int]
    path: list[int]
    fed: list[int] = field(default_factory=list)
    top_ids: Optional[list[list[int]]] = None
    hidden: Optional[torch.Tensor] = None

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    @property
    def true_rows(self) -> list[int]:
        """The rows whose context is the actual text: the last token and the accepted drafts (not rejected ones)."""
        return [0] + [i + 1 for i in self.path]


class Drafter(Protocol):
    top_k: int  # how many of the target's top next tokens per row accept() wants (0: none)
    taps: tuple[int, ...]  # the target layers whose input start() and accept() want per row (empty: none)

    def start(self, users: Sequence[int], prompts: Sequence[Sequence[int]], sampler: KeyedSampler,
              hidden: Optional[Sequence[torch.Tensor]] = None) -> None:
        """A new request per user; the prompts are what the target was prefilled with (hidden: its tapped hidden
        states over each prompt, when the drafter names taps). A drafter that samples draws with the sampler's key
        for the drafted position, the target's own noise there, unless the settings are greedy."""

    def propose(self, users: Sequence[int], contexts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                extra_cost: ExtraCost, trees: bool = False) -> list[Draft]:
        """Up to max_tokens[i] draft tokens continuing contexts[i] (the whole sequence so far, prompt included).
        extra_cost(k): what verifying k more tokens costs the target this iteration (backend.extra_cost_curve);
        trees: the target verifies token trees."""

    def accept(self, user: int, verified: Verified) -> None:
        """After verification of the user's draft (see Verified)."""

    def warm_up(self) -> dict[str, float]:
        """Compile (on a TT device also plan the traces of) the drafter's own programs, after its target's warm-up and
        before anything is timed: a draft model's, a draft head's on the device. Seconds spent, by TT's perf keys
        ({"compile_prefill": s, "compile_decode": s}; empty for a drafter with none). Learns nothing."""


class FallbackDrafter(Drafter, Protocol):
    """A drafter the hybrid weighs against copied drafts: what its draft would bring."""

    def draft_value(self, user: int, n: int, extra_cost: ExtraCost) -> float:
        """Expected tokens per unit of work (its making and its verification) of a draft of up to n tokens, from its
        recent acceptance; the hybrid lets it draft where this beats the copied draft's."""


class ModelDrafter:
    """Autoregressive drafting with a (smaller) model.

    The draft cache holds a prefix of the user's context. Each proposal first feeds the tokens it has not seen
    (one or two normally, more after iterations in which another source drafted; in steps within the draft's row
    budget), then one token per step. The drafts it fed stay valid as far as the target accepted them; everything
    after is overwritten later. A draft that is a view of the target's first layers (`shares_target_cache`) reads
    the target's cache for those layers: the target's prefill and verification steps write every position before
    the last token with the same weights, so such a draft needs no prefill and no catch-up of its own.

    draft_cost: one draft token's cost in target forwards (about draft layers / target layers). When given, the
    draft length adapts to recent acceptance (DraftLengthPolicy, carried from one request to the next) and
    drafting pauses while it does not pay; when None every draft has the full requested length.
    """

    top_k = 0
    taps = ()

    def __init__(self, lm: CausalLM, draft_cost: Optional[float] = None):
        self.lm, self.draft_cost = lm, draft_cost
        self.shares_cache = lm.shares_target_cache
        self.cache_len: dict[int, int] = {}
        self.fed: dict[int, tuple[int, int]] = {}  # user -> (context length at proposal, drafts fed)
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.sampler = KeyedSampler(SamplingParams())

    def start(self, users, prompts, sampler, hidden=None):
        if not self.shares_cache:
            for u, p in zip(users, prompts):
                self.lm.prefill(u, p)
        self.cache_len = {u: len(p) for u, p in zip(users, prompts)}
        self.fed = {}
        if self.draft_cost is not None:
            learned = DraftLengthPolicy.learned_from(self.policies.values(), self.draft_cost)
            self.policies = {u: copy.copy(learned) for u in users}
        self.sampler = sampler

    def warm_up(self) -> dict[str, float]:
        # it catches up on accepted text in steps of up to its whole row budget
        return self.lm.warm_up(self.lm.max_step_rows, 0, ())

    def draft_value(self, user: int, n: int, extra_cost: ExtraCost) -> float:
        """Expected tokens per unit of work of a draft of up to n tokens (DraftLengthPolicy.value; 0 when its
        acceptance is not tracked)."""
        return self.policies[user].value(n, extra_cost, self.draft_cost) if user in self.policies else 0.0

    def _next_tokens(self, rows: list[UserRows]) -> list[int]:
        """One draft token per user after its fed rows: greedy, or drawn from the draft's q with the target's key."""
        params = self.sampler.params
        out = self.lm.step(rows, logits=not params.greedy)
        if params.greedy:
            return [ids[-1] for ids in out.ids]
        return [self.sampler.sample(probabilities(logits[-1], params), r.user, r.start_pos + len(r.tokens))
                for r, logits in zip(rows, out.logits)]

    def _first_rows(self, live: list[tuple[int, Sequence[int]]]) -> list[UserRows]:
        """The first drafting step: every token the draft cache has not seen, up to the user's last one. Users far
        behind (after iterations another source drafted) first catch up in chunks within the row budget."""
        chunk = max(1, self.lm.max_step_rows // max(1, len(live)))
        while True:
            behind = [(u, ctx) for u, ctx in live if len(ctx) - self.cache_len[u] > chunk]
            if not behind:
                return [UserRows(u, list(ctx[self.cache_len[u]:]), self.cache_len[u]) for u, ctx in live]
            self.lm.step([UserRows(u, list(ctx[self.cache_len[u] : self.cache_len[u] + chunk]), self.cache_len[u])
                          for u, ctx in behind])
            for u, _ in behind:
                self.cache_len[u] += chunk

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        if self.policies:
            max_tokens = [self.policies[u].next_length(n, extra_cost) if n > 0 else 0
                          for u, n in zip(users, max_tokens)]
        drafts = {u: [] for u in users}
        live = [(u, ctx) for u, ctx, n in zip(users, contexts, max_tokens) if n > 0]
        if self.shares_cache:  # the target wrote every position before the last token
            self.cache_len.update({u: len(ctx) - 1 for u, ctx in live})
        rows = self._first_rows(live)
        wanted = dict(zip(users, max_tokens))
        while rows:
            for r, tok in zip(rows, self._next_tokens(rows)):
                drafts[r.user].append(tok)
            rows = [UserRows(r.user, [drafts[r.user][-1]], r.start_pos + len(r.tokens)) for r in rows
                    if len(drafts[r.user]) < wanted[r.user]]
        for u, ctx in zip(users, contexts):
            if drafts[u]:
                self.fed[u] = (len(ctx), len(drafts[u]) - 1)
        return [Draft(drafts[u], "model" if drafts[u] else "none") for u in users]

    def accept(self, user, verified):
        if user in self.fed:
            context_len, n_fed = self.fed.pop(user)
            self.cache_len[user] = context_len + min(verified.n_accepted, n_fed)
            if self.policies:
                self.policies[user].update(n_fed + 1, verified.n_accepted)


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
        self.recycled = RecycledTokens(recycle) if recycle else None
        self.top_k, self.taps = recycle, ()
        # Copy mode's prior is flat and low: its runs are keyed by the copied run's length, which spreads its few
        # verifications over long-match buckets whose default prior (0.9) scored its drafts well above how often they
        # were accepted on chat, QA and JSON.
        self.acceptance = {"suffix": MatchAcceptance(), "memory": MatchAcceptance(), "corpus": MatchAcceptance(),
                           "copy": MatchAcceptance(prior=[0.3] * len(LENGTH_BUCKETS)),
                           "recycle": MatchAcceptance(prior=[0.45, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02, 0.02])}
        self.automata: dict[int, SuffixAutomaton] = {}
        self.prompt_lens: dict[int, int] = {}
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.cursors: dict[int, CopyCursor] = {}
        self.pending: dict = {}  # user -> (Candidate, length) for a chain, or the tree's nodes

    def start(self, users, prompts, sampler, hidden=None):
        if self.memory is not None:
            self.memory.start_request([sam.tokens[self.prompt_lens[u]:] for u, sam in self.automata.items()])
        self.automata = {u: SuffixAutomaton(p) for u, p in zip(users, prompts)}
        self.prompt_lens = {u: len(p) for u, p in zip(users, prompts)}
        self.policies = {u: DraftLengthPolicy(0.0) for u in users}
        self.cursors = {u: CopyCursor() for u in users}
        self.pending = {}

    def warm_up(self) -> dict[str, float]:
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
        k = self.policies[user].gate(best_length(best.probs, extra_cost) if best else 0, n)
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
        tokens, parents, probs, origins, offsets = build_tree(
            context[-1], [(c.tokens, c.probs) for c in candidates], self.recycled, recycle.rates(),
            min(n, self.MAX_TREE_NODES), floor)  # at most n nodes, parents first
        k = self.policies[user].gate(best_length(probs, extra_cost), n)
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

    def follow(self, sam: SuffixAutomaton) -> None:
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


class HybridDrafter:
    """Per user and iteration, the copied draft or the fallback's (a trained draft head or a draft model), whichever
    is expected to bring more tokens per unit of work (as SAM-Decoding picks between its automaton and EAGLE): the
    copied draft's value is (1 + the sum of its tokens' acceptance probabilities) / (1 + what verifying them costs),
    the fallback's (draft_value) comes from its recent acceptance and what its drafts cost to make and verify.
    Copied drafts cost nothing to make, so they are proposed first and the fallback runs only for the users it wins
    or that have no copied draft (where it still decides for itself whether drafting pays)."""

    def __init__(self, suffix: SuffixDrafter, fallback: FallbackDrafter):
        self.suffix, self.fallback = suffix, fallback
        self.top_k, self.taps = suffix.top_k, fallback.taps

    def start(self, users, prompts, sampler, hidden=None):
        self.suffix.start(users, prompts, sampler)
        self.fallback.start(users, prompts, sampler, hidden)

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        drafts = self.suffix.propose(users, contexts, max_tokens, extra_cost, trees)
        tries = [max_tokens[i] > 0 and (not d.tokens or (1 + d.expected) / (1 + extra_cost(len(d.tokens)))
                                        < self.fallback.draft_value(users[i], max_tokens[i], extra_cost))
                 for i, d in enumerate(drafts)]
        # every user is passed on, with 0 tokens where the copy wins: a head on a TT device feeds each verified step's
        # rows at the next proposal (the step after rewrites them); the others do nothing for 0 tokens
        fallback_drafts = self.fallback.propose(users, contexts, [n if t else 0 for n, t in zip(max_tokens, tries)],
                                                extra_cost, trees)
        for i, d in enumerate(fallback_drafts):
            if tries[i] and (d.tokens or not drafts[i].tokens):
                self.suffix.withdraw(users[i])
                drafts[i] = d
        return drafts

    def accept(self, user, verified):
        self.suffix.accept(user, verified)  # each source learns only from its own drafts
        self.fallback.accept(user, verified)

    def warm_up(self) -> dict[str, float]:
        return self.fallback.warm_up()  # copied drafts are made on the host: nothing to compile
