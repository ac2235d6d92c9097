# SPDX-License-Identifier: Apache-2.0
"""Torch implementation of the `CausalLM` backend interface over a `Transformer` and a KV cache."""
from typing import Sequence

import torch

from .model import Transformer


# Steps of up to this many tokens per user (decode, verification, draft catch-up) attend token by token, so a
# token's result is bit-identical whatever else shares the step; longer ones (prefill) take one masked call.
EXACT_ATTENTION_MAX_TOKENS = 65


class TorchCausalLM:
    """The first `n_layers` layers of `model` (all of them for a target) with a KV cache of their own.

    Two instances over one Transformer share every weight tensor: that is how a layer-truncated draft
    costs no extra weight memory.
    """

    def __init__(self, model: Transformer, n_layers: int, max_batch_size: int):
        if not 1 <= n_layers <= model.args.n_layers:
            raise ValueError(f"n_layers must be in [1, {model.args.n_layers}], got {n_layers}")
        self.model = model
        self.cache = model.new_cache(n_layers, max_batch_size)
        self.n_layers, self.max_batch_size = n_layers, max_batch_size
        self.max_seq_len, self.vocab_size = model.max_seq_len, model.args.vocab_size
        self.device = model.output.weight.device

    def _forward(self, tokens: Sequence[Sequence[int]], start_pos: Sequence[int], users: Sequence[int],
                 last_only: bool) -> torch.Tensor:
        lengths = [len(t) for t in tokens]
        kv_len = max(p + n for p, n in zip(start_pos, lengths))
        if kv_len > self.max_seq_len:
            raise ValueError(f"forward would write position {kv_len - 1} past max_seq_len {self.max_seq_len}")
        # Lossless bf16 needs every token's result to be independent of how many tokens share the step.
        # oneDNN's bf16 matmul is row-invariant for M >= 2 but takes another kernel for M == 1, so a lone
        # token gets a padding partner (tests/test_row_invariance.py checks this on the installed torch).
        width = max(max(lengths), 2 if sum(lengths) == 1 else 1)
        scratch = self.cache.scratch_slot
        # Right-pad ragged users; padding writes the scratch slot and attends like the last real token.
        padded = [list(t) + [0] * (width - len(t)) for t in tokens]
        slots = [[p + i if i < n else scratch for i in range(width)] for p, n in zip(start_pos, lengths)]
        query = [[p + i if i < n else kv_len - 1 for i in range(width)] for p, n in zip(start_pos, lengths)]
        dev = self.device
        exact = None
        if max(lengths) <= EXACT_ATTENTION_MAX_TOKENS:
            window = self.model.args.sliding_window or self.max_seq_len
            exact = [(b, i, u, max(0, p + i + 1 - window), p + i + 1)
                     for b, (u, p, n) in enumerate(zip(users, start_pos, lengths)) for i in range(n)]
        step = self.model.step_inputs(
            positions=torch.tensor(slots, device=dev),
            query_pos=torch.tensor(query, device=dev),
            rows=torch.tensor(users, device=dev).view(-1, 1),
            kv_len=kv_len,
            all_rows=list(users) == list(range(self.max_batch_size)),
            exact_tokens=exact,
        )
        last = torch.tensor([n - 1 for n in lengths], device=dev) if last_only else None
        return self.model(torch.tensor(padded, device=dev), step, self.cache, output_index=last)

    def argmax(self, tokens, start_pos, users, last_only=False) -> list[list[int]]:
        ids = self._forward(tokens, start_pos, users, last_only).argmax(dim=-1).tolist()
        return [row[:1] if last_only else row[: len(t)] for row, t in zip(ids, tokens)]

    def logits(self, tokens, start_pos, users, last_only=False) -> list[torch.Tensor]:
        out = self._forward(tokens, start_pos, users, last_only).float()
        return [out[i, :1] if last_only else out[i, : len(t)] for i, t in enumerate(tokens)]
