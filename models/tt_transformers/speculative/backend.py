# SPDX-License-Identifier: Apache-2.0
"""The interface the speculative loop uses to run a model; the torch and ttnn backends implement it.

A `CausalLM` owns a KV cache with a slot per user (a cache row on torch, a page-table row on a TT device) for the
whole batch: users that finish go idle (on a TT device their rows sit at position -1), so a traced step keeps one
shape for the whole run. Two calls run the model:
- `prefill(user, tokens)`: the prompt, alone (on TT a separate, 128-padded, chunked program);
- `step(rows)`: one decode or verification step over every active user's `[last token, d1..dK]` at consecutive
  positions, all in one forward. Rollback after a rejection is by position only: later steps overwrite the
  rejected slots, and attention never reads past a row's own position.
A step carries at most `max_step_rows` tokens over all users (on a TT device every row of every user shares the
decode batch's 32-row tile), and `step_cost` says what a step of a given shape costs, so the loop sizes drafts
across users and the draft-length policy prices each drafted token.
"""
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

MAX_DRAFT_TOKENS = 64  # the most draft tokens a user may have verified in one step (backends size for it)


@dataclass
class UserRows:
    """One user's part of a step: `tokens` fed at positions start_pos, start_pos + 1, ... (a chain), or a token tree
    rooted at tokens[0]: `parents[i]` is the row of token i's parent (parents[0] = -1, parents[i] < i), and token i
    sits at position start_pos + its depth, seeing the cache before start_pos and its own ancestors only. A tree's
    rows take cache slots start_pos + i; commit_path then moves the accepted path to its true positions."""

    user: int
    tokens: list[int]
    start_pos: int
    parents: Optional[list[int]] = None


@dataclass
class DeviceRows:
    """A user's tapped states that stayed on the device: its rows of the step's tap tile, first_row onward, at
    positions start_pos onward (a TT device's draft head reads them there)."""

    first_row: int
    start_pos: int


@dataclass
class StepOutput:
    """Per fed user, for each of its rows (or only the last one for a prefill): the greedy token ids, which is all
    a device sends back for greedy verification; the top-k ids per row when asked for (token recycling drafts from
    them); float32 logits when asked for (sampling); the tapped hidden states when asked for: the residual stream
    entering each requested layer, concatenated in the order asked (an EAGLE-3 draft head drafts from them), or, from
    a device that keeps them for a head of its own, where they are (DeviceRows)."""

    ids: list[list[int]]
    logits: Optional[list[torch.Tensor]] = None
    top_ids: Optional[list[list[list[int]]]] = None
    hidden: Optional[list] = None  # [rows, len(taps) * dim] tapped states (every prompt token for a prefill), or DeviceRows


class CausalLM(Protocol):
    n_layers: int
    max_seq_len: int
    max_batch_size: int
    vocab_size: int
    max_step_rows: int  # tokens one step may carry over all users
    device_name: str  # where it runs, for reports: "cpu", "cuda:0", "N150 (1x1 mesh)"

    supports_trees: bool  # whether step takes UserRows.parents (and commit_path)
    shares_target_cache: bool  # a draft view over its target's cache (draft_view): the target's steps fill it

    def draft_view(self, n_layers: int) -> "CausalLM":
        """The first n_layers layers as a draft model, reading and writing this model's cache for those layers."""

    def draft_head(self, draft_head, chain_len: int, required: bool) -> dict:
        """The EAGLE-3 draft head for this model that SpeculativeConfig.draft_head names (a folder, a hub id in the
        local cache, or None: the one shipped for its checkpoint), read and checked against it (checkpoints/
        eagle3_format.py), as make_drafter takes it: {"head": a DraftHeadModel beside it} or {"device_head": a
        ChainDraftHead where it keeps its taps, drafting chains of chain_len}. {} where draft_head is None and no
        head ships for it, or the shipped one taps layers it does not run, unless `required` (head mode): then a
        UserError naming draft_head."""

    def prefill(self, user: int, tokens: Sequence[int], logits: bool = False, taps: Sequence[int] = ()
                ) -> StepOutput:
        """Fill the user's cache with `tokens` from position 0; outputs for the last token only (the tapped hidden
        states for every token)."""

    def step(self, rows: Sequence[UserRows], logits: bool = False, top_k: int = 0, taps: Sequence[int] = ()
             ) -> StepOutput:
        """One forward over every listed user's rows; users not listed are idle. top_k > 0: also the top_k ids.
        taps: layer ids in [0, n_layers] whose input (the residual stream entering the layer; n_layers: the last
        layer's output) to return per row."""

    def commit_path(self, user: int, start_pos: int, path: Sequence[int]) -> None:
        """After a tree step: the accepted rows `path` (row 0 first, one per depth) move to positions start_pos,
        start_pos + 1, ... so the cache holds the accepted text where a chain would have put it."""

    def step_cost(self, n_users: int, n_rows: int, context_len: float) -> float:
        """Time of a step computing n_rows tokens of n_users users over contexts of about context_len tokens, in
        units of the part that does not depend on the rows (streaming the weights once). The users count apart from
        the rows because attention may read each user's cache once for all of its rows (the CPU kernels do)."""

    def warm_up(self, max_rows_per_user: int, top_k: int, taps: Sequence[int], logits: bool = False) -> dict:
        """Compile (on a TT device also capture the traces of) every program that prefills and steps of up to
        max_rows_per_user rows per user with these outputs (logits: the steps return them, as sampling asks) will
        run, before anything is timed; seconds spent, as {"compile_prefill": s, "compile_decode": s} (TT's perf
        keys). May write user 0's cache."""

    def prepare_traces(self) -> float:
        """After every model on the device has been warmed up: compile and capture each program they planned, once
        (a TT mesh's traces); seconds spent (0 where nothing is traced)."""

    def release(self) -> None:
        """Give back device resources (a TT device's traces) before the model is dropped."""


# What the draft-length policy adds to the step model's price of a verified row: the fit's error (a row priced low
# drafts at a loss; issue 47: never measurably slower than plain decoding). Small where rows are cheap (a short
# context), a few % of a step where they are not.
COST_MARGIN = 0.1


def extra_cost_curve(lm: CausalLM, n_users: int, context_len: float):
    """k -> what verifying k more tokens for one user costs this step, in units of one user's share of a plain
    step (one row per user), plus COST_MARGIN of it: the price the draft-length policy weighs against expected
    acceptance."""
    base = lm.step_cost(n_users, n_users, context_len)
    share = base / (1 + COST_MARGIN) / n_users
    return lambda k: (lm.step_cost(n_users, n_users + k, context_len) - base) / share
