# SPDX-License-Identifier: Apache-2.0
"""Per user and step, the copied draft or another drafter's, whichever is expected to bring more tokens per unit of
work."""
from .base import FallbackDrafter
from .copied import SuffixDrafter


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

    def warm_up(self, logits: bool = False) -> dict[str, float]:
        return self.fallback.warm_up(logits)  # copied drafts are made on the host: nothing to compile
