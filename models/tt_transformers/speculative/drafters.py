# SPDX-License-Identifier: Apache-2.0
"""Draft sources behind one small interface, so the generation loop never knows what drafted."""
import copy
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .backend import CausalLM, UserRows
from .draft_length import DraftLengthPolicy, ExtraCost, suffix_cap
from .sampling import SamplingParams, probabilities, sample
from .suffix_automaton import SuffixAutomaton

DEFAULT_SA_THRESHOLD = 3  # minimum match length for a suffix draft (TensorRT-LLM uses 4, SAM-Decoding 5)
DRAFT_RNG_STREAM = 1 << 20  # the draft model samples from streams of its own, apart from the target's


@dataclass
class Draft:
    tokens: list[int]
    source: str  # "model", "suffix" or "none"
    match_len: int = 0  # length of the suffix match behind a suffix draft
    probs: Optional[list[torch.Tensor]] = None  # when sampling: the draft model's q for each token; None = point mass


class Drafter(Protocol):
    def start(self, users: Sequence[int], prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        """A new request per user; the prompts are what the target was prefilled with. A model drafter samples
        its drafts with the same settings (and returns q with them) unless they are greedy."""

    def propose(self, users: Sequence[int], contexts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                extra_cost: ExtraCost) -> list[Draft]:
        """Up to max_tokens[i] draft tokens continuing contexts[i] (the whole sequence so far, prompt included).
        extra_cost(k): what verifying k more tokens costs the target this iteration (backend.extra_cost_curve)."""

    def accept(self, user: int, new_tokens: Sequence[int], n_accepted: int) -> None:
        """After verification: `new_tokens` were appended to the user's context, the first `n_accepted` of them
        from this iteration's draft."""


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

    def __init__(self, lm: CausalLM, draft_cost: Optional[float] = None):
        self.lm, self.draft_cost = lm, draft_cost
        self.shares_cache = getattr(lm, "shares_target_cache", False)
        self.cache_len: dict[int, int] = {}
        self.fed: dict[int, tuple[int, int]] = {}  # user -> (context length at proposal, drafts fed)
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.sampling, self.streams = SamplingParams(), None

    def start(self, users, prompts, sampling):
        if not self.shares_cache:
            for u, p in zip(users, prompts):
                self.lm.prefill(u, p)
        self.cache_len = {u: len(p) for u, p in zip(users, prompts)}
        self.fed = {}
        if self.draft_cost is not None:
            learned = DraftLengthPolicy.learned_from(self.policies.values(), self.draft_cost)
            self.policies = {u: copy.copy(learned) for u in users}
        self.sampling = sampling
        self.streams = None if sampling.greedy else sampling.streams()

    def _next_tokens(self, rows: list[UserRows]) -> list[tuple[int, Optional[torch.Tensor]]]:
        """One draft token per user after its fed rows: greedy, or sampled from the draft's q (returned too)."""
        out = self.lm.step(rows, logits=not self.sampling.greedy)
        if self.sampling.greedy:
            return [(ids[-1], None) for ids in out.ids]
        tokens = []
        for r, logits in zip(rows, out.logits):
            q = probabilities(logits[-1], self.sampling)
            tokens.append((sample(q, self.streams(DRAFT_RNG_STREAM + r.user, q.device)), q))
        return tokens

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

    def propose(self, users, contexts, max_tokens, extra_cost):
        if self.policies:
            max_tokens = [self.policies[u].next_length(n, extra_cost) if n > 0 else 0
                          for u, n in zip(users, max_tokens)]
        drafts = {u: [] for u in users}
        probs = {u: [] for u in users}
        live = [(u, ctx) for u, ctx, n in zip(users, contexts, max_tokens) if n > 0]
        if self.shares_cache:  # the target wrote every position before the last token
            self.cache_len.update({u: len(ctx) - 1 for u, ctx in live})
        rows = self._first_rows(live)
        wanted = dict(zip(users, max_tokens))
        while rows:
            for r, (tok, q) in zip(rows, self._next_tokens(rows)):
                drafts[r.user].append(tok)
                probs[r.user].append(q)
            rows = [UserRows(r.user, [drafts[r.user][-1]], r.start_pos + len(r.tokens)) for r in rows
                    if len(drafts[r.user]) < wanted[r.user]]
        for u, ctx in zip(users, contexts):
            if drafts[u]:
                self.fed[u] = (len(ctx), len(drafts[u]) - 1)
        return [Draft(drafts[u], "model" if drafts[u] else "none",
                      probs=None if self.sampling.greedy else probs[u]) for u in users]

    def accept(self, user, new_tokens, n_accepted):
        if user in self.fed:
            context_len, n_fed = self.fed.pop(user)
            self.cache_len[user] = context_len + min(n_accepted, n_fed)
            if self.policies:
                self.policies[user].update(n_fed + 1, n_accepted)


class SuffixDrafter:
    """Model-free drafts: the continuation of the longest earlier match in the user's own text.

    One `SuffixAutomaton` per user over prompt + generated tokens, extended with every new token. A user whose
    longest earlier match is shorter than `threshold` gets no draft, so the target decodes one token exactly as
    plain decoding does. A draft is at most max_spec_factor * match_len tokens and at most what the user's
    DraftLengthPolicy (draft cost 0) finds worth verifying.
    """

    def __init__(self, threshold: int = DEFAULT_SA_THRESHOLD, max_spec_factor: float = 1.0):
        if threshold < 1:
            raise ValueError(f"sa_threshold must be >= 1, got {threshold}")
        self.threshold, self.max_spec_factor = threshold, max_spec_factor
        self.automata: dict[int, SuffixAutomaton] = {}
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.drafted: dict[int, int] = {}

    def start(self, users, prompts, sampling):
        self.automata = {u: SuffixAutomaton(p) for u, p in zip(users, prompts)}
        self.policies = {u: DraftLengthPolicy(0.0) for u in users}  # fresh: how much text repeats is per request
        self.drafted = {}

    def propose(self, users, contexts, max_tokens, extra_cost):
        drafts = []
        for u, ctx, n in zip(users, contexts, max_tokens):
            sam = self.automata[u]
            for t in ctx[len(sam.tokens):]:
                sam.extend(t)
            tokens, match_len = [], 0
            if n > 0 and sam.match_len >= self.threshold:
                n = min(n, suffix_cap(sam.match_len, self.max_spec_factor),
                        self.policies[u].next_length(n, extra_cost))
                tokens, match_len = sam.propose(n, self.threshold)
            self.drafted[u] = len(tokens)
            drafts.append(Draft(tokens, "suffix" if tokens else "none", match_len))
        return drafts

    def accept(self, user, new_tokens, n_accepted):
        self.policies[user].update(self.drafted.pop(user, 0), n_accepted)


class HybridDrafter:
    """Per user and iteration: the suffix draft when its match reaches the threshold, else the draft model."""

    def __init__(self, suffix: SuffixDrafter, model: ModelDrafter):
        self.suffix, self.model = suffix, model

    def start(self, users, prompts, sampling):
        self.suffix.start(users, prompts, sampling)
        self.model.start(users, prompts, sampling)

    def propose(self, users, contexts, max_tokens, extra_cost):
        drafts = self.suffix.propose(users, contexts, max_tokens, extra_cost)
        fallback = [i for i, d in enumerate(drafts) if not d.tokens and max_tokens[i] > 0]
        if fallback:
            model_drafts = self.model.propose([users[i] for i in fallback], [contexts[i] for i in fallback],
                                              [max_tokens[i] for i in fallback], extra_cost)
            for i, d in zip(fallback, model_drafts):
                drafts[i] = d
        return drafts

    def accept(self, user, new_tokens, n_accepted):
        self.suffix.accept(user, new_tokens, n_accepted)  # each source learns only from its own drafts
        self.model.accept(user, new_tokens, n_accepted)
