# SPDX-License-Identifier: Apache-2.0
"""What every drafter is to the loop: the `Drafter` interface, the `Draft` it proposes and the `Verified` it learns
from, so that the generation loop never knows what drafted (`FallbackDrafter`: what the hybrid also asks of the
drafter it weighs against copied drafts)."""
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from ..draft_length import ExtraCost
from ..sampling import KeyedSampler


@dataclass
class Draft:
    """Draft tokens continuing a user's context: a chain, or a token tree when `parents` is given (parents[i] is the
    index of token i's parent among the draft tokens, -1 for a child of the context's last token; parents come
    before their children)."""

    tokens: list[int]
    source: str  # "suffix", "memory", "corpus", "copy", "recycle", "tree" (copied), "model", "head" or "none"
    match_len: int = 0  # length of the match behind a copied draft
    parents: Optional[list[int]] = None
    expected: float = 0.0  # accepted tokens the drafter expects from it (its own estimate; the hybrid compares them)


@dataclass
class Verified:
    """What a verification step did for one user: `new_tokens` were appended to its context, of which the draft
    tokens `path` (indices into the draft, root to leaf) were accepted; `fed` were the step's rows and `top_ids` the
    target's top-k next tokens after each row (when the drafter asked for them), `hidden` its tapped hidden states
    per row [rows, dim] (when the drafter wants them)."""

    new_tokens: list[int]
    path: list[int]
    fed: list[int] = field(default_factory=list)
    top_ids: Optional[list[list[int]]] = None
    hidden: Optional[torch.Tensor] = None

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    @property
    def true_rows(self) -> list[int]:
        """The rows whose context is the actual text: the last token and the accepted drafts (not rejected ones)."""
        return [0] + [i + 1 for i in self.path]


class Drafter(Protocol):
    top_k: int  # how many of the target's top next tokens per row accept() wants (0: none)
    taps: tuple[int, ...]  # the target layers whose input start() and accept() want per row (empty: none)

    def start(self, users: Sequence[int], prompts: Sequence[Sequence[int]], sampler: KeyedSampler,
              hidden: Optional[Sequence[torch.Tensor]] = None) -> None:
        """A new request per user; the prompts are what the target was prefilled with (hidden: its tapped hidden
        states over each prompt, when the drafter names taps). A drafter that samples draws with the sampler's key
        for the drafted position, the target's own noise there, unless the settings are greedy."""

    def propose(self, users: Sequence[int], contexts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                extra_cost: ExtraCost, trees: bool = False) -> list[Draft]:
        """Up to max_tokens[i] draft tokens continuing contexts[i] (the whole sequence so far, prompt included).
        extra_cost(k): what verifying k more tokens costs the target this iteration (backend.extra_cost_curve);
        trees: the target verifies token trees."""

    def accept(self, user: int, verified: Verified) -> None:
        """After verification of the user's draft (see Verified)."""

    def warm_up(self, logits: bool = False) -> dict[str, float]:
        """Compile (on a TT device also plan the traces of) the drafter's own programs, after its target's warm-up and
        before anything is timed: a draft model's, a draft head's on the device. logits: the run samples, so a draft
        model's steps return them. Seconds spent, by TT's perf keys ({"compile_prefill": s, "compile_decode": s};
        empty for a drafter with none). Learns nothing."""


class FallbackDrafter(Drafter, Protocol):
    """A drafter the hybrid weighs against copied drafts: what its draft would bring."""

    def draft_value(self, user: int, n: int, extra_cost: ExtraCost) -> float:
        """Expected tokens per unit of work (its making and its verification) of a draft of up to n tokens, from its
        recent acceptance; the hybrid lets it draft where this beats the copied draft's."""
