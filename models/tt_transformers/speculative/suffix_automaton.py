# SPDX-License-Identifier: Apache-2.0
"""Online suffix automaton over token ids: the model-free draft source (SAM-Decoding, arXiv 2411.10666).

The automaton of a sequence S has one state per class of substrings with the same set of end positions;
at most 2|S| - 1 states and 3|S| - 4 transitions, and appending a token costs amortised O(1).

The draft needs the longest suffix of S that also occurred earlier. That is exactly the suffix link of the
state `extend` creates for the new last token (the classic construction finds it on the way), so the match
comes for free with every extension and is never recomputed by scanning.

Which occurrence: each state remembers `recent[state]`, an end position of its strings, refreshed whenever the
state becomes the longest earlier match (and set when the state is created). The draft copies what followed
that occurrence, i.e. the most recent time this context was matched, which is what edits and repeated
structures continue from; a context never matched before falls back to the occurrence it was created at.
"""


class SuffixAutomaton:
    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link: list[int] = [-1]  # suffix link (the state of the longest suffix in another class)
        self.length: list[int] = [0]  # longest string of the state
        self.recent: list[int] = [-1]  # an end position (index into tokens) of the state's strings
        self.last = 0  # state of the whole sequence
        self.match_state, self.match_len, self.match_end = 0, 0, -1  # longest suffix that occurred earlier
        for t in tokens:
            self.extend(t)

    @property
    def n_states(self) -> int:
        return len(self.length)

    def extend(self, token: int) -> None:
        """Append one token (amortised O(1)) and update the longest earlier match."""
        pos = len(self.tokens)
        self.tokens.append(token)
        nxt, link, length, recent = self.next, self.link, self.length, self.recent
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        recent.append(pos)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone keeps the strings up to length[p] + 1
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                recent.append(recent[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        match = link[cur]  # the longest suffix that occurred before `pos`
        self.match_state, self.match_len, self.match_end = match, length[match], recent[match]
        recent[match] = pos

    def propose(self, max_tokens: int, min_match: int = 1) -> tuple[list[int], int]:
        """Up to max_tokens tokens that followed an earlier occurrence of the longest matched suffix, and the
        length of the suffix they continue. When that occurrence ends too close to the end of the sequence for
        max_tokens to follow, walk up suffix links (shorter suffixes, at least min_match long) to one whose
        occurrence has more after it. ([], 0) when no suffix of at least min_match tokens occurred before.
        """
        state, match_len, end = self.match_state, self.match_len, self.match_end
        if match_len < max(min_match, 1) or max_tokens <= 0:
            return [], 0
        n_tokens = len(self.tokens)
        best_len, best_end = match_len, end
        for _ in range(4):  # a few shorter suffixes at most: the walk stays O(1)
            if n_tokens - 1 - best_end >= max_tokens:
                break
            state = self.link[state]
            if state <= 0 or self.length[state] < min_match:
                break
            if self.recent[state] < best_end:
                best_len, best_end = self.length[state], self.recent[state]
        return self.tokens[best_end + 1 : best_end + 1 + max_tokens], best_len
