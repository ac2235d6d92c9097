# SPDX-License-Identifier: Apache-2.0
"""Drafting with an EAGLE-3 draft head that runs where its target keeps the taps: a TT device
(ttnn_backend/eagle3_head.py), one traced replay per chain."""
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .base import Draft, Verified
from .eagle3_base import HeadChain, HeadDrafterBase


@dataclass
class HeadFeed:
    """Rows a traced head is fed before it drafts, at positions start_pos onward, each with the token after it: a
    verified step's true rows where the device left their tapped states (tile_rows, DeviceRows), or a prompt's states
    from the prefill (states [n, len(taps) * dim])."""

    user: int
    start_pos: int
    next_tokens: list[int]
    tile_rows: Optional[list[int]] = None
    states: Optional[torch.Tensor] = None


class ChainDraftHead(Protocol):
    vocab: torch.Tensor  # [V'] the draft vocabulary as target ids
    vocab_size: int
    taps: tuple[int, ...]
    draft_cost: float  # one chain step, in target steps (an estimate until measured)
    chain_len: int  # tokens one drafting replay gives (fixed per trace)
    last_draft_s: float  # seconds of the last replay of draft() (the prompt's feed-only replays before it excluded)

    def warm_up(self) -> float:
        """Plan its traces beside the target's (captured with them by the target's prepare_traces); seconds spent."""

    def draft(self, feeds: Sequence[HeadFeed], chain_users: Sequence[int], k: int
              ) -> dict[int, tuple[list[int], list[float]]]:
        """Feed every row of `feeds`, then draft k tokens (chain_len, or 0 with no chain_users: feed only) for each of
        chain_users from its last fed row: {user: (target ids, the head's probability of each)}."""


class TracedHeadDrafter(HeadDrafterBase):
    """A head that runs where its target keeps the taps (a TT device: ttnn_backend/eagle3_head.py). The target's step
    leaves them on the device, so every verified step's true rows are fed at the next proposal, whoever drafted them
    (the next step rewrites the tap tile), and one traced replay drafts a chain of chain_len tokens for every user
    that drafts. The chain is then cut where one more token no longer pays for its verification (the replay is
    spent), with acceptance learned and gated as every head's (HeadDrafterBase). Under sampling the chain is the
    head's argmax (q over the draft vocabulary stays on the device), accepted where it equals the target's draws."""

    def __init__(self, head: ChainDraftHead):
        super().__init__(head)
        self.feeds: dict[int, HeadFeed] = {}
        self.prompt_states: dict[int, torch.Tensor] = {}

    def start(self, users, prompts, sampler, hidden=None):
        self._reset(users, sampler, hidden)
        self.feeds = {}
        self.prompt_states = dict(zip(users, hidden))  # fed at the first proposal, when the token after it is known

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        feeds = []
        for u, ctx in zip(users, contexts):
            if u in self.prompt_states:
                states = self.prompt_states.pop(u)
                feeds.append(HeadFeed(u, 0, list(ctx[1 : len(states) + 1]), states=states))
            elif u in self.feeds:
                feeds.append(self.feeds.pop(u))
        probes, fed = set(), {f.user for f in feeds}
        wanted = {u: n for u, n in ((u, min(n, self.head.chain_len)) for u, n in zip(users, max_tokens))
                  if n > 0 and u in fed and self._gated(u, n, extra_cost, probes)}
        if not feeds:
            return [Draft([], "none") for _ in users]
        k = self.head.chain_len if wanted else 0  # 0: the rows fed, nothing drafted (the device skips the LM head)
        chains = self.head.draft(feeds, list(wanted), k)
        if wanted:  # a chain step's share of the drafting replay (a prompt's feed-only replays are the prefill's)
            self.cost.ran(self.head.last_draft_s / k)
            self.cost.proposed(extra_cost)
        drafts = {}
        for u, n in wanted.items():
            chain = HeadChain()
            for token, p in zip(*(values[:n] for values in chains[u])):
                chain.extend(token, p, self.acceptance, 0.0, extra_cost)
            draft = self._chain_draft(u, chain, chain.paying or int(u in probes))
            if draft is not None:
                drafts[u] = draft
        self._learn_declines(wanted, drafts)
        return [drafts.get(u, Draft([], "none")) for u in users]

    def warm_up(self, logits: bool = False) -> dict[str, float]:
        return {"compile_decode": self.head.warm_up()}  # its traces, made with the target's

    def accept(self, user, verified: Verified):
        rows = verified.hidden  # DeviceRows: where the step left the user's tapped states
        true = verified.true_rows
        self.feeds[user] = HeadFeed(user, rows.start_pos, list(verified.new_tokens[: len(true)]),
                                    tile_rows=[rows.first_row + r for r in true])
        self._learn(user, verified)
