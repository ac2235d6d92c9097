# SPDX-License-Identifier: Apache-2.0
"""What a draft head's drafter does wherever the head runs (beside the target, eagle3.py; on the device,
eagle3_device.py): acceptance learned per depth against the head's confidence, length policies that gate users whose
drafts do not pay, chains cut where one more token no longer pays, and what a head run costs, measured."""
import time
from dataclasses import dataclass, field
from typing import Optional

from loguru import logger

from ..draft_length import LENGTH_BUCKETS, DraftLengthPolicy, ExtraCost, MatchAcceptance
from ..sampling import KeyedSampler, SamplingParams
from .base import Draft, Verified


class HeadDrafterBase:
    """A draft head's drafter, wherever the head runs: each token's acceptance is estimated as a learned rate (per
    draft depth) times the head's probability for it (EAGLE-2, arXiv 2406.16858: the draft's confidence predicts
    acceptance), and a chain stops where one more token no longer pays for its head run and its verification. What a
    head run costs is measured as it drafts (RunCost); a user whose recent acceptance does not pay for the runs is not
    run at all, except for a 1-token probe now and then (DraftLengthPolicy.gate). The head (`head`) declares vocab,
    vocab_size, taps and draft_cost (its estimated run cost)."""

    top_k = 0

    def __init__(self, head):
        self.head, self.cost = head, RunCost(head.draft_cost)
        self.vocab, self.taps = head.vocab, tuple(head.taps)
        # prior: a token with the head's probability c is accepted with probability ~0.9 c at any depth
        self.acceptance = MatchAcceptance(prior=[0.9] * len(LENGTH_BUCKETS))
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.pending: dict[int, HeadDraft] = {}
        self.sampler = KeyedSampler(SamplingParams())

    def _reset(self, users, sampler, hidden) -> None:
        """A new request per user: its length policy (learned from the last request's), nothing pending."""
        if hidden is None:
            raise ValueError("a draft head drafts from the target's tapped hidden states: the generator must ask the "
                             "backend for them (Drafter.taps)")
        self.pending = {}
        self.policies = {u: DraftLengthPolicy.learned_from(self.policies.values(), self.draft_cost) for u in users}
        self.sampler = sampler
        # the head's prefill (the prompt's rows) waits for its first proposal: a request it never drafts for costs
        # nothing (on a CPU that is most of them: a long prompt's rows cost a sizeable share of the request)

    @property
    def draft_cost(self) -> float:
        return self.cost.value

    def draft_value(self, user: int, n: int, extra_cost: ExtraCost) -> float:
        """Expected tokens per unit of work of a head draft of up to n tokens, from its recent acceptance: k tokens
        take k + 1 runs (the first feeds the last step's accepted rows, the last finds a token that no longer pays)."""
        return self.policies[user].value(n, extra_cost, self.draft_cost, fixed_cost=self.draft_cost)

    def _gated(self, user: int, n: int, extra_cost: ExtraCost, probes: set) -> bool:
        """Whether the user's head drafts this step: they pay, or a 1-token probe is due (then it joins `probes`)."""
        pays = self.draft_value(user, n, extra_cost) > 1.0
        policy = self.policies[user]  # a probe: 2 runs and a row, for a token accepted at the policy's estimate
        if not policy.gate(int(pays), n, 2 * self.draft_cost + extra_cost(1) - policy.acceptance):
            return False
        if not pays:
            probes.add(user)
        return True

    def _learn_declines(self, ran, drafts: dict) -> None:
        """The users the head ran for whose runs found no token likely enough to pay for its row (no draft): a
        rejection for their gate, which otherwise learns only from verified drafts and would run such a head every
        step at a loss."""
        for user in ran:
            if user not in drafts:
                self.policies[user].update(1, 0)

    def _chain_draft(self, user: int, chain: "HeadChain", k: int) -> Optional[Draft]:
        """The chain's first k tokens as the user's draft (none for k = 0), kept to learn from its verification."""
        if not k:
            return None
        self.pending[user] = HeadDraft(chain.confidences[:k], k)
        return Draft(chain.tokens[:k], "head", expected=sum(chain.path_probs[:k]))

    def _learn(self, user, verified: Verified) -> None:
        """What the verification says of the user's last head draft: acceptance per depth and confidence, and the
        length policy."""
        self.cost.verified(max(0, len(verified.fed) - 1))
        pending = self.pending.pop(user, None)
        if pending is None:
            return
        if pending.tree is None:
            for j in range(min(pending.length, verified.n_accepted + 1)):
                self.acceptance.observe(j + 1, pending.confidences[j], j < verified.n_accepted)
        else:  # the accepted path's nodes passed; the tried children of its last node failed
            chosen, tree = pending.tree
            on_path = [chosen[i] for i in verified.path]
            last = on_path[-1] if on_path else -1
            for i in on_path:
                self.acceptance.observe(tree.nodes[i].depth, tree.nodes[i].confidence, True)
            for i in chosen:
                if tree.nodes[i].parent == last:
                    self.acceptance.observe(tree.nodes[i].depth, tree.nodes[i].confidence, False)
        self.policies[user].update(pending.length, verified.n_accepted)


