# SPDX-License-Identifier: Apache-2.0
"""TT-Transformers' decode attention with the KV-cache update issued in ordered passes, for verification steps.

A verification step puts each user's [last token, d1..dK] in the decode batch as K+1 rows at consecutive
positions p..p+K, every row with the user's page-table row, so most of a user's rows land in the same 32-slot
cache block. `ttnn.experimental.paged_update_cache` updates one row inside an existing cache tile ("This op
updates one token row inside an existing cache tile", its docstring) with the rows spread over cores, each
reading, modifying and writing back the whole tile: rows that share a tile race and all but one write is lost
(tt-metal's Gemma-4 speculative decode hit exactly this and writes row by row, `sequential_kv_write`).

This class keeps TT-Transformers' own `Attention.forward_decode` (nothing copied): only the cache update it issues
becomes one op per pass. Pass j carries each user's j-th row; every other row has update position -1, which the
update kernel skips (reader_update_cache_interleaved_start_id.cpp in the ttnn wheel: `raw_update_idx == -1` sets
`skip_update`; TT-Transformers parks idle users at -1 the same way). Within one pass no two rows belong to the same
user, and rows of different users never share a block, so no tile is written twice in one op; the passes run in
order on the command queue. A step with at most P rows per user needs P update ops per K/V per layer instead of one
per row, and attention (SDPA decode, which reads each row's keys up to its own position) still runs once.

Built through TT-Transformers' `Transformer(..., attention_class=...)` hook. The model is built with
`use_qk_fused = False`, so the cache update is `paged_update_cache` (K and V separately) and not the fused op.
"""
from typing import Any

from .tt_surface import uses_qk_fused
from .ttnn_api import ttnn


class KVWritePasses:
    """The position tensors (one per pass, device tensors refreshed every step) the current trace writes with;
    shared by every layer of a model, set by the backend before it compiles and captures a step. `writes` counts the
    cache writes TT's attention made through the ordered writer and `issued` the update ops that issued, so the
    backend can check, when it compiles a step, that every layer's K and V writes went through it (TtnnCausalLM
    ._check_ordered_writes): a TT-Transformers that bound the op another way would write every row at once, racing,
    with no error."""

    def __init__(self):
        self.positions: list[Any] = []
        self.writes = 0
        self.issued = 0

    def count_from_zero(self) -> None:
        self.writes = self.issued = 0


def ordered_update(update_op, passes: KVWritePasses):
    """`update_op` (paged_update_cache) issued once per pass, with that pass's positions; as TT issues it (one op over
    every row) when no passes are set (a decode step not made by this backend). Each call is counted in `passes`."""
    def write(cache, input_tensor, *, update_idxs_tensor=None, **kwargs):
        passes.writes += 1
        for positions in passes.positions or [update_idxs_tensor]:
            update_op(cache, input_tensor, update_idxs_tensor=positions, **kwargs)
            passes.issued += 1
    return write


def ordered_write_attention(base: type, passes: KVWritePasses) -> type:
    """A subclass of TT-Transformers' Attention whose decode cache writes go through `passes`.

    It must be named `Attention`: TT-Transformers' Attention.__init__ finds its weights with
    `configuration.get_state_dict_prefix(self.__class__.__name__, layer_num)`, whose module map
    (tt/model_config.py, ModelArgs.get_state_dict_prefix) knows only "MLP", "Attention", "TransformerBlock" and "",
    and the same name keys TT's weight-cache files."""
    class Attention(base):
        def forward_decode(self, *args, **kwargs):
            if uses_qk_fused(self):  # the fused update is not ordered: build the model with use_qk_fused False
                raise ValueError("ordered cache writes need ModelArgs.use_qk_fused = False before the model is built")
            batched = ttnn.experimental.paged_update_cache
            ttnn.experimental.paged_update_cache = ordered_update(batched, passes)
            try:
                return super().forward_decode(*args, **kwargs)
            finally:
                ttnn.experimental.paged_update_cache = batched

    return Attention
