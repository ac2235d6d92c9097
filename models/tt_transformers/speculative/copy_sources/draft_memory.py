# SPDX-License-Identifier: Apache-2.0
"""Cross-request memory for model-free drafts: what earlier responses (and, optionally, a corpus the user points at)
say comes next, for when the request's own text has no good match (arctic-inference's global suffix tree,
SAM-Decoding's static automaton).

A `TokenStore` is one suffix automaton over documents, each closed by a separator no context contains (so no match
spans two documents), with a running match per user into it: the longest suffix of the user's context that
occurs in the store, advanced token by token (amortised O(1)). Earlier responses live in a store with a token
budget: when it is exceeded the oldest responses go and the automaton is rebuilt from the rest (amortised O(1) per
token, at request boundaries). A corpus lives in a store of its own that never evicts.
"""
from collections import deque
from typing import Optional, Sequence

from loguru import logger

from ..config import DEFAULT_DRAFT_MEMORY
from . import implementations

MATCH_WINDOW = 64  # context tokens a new match starts from (a longer match is not needed)


class TokenStore:
    def __init__(self, max_tokens: Optional[int] = None):
        self.max_tokens = max_tokens
        self.docs: deque[list[int]] = deque()
        self.n_tokens = 0
        self.sam = implementations().SuffixAutomaton()
        self.matches: dict[int, tuple[int, int, int]] = {}  # user -> (state, length, context tokens consumed)

    def add(self, tokens: Sequence[int]) -> None:
        if not tokens or self.max_tokens == 0:
            return
        self.docs.append(list(tokens))
        self.n_tokens += len(tokens)
        if self.max_tokens is not None and self.n_tokens > self.max_tokens:
            while self.docs and self.n_tokens > 3 * self.max_tokens // 4:
                self.n_tokens -= len(self.docs.popleft())
            self.sam = implementations().SuffixAutomaton()
            for doc in self.docs:
                self._append(doc)
            self.matches = {}
        else:
            self._append(tokens)

    def _append(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.sam.extend(t)
        self.sam.extend(-1 - len(self.sam.tokens))  # a separator of its own: never in a context

    def match(self, user: int, context: Sequence[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of `context` that occurs in the store."""
        state, length, seen = self.matches.get(user, (0, 0, max(0, len(context) - MATCH_WINDOW)))
        for t in context[seen:]:
            state, length = self.sam.advance(state, length, t)
        self.matches[user] = (state, length, len(context))
        return state, length

    def forget_matches(self) -> None:
        self.matches = {}


class DraftMemory:
    """Earlier responses (bounded, oldest evicted) and an optional static corpus."""

    def __init__(self, max_tokens: int = DEFAULT_DRAFT_MEMORY, corpus: Sequence[Sequence[int]] = ()):
        self.responses = TokenStore(max_tokens)
        self.corpus = TokenStore()
        for doc in corpus:
            self.corpus.add(doc)

    @property
    def stores(self) -> list[tuple[str, TokenStore]]:
        return [("memory", self.responses), ("corpus", self.corpus)]

    def start_request(self, finished_responses: Sequence[Sequence[int]]) -> None:
        """Remember the responses of the request that just ended; a new request matches from scratch."""
        for response in finished_responses:
            self.responses.add(response)
        for _, store in self.stores:
            store.forget_matches()
        logger.info(f"Draft memory: {len(self.responses.docs)} earlier responses, {self.responses.n_tokens:,} tokens "
                    f"(limit {self.responses.max_tokens:,}), corpus {self.corpus.n_tokens:,} tokens; "
                    f"{(self.responses.sam.nbytes + self.corpus.sam.nbytes) / 2**20:.1f} MB")
