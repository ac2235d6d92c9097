# SPDX-License-Identifier: Apache-2.0
"""Deciding how much of a draft the target accepts: the drafts that equal the target's own token at their position.

The target's token after each fed row is its argmax when greedy, its keyed draw when sampling (sampling.TargetSamples,
read lazily), so in both cases the result is what plain decoding would append, token by token.
"""
from typing import Sequence


def verify_chain(draft: Sequence[int], target_tokens: Sequence[int]) -> list[int]:
    """Tokens to append: the longest draft prefix equal to the target's own tokens, plus the target's next token
    (the correction, or the bonus token when all drafts pass).

    target_tokens[i] is the target's token after the i-th fed token ([last accepted, d1..dn]), so it has
    len(draft) + 1 entries.
    """
    assert len(target_tokens) == len(draft) + 1, "the target must score the last accepted token and every draft"
    n = 0
    while n < len(draft) and draft[n] == target_tokens[n]:
        n += 1
    return list(draft[:n]) + [target_tokens[n]]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Draft indices below each node (-1: the context's last token), in draft order."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def verify_tree(tokens: Sequence[int], parents: Sequence[int], target_tokens: Sequence[int]
                ) -> tuple[list[int], list[int]]:
    """Tokens to append after a token tree, and the accepted path (draft indices, root to leaf).

    target_tokens[0] is the target's token after the context's last token and target_tokens[i + 1] its token after
    draft token i (in the context of that token's path). From the root, follow the child that equals the target's
    token while there is one; then append the target's own token. Siblings differ, so the path is unique.
    """
    assert len(target_tokens) == len(tokens) + 1, "the target must score the root and every tree node"
    children = children_of(parents)
    path, node = [], -1
    while True:
        want = target_tokens[node + 1]
        node = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if node is None:
            return [tokens[i] for i in path] + [want], path
        path.append(node)
