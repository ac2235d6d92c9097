# SPDX-License-Identifier: Apache-2.0
"""An EAGLE-3 draft head (the torch backend's eagle3_head.py has its form) on the Tenstorrent device, traced beside the
target: the taps never leave the device and only the drafted ids (and the top logits each draft's confidence comes from)
come back.

What a replay does, for every row of one 32-row tile (the rows the target's verification step used):
- feed: the head layer over the rows the target just verified, at their positions: its input state is fc over the
  tap tile (the target's traced step writes each tapped layer's input there, TtnnCausalLM._forward), its token the
  next token of each row (accepted drafts and the target's own token: looked up on the host in the head's embedding
  table and written with the step's inputs, 32 x dim values). Rows not verified sit at position -1: skipped by the
  cache update and by attention, their results never read. A user's feed rows share cache blocks, so the head's
  cache writes go in ordered passes as the target's do (attention.py).
- chain: k - 1 more steps from each drafting user's last fed row, in that same row (every other row at position -1):
  the head's own output state and the embedding of its last draft, looked up on the device in the head's table
  ordered by draft id (ttnn.embedding of the token tensor the previous step's argmax wrote, as TT's decode feeds its
  sampled token back), so no id crosses to the host between steps. Each step's ids and its top logits per row are
  joined on the device: two reads a replay.
The prompt: the prefill's taps come back to the host once per request (PromptTaps); the rows before the last K + 1
go into the head's cache with prefill-shaped ops (fill_prompt: k and v only, 256 rows at a time), the last ones
through the drafting replay.

The layer follows TT-Transformers' decode attention (tt/attention.py; TT's Attention and MLP classes themselves are
built for the model's own width, the head's attention reads 2 * dim): q and k rows of the qkv weight permuted to
Meta's pairwise rotary layout as TT's checkpoint loader does, nlp_create_qkv_heads_decode, rotary_embedding_llama
with TT's rotation matrix and cos/sin gathered as RotarySetup does, the paged cache update and paged SDPA decode over
the head's own paged KV cache (a page-table row per user), nlp_concat_heads_decode; every matmul over the decode
tile DRAM-sharded with TT's decode program config (DecodeMatmul); norms and elementwise ops DRAM-interleaved.
Weights are converted once and cached as TT-Transformers caches its own (ttnn.as_tensor with cache_file_name), in
its performance preset's dtypes (bfloat8_b matmul weights, bfloat16 norms and tables; the KV cache bfloat8_b).
Meshes: the head is replicated on every device (the target's traced step all-gathers the taps, so no head trace
holds a collective: two traces with CCL ops deadlocked on a multi-chip mesh in tt-metal's Gemma-4 work).
"""
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..checkpoints.cache import cache_root
from ..errors import UserError
from ..speculative.drafters.eagle3_device import HeadFeed
from ..checkpoints.eagle3_format import HeadConfig, estimated_run_cost, parameter_names
from ..checkpoints.model_shape import ModelShape
from ..checkpoints.rope import rope_tables
from .causal_lm import TtnnCausalLM
from .head_matmuls import FILL_ROWS, MAX_TILES_PER_BANK, DecodeMatmul, HeadKernelConfigs, column_chunks
from .model import BLOCK_SIZE, TILE_ROWS, blocks_per_user
from .trace_plan import HeadKey, head_trace_bytes, head_trace_keys, pass_ladder, passes_for
from .traces import TracedModel, captured, device_tensors
from .ttnn_api import ttnn
from .vocab import slice_top_k


@dataclass
class HeadInputs:
    """The persistent device tensors every head replay reads (refreshed in place before each replay)."""

    embeds: Any  # [1, 1, 32, dim]: each fed row's next-token embedding
    positions: Any  # [32] int32: each fed row's position, -1 elsewhere (attention)
    rope_rows: Any  # [1, 32] uint32: the same positions clamped at 0 (rotary rows: TT's rot_mat_idxs, rope.py)
    page_table: Any  # [32, blocks] int32: each row's user's page-table row of the head's cache
    pass_positions: list  # per pass (up to the widest feed's) [32] int32: pass j writes each user's j-th fed row
    chain_positions: list  # chain step j: [32] int32, the drafting users' last fed rows at position + j, -1 elsewhere
    chain_rope_rows: list  # the same clamped at 0, [1, 32] uint32
    tokens: list  # per chain step [1, 1, 1, 32] uint32: each row's draft, written by the argmax (TT's tt_out_tok)


@dataclass
class HeadTrace:
    trace_id: Any
    top: list  # per chain step, per vocabulary slice: (values, indices) [1, 1, 32, CONFIDENCE_TOP] of each row
    logits: list  # per chain step: [1, 1, 32, V'] (kept on the device; tests read them)
    chain_ids: Any = None  # [1, 1, k, 32] uint32: the steps' drafts (HeadInputs.tokens) stacked, read in one go
    chain_top: Any = None  # [1, 1, 32, k * slices * CONFIDENCE_TOP]: every step's top values side by side, one read


CONFIDENCE_TOP = 32  # the top logits a row's confidence is computed from (ttnn.topk's multi-core k is at most 64)


