# SPDX-License-Identifier: Apache-2.0
"""Drafting with a trained draft head on the target's own final hidden states (EAGLE, arXiv 2401.15077).

The head (torch_backend/draft_head.py) reads, at position t, the target's final hidden state at t and token t+1,
and predicts the hidden state at t+1 and so the token at t+2. The target returns its hidden states for the rows it
verifies (and for the prompt at prefill), so the head always starts a draft from true states: the states of the
last step's accepted rows are fed first (one run, together with everything else the head has not seen), then the
head drafts on its own predicted states, one run per token. Its KV cache (one layer) is rolled back by position as
the target's is. The backend may be a TT device: the head runs where `DraftHeadModel` runs (on the host in torch).
"""
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from .draft_length import LENGTH_BUCKETS, DraftLengthPolicy, ExtraCost, MatchAcceptance
from .drafters import DRAFT_RNG_STREAM, Draft, Verified
from .sampling import SamplingParams, probabilities, sample


class DraftHeadModel(Protocol):
    vocab: torch.Tensor  # [V'] the draft vocabulary: the target's token ids the head can propose
    vocab_size: int  # the target's vocabulary
    draft_cost: float  # estimated cost of one head run, in units of a plain decode step of the target (until measured)
    max_rows: int  # rows one run may carry per user (longer catch-ups go in chunks)

    def run(self, users: Sequence[int], start_pos: Sequence[int], hidden: Sequence[torch.Tensor],
            next_tokens: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each user, rows (hidden state at t, token t+1) at t = start_pos, start_pos + 1, ...: the predicted
        hidden state after each row [n, dim] and the logits over the draft vocabulary after its last row [V']. A
        row's results do not depend on how many rows share the run."""


@dataclass
class HeadDraft:
    """A proposed head draft, to learn from its verification."""

    confidences: list[float]  # the head's probability of each drafted token: what its acceptance is learned against
    length: int


class HeadDrafter:
    """Drafts with a trained head: each token's acceptance is estimated as a learned rate (per draft depth) times the
    head's probability for it (EAGLE-2, arXiv 2406.16858: the draft's confidence predicts acceptance), and the
    chain stops where one more token no longer pays for its head run and its verification. What a head run costs is
    measured as it drafts (RunCost); a user whose recent acceptance does not pay for the runs is not run at all,
    except for a 1-token probe now and then (DraftLengthPolicy.gate).

    States: known[u] holds the target's hidden states the head has not been fed yet, for positions fed_len[u],
    fed_len[u] + 1, ... (from the prefill, then from every verified step's accepted rows, whichever source drafted).
    """

    top_k = 0
    wants_hidden = True

    def __init__(self, head: DraftHeadModel):
        self.head, self.cost = head, RunCost(head.draft_cost)
        self.vocab = head.vocab
        # prior: a token with the head's probability c is accepted with probability ~0.9 c at any depth
        self.acceptance = MatchAcceptance(prior=[0.9] * len(LENGTH_BUCKETS))
        self.known: dict[int, torch.Tensor] = {}
        self.fed_len: dict[int, int] = {}
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.pending: dict[int, HeadDraft] = {}
        self.sampling, self.streams = SamplingParams(), None

    def start(self, users, prompts, sampling, hidden=None):
        if hidden is None:
            raise ValueError("a draft head drafts from the target's hidden states: the generator must ask the backend "
                             "for them (Drafter.wants_hidden)")
        self.known = {u: h for u, h in zip(users, hidden)}
        self.fed_len = {u: 0 for u in users}
        self.pending = {}
        self.policies = {u: DraftLengthPolicy.learned_from(self.policies.values(), self.draft_cost) for u in users}
        self.sampling = sampling
        self.streams = None if sampling.greedy else sampling.streams()
        self._catch_up([(u, p) for u, p in zip(users, prompts)], 0)  # the head's prefill: every prompt row but one

    @property
    def draft_cost(self) -> float:
        return self.cost.value

    def draft_value(self, user: int, n: int, extra_cost: ExtraCost) -> float:
        """Expected tokens per unit of work of a head draft of up to n tokens, from its recent acceptance: k tokens
        take k + 1 runs (the first feeds the last step's accepted rows, the last finds a token that no longer pays)."""
        return self.policies[user].value(n, extra_cost, self.draft_cost, fixed_cost=self.draft_cost)

    def _rows(self, user: int, context: Sequence[int], end: int) -> tuple[int, torch.Tensor, list[int]]:
        """The head's next rows for positions fed_len .. end - 1: (start, hidden states, next tokens)."""
        start = self.fed_len[user]
        return start, self.known[user][: end - start], list(context[start + 1 : end + 1])

    def _feed(self, users: list[int], rows: list[tuple[int, torch.Tensor, list[int]]]):
        outs = self.head.run(users, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        for u, (start, states, _) in zip(users, rows):
            self.fed_len[u] = start + len(states)
            self.known[u] = self.known[u][len(states):]
        return outs

    def _catch_up(self, live: list[tuple[int, Sequence[int]]], last_rows: int) -> None:
        """Feed the known states of each user's positions before len(context) - 1, in chunks of the head's row budget,
        except its last `last_rows`..max_rows rows when last_rows > 0 (the caller's first drafting run takes them)."""
        while True:
            behind = [(u, ctx) for u, ctx in live
                      if len(ctx) - 1 - self.fed_len[u] > (self.head.max_rows if last_rows else 0)]
            if not behind:
                return
            ends = [min(len(ctx) - 1, self.fed_len[u] + self.head.max_rows) for u, ctx in behind]
            self._feed([u for u, _ in behind], [self._rows(u, ctx, end) for (u, ctx), end in zip(behind, ends)])

    def _choose(self, logits: torch.Tensor, user: int) -> tuple[int, float, Optional[torch.Tensor]]:
        """The draft token after these logits over the draft vocabulary: (token, the head's probability of it, q
        over the whole vocabulary when sampling)."""
        if self.sampling.greedy:
            p = torch.softmax(logits.float(), dim=-1)
            i = int(p.argmax())
            return int(self.vocab[i]), float(p[i]), None
        q_draft = probabilities(logits, self.sampling)
        i = sample(q_draft, self.streams(DRAFT_RNG_STREAM + user, q_draft.device))
        q = torch.zeros(self.head.vocab_size, dtype=q_draft.dtype, device=q_draft.device)
        q[self.vocab.to(q.device)] = q_draft
        return int(self.vocab[i]), float(q_draft[i]), q

    def propose(self, users, contexts, max_tokens, extra_cost: ExtraCost, trees=False):
        """Chains only: a head tree (EAGLE-2) would need the head's top candidates per depth, left for later."""
        # a one-token context has no row yet (the head's first row predicts the state at position 1); a user whose
        # head drafts do not pay is not run, but for a probe now and then
        live, probes = [], set()
        for u, ctx, n in zip(users, contexts, max_tokens):
            if n > 0 and len(ctx) > 1:
                pays = self.draft_value(u, n, extra_cost) > 1.0
                if self.policies[u].gate(int(pays), n):
                    live.append((u, ctx))
                    if not pays:
                        probes.add(u)
        wanted = dict(zip(users, max_tokens))
        start, runs = time.perf_counter(), 1
        self._catch_up(live, 1)
        going = [u for u, _ in live]
        outs = self._feed(going, [self._rows(u, ctx, len(ctx) - 1) for u, ctx in live]) if live else []
        state = {u: (len(ctx) - 1, out[0][-1:], out[1]) for (u, ctx), out in zip(live, outs)}  # position, h, logits
        chains = {u: HeadChain() for u in going}
        while going:
            for u in going:
                chains[u].extend(*self._choose(state[u][2], u), self.acceptance, self.draft_cost, extra_cost)
            going = [u for u in going if chains[u].paying == len(chains[u].tokens) < wanted[u]]
            if going:
                outs = self.head.run(going, [state[u][0] for u in going], [state[u][1] for u in going],
                                     [[chains[u].tokens[-1]] for u in going])
                runs += 1
                for u, (h, logits) in zip(going, outs):
                    state[u] = (state[u][0] + 1, h, logits)
        if live:  # a proposal's head work, per run (catch-up runs of a long gap count in the first)
            self.cost.ran((time.perf_counter() - start) / runs)
            self.cost.proposed_at = time.perf_counter()
        drafts = []
        for u, n in zip(users, max_tokens):
            chain = chains.get(u)
            # a probe drafts one token; the runs being spent, a first token pays if it is likelier than its row costs
            k = 0 if chain is None else chain.paying or int(u in probes or chain.path_probs[0] > extra_cost(1))
            if k == 0:
                drafts.append(Draft([], "none"))
                continue
            self.pending[u] = HeadDraft(chain.confidences[:k], k)
            drafts.append(Draft(chain.tokens[:k], "head", probs=None if self.sampling.greedy else chain.probs[:k],
                                expected=sum(chain.path_probs[:k])))
        return drafts

    def accept(self, user, verified: Verified):
        true_states = verified.hidden[verified.true_rows].to(self.known[user].dtype)
        self.known[user] = torch.cat([self.known[user], true_states])
        self.cost.verified()
        pending = self.pending.pop(user, None)
        if pending is not None:
            for j in range(min(pending.length, verified.n_accepted + 1)):
                self.acceptance.observe(j + 1, pending.confidences[j], j < verified.n_accepted)
            self.policies[user].update(pending.length, verified.n_accepted)


@dataclass
class HeadChain:
    """A head draft being built: its tokens, and how many of them pay for their runs and verification (the value
    (1 + sum of path probabilities) / (1 + (k + 1) draft_cost + extra_cost(k)) grows with each paying token)."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    probs: list[Optional[torch.Tensor]] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    paying: int = 0
    value: float = 1.0

    def extend(self, token: int, confidence: float, q: Optional[torch.Tensor], acceptance: MatchAcceptance,
               draft_cost: float, extra_cost: ExtraCost) -> None:
        k = len(self.tokens) + 1
        path = (self.path_probs[-1] if self.path_probs else 1.0) * acceptance.prob(k, confidence)
        value = (1 + sum(self.path_probs) + path) / (1 + (k + 1) * draft_cost + extra_cost(k))
        self.tokens.append(token)
        self.confidences.append(confidence)
        self.probs.append(q)
        self.path_probs.append(path)
        if value > self.value and self.paying == k - 1:
            self.paying, self.value = k, value


class RunCost:
    """What one head run costs, in target steps, measured on this machine: decayed means of a run's seconds and of a
    target step's (from the end of a proposal to its verification). Until both are measured, the estimate from the
    weights each streams, which is low on a CPU (a run's op launches do not shrink with its weights); on a TT device
    the head runs on the host beside the device's step. measure=False keeps the estimate (drafts that do not depend
    on timing, for tests)."""

    decay = 0.9

    def __init__(self, estimate: float, measure: bool = True):
        self.estimate, self.measure, self.run_s, self.step_s = estimate, measure, None, None
        self.proposed_at: Optional[float] = None

    @property
    def value(self) -> float:
        if not self.measure or self.run_s is None or self.step_s is None:
            return self.estimate
        return self.run_s / self.step_s

    def ran(self, seconds: float) -> None:
        self.run_s = seconds if self.run_s is None else self.decay * self.run_s + (1 - self.decay) * seconds

    def verified(self) -> None:
        """The target verified the last proposal (the first call after it times the step)."""
        if self.proposed_at is not None:
            seconds, self.proposed_at = time.perf_counter() - self.proposed_at, None
            self.step_s = seconds if self.step_s is None else self.decay * self.step_s + (1 - self.decay) * seconds
