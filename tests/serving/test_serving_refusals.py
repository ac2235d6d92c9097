# SPDX-License-Identifier: Apache-2.0
"""A refused call moves nothing (serving/core.py): the runner's loop over the paged torch model, with one bad call
sent before one of the runner's own. The bad call raises one ValueError naming what is wrong; the runner's call
then runs as if it had not been made: every output and all four of the model's counters (so every draft) equal the
run without it. And a release repeated after another request took the slot is ignored."""
import copy
import dataclasses

import pytest
import torch

from models.tt_transformers.serving.plan import plan_speculation
from models.tt_transformers.serving.reference_runner import ReferenceRunner
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import random_model
from .helpers import paged_torch_model

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 1, 9, 1, 9], [3, 3, 4, 3, 3, 4], [8, 2, 8, 2, 8, 2]]
MAX_TOKENS = [3, 20, 25, 12]


class Meddler:
    """The model as the runner calls it; at the first call of `method` that `spoil` can spoil, the spoiled call goes
    first and must raise ValueError matching `match`."""

    def __init__(self, model, method: str, spoil, match: str):
        self.model, self.method, self.spoil, self.match = model, method, spoil, match
        self.refused = 0

    def __getattr__(self, name):
        attr = getattr(self.model, name)
        if name != self.method or not callable(attr):
            return attr

        def call(*args, **kwargs):
            bad = None if self.refused else self.spoil(copy.deepcopy(args), {k: v if k == "kv_cache" else
                                                                             copy.deepcopy(v)
                                                                             for k, v in kwargs.items()})
            if bad is not None:
                with pytest.raises(ValueError, match=self.match):
                    attr(*bad[0], **bad[1])
                self.refused += 1
            return attr(*args, **kwargs)
        return call


def run(narrow_verify: bool, meddle=None):
    """Four requests at 3 concurrent (a padding row; the fourth waits for the first, which stops after 3 tokens, and
    takes its blocks; the survivors are compacted by slot_remap); meddle(model) wraps the model the runner sees."""
    model = random_model(torch.float32, max_seq_len=40, seed=3)
    target = TorchCausalLM(model, model.args.n_layers, 4)
    plan = dataclasses.replace(plan_speculation(None, 3, 4), supports_narrow_decode=True)
    served, kv_cache, blocks = paged_torch_model(target, plan.effective_k, 3, block_size=8)
    seen = meddle(served) if meddle else served
    runner = ReferenceRunner(seen, plan, 4, 3, [], target.max_seq_len, target.vocab_size,
                             narrow_verify=narrow_verify, blocks=blocks, kv_cache=kv_cache)
    outputs = runner.run({0: [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS[:3], MAX_TOKENS))],
                          1: [("r3", PROMPTS[3], MAX_TOKENS[3])]})
    assert runner.stats.slot_moves > 0 and runner.counters.accepted_tokens > 0
    return outputs, served.spec_decode_metrics(), seen


def live_rows(kwargs, start_pos) -> list[int]:
    first = start_pos if start_pos.dim() == 1 else start_pos[:, 0]
    return [r for r in range(first.shape[0]) if first[r] >= 0]


def of_kind(verify: bool):
    """Spoilers apply to a verify carrying a slot_remap (the old code had applied it before refusing), or to the
    ordinary decode (this schedule remaps none: a spoiled remap starts from the identity)."""
    def wrap(spoil):
        def spoiled(args, kwargs):
            if (kwargs.get("spec_mode") is not None) != verify or (verify and kwargs.get("slot_remap") is None):
                return None
            return spoil(args, kwargs)
        return spoiled
    return wrap


def remap_of(args, kwargs) -> torch.Tensor:
    remap = kwargs.get("slot_remap")
    return torch.arange(args[0].shape[0], dtype=torch.int32) if remap is None else torch.as_tensor(remap).clone()


def unknown_slot_row(args, kwargs):
    tokens, start_pos = args
    pad = [r for r in range(tokens.shape[0]) if r not in live_rows(kwargs, start_pos)]
    if not pad:
        return None
    tokens[pad[0]] = -1
    tokens[pad[0], 0] = 5
    if start_pos.dim() == 1:
        start_pos[pad[0]] = 3
    else:
        start_pos[pad[0], 0] = 3
    return (tokens, start_pos), kwargs


def wrong_position(args, kwargs):
    tokens, start_pos = args
    row = live_rows(kwargs, start_pos)[-1]
    start_pos[row] = torch.where(start_pos[row] >= 0, start_pos[row] + 1, start_pos[row])
    return (tokens, start_pos), kwargs


def swapped_remap(args, kwargs):
    remap = remap_of(args, kwargs)
    rows = live_rows(kwargs, args[1])
    if len(rows) < 2:
        return None
    remap[rows[0]], remap[rows[1]] = int(remap[rows[1]]), int(remap[rows[0]])
    return args, {**kwargs, "slot_remap": remap}


