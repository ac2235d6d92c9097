# SPDX-License-Identifier: Apache-2.0
"""The contract's model side, whatever runs the target: the verify mapping, the drafter's slots and the counters.

A verify's [B, 1+K] block is the package's own verify step: each live row i becomes `UserRows(i, [last token,
d1..dn], start_pos)` (padding rows and padded draft columns are never fed), one `step` runs them all, and the greedy
ids after each fed row land in upstream's column layout: column j < n is the model's choice at candidate position j,
column n the bonus; everything not verified is PLACEHOLDER_TOKEN_ID. Decode row i is decode slot i (after slot_remap),
which a backend maps onto its KV cache: a cache row on torch, a page-table row on TT.

The backend supplies `step(rows, top_k) -> StepOutput` (CausalLM.step on the KV cache this call addresses) and, where
it refuses inputs of its own (a page table, a program not prepared), `check(rows, top_k)`, which raises before anything
changes; everything here is shared (docs/serving.md: what the ttnn side provides). Every call checks all it was given
(the block, slot_remap, each row against its slot's request, the backend's check) before it applies slot_remap or tells
the drafter anything: a refused call moves nothing, and its correct retry runs as if it had not been made.
"""
import operator
from typing import Callable, Optional, Sequence

import torch

from ..speculative.backend import CausalLM, StepOutput, UserRows
from ..speculative.metrics import SpecDecodeCounters
from .contract import (
    ACCEPT_MODE_ARGMAX_IDS,
    PLACEHOLDER_TOKEN_ID,
    DraftOutput,
    VerifyOutput,
    check_draft_output,
    check_plain_decode,
    check_verify_block,
)
from .proposer import CopiedDraftProposer

Step = Callable[[Sequence[UserRows], int], StepOutput]  # (rows, top_k) -> the target's greedy (and top-k) ids per row
Check = Callable[[Sequence[UserRows], int], None]  # (rows, top_k): raises where the backend would refuse the step