def to_meta_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k projection rows from the checkpoint's rotate-half layout to Meta's pairwise one, which TT's
    rotary_embedding_llama rotates (load_checkpoints.py reverse_permute: within each head, row 2i is row i and row
    2i + 1 is row i + head_dim / 2). q and k permuted alike leave every q . k, so attention, unchanged."""
    return w.view(n_heads, 2, w.shape[0] // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)


def from_meta_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """to_meta_rows undone: Meta's pairwise rows back to the checkpoint's rotate-half order."""
    return w.view(n_heads, w.shape[0] // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def meta_table(table: torch.Tensor) -> torch.Tensor:
    """A rotate-half cos/sin table [positions, head_dim] in Meta's pairwise layout (rope.py gather_cos_sin)."""
    half = table[:, : table.shape[1] // 2]
    return torch.stack((half, half), dim=-1).flatten(-2)


def rotation_matrix() -> torch.Tensor:
    """TT's get_rot_transformation_mat (tt/common.py): x @ M swaps each pair (x[2k], x[2k + 1]) to
    (-x[2k + 1], x[2k]), so rotary_embedding_llama computes x * cos + (x @ M) * sin."""
    m = torch.zeros(TILE_ROWS, TILE_ROWS)
    m[torch.arange(0, TILE_ROWS, 2), torch.arange(1, TILE_ROWS, 2)] = 1.0
    m[torch.arange(1, TILE_ROWS, 2), torch.arange(0, TILE_ROWS, 2)] = -1.0
    return m.view(1, 1, TILE_ROWS, TILE_ROWS)


def head_weights(config: HeadConfig, weights: dict) -> dict[str, torch.Tensor]:
    """The head's own tensors as the device program reads them (float32, converted once per dtype): linear weights
    transposed [in, out]; qkv's q and k rows in Meta's layout (to_meta_rows); norms [1, 1, dim / 32, 32] as
    TT-Transformers' RMSNorm stores them (models/common/rmsnorm.py)."""
    a = config.layer
    H, Hk, D = a.n_heads, a.n_kv_heads, a.head_dim
    out = {}
    for name, parts in parameter_names(config).items():
        w = torch.cat([weights[p] for p in parts]).float()
        if name.endswith("wqkv.weight"):
            w = torch.cat([to_meta_rows(w[: H * D], H), to_meta_rows(w[H * D : (H + Hk) * D], Hk), w[(H + Hk) * D :]])
        out[name] = w.view(1, 1, -1, 32) if w.dim() == 1 else w.t().contiguous()
    return out


def stored_weights(config: HeadConfig, weights: dict) -> dict:
    """The head's tensors (the file's names, for a host head) with every matmul weight as the device holds it in
    bfloat8_b: rounded (bfp8.py) in the layout the device stores (head_weights: transposed, q and k rows in Meta's
    order, q/k/v and gate/up fused), then put back in the file's layout. The host reference a device head's drafts
    are checked against (make tt-smoke), and tools/head_precision.py's."""
    from .bfp8 import bfp8_round

    a, out, host = config.layer, dict(weights), head_weights(config, weights)
    for name, parts in parameter_names(config).items():
        if host[name].dim() != 2:  # norms: bfloat16 on the device
            continue
        w = bfp8_round(host[name]).t()
        if name.endswith("wqkv.weight"):
            q, k = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
            w = torch.cat([from_meta_rows(w[:q], a.n_heads), from_meta_rows(w[q : q + k], a.n_kv_heads), w[q + k :]])
        for part, piece in zip(parts, w.split([weights[p].shape[0] for p in parts])):
            out[part] = piece.to(weights[part].dtype)
    return out


class TtnnDraftHead(TracedModel):
    """The `ChainDraftHead` of speculative/drafters/eagle3_device.py on a TT device, beside its target (a TtnnCausalLM
    whose steps write the tap tile). Traces are keyed by (feed write passes, chain length k) and made with every other
    model on the mesh (traces.MeshTraces), as the target's are."""

    def __init__(self, target: TtnnCausalLM, config: HeadConfig, weights: dict, embedding: torch.Tensor,
                 chain_len: int, target_args: ModelShape, weights_dtype=None, cache_dir: Optional[Path] = None):
        if not 1 <= chain_len <= TILE_ROWS:
            raise UserError(f"chain_len {chain_len}: a draft head on the device drafts chains of 1 to {TILE_ROWS} "
                            "tokens (one 32-row tile); lower it, or draft copied tokens instead (draft mode suffix)",
                            "chain_len")
        if config.layer.head_dim % TILE_ROWS:
            raise UserError(f"draft_head: the head's head_dim {config.layer.head_dim} is not a multiple of 32, which "
                            "TT's rotary_embedding_llama needs on the device; run the head on the host (the torch "
                            "backend)", "draft_head")
        self.target, self.config, self.chain_len = target, config, chain_len
        self.mesh = target.tt.mesh_device
        a = self.args = config.layer
        self.taps, self.vocab_size = tuple(config.taps), a.vocab_size
        self.vocab = torch.arange(config.draft_vocab_size) + (weights["d2t"].long() if "d2t" in weights else 0)
        self.dtype = weights_dtype or ttnn.bfloat8_b  # matmul weights
        self.configs = HeadKernelConfigs.for_mesh(self.mesh)
        self.max_seq_len = target.max_seq_len + chain_len  # a chain writes past the last position a step verifies
        self.blocks = blocks_per_user(self.max_seq_len)
        self.page_table = torch.arange(target.max_batch_size * self.blocks, dtype=torch.int32).view(
            target.max_batch_size, self.blocks)
        self.embedding = embedding.to(torch.bfloat16)  # the feed's next tokens are looked up on the host
        banks = self.mesh.dram_grid_size().x
        self.cache_dir = cache_dir or cache_root() / "tt_draft_heads" / head_id(config, weights, banks)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        host = head_weights(config, weights)
        self.matmuls = {name: [DecodeMatmul.build(self.mesh, w.shape[0], columns,
                                                  a.n_heads if name.endswith("wo.weight") else None)
                               for columns in column_chunks(w.shape[1], banks)]
                        for name, w in host.items() if w.dim() == 2}
        for name in ("fc.weight", "layer.attention.wqkv.weight"):
            for chunk in self.matmuls[name]:
                chunk.add_fill_program(self.mesh, host[name].shape[0])
        self.weights = {name: self._device_weight(name, w) for name, w in host.items()}
        self.tables = self._tables(embedding)
        shape = (target.max_batch_size * self.blocks, a.n_kv_heads, BLOCK_SIZE, a.head_dim)
        # the KV cache in the precision of TT's preset the weights follow: bfloat8_b with bfloat8_b weights
        # (performance), bfloat16 otherwise (accuracy; paged SDPA decode takes no float32 cache)
        cache_dtype = ttnn.bfloat8_b if self.dtype == ttnn.bfloat8_b else ttnn.bfloat16
        self.kv_cache = [ttnn.as_tensor(torch.zeros(shape), dtype=cache_dtype, layout=ttnn.TILE_LAYOUT,
                                        device=self.mesh, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh),
                                        memory_config=ttnn.DRAM_MEMORY_CONFIG) for _ in range(2)]
        self.ladder = pass_ladder(chain_len + 1)
        self.prompt_rows = self.ladder[-1]  # prompt rows per user and replay: the feed's widest trace
        self.planned: set[HeadKey] = set()
        self.compiled: set[HeadKey] = set()
        self.trace = target.trace  # eager (False) with an eager target: every replay runs its ops one by one
        self.inputs: Optional[HeadInputs] = None
        self.traces: dict[HeadKey, HeadTrace] = {}
        self.step_times: dict[HeadKey, list] = {}
        self.last_draft_s, self.last_key = 0.0, None  # the last replay, reads included: what a chain step is priced by
        self.last_rows: dict[int, int] = {}  # the tile row each user of the last drafting replay drafted in
        self.last_eager: Optional[HeadTrace] = None  # an eager replay's outputs, until the next
        self.fill_built = False  # the prompt fill's programs (compile builds them before any trace)
        self.draft_cost = estimated_run_cost(config, target_args)  # one chain step, until measured (RunCost)
        self.mesh_traces = target.mesh_traces
        self.mesh_traces.add(self)

    # ---- weights -------------------------------------------------------------------------------------------------

    def _device_weight(self, name: str, w: torch.Tensor):
        """One tensor on every device: the head's own weights converted once and cached as TT-Transformers caches its
        own (ttnn.as_tensor with cache_file_name, which appends the dtype and layout to the file name and loads an
        existing file whatever its shape or memory config: the folder is keyed by the head's tensors and the
        conversion), matmul weights in the head's dtype (TILE) DRAM-sharded (DecodeMatmul), norm weights bfloat16
        ROW_MAJOR in DRAM (models/common/rmsnorm.py)."""
        replicated = ttnn.ReplicateTensorToMesh(self.mesh)
        if name not in self.matmuls:
            return ttnn.as_tensor(w, dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT, device=self.mesh,
                                  mesh_mapper=replicated, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                                  cache_file_name=self.cache_dir / name)
        return [ttnn.as_tensor(w[:, chunk.columns[0] : chunk.columns[1]].contiguous(), dtype=self.dtype,
                               layout=ttnn.TILE_LAYOUT, device=self.mesh, mesh_mapper=replicated,
                               memory_config=chunk.weight_config, cache_file_name=self.cache_dir / f"{name}.{i}")
                for i, chunk in enumerate(self.matmuls[name])]

    def _tables(self, embedding: torch.Tensor) -> dict:
        """The bfloat16 tables that depend on the run, built each time: the chain's embedding in draft-id order
        ([1, 1, V', dim] ROW_MAJOR as tt/embedding.py stores its own: a ttnn.embedding table must be "BFLOAT16" and
        ROW_MAJOR, embedding_device_operation.cpp), and TT's RotarySetup pieces (tt/rope.py) over the cache's
        positions: cos/sin in Meta's layout ROW_MAJOR for the decode gather (a TILE table would be converted at every
        ttnn.embedding call), the decode rotation matrix one tile per user's core (height-sharded as q and k, which
        rotary_embedding_llama needs) and the prefill one in DRAM. The host keeps cos/sin for the fill's chunks."""
        def table(t, layout, memory_config=ttnn.DRAM_MEMORY_CONFIG):
            return ttnn.from_torch(t, dtype=ttnn.bfloat16, layout=layout, device=self.mesh, memory_config=memory_config,
                                   mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh))

        positions = self.blocks * BLOCK_SIZE
        self.rope = cos, sin = [meta_table(t).view(1, 1, positions, -1)
                                for t in rope_tables(self.args, positions, torch.float32)]
        return {"draft_embedding": table(embedding[self.vocab].float().view(1, 1, len(self.vocab), -1),
                                         ttnn.ROW_MAJOR_LAYOUT),
                "rope_cos": table(cos, ttnn.ROW_MAJOR_LAYOUT), "rope_sin": table(sin, ttnn.ROW_MAJOR_LAYOUT),
                "trans_mat": table(rotation_matrix().repeat(1, 1, TILE_ROWS, 1), ttnn.TILE_LAYOUT,
                                   self._per_user(TILE_ROWS)),
                "trans_mat_prefill": table(rotation_matrix(), ttnn.TILE_LAYOUT)}

    # ---- the program ---------------------------------------------------------------------------------------------

    def _norm(self, x, name: str):
        return ttnn.rms_norm(x, epsilon=self.args.norm_eps, weight=self.weights[name],
                             memory_config=ttnn.DRAM_MEMORY_CONFIG, compute_kernel_config=self.configs.norm)

    def _linear(self, x, name: str, memory_config=None):
        """x @ the named weight, bfloat16, in DRAM. Over the decode tile with TT's DRAM-sharded decode matmul
        (DecodeMatmul: x resharded in, the output back to DRAM); a prompt fill's rows with the matmul's own program
        over the same weights, as TT's prefill matmuls read its decode-sharded weights."""
        out_config, chunks, parts = memory_config or ttnn.DRAM_MEMORY_CONFIG, self.matmuls[name], []
        decode = x.shape[-2] == TILE_ROWS
        if decode and chunks[0].input_config is not None:  # one reshard for every chunk (their K and grid are one)
            x = ttnn.to_memory_config(x, chunks[0].input_config)
        for chunk, w in zip(chunks, self.weights[name]):
            if not decode:
                parts.append(ttnn.linear(x, w, program_config=chunk.fill, dtype=ttnn.bfloat16,
                                         memory_config=out_config, compute_kernel_config=self.configs.matmul))
                continue
            out = ttnn.linear(x, w, program_config=chunk.program, memory_config=ttnn.L1_WIDTH_SHARDED_MEMORY_CONFIG,
                              dtype=ttnn.bfloat16, compute_kernel_config=self.configs.matmul)
            parts.append(ttnn.sharded_to_interleaved(out, out_config))
        return parts[0] if len(parts) == 1 else ttnn.concat(parts, dim=3, memory_config=out_config)

    def _cols(self, x, start: int, end: int):
        return ttnn.slice(x, [0, 0, 0, start], [1, 1, x.shape[-2], end], memory_config=ttnn.DRAM_MEMORY_CONFIG)

    @staticmethod
    def _per_user(width: int):
        """Height-sharded in L1, one user's [32, width] per core on the first 32 cores row by row: where
        nlp_create_qkv_heads_decode puts q, k and v (num_cores_to_corerangeset(32 users, row_wise)), so TT's rotary
        inputs, paged_update_cache's update and nlp_concat_heads_decode's input sit there too (tt/rope.py batch_grid,
        CREATE_QKV_DECODE_SHARD and SCORES_BATCHED_MM_OUTPUT_MEMCFG in tt/model_config.py)."""
        return ttnn.create_sharded_memory_config((TILE_ROWS, width), ttnn.CoreGrid(y=4, x=8), ttnn.ShardStrategy.HEIGHT,
                                                 use_height_and_width_as_shard_shape=True)

    def _project(self, taps):
        """The taps [1, 1, rows, len(taps) * dim] -> the first state (fc, after the config's norms)."""
        c = self.config
        if c.norm_before_fc:
            taps = self._norm(taps, "input_norm.weight")
        if c.fc_norm:
            dim = c.target_hidden
            taps = ttnn.concat([self._norm(self._cols(taps, i * dim, (i + 1) * dim), f"fc_norm.{i}.weight")
                                for i in range(len(c.taps))], dim=3, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        return self._linear(taps, "fc.weight")

    def _attention_input(self, embeds, state):
        """(the layer's attention input: the normed embedding and state side by side (2 dim), the residual)."""
        normed = self._norm(state, "layer.hidden_norm.weight")
        x = ttnn.concat([self._norm(embeds, "layer.input_layernorm.weight"), normed], dim=3,
                        memory_config=ttnn.DRAM_MEMORY_CONFIG)
        return x, normed if self.config.norm_before_residual else state

    def _rot_mats(self, rope_rows):
        """Each row's cos and sin, [1, 32, 1, head_dim] height-sharded one user per core: TT's
        RotarySetup.get_rot_mats (tt/rope.py: embedding, unsqueeze_to_4D, transpose(1, 2), interleaved_to_sharded)."""
        return [ttnn.interleaved_to_sharded(ttnn.transpose(ttnn.unsqueeze_to_4D(ttnn.embedding(
            rope_rows, self.tables[name], layout=ttnn.TILE_LAYOUT)), 1, 2), self._per_user(self.args.head_dim))
            for name in ("rope_cos", "rope_sin")]

    def _cache_rows(self, embeds, state, rope_rows, passes: list):
        """The layer up to its cache update (TT's attention forward_decode): every row's k and v written into the head's
        cache in ordered passes (no two rows of one op share a cache block: attention.py). Returns q, rotated, and the
        residual, for the rest of the layer (_layer)."""
        a = self.args
        x, residual = self._attention_input(embeds, state)
        # bfloat16 qkv ("bfloat16 is required by nlp_create_qkv_heads_decode"); q, k, v [1, 32, heads, D] per user core
        # qkv in L1 as TT's (tt/attention.py): on Wormhole the op reads its rows at 16-byte L1 alignment, which DRAM
        # does not give (its fix for DRAM inputs, tt-metal #43270, is on for Blackhole only)
        q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
            self._linear(x, "layer.attention.wqkv.weight", ttnn.L1_MEMORY_CONFIG), num_heads=a.n_heads,
            num_kv_heads=a.n_kv_heads, memory_config=self._per_user(a.head_dim))
        cos, sin = self._rot_mats(rope_rows)
        q, k = (ttnn.experimental.rotary_embedding_llama(t, cos, sin, self.tables["trans_mat"], is_decode_mode=True)
                for t in (q, k))
        keys, values = self.kv_cache
        page_table = self.inputs.page_table
        for pass_positions in passes:
            ttnn.experimental.paged_update_cache(keys, k, update_idxs_tensor=pass_positions, page_table=page_table)
            ttnn.experimental.paged_update_cache(values, v, update_idxs_tensor=pass_positions, page_table=page_table)
        return q, residual

    def _layer(self, embeds, state, positions, rope_rows, passes: list):
        """The head's decoder layer over the tile (Eagle3Layer.forward in the torch backend's eagle3_head.py) with TT's
        decode attention ops (tt/attention.py forward_decode): returns the state fed forward and the draft-vocabulary
        logits [1, 1, 32, V']."""
        a, c, dram = self.args, self.config, ttnn.DRAM_MEMORY_CONFIG
        H, D = a.n_heads, a.head_dim
        q, residual = self._cache_rows(embeds, state, rope_rows, passes)
        keys, values = self.kv_cache
        page_table = self.inputs.page_table
        attn = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, keys, values, page_table_tensor=page_table, cur_pos_tensor=positions, scale=D ** -0.5,
            sliding_window_size=a.sliding_window, program_config=self.configs.sdpa_program,
            compute_kernel_config=self.configs.sdpa, memory_config=dram)  # DRAM: GQA takes no sharded output
        # the heads side by side, one head per core: wo's DRAM-sharded input as it is (TT's ATTN_OUTPUT_PROGCFG)
        attn = ttnn.experimental.nlp_concat_heads_decode(ttnn.to_memory_config(attn, self._per_user(D)), num_heads=H)
        h = ttnn.add(residual, self._linear(attn, "layer.attention.wo.weight"), memory_config=dram)
        gate_up = self._linear(self._norm(h, "layer.ffn_norm.weight"), "layer.feed_forward.w_gate_up.weight")
        hidden = a.hidden_dim
        mlp = ttnn.mul(ttnn.silu(self._cols(gate_up, 0, hidden), memory_config=dram),
                       self._cols(gate_up, hidden, 2 * hidden), memory_config=dram)
        h = ttnn.add(h, self._linear(mlp, "layer.feed_forward.w_down.weight"), memory_config=dram)
        normed_out = self._norm(h, "norm.weight")
        return (normed_out if c.norm_output else h), self._linear(normed_out, "lm_head.weight")

    def _choose(self, logits, tokens) -> list:
        """Each row's argmax over the draft vocabulary written into `tokens`, as TT's decode writes its sampled token
        into the next step's token input (the untilized logits' argmax, multi-core over a ROW_MAJOR last dim, with
        output_tensor [1, 1, 1, 32] uint32: no reshape of the ids); and the top CONFIDENCE_TOP logits of each row per
        vocabulary slice (ttnn.topk multi-core on power-of-two slices, as the target's top k), from which the host
        computes the draft's confidence: a softmax over one row of the draft vocabulary would run on one core."""
        dram = ttnn.DRAM_MEMORY_CONFIG
        ttnn.argmax(ttnn.untilize(logits, use_multicore=True, memory_config=dram), dim=-1, keepdim=False,
                    output_tensor=tokens)
        return slice_top_k(logits, CONFIDENCE_TOP, len(self.vocab))

    def _forward(self, key: HeadKey):
        """The traced program for (passes, k): the feed over the tile, then k - 1 chain steps. k = 0, a feed that drafts
        nothing (the hybrid took a copied draft for every user): the fed rows' k and v into the cache only, which is
        all a later replay reads of them (a one-layer head's cache rows depend on each row's own input, as
        fill_prompt's): no attention, MLP, LM head, argmax or top k."""
        passes, k = key
        i, dram = self.inputs, ttnn.DRAM_MEMORY_CONFIG
        state = self._project(self.target.tap_tile(self.taps))
        if k == 0:
            self._cache_rows(i.embeds, state, i.rope_rows, i.pass_positions[:passes])
            return HeadTrace(None, [], [])
        state, logits = self._layer(i.embeds, state, i.positions, i.rope_rows, i.pass_positions[:passes])
        out = HeadTrace(None, [self._choose(logits, i.tokens[0])], [logits])
        for j in range(1, k):
            embeds = ttnn.unsqueeze_to_4D(ttnn.embedding(i.tokens[j - 1], self.tables["draft_embedding"],
                                                         layout=ttnn.TILE_LAYOUT, memory_config=dram))
            state, logits = self._layer(embeds, state, i.chain_positions[j - 1], i.chain_rope_rows[j - 1],
                                        [i.chain_positions[j - 1]])
            out.top.append(self._choose(logits, i.tokens[j]))
            out.logits.append(logits)
        # the chain's outputs side by side, so a replay ends in two reads, not 2 x k
        out.chain_ids = ttnn.concat(i.tokens[:k], dim=2, memory_config=dram) if k > 1 else i.tokens[0]
        values = [v for step in out.top for v, _ in step]
        out.chain_top = ttnn.concat(values, dim=3, memory_config=dram) if len(values) > 1 else values[0]
        return out

    def fill_prompt(self, user: int, states: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """A prompt's rows 0.. (states [n, len(taps) * dim], each row's next token) into the user's head cache with
        prefill-shaped ops, FILL_ROWS at a time, once per request: a one-layer head's cache holds each row's k and v,
        which depend on the row's own input only, so the rows' attention, MLP and LM head are not run (the last rows,
        whose state the chain starts from, go through the drafting replay). Eager (a prompt's length varies), as TT's
        prefill; its tensors freed before the next replay."""
        for start in range(0, len(next_tokens), FILL_ROWS):
            self._fill_chunk(user, start, states[start : start + FILL_ROWS], next_tokens[start : start + FILL_ROWS])

    def _fill_chunk(self, user: int, start: int, states: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """Up to FILL_ROWS rows from position `start` (a multiple of FILL_ROWS): TT's attention forward_prefill up to
        the cache fill (nlp_create_qkv_heads, rotary_embedding_llama on the chunk's cos/sin rows, typecast to the
        cache's dtype, paged_fill_cache into the chunk's page-table slice, as TT's chunked prefill). Padded rows
        write positions past the prompt, rewritten by their own feed before any query reads them."""
        a, dram = self.args, ttnn.DRAM_MEMORY_CONFIG
        replicated = ttnn.ReplicateTensorToMesh(self.mesh)
        taps, embeds = torch.zeros(FILL_ROWS, states.shape[1]), torch.zeros(FILL_ROWS, a.dim)
        taps[: len(next_tokens)] = states.float()
        embeds[: len(next_tokens)] = self.embedding[torch.tensor(list(next_tokens))].float()
        taps, embeds = (ttnn.from_torch(t.view(1, 1, FILL_ROWS, -1), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                                        device=self.mesh, memory_config=dram, mesh_mapper=replicated)
                        for t in (taps, embeds))
        x, _ = self._attention_input(embeds, self._project(taps))
        q, k, v = ttnn.experimental.nlp_create_qkv_heads(
            self._linear(x, "layer.attention.wqkv.weight"), num_heads=a.n_heads, num_kv_heads=a.n_kv_heads,
            transpose_k_heads=False, memory_config=dram)
        # the chunk's cos/sin written from the host (a device slice at each chunk's offset would be a new program,
        # compiled while traces are live: ttnn.slice keys its program by the offsets)
        cos, sin = (ttnn.from_torch(t[:, :, start : start + FILL_ROWS], dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                                    device=self.mesh, memory_config=dram, mesh_mapper=replicated) for t in self.rope)
        k = ttnn.experimental.rotary_embedding_llama(k, cos, sin, self.tables["trans_mat_prefill"],
                                                     is_decode_mode=False)
        blocks = self.page_table[user : user + 1, start // BLOCK_SIZE : (start + FILL_ROWS) // BLOCK_SIZE]
        page_table = ttnn.from_torch(blocks, dtype=ttnn.int32, device=self.mesh, memory_config=dram,
                                     mesh_mapper=replicated)
        filled = [ttnn.typecast(t, cache.dtype) for t, cache in zip((k, v), self.kv_cache)]  # a raw tile copy
        for cache, t in zip(self.kv_cache, filled):
            ttnn.experimental.paged_fill_cache(cache, t, page_table, batch_idx=0)
        for t in (taps, embeds, x, q, k, v, cos, sin, page_table, *filled):
            ttnn.deallocate(t)

    # ---- traces (made with the mesh's other models: MeshTraces.prepare) ---------------------------------------

    def warm_up(self) -> float:
        """Plan the head's traces (trace_plan.head_trace_keys), made with every other model's on the mesh by the
        target's prepare_traces (or the first replay that needs them); seconds spent. The target must have planned
        steps with the head's taps (they write its input)."""
        if not any(key.taps == self.taps for key in self.target.planned):
            raise ValueError(f"the target's steps do not write taps {list(self.taps)}: warm it up with them first")
        start = time.perf_counter()
        self.planned |= set(head_trace_keys(self.chain_len))
        self.mesh_traces.check_region()
        return time.perf_counter() - start

    def trace_bytes(self, key: HeadKey) -> int:
        args = self.target.tt.args
        return head_trace_bytes(args.model_name, args.device_name, self.target.tt.full_layers, key)

    def compile(self, key: HeadKey) -> None:
        """Run the program once outside a trace with every position -1 (nothing written), so its kernels are built;
        the first time, the prompt fill's too (built while no trace is live), into user 0's last chunk of positions
        (rewritten by their own feed before any query reads them)."""
        if not self.fill_built:
            self._fill_chunk(0, self.blocks * BLOCK_SIZE - FILL_ROWS,
                             torch.zeros(1, len(self.taps) * self.config.target_hidden), [0])
            self.fill_built = True
        self._write_inputs(key, [], [])
        self._deallocate(self._forward(key))

    @staticmethod
    def _deallocate(out: HeadTrace) -> None:
        """A program's outputs (not the persistent token tensors the argmax writes)."""
        k = len(out.logits)
        joined = [out.chain_ids if k > 1 else None, out.chain_top if k and k * len(out.top[0]) > 1 else None]
        for tensor in device_tensors([out.top, out.logits, joined]):
            ttnn.deallocate(tensor)

    def capture(self, key: HeadKey) -> None:
        trace_id, out = captured(self.mesh, lambda: self._forward(key))
        out.trace_id = trace_id
        self.traces[key] = out

    # ---- inputs --------------------------------------------------------------------------------------------------

    def _write_inputs(self, key: HeadKey, feeds: list[tuple[int, list[int], int, list[int]]],
                      chains: list[tuple[int, int]]) -> None:
        """feeds: (user, tile rows, first position, next tokens) of every row fed; chains: (user, tile row of its last
        fed row) of every drafting user. The first call allocates every input (the widest feed's pass tensors and the
        longest chain's); later calls copy in the ones the key's trace reads."""
        positions = torch.full((TILE_ROWS,), -1, dtype=torch.int32)
        passes = torch.full((self.ladder[-1], TILE_ROWS), -1, dtype=torch.int32)
        chain = torch.full((max(1, self.chain_len - 1), TILE_ROWS), -1, dtype=torch.int32)
        page_table = self.page_table[0].repeat(TILE_ROWS, 1)  # idle rows: any valid row, never read
        tokens = torch.zeros(TILE_ROWS, dtype=torch.long)
        for user, rows, start, next_tokens in feeds:
            for j, (r, token) in enumerate(zip(rows, next_tokens)):
                positions[r], passes[j, r], tokens[r] = start + j, start + j, token
                page_table[r] = self.page_table[user]
        for user, r in chains:
            chain[: self.chain_len - 1, r] = positions[r] + torch.arange(1, self.chain_len, dtype=torch.int32)
        replicated = ttnn.ReplicateTensorToMesh(self.mesh)

        def ints(t):
            return ttnn.from_torch(t, dtype=ttnn.int32, mesh_mapper=replicated)

        def rope_rows(t):  # rotary rows: positions clamped at 0, [1, 32] as TT's rot_mat_idxs (rope.py get_rot_idxs)
            return ttnn.from_torch(t.clamp(min=0).view(1, -1), dtype=ttnn.uint32, mesh_mapper=replicated)

        embeds = ttnn.from_torch(self.embedding[tokens].view(1, 1, TILE_ROWS, -1), dtype=ttnn.bfloat16,
                                 layout=ttnn.TILE_LAYOUT, mesh_mapper=replicated)
        n_passes, k = key
        if self.inputs is None:
            tokens = [ttnn.from_torch(torch.zeros(1, 1, 1, TILE_ROWS, dtype=torch.int64), dtype=ttnn.uint32,
                                      mesh_mapper=replicated) for _ in range(self.chain_len)]
            host = [embeds, ints(positions), rope_rows(positions), ints(page_table), [ints(p) for p in passes],
                    [ints(c) for c in chain], [rope_rows(c) for c in chain], tokens]
            self.inputs = HeadInputs(*(
                [ttnn.to_device(t, self.mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG) for t in part]
                if isinstance(part, list) else ttnn.to_device(part, self.mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG)
                for part in host))
            return
        i = self.inputs
        pairs = [(embeds, i.embeds), (ints(positions), i.positions), (rope_rows(positions), i.rope_rows),
                 (ints(page_table), i.page_table), *((ints(p), d) for p, d in zip(passes[:n_passes], i.pass_positions)),
                 *((ints(c), d) for c, d in zip(chain[: max(k - 1, 0)], i.chain_positions)),
                 *((rope_rows(c), d) for c, d in zip(chain[: max(k - 1, 0)], i.chain_rope_rows))]
        for src, dst in pairs:
            ttnn.copy_host_to_device_tensor(src, dst)

    # ---- drafting ------------------------------------------------------------------------------------------------

    def draft(self, feeds: Sequence[HeadFeed], chain_users: Sequence[int], k: int) -> dict[int, tuple[list, list]]:
        """Feed every row in `feeds` (a verified step's rows in the tap tile, or a prompt's states), then draft k
        tokens (chain_len, or 0 with no chain_users: a feed-only replay) for each user in chain_users from its last fed
        row, in one replay. Returns {user: (target ids, the head's confidence in each)}."""
        if k != (self.chain_len if chain_users else 0):
            raise ValueError(f"a device head drafts {self.chain_len} tokens per replay for the users that draft, or 0 "
                             f"when none does; not {k} for {len(chain_users)} users")
        tile = [f for f in feeds if f.tile_rows is not None]
        prompt = [f for f in feeds if f.tile_rows is None]
        if tile and prompt:
            raise ValueError("a prompt's rows and a verified step's come in separate proposals (every user starts "
                             "with the same first step)")
        replay, states, fills = ([(f.user, list(f.tile_rows), f.start_pos, list(f.next_tokens)) for f in tile],
                                 None, []) if tile else self._prompt_replay(prompt)
        missing = set(chain_users) - {row[0] for row in replay}
        if missing:
            raise ValueError(f"users {sorted(missing)} have no rows to feed: the head drafts from a user's last fed "
                             "row")
        chains = [(user, rows[-1]) for user, rows, *_ in replay if user in chain_users]
        key = (passes_for(max(len(rows) for _, rows, *_ in replay), self.ladder), k)
        if key not in (self.traces if self.trace else self.compiled):
            self.planned.add(key)
            self.mesh_traces.check_region()
            self.mesh_traces.prepare()
        for fill in fills:  # a prompt's earlier rows (compiled above, before any of its traces)
            self.fill_prompt(*fill)
        if states is not None:  # a prompt's last rows: the tap tile is the feed's input
            tile_tensor = self.target.tap_tile(self.taps)
            ttnn.copy_host_to_device_tensor(ttnn.from_torch(
                states.view(1, 1, TILE_ROWS, -1), dtype=tile_tensor.dtype, layout=ttnn.TILE_LAYOUT,
                mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh)), tile_tensor)
        self._write_inputs(key, replay, chains)
        start = time.perf_counter()
        if self.trace:
            program = self.traces[key]
            ttnn.execute_trace(self.mesh, program.trace_id, cq_id=0, blocking=False)
        else:  # eager: the same program, op by op (its outputs kept until the next replay, for read_logits)
            if self.last_eager is not None:
                self._deallocate(self.last_eager)
            program = self.last_eager = self._forward(key)
        out = self._read(program, [row for _, row in chains]) if chains else []
        self.step_times.setdefault(key, []).append(time.perf_counter() - start)
        self.last_draft_s, self.last_key, self.last_rows = self.step_times[key][-1], key, dict(chains)
        return {user: drafted for (user, _), drafted in zip(chains, out)}

    def _prompt_replay(self, feeds: Sequence[HeadFeed]) -> tuple[list, torch.Tensor, list]:
        """The prompts' last rows, up to prompt_rows per user (each user its own run of tile rows), for the drafting
        replay: (rows fed, the tap tile's contents, the earlier rows' fill_prompt arguments)."""
        share = max(1, min(self.prompt_rows, TILE_ROWS // len(feeds)))
        replay, states, fills = [], torch.zeros(TILE_ROWS, feeds[0].states.shape[1]), []
        for slot, f in enumerate(feeds):
            if f.start_pos != 0:
                raise ValueError(f"user {f.user}: a prompt's rows start at position 0, not {f.start_pos}")
            begin = max(0, len(f.next_tokens) - share)
            if begin:
                fills.append((f.user, f.states[:begin], list(f.next_tokens[:begin])))
            rows = list(range(slot * share, slot * share + len(f.next_tokens) - begin))
            states[rows] = f.states[begin:].float()
            replay.append((f.user, rows, begin, list(f.next_tokens[begin:])))
        return replay, states, fills

    def _read(self, trace: HeadTrace, rows: list[int]) -> list[tuple[list[int], list[float]]]:
        """The drafted ids (mapped to the target's) and confidences of the given rows: one read of each. A draft's
        confidence is its softmax probability among its row's top logits (the rest of the draft vocabulary's mass
        left out: at least the full softmax's probability)."""
        def read(t):
            return ttnn.to_torch(ttnn.get_device_tensors(t)[0])

        k = len(trace.logits)
        ids = read(trace.chain_ids).reshape(-1, TILE_ROWS)[:k].long().t()[rows]  # [rows, k]
        top = read(trace.chain_top).reshape(TILE_ROWS, k, -1).float()[rows]  # [rows, k, slices * CONFIDENCE_TOP]
        confidence = 1.0 / torch.exp(top - top.amax(dim=-1, keepdim=True)).sum(dim=-1)
        return [(self.vocab[i].tolist(), c.tolist()) for i, c in zip(ids, confidence)]

    def read_logits(self, step: int) -> torch.Tensor:
        """Chain step `step`'s draft-vocabulary logits [32, V'] of the last replay (rows: last_rows; for checks: the
        loop reads ids and probabilities only)."""
        logits = (self.traces[self.last_key] if self.trace else self.last_eager).logits[step]
        return ttnn.to_torch(ttnn.get_device_tensors(logits)[0]).reshape(TILE_ROWS, -1).float()


def head_id(config: HeadConfig, weights: dict, banks: int) -> str:
    """A cache folder name for one head's converted weights: its shapes, a hash of its tensors' bytes and of how they
    are converted (Meta's q/k rows, the column chunks over `banks` DRAM banks: ttnn.as_tensor loads a cached file
    whatever its shape or memory config)."""
    digest = hashlib.sha256(f"meta-qkv, {MAX_TILES_PER_BANK} tiles a bank over {banks} banks".encode())
    for name in sorted(weights):
        t = weights[name].contiguous()
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.view(-1)[:: max(1, t.numel() // 4096)].float().numpy().tobytes())  # a sample of each tensor
    return f"eagle3-{config.layer.dim}-{config.draft_vocab_size}-{digest.hexdigest()[:12]}"

