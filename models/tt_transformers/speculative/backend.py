# SPDX-License-Identifier: Apache-2.0
"""The interface the speculative loop uses to run a model; torch and ttnn backends implement it.

A `CausalLM` owns one KV cache with a row per user. Every call is ragged: user u feeds tokens[u]
starting at position start_pos[u]. Prefill, one-token decode, draft catch-up and verification of
n drafts are all this one call; rollback after a rejection is by position only (later calls
overwrite the rejected slots, and attention never reads past a user's own position).
"""
from typing import Protocol, Sequence

import torch

MAX_DRAFT_TOKENS = 64  # the most draft tokens a user may have verified in one step (backends size for it)


class CausalLM(Protocol):
    n_layers: int
    max_seq_len: int
    max_batch_size: int
    vocab_size: int

    def argmax(self, tokens: Sequence[Sequence[int]], start_pos: Sequence[int], users: Sequence[int],
               last_only: bool = False) -> list[list[int]]:
        """Greedy next token after every fed token (or only the last one): what a device sends back."""

    def logits(self, tokens: Sequence[Sequence[int]], start_pos: Sequence[int], users: Sequence[int],
               last_only: bool = False) -> list[torch.Tensor]:
        """float32 logits [len(tokens[u]) or 1, vocab] per user, for sampling."""

    def verify_cost(self, n_users: int, context_len: float) -> float:
        """What one more token in a step of n_users users (context_len tokens each on average) costs, in units of
        one user's share of a plain decode step (draft_length.verify_cost_at); it sets how long drafts are worth
        verifying."""
