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

Attention in one cache scan per user (GroupedRows): paged SDPA decode gives each row its own reduction over the
cache, so a user's 1+K verify rows read its K and V 1+K times. ttnn 0.81.1's
`paged_scaled_dot_product_attention_decode(..., spec_multi_pos_tiles=T)` folds T candidates onto one batch row, Q
[1, groups, T x 32, head_dim] with candidate j's heads in row tile j: the group's cache is scanned once, up to its last
candidate's position, and each row tile is masked at its own position (the wheel's
sdpa_decode/device/kernels/dataflow/dataflow_common.hpp generate_mask_spec_multi_pos; compute/sdpa_flash_decode.cpp:
"entry 0 is the smallest bound (mask predicate), entry Tg-1 the largest (KV scan range)"), so each row still attends
to exactly the positions up to its own. Its constraints, as the wheel's validation and program factory state them
(sdpa_decode_device_operation.cpp, sdpa_decode_program_factory.cpp SdpaDecodeProgramFactory::create):
- num_kv_heads == 1: a device holding several KV heads gets a view of its cache with one head per block, [blocks x
  kv heads, 1, 32, head_dim] (a reshape that keeps the last two dims: the same buffer), and one group per (KV head,
  user) whose page-table row is the user's blocks x kv heads + the head; every group carries all the Q heads, and
  each output head is taken from its own KV head's group (a 0/1 mask per head, exact);
- Q unsharded in DRAM, bfloat16, TILE, T x 32 rows per group; cur_pos one per candidate, non-decreasing in a group;
  is_causal, no attention mask, no sliding window (a model with a window keeps TT's per-row call);
- the circular buffers in L1: with TT-Transformers' SDPA decode config (8 x 8 cores, dynamic K chunks:
  get_attn_sdpa_decode_program_config) T = 16 needs 1,583,392 B per core at head_dim 64 and T = 32 3,123,488 B,
  where Wormhole has 1,393,312 B ("spec_multi_pos_tiles=16: circular buffers need ... Reduce spec_multi_pos_tiles",
  the wheel on the mock N150); T <= 8 fits at head_dim 64 and 128 (MAX_GROUP_TILES);
- a core per group: "Cores available (64) must be >= batch size (128)" (the 8 x 8 grid of that config, SDPA_CORES),
  so KV heads x 32 / T <= 64: Llama-3.1-8B's 8 KV heads on an N150 group at T >= 4 only.
The groups are reshapes of the 32-row tile, so T divides 32 and a user's rows sit at T x its slot (group_tiles).

Built through TT-Transformers' `Transformer(..., attention_class=...)` hook. The model is built with
`use_qk_fused = False`, so the cache update is `paged_update_cache` (K and V separately) and not the fused op.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from .tt_surface import uses_qk_fused
from .ttnn_api import ttnn

TILE = 32  # rows of a tile: the decode batch, and one candidate's Q heads in a group
# The most candidates a group holds on Wormhole under TT's SDPA decode config (module docstring: L1)
MAX_GROUP_TILES = 8
SDPA_CORES = 64  # TT-Transformers' SDPA decode grid (get_attn_sdpa_decode_program_config: 8 x 8): a core per group


