# SPDX-License-Identifier: Apache-2.0
"""Deciding how much of a draft the target accepts."""
from typing import Sequence


def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Tokens to append: the longest draft prefix the target would have chosen itself, plus the target's own next
    token (the correction, or the bonus token when all drafts pass).

    target_argmax[i] is the target's greedy token after the i-th fed token ([last accepted, d1..dn]), so it has
    len(draft) + 1 entries. The result equals what plain greedy decoding would append, one token at a time.
    """
    assert len(target_argmax) == len(draft) + 1, "the target must score the last accepted token and every draft"
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return list(draft[:n]) + [target_argmax[n]]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Draft indices below each node (-1: the context's last token), in draft order."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def verify_greedy_tree(tokens: Sequence[int], parents: Sequence[int], target_argmax: Sequence[int]
                       ) -> tuple[list[int], list[int]]:
    """Tokens to append after a token tree, and the accepted path (draft indices, root to leaf).

    target_argmax[0] is the target's token after the context's last token and target_argmax[i + 1] its token after
    draft token i (in the context of that token's path). From the root, follow the child that equals the target's
    token while there is one; then append the target's own token. Siblings differ, so the path is unique, and the
    result is what plain greedy decoding would append, token by token.
    """
    assert len(target_argmax) == len(tokens) + 1, "the target must score the root and every tree node"
    children = children_of(parents)
    path, node = [], -1
    while True:
        want = target_argmax[node + 1]
        node = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if node is None:
            return [tokens[i] for i in path] + [want], path
        path.append(node)
