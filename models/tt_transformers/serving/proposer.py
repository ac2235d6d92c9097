# SPDX-License-Identifier: Apache-2.0
"""The model-owned drafter behind propose_draft_tokens: the package's copied drafts, one request per decode slot.

Each request gets a suffix automaton over its prompt and committed tokens (SuffixDrafter.start_request at prefill);
finished requests leave their responses in a DraftMemory that later requests draft from; the target's top-k after
each verified token feeds recycled drafts. How many tokens a row is offered (DraftOutput.num_valid, 0 for none) is
the package's draft-length policy (best_length over each token's estimated acceptance, priced by the target's
step_cost, with DraftLengthPolicy's probes), capped by K and the end of the context.

State is keyed by a request key the slot points to, so a slot move (slot_remap) moves a pointer, and a slot whose
request went (release_request) or was never prefilled drafts nothing. It speaks only to the CausalLM interface
(step_cost, max_seq_len, vocab_size): the same proposer serves the torch and ttnn backends.
"""
from dataclasses import dataclass, field
from itertools import count
from typing import Optional, Sequence

import torch

from ..speculative.backend import CausalLM, extra_cost_curve
from ..speculative.copy_sources.draft_memory import DraftMemory
from ..speculative.config import SpeculativeConfig
from ..speculative.drafters import SuffixDrafter, Verified
from .contract import PLACEHOLDER_TOKEN_ID, DraftOutput, check_committed_block

DEFAULTS = SpeculativeConfig()  # the library's drafting defaults (the demo's flags take theirs from it too)


@dataclass
class RequestState:
    """One request's context (prompt and every committed token), its last proposal, and its last step: the rows fed
    (last token and the drafts verified) and the target's top-k after each."""

    context: list[int]
    prefilled: bool = True  # no decode yet: the first brings the prefill's token
    proposed: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    top_ids: Optional[list[list[int]]] = None


class CopiedDraftProposer:
    def __init__(self, target: CausalLM, drafter: Optional[SuffixDrafter] = None):
        """drafter: the copied drafts (default: as the demo builds them, with a draft memory and recycling)."""
        self.target = target
        self.drafter = drafter or SuffixDrafter(DEFAULTS.sa_threshold, DraftMemory(DEFAULTS.draft_memory),
                                                DEFAULTS.recycle_top_k)
        self.top_k = self.drafter.top_k  # the target's top next tokens a step should return (0: none)
        self.requests: dict[int, RequestState] = {}  # request key -> state
        self.slots: dict[int, int] = {}  # decode slot -> request key
        self.keys = count()

    def start(self, slot: int, tokens: Sequence[int]) -> None:
        """A request prefilled into `slot` (new, or resumed after a preemption with its whole history)."""
        if slot in self.slots:
            self.release(slot)  # the slot's previous request ended without a release_request
        key = next(self.keys)
        self.slots[slot] = key
        self.requests[key] = RequestState(list(tokens))
        self.drafter.start_request(key, tokens)

    def release(self, slot: int) -> None:
        """The slot's request finished or was preempted: its state goes (its response into the draft memory)."""
        key = self.slots.pop(slot, None)
        if key is not None:
            del self.requests[key]
            self.drafter.stop_request(key)

    def remap(self, slot_remap: Sequence[int]) -> None:
        """Slot i takes the request slot_remap[i] held (an absolute permutation, applied once per submission)."""
        moved = {i: self.slots[j] for i, j in enumerate(slot_remap) if j in self.slots}
        self.slots = moved | {s: key for s, key in self.slots.items() if s >= len(slot_remap)}

    def request(self, slot: int, what: str) -> RequestState:
        if slot not in self.slots:
            raise ValueError(f"{what} row {slot} holds a request, but no request was prefilled into slot {slot} (or "
                             "it was released): a slot_remap or prefill was missed")
        return self.requests[self.slots[slot]]

    def fed(self, slot: int, tokens: Sequence[int], start_pos: int) -> None:
        """A verify or plain decode feeds the slot `tokens` (the last committed token, then drafts) from start_pos. The
        first decode after a prefill brings the prefill's token (not yet in the context); later ones the context's
        last token. Called before the step runs, so a step that does not fit the slot's request fails first."""
        state = self.request(slot, "verify")
        ctx = state.context
        if state.prefilled and start_pos == len(ctx):
            ctx.append(tokens[0])
        elif start_pos != len(ctx) - 1 or ctx[-1] != tokens[0]:
            raise ValueError(f"verify row {slot} feeds token {tokens[0]} at position {start_pos}, but the request in "
                             f"slot {slot} holds {len(ctx)} tokens ending in {ctx[-1]}: a slot_remap was missed or "
                             "applied twice")
        if list(tokens[1:]) != state.proposed:
            self.drafter.withdraw(self.slots[slot])  # not the draft it proposed (cut or replaced): nothing to learn
        state.fed, state.top_ids, state.proposed, state.prefilled = list(tokens), None, [], False

    def saw(self, slot: int, top_ids: Optional[list[list[int]]]) -> None:
        """The target's top-k next tokens after each row the step fed the slot (recycled drafts learn from them)."""
        self.requests[self.slots[slot]].top_ids = top_ids

    def propose(self, num_drafts: int, committed_tokens: torch.Tensor, committed_positions: torch.Tensor,
                accepted_counts: torch.Tensor) -> DraftOutput:
        """After a commit: learn from each row's verified draft, extend its context with the committed tokens, and
        offer up to num_drafts more (num_valid: the draft-length policy's length; 0 for padding rows)."""
        check_committed_block(num_drafts, committed_tokens, committed_positions, accepted_counts)
        rows = committed_tokens.shape[0]
        keys, contexts, caps, live_rows = [], [], [], []
        for i, (toks, pos, n) in enumerate(zip(committed_tokens.tolist(), committed_positions.tolist(),
                                               accepted_counts.tolist())):
            if pos[0] < 0:  # a padding row
                continue
            state = self.request(i, "propose")
            if pos[0] != len(state.context):
                raise ValueError(f"propose row {i} commits from position {pos[0]}, but the request in slot {i} holds "
                                 f"{len(state.context)} tokens: its verify was not seen")
            new = toks[:n]
            if state.fed and new[:-1] != state.fed[1:n]:
                raise ValueError(f"propose row {i} commits {new}, but the drafts verified were {state.fed[1:]}: the "
                                 "accepted tokens must be the verified drafts' prefix")
            key = self.slots[i]
            if state.fed:
                self.drafter.accept(key, Verified(new, list(range(n - 1)), state.fed, state.top_ids))
            state.context.extend(new)
            state.fed, state.top_ids = [], None
            room = self.target.max_seq_len - len(state.context)  # the drafts' last position must be in the cache
            keys.append(key)
            contexts.append(state.context)
            caps.append(max(0, min(num_drafts, room)))
            live_rows.append(i)
        ids = torch.full((rows, num_drafts), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        num_valid = torch.zeros(rows, dtype=torch.int32)
        if keys:
            context_len = sum(len(c) for c in contexts) / len(contexts)
            drafts = self.drafter.propose(keys, contexts, caps, extra_cost_curve(self.target, len(keys), context_len))
            for i, key, draft in zip(live_rows, keys, drafts):
                ids[i, : len(draft.tokens)] = torch.tensor(draft.tokens, dtype=torch.int32)
                num_valid[i] = len(draft.tokens)
                self.requests[key].proposed = list(draft.tokens)
        return DraftOutput(ids, num_valid)
