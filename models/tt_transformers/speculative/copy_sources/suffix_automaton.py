# SPDX-License-Identifier: Apache-2.0
"""Online suffix automaton over token ids with occurrence counts: the model-free draft source (SAM-Decoding,
arXiv 2411.10666; frequency-scored continuations as in SuffixDecoding, arXiv 2411.04975).

The automaton of a sequence S has one state per class of substrings with the same set of end positions (endpos);
at most 2|S| - 1 states and 3|S| - 4 transitions, and appending a token costs amortised O(1).

- The longest suffix of S that occurred earlier is the suffix link of the state `extend` creates (the
  construction finds it on the way): the match comes with every extension, never from a scan.
- Each state keeps `count` = |endpos| (how often its strings occur), `cont` = how many of those occurrences are
  followed by a token, and `best` = its most frequent next token (ties go to the most recent). Appending a token
  adds one end position to every state on the new state's suffix-link chain and one continuation to every state
  on the previous last state's chain; on real text these chains are short (3 states on average, at most 8, over
  4,000 tokens of the benchmark prompts), so both walks are capped at CHAIN_CAP states: only degenerate periodic
  text (one token repeated) undercounts the shortest states.
- `continuation(state, ...)` follows `best` from a state: the most frequent continuation of that context, the
  frequency of each step (child count / continuations) and the acceptance probability that gives it, which is what
  a draft copies and how it is scored.
- `recent[state]` is an end position of the state's strings, the most recent one at which it was the longest
  earlier match (or where it was created).

This Python class is the reference; drafting runs its port in suffix_native.c (native.py) where that builds, which
tests/speculative/test_suffix_native.py holds to the same matches, counts and continuations (`implementations()`: whichever runs).
"""
import sys
from typing import Sequence

from ..draft_length import BUCKET_OF, LONGEST

CHAIN_CAP = 64


class ReferenceSuffixAutomaton:
    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link: list[int] = [-1]  # suffix link (the state of the longest suffix in another class)
        self.length: list[int] = [0]  # longest string of the state
        self.recent: list[int] = [-1]  # an end position (index into tokens) of the state's strings
        self.count: list[int] = [0]  # |endpos|: occurrences of the state's strings
        self.cont: list[int] = [0]  # occurrences followed by another token
        self.best: list[int] = [-1]  # most frequent next token (-1: none yet)
        self.last = 0  # state of the whole sequence
        self.match_state, self.match_len, self.match_end = 0, 0, -1  # longest suffix that occurred earlier
        for t in tokens:
            self.extend(t)

    @property
    def n_states(self) -> int:
        return len(self.length)

    @property
    def n_transitions(self) -> int:
        return sum(len(t) for t in self.next)

    @property
    def nbytes(self) -> int:
        """Memory held (the lists and dicts; the ints in them are mostly shared small ints)."""
        return sum(sys.getsizeof(t) for t in self.next) + sum(sys.getsizeof(x) for x in (
            self.next, self.link, self.length, self.recent, self.tokens, self.count, self.cont, self.best))

    def state(self, state: int) -> tuple[int, int, int, int, int, int]:
        """(length, link, recent, count, cont, best) of a state."""
        return (self.length[state], self.link[state], self.recent[state], self.count[state], self.cont[state],
                self.best[state])

    def transition(self, state: int, token: int) -> int:
        """The state reached from `state` by `token`, -1 when none."""
        return self.next[state].get(token, -1)

    def extend(self, token: int) -> None:
        """Append one token (amortised O(1)) and update the longest earlier match and the counts."""
        pos = len(self.tokens)
        self.tokens.append(token)
        nxt, link, length, recent = self.next, self.link, self.length, self.recent
        count, cont, best = self.count, self.cont, self.best
        previous = self.last
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[previous] + 1)
        recent.append(pos)
        count.append(0)
        cont.append(0)
        best.append(-1)
        p = previous
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone keeps the strings up to length[p] + 1, and q's occurrences so far
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                recent.append(recent[q])
                count.append(count[q])
                cont.append(cont[q])
                best.append(best[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        x, steps = cur, 0
        while x > 0 and steps < CHAIN_CAP:  # every suffix of the text now also ends at pos
            count[x] += 1
            x, steps = link[x], steps + 1
        x, steps = previous, 0
        while x > 0 and steps < CHAIN_CAP:  # every suffix of the text before pos is now followed by `token`
            cont[x] += 1
            b = best[x]
            if b < 0 or b == token or count[nxt[x][token]] >= count[nxt[x][b]]:
                best[x] = token
            x, steps = link[x], steps + 1
        match = link[cur]  # the longest suffix that occurred before `pos`
        self.match_state, self.match_len, self.match_end = match, length[match], recent[match]
        recent[match] = pos

    def continuation(self, state: int, context_len: int, max_tokens: int, rates: Sequence[float],
                     floor: float) -> tuple[list[int], list[float], list[float]]:
        """The most frequent continuation from `state`, a matched context of context_len tokens: up to max_tokens
        tokens, each step's frequency f (occurrences of the extended context / occurrences of the context followed
        by anything), and P_i, the probability that the first i tokens are all accepted, where each token passes
        with rates[bucket of its context length] * f (draft_length.MatchAcceptance). Stops where P_i < floor. A
        context whose only occurrence ends the text (the walk caught up with the present, as periodic text does)
        continues from its suffix link, the longest shorter context seen followed by something."""
        tokens, freqs, probs, p = [], [], [], 1.0
        nxt, count, cont, best, link, length = self.next, self.count, self.cont, self.best, self.link, self.length
        while len(tokens) < max_tokens:
            while cont[state] == 0 and state > 0:  # reached the end of the text (periodic text does): fall back
                state = link[state]  # to the longest shorter context that was seen followed by something
                context_len = length[state]
            if cont[state] == 0:
                break
            token = best[state]
            if token < 0:  # a document separator (draft_memory.py): the continuation ends there
                break
            child = nxt[state][token]
            f = count[child] / cont[state]
            q = rates[BUCKET_OF[context_len if context_len < LONGEST else LONGEST]] * f
            p *= q if q < 0.99 else 0.99
            if p < floor:
                break
            tokens.append(token)
            freqs.append(f)
            probs.append(p)
            state, context_len = child, context_len + 1
        return tokens, freqs, probs

    def anchors(self, state: int, min_len: int, limit: int) -> list[tuple[int, int]]:
        """`state` and up to limit - 1 of its suffix-link ancestors (shorter contexts) at least min_len long, with
        their lengths."""
        out = []
        while state > 0 and self.length[state] >= min_len and len(out) < limit:
            out.append((state, self.length[state]))
            state = self.link[state]
        return out

    def advance(self, state: int, length: int, token: int) -> tuple[int, int]:
        """The longest suffix of (a matched string of `length` tokens at `state`, then token) that occurs in the
        text: follow `token`, or shorten first; (0, 0) when not even `token` occurs."""
        nxt, link = self.next, self.link
        while state > 0 and token not in nxt[state]:
            state = link[state]
            length = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], length + 1
        return 0, 0