@dataclass
class HeadDraft:
    """A proposed head draft, to learn from its verification."""

    confidences: list[float]  # the head's probability of each drafted token: what its acceptance is learned against
    length: int  # a chain's length, a tree's depth
    tree: Optional[tuple] = None  # (the chosen node numbers, the HeadTree) for a tree


@dataclass
class HeadChain:
    """A head draft being built: its tokens, and how many of them pay for their runs and verification (the value
    (1 + sum of path probabilities) / (1 + (k + 1) draft_cost + extra_cost(k)) grows with each paying token)."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    paying: int = 0
    value: float = 1.0

    def extend(self, token: int, confidence: float, acceptance: MatchAcceptance, draft_cost: float,
               extra_cost: ExtraCost) -> None:
        k = len(self.tokens) + 1
        path = (self.path_probs[-1] if self.path_probs else 1.0) * acceptance.prob(k, confidence)
        value = (1 + sum(self.path_probs) + path) / (1 + (k + 1) * draft_cost + extra_cost(k))
        self.tokens.append(token)
        self.confidences.append(confidence)
        self.path_probs.append(path)
        if value > self.value and self.paying == k - 1:
            self.paying, self.value = k, value


class RunCost:
    """What one head run costs, in plain target decode steps, measured on this machine: decayed means of a drafting
    run's seconds (feeding the target's verified rows, a prompt's at a first proposal, is the head's prefill, not a
    run; a catch-up's rows are timed apart, `fed`, to price the next long gap) and of a plain step's: the step that verifies a proposal is timed (from the end of the proposal to the
    first user's verification) and priced in plain steps by the proposal's extra_cost for each user's verified rows
    (a long verification at a long context costs several plain steps). Until both are measured, the estimate from
    the weights each streams, which is low on a CPU (a run's op launches do not shrink with its weights).
    measure=False keeps the estimate (drafts that do not depend on timing, for tests)."""

    decay = 0.9
    WARN_AFTER = 8  # verified proposals before a head slower than the target's step is reported (once)

    def __init__(self, estimate: float, measure: bool = True):
        self.estimate, self.measure, self.run_s, self.step_s = estimate, measure, None, None
        self.verifications = 0
        self.feed_row_s: Optional[float] = None  # a catch-up row's seconds (HeadDrafter.catch_up_pays)
        self.proposed_at: Optional[float] = None
        self.extra_cost: ExtraCost = lambda k: 0.0  # the last proposal's
        self.step_seconds: Optional[float] = None  # the step being verified, until every user's rows are in
        self.step_rows: list[int] = []

    @property
    def value(self) -> float:
        self._settle()
        if not self.measure or self.run_s is None or self.step_s is None:
            return self.estimate
        return self.run_s / self.step_s

    def ran(self, seconds: float) -> None:
        self.run_s = seconds if self.run_s is None else self.decay * self.run_s + (1 - self.decay) * seconds

    def fed(self, seconds: float, rows: int) -> None:
        """A catch-up feed of `rows` rows (a prompt's, a long gap's) took `seconds`."""
        row_s = seconds / rows
        self.feed_row_s = row_s if self.feed_row_s is None else self.decay * self.feed_row_s + (1 - self.decay) * row_s

    @property
    def feed_row_value(self) -> float:
        """One catch-up row in plain target steps: measured, else a 32nd of a run (a catch-up's rows share each
        weight's read and pay only fc's and the K/V projection's arithmetic: a 16th to a 90th of a run on this
        project's CPUs)."""
        self._settle()
        if not self.measure or self.feed_row_s is None or self.step_s is None:
            return self.value / 32
        return self.feed_row_s / self.step_s

    def proposed(self, extra_cost: ExtraCost) -> None:
        """A proposal ends now; its verification step will be priced with extra_cost."""
        self._settle()
        self.proposed_at, self.extra_cost = time.perf_counter(), extra_cost

    def verified(self, draft_rows: int) -> None:
        """A user's verification of the last proposal, with draft_rows rows past its last token (the first call after
        the proposal times the step)."""
        if self.proposed_at is not None:
            self.step_seconds, self.proposed_at, self.step_rows = time.perf_counter() - self.proposed_at, None, []
        if self.step_seconds is not None:
            self.step_rows.append(draft_rows)

    def _settle(self) -> None:
        """The timed step's seconds per plain step (1 + the users' mean extra cost) into the step's mean."""
        if self.step_seconds is None:
            return
        seconds = self.step_seconds / (1 + sum(map(self.extra_cost, self.step_rows)) / len(self.step_rows))
        self.step_seconds = None
        self.step_s = seconds if self.step_s is None else self.decay * self.step_s + (1 - self.decay) * seconds
        self.verifications += 1
        if self.measure and self.verifications == self.WARN_AFTER and self.value > 1.0:
            logger.warning(f"Draft head: a run takes {1e3 * self.run_s:.1f} ms, {self.value:.1f}x the target's step "
                           f"({1e3 * self.step_s:.1f} ms): its drafts rarely pay here (it drafts only when its "
                           "acceptance covers that)")
