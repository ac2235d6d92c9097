# SPDX-License-Identifier: Apache-2.0
"""How many tokens to draft: the length that maximises expected tokens per unit of work, from recent acceptance.

With per-token acceptance a, a draft of k tokens yields (1 - a^(k+1)) / (1 - a) tokens per target forward
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", section 3.1) and costs
1 + k * draft_cost + extra_cost(k) target forwards, where draft_cost is one draft token (0 for the suffix
automaton, about draft_layers / target_layers for a truncated model) and extra_cost(k) what verifying k more
tokens adds to the step, both in units of one user's share of a plain decode step. extra_cost comes from the
target backend (backend.extra_cost_curve over CausalLM.step_cost): nearly linear on a CPU, growing with the batch;
a step function of 32-row tiles on a TT device, where tokens that fit the tile are nearly free. The policy keeps a
decayed count of accepted and rejected draft tokens, estimates a, and picks the best k up to the iteration's
maximum. When drafting does not pay (k = 0) it still drafts one token after `probe_every` idle iterations, so the
estimate can recover; the wait doubles after each probe that does not bring drafting back (up to
`max_probe_every`), so a draft source that never agrees costs almost nothing.

A suffix draft is further capped at max_spec_factor * match_len tokens (SuffixDecoding's rule): a short match
predicts a short continuation, and long rejected drafts eat the gain.
"""
import math
from dataclasses import dataclass
from typing import Callable

ExtraCost = Callable[[int], float]  # k -> extra cost of verifying k more tokens (units of a user's plain step)


def linear_cost(per_token: float) -> ExtraCost:
    """A cost curve that grows by `per_token` with every verified token."""
    return lambda k: k * per_token


@dataclass
class DraftLengthPolicy:
    draft_cost: float = 0.0
    decay: float = 0.8  # weight of the past per iteration
    prior_accepted: float = 3.0  # pseudo-counts: start at a = 0.75 with the weight of four tokens
    prior_rejected: float = 1.0
    probe_every: int = 8
    max_probe_every: int = 64

    def __post_init__(self):
        self.accepted, self.rejected, self.idle = self.prior_accepted, self.prior_rejected, 0
        self.wait = self.probe_every

    @classmethod
    def learned_from(cls, policies, draft_cost: float) -> "DraftLengthPolicy":
        """A policy for a new request that starts from what earlier requests learned about the same draft model:
        their pooled acceptance, at the prior's weight so the new request's own drafts still move it quickly, and
        their shortest probe wait. A draft model agrees with its target about as often on every request, so a
        known-bad draft is not tried again at the start of each one."""
        policy = cls(draft_cost)
        policies = list(policies)
        if policies:
            accepted = sum(p.accepted for p in policies)
            share = accepted / (accepted + sum(p.rejected for p in policies))
            weight = policy.accepted + policy.rejected
            policy.accepted, policy.rejected = weight * share, weight * (1 - share)
            policy.wait = min(p.wait for p in policies)
        return policy

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next draft token is accepted."""
        return self.accepted / (self.accepted + self.rejected)

    def next_length(self, max_tokens: int, extra_cost: ExtraCost) -> int:
        """Draft length for the next iteration, at most max_tokens (counts iterations without drafting).

        The scan stops at the first k whose value does not improve: the value is unimodal for the costs backends
        report within a step's row budget (linear, or flat inside one 32-row tile).
        """
        a = min(self.acceptance, 0.999)
        best_k, best = 0, 1.0  # k = 0: one token per forward of cost 1
        for k in range(1, max_tokens + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (1 + k * self.draft_cost + extra_cost(k))
            if value <= best:
                break
            best_k, best = k, value
        if best_k == 0:
            self.idle += 1
            if self.idle >= self.wait:
                self.idle, self.wait = 0, min(2 * self.wait, self.max_probe_every)
                return min(1, max_tokens)
        else:
            self.idle, self.wait = 0, self.probe_every
        return best_k

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verified draft: `accepted` tokens passed, and the next one failed unless all passed."""
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)


def suffix_cap(match_len: int, max_spec_factor: float) -> int:
    """At most max_spec_factor tokens per matched token (at least one)."""
    return max(1, math.floor(max_spec_factor * match_len))