def not_a_permutation(args, kwargs):
    remap = remap_of(args, kwargs)
    remap[-1] = remap[0]
    return args, {**kwargs, "slot_remap": remap}


def another_requests_blocks(args, kwargs):
    rows = live_rows(kwargs, args[1])
    if len(rows) < 2:
        return None
    table = kwargs["page_table"].clone()
    table[rows[0]] = table[rows[1]]
    return args, {**kwargs, "page_table": table}


DECODE_CASES = {
    # the padding row's slot may still hold a finished request whose release has not taken effect
    "unknown-slot-row": (unknown_slot_row, "no request was prefilled into slot|a slot_remap was missed"),
    "wrong-position": (wrong_position, "a slot_remap was missed or applied twice"),
    "swapped-remap": (swapped_remap, "a slot_remap was missed or applied twice"),
    "not-a-permutation": (not_a_permutation, "slot_remap must be a permutation"),
    "another-requests-blocks": (another_requests_blocks, "which row [0-9]+ writes: a block another request holds"),
}


@pytest.fixture(scope="module")
def clean():
    return {narrow: run(narrow)[:2] for narrow in (True, False)}


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "ordinary-decode"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_a_refused_decode_moves_nothing(clean, case, verify):
    """A verify carrying a slot_remap (or, with the document's ordinary decodes, a plain decode), refused for a row in
    an unknown slot, a row at a wrong position, a remap that swaps two requests or is no permutation, or a page table
    giving a row another live request's blocks: the retry succeeds and the run equals the clean one."""
    spoil, match = DECODE_CASES[case]
    narrow = verify  # ordinary decodes come only in the document's form (narrow_verify False)
    outputs, counters, seen = run(narrow, lambda m: Meddler(m, "decode_forward", of_kind(verify)(spoil), match))
    assert seen.refused == 1
    assert (outputs, counters) == clean[narrow]


def late_row_commits_elsewhere(args, kwargs):
    num_drafts, tokens, positions, counts = args
    rows = [r for r in range(positions.shape[0]) if positions[r, 0] >= 0]
    if len(rows) < 2:
        return None
    positions[rows[-1]] = torch.where(positions[rows[-1]] >= 0, positions[rows[-1]] + 1, positions[rows[-1]])
    return (num_drafts, tokens, positions, counts), kwargs


def test_a_refused_proposal_moves_no_row(clean):
    """propose_draft_tokens refused for its last live row (a commit at the wrong position): the rows before it were not
    advanced, and the retry proposes what the clean run did."""
    outputs, counters, seen = run(True, lambda m: Meddler(m, "propose_draft_tokens", late_row_commits_elsewhere,
                                                          "commits from position"))
    assert seen.refused == 1
    assert (outputs, counters) == clean[True]


class StaleRelease:
    """After the first prefill into a slot that an earlier request held (and was released from), the earlier
    request's release_request is sent again: by slot, as the contract has it, so it names the new request's slot.
    skip: the next decode is preceded by one that leaves every slot out (a step in which the runner did not schedule
    the new request: its slot is not a live row), as a runner splitting a step over two calls sends."""

    def __init__(self, model, skip: bool = False):
        self.model, self.skip, self.released, self.repeated, self.skipped = model, skip, set(), 0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def release_request(self, slot):
        self.released.add(int(slot))
        return self.model.release_request(slot)

    def prefill_forward(self, **kwargs):
        out = self.model.prefill_forward(**kwargs)
        reused = [s for s in kwargs["empty_slots"] if s in self.released]
        if reused and not self.repeated:
            self.model.release_request(reused[0])
            self.repeated += 1
        return out

    def decode_forward(self, tokens, start_pos, **kwargs):
        if self.skip and self.repeated and not self.skipped:
            rows = tokens.shape[0]
            padding = torch.zeros(rows, 1, dtype=torch.int32), torch.full((rows,), -1, dtype=torch.int32)
            self.model.decode_forward(*padding, page_table=kwargs["page_table"], kv_cache=kwargs["kv_cache"])
            self.skipped += 1
        return self.model.decode_forward(tokens, start_pos, **kwargs)


@pytest.mark.parametrize("skip", [False, True], ids=["decoded-next-step", "left-out-of-a-step"])
def test_a_release_repeated_after_the_slot_was_reused_is_ignored(clean, skip):
    """The new request keeps its drafter state, also when the next decode leaves it out: outputs and counters (every
    draft) equal the clean run's."""
    outputs, counters, seen = run(True, lambda m: StaleRelease(m, skip))
    assert seen.repeated == 1 and seen.skipped == skip
    assert (outputs, counters) == clean[True]
