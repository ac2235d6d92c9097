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
