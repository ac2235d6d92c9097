# SPDX-License-Identifier: Apache-2.0
"""The model-owned drafter behind propose_draft_tokens: the package's copied drafts, one request per decode slot.

Each request gets a suffix automaton over its prompt and committed tokens (SuffixDrafter.start_request at prefill);
finished requests leave their responses in a DraftMemory that later requests draft from; the target's top-k after
each verified token feeds recycled drafts. How many tokens a row is offered (DraftOutput.num_valid, 0 for none) is
the package's draft-length policy (best_length over each token's estimated acceptance, priced by the target's
step_cost, with DraftLengthPolicy's probes), capped by K and the end of the context.

State is keyed by a request key the slot points to, so a slot move (slot_remap) moves a pointer, and a slot whose
request went or was never prefilled drafts nothing. Every call checks all its rows before it changes anything, so a
refused one leaves the state as it was. release_request names only a slot (the contract has no request id), so one
repeated after another request took the slot reads as that request's own; and a slot a running request holds need not
be a live row of every decode (a runner may leave it out of a step). So a request's state goes only when the next
request is prefilled into its slot (start): nothing else shows that it ended. Its response joins the draft memory at
the release (send_response), so later requests draft from it at once; a release that was not its own can at most send
a running request's response in two parts. It speaks only to the CausalLM interface
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
            self.stop(slot)  # the slot's previous request ended: the rest of its response joins the memory
        key = next(self.keys)
        self.slots[slot] = key
        self.requests[key] = RequestState(list(tokens))
        self.drafter.start_request(key, tokens)

    def release(self, slot: int) -> None:
        """release_request: the slot's request finished or was preempted. Its response so far joins the draft memory
        now; its state stays until the next prefill into the slot (start). A slot holding nothing: no change."""
        key = self.slots.get(slot)
        if key is not None:
            self.drafter.send_response(key)

    def stop(self, slot: int) -> None:
        key = self.slots.pop(slot)
        del self.requests[key]
        self.drafter.stop_request(key)

    def remapped(self, slot_remap: Optional[Sequence[int]]) -> dict[int, int]:
        """The slots after slot_remap (slot i takes the request slot_remap[i] held), without applying it."""
        if slot_remap is None:
            return self.slots
        moved = {i: self.slots[j] for i, j in enumerate(slot_remap) if j in self.slots}
        return moved | {s: key for s, key in self.slots.items() if s >= len(slot_remap)}

    def remap(self, slot_remap: Sequence[int]) -> None:
        """Slot i takes the request slot_remap[i] held (an absolute permutation, applied once per submission)."""
        self.slots = self.remapped(slot_remap)

    def check_fed(self, rows: Sequence[tuple[int, Sequence[int], int]], slot_remap=None, what: str = "verify") -> None:
        """Each (slot, tokens, start_pos) a decode feeds must continue the request its slot holds after slot_remap:
        checked for every row before anything changes."""
        slots = self.remapped(slot_remap)
        for slot, tokens, start_pos in rows:
            if slot not in slots:
                raise ValueError(f"{what} row {slot} holds a request, but no request was prefilled into slot {slot} "
                                 "(or it was released): a slot_remap or prefill was missed")
            state = self.requests[slots[slot]]
            ctx = state.context
            if not (state.prefilled and start_pos == len(ctx)) and (start_pos != len(ctx) - 1 or ctx[-1] != tokens[0]):
                raise ValueError(f"{what} row {slot} feeds token {tokens[0]} at position {start_pos}, but the request "
                                 f"in slot {slot} holds {len(ctx)} tokens ending in {ctx[-1]}: a slot_remap was missed "
                                 "or applied twice")

    def fed(self, rows: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """A checked decode (check_fed, slot_remap applied) feeds each slot `tokens` (the last committed token, then
        drafts) from start_pos. The first decode after a prefill brings the prefill's token (not yet in the context);
        later ones the context's last token."""
        for slot, tokens, start_pos in rows:
            state = self.requests[self.slots[slot]]
            if state.prefilled and start_pos == len(state.context):
                state.context.append(tokens[0])
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
        commits = []  # (row, state, committed tokens): every row checked before any is applied
        for i, (toks, pos, n) in enumerate(zip(committed_tokens.tolist(), committed_positions.tolist(),
                                               accepted_counts.tolist())):
            if pos[0] < 0:  # a padding row
                continue
            if i not in self.slots:
                raise ValueError(f"propose row {i} holds a request, but no request was prefilled into slot {i} (or "
                                 "it was released): a slot_remap or prefill was missed")
            state = self.requests[self.slots[i]]
            if pos[0] != len(state.context):
                raise ValueError(f"propose row {i} commits from position {pos[0]}, but the request in slot {i} holds "
                                 f"{len(state.context)} tokens: its verify was not seen")
            new = toks[:n]
            if state.fed and new[:-1] != state.fed[1:n]:
                raise ValueError(f"propose row {i} commits {new}, but the drafts verified were {state.fed[1:]}: the "
                                 "accepted tokens must be the verified drafts' prefix")
            commits.append((i, state, new))
        keys, contexts, caps, live_rows = [], [], [], []
        for i, state, new in commits:
            key = self.slots[i]
            if state.fed:
                self.drafter.accept(key, Verified(new, list(range(len(new) - 1)), state.fed, state.top_ids))
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