def group_tiles(passes: int, max_users: int, kv_heads: int) -> int:
    """Candidates per group for a step program of `passes` write passes, each of up to max_users users holding a
    group of that many rows, on a device holding kv_heads KV heads: the power of two >= passes (the groups are
    reshapes of the 32-row tile), or 1 (TT's per-row call) where that exceeds MAX_GROUP_TILES, the groups do not fit
    the tile or the cores (kv_heads x 32 / T groups), or a group would hold one row."""
    tiles = 1 << (passes - 1).bit_length()
    fits = max_users * tiles <= TILE and kv_heads * (TILE // tiles) <= SDPA_CORES
    return tiles if 1 < tiles <= MAX_GROUP_TILES and fits else 1


@dataclass
class GroupedRows:
    """The device inputs of a grouped attention step (the backend refreshes them with the step's other inputs):
    `tiles` candidates per group; page_table [kv heads x 32 / tiles, blocks] int32, group (h, g) the blocks of the user
    in slot g as blocks x kv heads + h; positions [kv heads x 32] int32, the rows' positions once per KV head (a group
    of no user at -1, which the op skips); head_masks: per KV head [1, 32 / tiles, tiles x 32, head_dim] bfloat16,
    1 on the rows of that head's Q heads (empty with one KV head on the device)."""

    tiles: int
    page_table: Any
    positions: Any
    head_masks: list = field(default_factory=list)


def grouped_attention(sdpa_op, group: GroupedRows):
    """`sdpa_op` (paged_scaled_dot_product_attention_decode) as TT's Attention.forward_decode calls it, run as one
    spec_multi_pos_tiles call over `group` (module docstring); TT's own call where the model has a sliding window."""
    def attend(q, keys, values, *, page_table_tensor=None, cur_pos_tensor=None, sliding_window_size=None,
               memory_config=None, **kwargs):
        if sliding_window_size is not None:  # "spec_multi_pos_tiles is not supported with sliding_window_size"
            return sdpa_op(q, keys, values, page_table_tensor=page_table_tensor, cur_pos_tensor=cur_pos_tensor,
                           sliding_window_size=sliding_window_size, memory_config=memory_config, **kwargs)
        dram, tiles = ttnn.DRAM_MEMORY_CONFIG, group.tiles
        blocks, kv_heads, block, head_dim = keys.shape
        users, heads = q.shape[1], q.shape[2]
        shape = (1, users // tiles, tiles * TILE, head_dim)
        interleaved = ttnn.to_memory_config(q, dram)  # "spec_multi_pos_tiles requires an unsharded Q tensor"
        grouped = ttnn.reshape(interleaved, shape, shape)  # heads padded to the tile: one row tile per candidate
        stacked = ttnn.concat([grouped] * kv_heads, dim=1, memory_config=dram) if kv_heads > 1 else grouped
        one_head = (blocks * kv_heads, 1, block, head_dim)
        out = sdpa_op(stacked, ttnn.reshape(keys, one_head), ttnn.reshape(values, one_head),
                      page_table_tensor=group.page_table, cur_pos_tensor=group.positions, spec_multi_pos_tiles=tiles,
                      memory_config=dram, **kwargs)
        if kv_heads > 1:
            ttnn.deallocate(stacked)
            parts = []
            for h, mask in enumerate(group.head_masks):
                part = ttnn.slice(out, (0, h * shape[1], 0, 0), (1, (h + 1) * shape[1], *shape[2:]), memory_config=dram)
                parts.append(ttnn.mul(part, mask, memory_config=dram))
                ttnn.deallocate(part)
            ttnn.deallocate(out)
            out = parts[0]
            for part in parts[1:]:
                total = ttnn.add(out, part, memory_config=dram)
                ttnn.deallocate(out)
                ttnn.deallocate(part)
                out = total
        if interleaved is not q:
            ttnn.deallocate(interleaved)
        result = ttnn.reshape(out, (1, users, heads, head_dim), (1, users, TILE, head_dim))
        return ttnn.to_memory_config(result, memory_config) if memory_config is not None else result
    return attend


class KVWritePasses:
    """The position tensors (one per pass, device tensors refreshed every step) the current trace writes with;
    shared by every layer of a model, set by the backend before it compiles and captures a step. `writes` counts the
    cache writes TT's attention made through the ordered writer and `issued` the update ops that issued, so the
    backend can check, when it compiles a step, that every layer's K and V writes went through it (TtnnCausalLM
    ._check_ordered_writes): a TT-Transformers that bound the op another way would write every row at once, racing,
    with no error."""

    def __init__(self):
        self.positions: list[Any] = []
        self.grouped: Optional[GroupedRows] = None  # the step's attention in one cache scan per user, or per row
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
    """A subclass of TT-Transformers' Attention whose decode cache writes go through `passes`, and whose decode
    attention runs grouped (grouped_attention) when `passes.grouped` is set.

    It must be named `Attention`: TT-Transformers' Attention.__init__ finds its weights with
    `configuration.get_state_dict_prefix(self.__class__.__name__, layer_num)`, whose module map
    (tt/model_config.py, ModelArgs.get_state_dict_prefix) knows only "MLP", "Attention", "TransformerBlock" and "",
    and the same name keys TT's weight-cache files."""
    class Attention(base):
        def forward_decode(self, *args, **kwargs):
            if uses_qk_fused(self):  # the fused update is not ordered: build the model with use_qk_fused False
                raise ValueError("ordered cache writes need ModelArgs.use_qk_fused = False before the model is built")
            batched, per_row = (ttnn.experimental.paged_update_cache,
                                ttnn.transformer.paged_scaled_dot_product_attention_decode)
            ttnn.experimental.paged_update_cache = ordered_update(batched, passes)
            if passes.grouped is not None and passes.positions:  # a step of this backend's (TT's own: none set)
                ttnn.transformer.paged_scaled_dot_product_attention_decode = grouped_attention(per_row, passes.grouped)
            try:
                return super().forward_decode(*args, **kwargs)
            finally:
                ttnn.experimental.paged_update_cache = batched
                ttnn.transformer.paged_scaled_dot_product_attention_decode = per_row

    return Attention
