# SPDX-License-Identifier: Apache-2.0
"""Draft sources behind one small interface, so the generation loop never knows what drafted."""
from dataclasses import dataclass
from typing import Protocol, Sequence

from .backend import CausalLM


@dataclass
class Draft:
    tokens: list[int]
    source: str  # "model", "suffix" or "none"
    match_len: int = 0  # length of the suffix match behind a suffix draft


class Drafter(Protocol):
    def start(self, users: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """A new request per user; the prompts are what the target was prefilled with."""

    def propose(self, users: Sequence[int], contexts: Sequence[Sequence[int]],
                max_tokens: Sequence[int]) -> list[Draft]:
        """Up to max_tokens[i] draft tokens continuing contexts[i] (the whole sequence so far, prompt included)."""

    def accept(self, user: int, new_tokens: Sequence[int], n_accepted: int) -> None:
        """After verification: `new_tokens` were appended to the user's context, the first `n_accepted` of them
        from this iteration's draft."""


class ModelDrafter:
    """Autoregressive drafting with a (smaller) model that keeps its own KV cache.

    The draft cache holds a prefix of the user's context. Each proposal first feeds the tokens it has not seen
    (one or two normally, more after iterations in which another source drafted), then one token per step. The
    drafts it fed stay valid as far as the target accepted them; everything after is overwritten later.
    """

    def __init__(self, lm: CausalLM):
        self.lm = lm
        self.cache_len: dict[int, int] = {}
        self.fed: dict[int, tuple[int, int]] = {}  # user -> (context length at proposal, drafts fed)

    def start(self, users, prompts):
        self.lm.argmax([list(p) for p in prompts], [0] * len(users), list(users), last_only=True)
        self.cache_len = {u: len(p) for u, p in zip(users, prompts)}
        self.fed = {}

    def propose(self, users, contexts, max_tokens):
        drafts = {u: [] for u in users}
        live = [(u, ctx) for u, ctx, n in zip(users, contexts, max_tokens) if n > 0]
        if live:
            first = self.lm.argmax([ctx[self.cache_len[u]:] for u, ctx in live],
                                   [self.cache_len[u] for u, _ in live], [u for u, _ in live], last_only=True)
            for (u, _), tok in zip(live, first):
                drafts[u].append(tok[0])
        wanted = dict(zip(users, max_tokens))
        while True:
            live = [(u, ctx) for u, ctx in live if len(drafts[u]) < wanted[u]]
            if not live:
                break
            nxt = self.lm.argmax([[drafts[u][-1]] for u, _ in live],
                                 [len(ctx) + len(drafts[u]) - 1 for u, ctx in live], [u for u, _ in live])
            for (u, _), tok in zip(live, nxt):
                drafts[u].append(tok[0])
        for u, ctx in zip(users, contexts):
            if drafts[u]:
                self.fed[u] = (len(ctx), len(drafts[u]) - 1)
        return [Draft(drafts[u], "model" if drafts[u] else "none") for u in users]

    def accept(self, user, new_tokens, n_accepted):
        if user in self.fed:
            context_len, n_fed = self.fed.pop(user)
            self.cache_len[user] = context_len + min(n_accepted, n_fed)
