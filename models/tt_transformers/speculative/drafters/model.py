# SPDX-License-Identifier: Apache-2.0
"""Drafts from a (smaller) model: the target's first layers over its own cache, or a separate checkpoint."""
import copy
from typing import Optional, Sequence

from ..backend import CausalLM, UserRows
from ..draft_length import DraftLengthPolicy, ExtraCost
from ..sampling import KeyedSampler, SamplingParams, probabilities
from .base import Draft


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

    def warm_up(self, logits: bool = False) -> dict[str, float]:
        # it catches up on accepted text in steps of up to its whole row budget
        return self.lm.warm_up(self.lm.max_step_rows, 0, (), logits=logits)

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
