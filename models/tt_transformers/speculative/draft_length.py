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
`max_probe_every`), and a probe waits until the plain steps it waited for cover what it is expected to lose (its
price less the tokens it is expected to bring) at PROBE_BUDGET: at a long context a verified row costs a sizeable share
of a step, and a draft source that never agrees costs at most that share, while one that only just stopped paying is
probed as often as before.

Speculative decoding must never be measurably slower than plain decoding, at any context: the backend's price of
a row carries a margin for the step model's error (backend.COST_MARGIN), and probes wait for their loss as above.
The acceptance estimates are not discounted for their error: one that runs high above the break-even drafts once or
twice before the rejections bring it down (docs/draft_sources.md, "Draft length", has the simulation).

Copied drafts (the suffix automaton, earlier responses) know more than one acceptance rate: each token has its own
estimate (MatchAcceptance), and best_length weighs those directly.
"""
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

ExtraCost = Callable[[int], float]  # k -> extra cost of verifying k more tokens (units of a user's plain step)

PROBE_BUDGET = 0.01  # the share of the plain steps a probe waits for that may pay for its loss (DraftLengthPolicy.gate)


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

    def value(self, max_tokens: int, extra_cost: ExtraCost, draft_cost: float, fixed_cost: float = 0.0) -> float:
        """Expected tokens per unit of work of the best draft of up to max_tokens at this acceptance,
        (1 + a + ... + a^k) / (1 + fixed_cost + k draft_cost + extra_cost(k)) (1.0: drafting does not pay);
        fixed_cost is what a proposal costs whatever its length (a draft head's run over the accepted rows). The
        hybrid weighs it against a copied draft's value."""
        a = min(self.acceptance, 0.99)
        return max(1.0, best_draft((a ** i for i in range(1, max_tokens + 1)), extra_cost, draft_cost, fixed_cost)[1])

    def next_length(self, max_tokens: int, extra_cost: ExtraCost) -> int:
        """Draft length for the next iteration, at most max_tokens, from the estimated per-token acceptance."""
        a = min(self.acceptance, 0.999)
        return self.gate(best_length((a ** i for i in range(1, max_tokens + 1)), extra_cost, self.draft_cost),
                         max_tokens, self.draft_cost + extra_cost(1) - a)

    def gate(self, k: int, max_tokens: int, probe_loss: float) -> int:
        """The chosen length, except that a 1-token probe goes out after `wait` iterations without drafting (the wait
        doubling while drafting does not pay) once those iterations' plain steps cover probe_loss at PROBE_BUDGET:
        what the probe is expected to lose, in a user's plain steps (its price less the probability that its token is
        accepted). Counts iterations without drafting."""
        if k == 0:
            self.idle += 1
            if self.idle >= self.wait and self.idle * PROBE_BUDGET >= probe_loss:
                self.idle, self.wait = 0, min(2 * self.wait, self.max_probe_every)
                return min(1, max_tokens)
        else:
            self.idle, self.wait = 0, self.probe_every
        return k

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verified draft: `accepted` tokens passed, and the next one failed unless all passed."""
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)


def best_length(path_probs: Iterable[float], extra_cost: ExtraCost, draft_cost: float = 0.0) -> int:
    """The draft length k (0: no draft) that maximises expected tokens per unit of work,
    (1 + P_1 + ... + P_k) / (1 + k draft_cost + extra_cost(k)), where P_i is the probability that the first i draft
    tokens are all accepted (non-increasing)."""
    return best_draft(path_probs, extra_cost, draft_cost, beat=1.0)[0]


def best_draft(path_probs: Iterable[float], extra_cost: ExtraCost, draft_cost: float = 0.0,
               fixed_cost: float = 0.0, beat: float = 0.0) -> tuple[int, float]:
    """The draft length k with the most expected tokens per unit of work,
    (1 + P_1 + ... + P_k) / (1 + fixed_cost + k draft_cost + extra_cost(k)), and that value: (0, beat) when no k
    beats `beat` (best_length: 1.0, not drafting). The scan stops at the first k that does not improve: the value is
    unimodal for the costs backends report within a step's row budget (linear, or flat inside one 32-row tile)."""
    best_k, best, total = 0, beat, 1.0
    for k, p in enumerate(path_probs, 1):
        total += p
        value = total / (1 + fixed_cost + k * draft_cost + extra_cost(k))
        if value <= best:
            break
        best_k, best = k, value
    return best_k, best


# Context lengths (matched tokens) that share one acceptance estimate: short matches predict poorly, long ones well.
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 7, 10, 16, 32)
LONGEST = LENGTH_BUCKETS[-1]
BUCKET_OF = [max(0, bisect_right(LENGTH_BUCKETS, n) - 1) for n in range(LONGEST + 1)]  # length -> bucket


def bucket_of(length: int) -> int:
    return BUCKET_OF[length if length < LONGEST else LONGEST]


class MatchAcceptance:
    """How often a copied continuation is accepted, by the length of the context it continues, learned online.

    A drafted token continues a matched context of L tokens (the match the draft started from, plus the tokens of
    the draft before it) and the automaton gives its frequency f (how often that context went on this way). Its
    probability of acceptance, given the tokens before it were accepted, is estimated as rate(L) * f, where rate(L)
    = accepted / sum of f over the tokens verified in L's bucket, decayed so it follows the current request, and
    starting from a prior that trusts longer matches more. One instance per draft source (the request's own text,
    earlier responses, a corpus; recycled predictions use it by rank): each copies differently well.
    """

    def __init__(self, prior: Optional[Sequence[float]] = None, decay: float = 0.98, prior_weight: float = 2.0):
        """prior: the starting rate per bucket (default: 0.25 for a 1-token match rising to 0.9)."""
        prior = prior or [min(0.9, 0.25 + 0.1 * b) for b in range(len(LENGTH_BUCKETS))]
        self.decay = decay
        self.hits = [prior_weight * rate for rate in prior]
        self.trials = [prior_weight] * len(LENGTH_BUCKETS)
        self._rates = [h / t for h, t in zip(self.hits, self.trials)]

    def rates(self) -> list[float]:
        """rate per bucket: probability of acceptance per unit of frequency (a token's is capped at 0.99)."""
        return self._rates

    def prob(self, length: int, freq: float) -> float:
        return min(0.99, self._rates[bucket_of(length)] * freq)

    def observe(self, length: int, freq: float, accepted: bool) -> None:
        """A verified draft token (its parent was accepted): whether it passed."""
        b = bucket_of(length)
        self.hits[b] = self.decay * self.hits[b] + accepted
        self.trials[b] = self.decay * self.trials[b] + freq
        self._rates[b] = self.hits[b] / self.trials[b]