class SpecDecodeCore:
    def __init__(self, target: CausalLM, num_drafts: int, proposer: Optional[CopiedDraftProposer] = None):
        """num_drafts: the plan's effective K (every verify block is 1 + K wide)."""
        if num_drafts < 1:
            raise ValueError(f"num_drafts must be >= 1 (the plan's effective_k), got {num_drafts}")
        self.target, self.num_drafts = target, num_drafts
        self.proposer = proposer or CopiedDraftProposer(target)
        self.counters = SpecDecodeCounters(num_drafts)
        self.unsettled_moves: Optional[dict[int, int]] = None  # the last remap's moves, until the runner notes them

    def prefilled(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> None:
        """Requests prefilled into `slots` (new, or resumed with their whole history): drafting starts over."""
        for slot, prompt in zip(slots, prompts):
            self.proposer.start(slot, prompt)

    @staticmethod
    def checked_remap(slot_remap, rows: int) -> Optional[list[int]]:
        """The submission's slot_remap (row i reads the state slot j held) as a list, None for none or the identity;
        a value that is not a permutation of the decode rows is refused."""
        if slot_remap is None:
            return None
        remap = slot_remap.tolist() if isinstance(slot_remap, torch.Tensor) else list(slot_remap)
        if sorted(remap) != list(range(rows)):
            raise ValueError(f"slot_remap must be a permutation of the {rows} decode rows, got {remap}")
        return None if remap == list(range(rows)) else remap

    def apply(self, remap: Optional[list[int]], fed: list[tuple[int, list[int], int]]) -> None:
        """A checked submission: its remap applied once to the drafter's slots, then each live row told what it
        feeds."""
        self.unsettled_moves = None  # a moves note follows the last submission's remap
        if remap is not None:
            self.proposer.remap(remap)
            self.unsettled_moves = {old: new for new, old in enumerate(remap) if old != new}
        self.proposer.fed(fed)

    def slots_moved(self, old_to_new: dict) -> None:
        """The runner's note_state_slots_moved after a decode it accepted: the moves the remap already applied (a model
        applying slot_remap needs nothing more), checked so that a remap applied twice or missed shows."""
        moved = {int(old): int(new) for old, new in dict(old_to_new).items()}
        unknown = {old: new for old, new in moved.items() if (self.unsettled_moves or {}).get(old) != new}
        if unknown:
            raise ValueError(f"note_state_slots_moved {moved}: moves {unknown} are not the last slot_remap's "
                             f"{self.unsettled_moves or {}}")
        self.unsettled_moves = None

    def verify(self, tokens, start_pos, num_valid_drafts, accepted_counts, spec_mode, step: Step, slot_remap=None,
               check: Optional[Check] = None) -> VerifyOutput:
        """The verify call: everything checked, slot_remap applied, its live rows fed to one step, the greedy ids in
        upstream's layout: [B, 1+K], or [B, 1] for the narrow verify (contract.check_verify_block), whose rows are
        one token each, as a plain step's."""
        if spec_mode != ACCEPT_MODE_ARGMAX_IDS:
            raise ValueError(f"verify spec_mode {spec_mode!r}: this model returns only {ACCEPT_MODE_ARGMAX_IDS!r} "
                             "(its plan's accept_modes)")
        live = check_verify_block(tokens, start_pos, num_valid_drafts, accepted_counts, num_drafts=self.num_drafts,
                                  vocab_size=self.target.vocab_size)
        user_rows = [UserRows(r.row, r.tokens, r.start_pos) for r in live]
        self.check_rows(user_rows, tokens.shape[0], slot_remap, check, "verify")
        fed = [(r.user, r.tokens, r.start_pos) for r in user_rows]
        self.apply(self.checked_remap(slot_remap, tokens.shape[0]), fed)
        argmax_ids = torch.full(tuple(tokens.shape), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        if live:
            out = step(user_rows, self.proposer.top_k)
            for k, (r, ids) in enumerate(zip(live, out.ids)):
                argmax_ids[r.row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
                self.proposer.saw(r.row, out.top_ids[k] if out.top_ids else None)
                accepted = 0
                while accepted < r.n_drafts and r.tokens[1 + accepted] == ids[accepted]:
                    accepted += 1
                self.counters.observe_draft(r.n_drafts, accepted)
        return VerifyOutput(ACCEPT_MODE_ARGMAX_IDS, argmax_ids=argmax_ids)

    def check_rows(self, rows: list[UserRows], batch: int, slot_remap, check: Optional[Check], what: str) -> None:
        """Everything a decode's rows must satisfy, before anything changes: slot_remap a permutation, each row
        continuing the request its slot holds after it, the backend's own check."""
        remap = self.checked_remap(slot_remap, batch)
        self.proposer.check_fed([(r.user, r.tokens, r.start_pos) for r in rows], remap, what)
        if check is not None and rows:
            check(rows, self.proposer.top_k)

    def plain_decode(self, tokens, start_pos, step: Step, slot_remap=None, check: Optional[Check] = None
                     ) -> torch.Tensor:
        """The ordinary [B, 1] decode (supports_narrow_decode): each live row's greedy next token, [B, 1] int32
        (PLACEHOLDER_TOKEN_ID on padding rows), as a decode that samples greedily on the device returns it."""
        live = self.plain_decode_rows(tokens, start_pos, slot_remap, check)
        ids = torch.full((tokens.shape[0], 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        if live:
            out = step(live, self.proposer.top_k)
            for k, (row, row_ids) in enumerate(zip(live, out.ids)):
                ids[row.user, 0] = row_ids[0]
                self.proposer.saw(row.user, out.top_ids[k] if out.top_ids else None)
        return ids

    def plain_decode_rows(self, tokens, start_pos, slot_remap=None, check: Optional[Check] = None) -> list[UserRows]:
        """An ordinary decode's live rows (one token each), checked, slot_remap applied, told to the drafter: a
        backend whose ordinary decode is its own (TT-Transformers' decode_forward) calls this before running it."""
        live = [UserRows(row, [token], pos) for row, token, pos in
                check_plain_decode(tokens, start_pos, self.target.vocab_size)]
        self.check_rows(live, tokens.shape[0], slot_remap, check, "decode")
        self.apply(self.checked_remap(slot_remap, tokens.shape[0]), [(r.user, r.tokens, r.start_pos) for r in live])
        return live

    def propose(self, num_drafts: int, committed_tokens, committed_positions, accepted_counts) -> DraftOutput:
        """propose_draft_tokens: the copied drafts per row, checked as the runner will check them."""
        if num_drafts != self.num_drafts:
            raise ValueError(f"propose num_drafts {num_drafts} is not the plan's K {self.num_drafts}")
        drafted = self.proposer.propose(num_drafts, committed_tokens, committed_positions, accepted_counts)
        check_draft_output(drafted, committed_tokens.shape[0], num_drafts, self.target.vocab_size)
        return drafted

    def release(self, slot) -> None:
        """release_request: a decode slot, checked; the drafter sends the slot's response to the draft memory and
        keeps the request's state until the next prefill into the slot (CopiedDraftProposer.release: a release names
        no request, so one repeated after another request took the slot, or a running request left out of a step,
        must not end the request the slot holds)."""
        try:
            index = None if isinstance(slot, bool) else operator.index(slot)  # an int, numpy's, a one-element tensor
        except TypeError:
            index = None
        if index is None or not 0 <= index < self.target.max_batch_size:
            raise ValueError(f"release_request slot must be a decode slot in [0, {self.target.max_batch_size}), got "
                             f"{slot!r}")
        self.proposer.release(index)
