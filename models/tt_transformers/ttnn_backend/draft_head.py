# SPDX-License-Identifier: Apache-2.0
"""An EAGLE-3 draft head (torch_backend/draft_head.py has its form) on the Tenstorrent device, traced beside the target:
the taps never leave the device and only the drafted ids (and the head's probability of each) come back.

What a replay does, for every row of one 32-row tile (the rows the target's verification step used):
- feed: the head layer over the rows the target just verified, at their positions: its input state is fc over the
  tap tile (the target's traced step writes each tapped layer's input there, TtnnCausalLM._forward), its token the
  next token of each row (accepted drafts and the target's own token: looked up on the host in the head's embedding
  table and written with the step's inputs, 32 x dim values). Rows not verified sit at position -1: skipped by the
  cache update and by attention, their results never read. A user's feed rows share cache blocks, so the head's
  cache writes go in ordered passes as the target's do (attention.py).
- chain: k - 1 more steps from each drafting user's last fed row, in that same row (every other row at position -1):
  the head's own output state and the embedding of its last draft, looked up on the device in the head's table
  ordered by draft id (ttnn.embedding), so no id crosses to the host between steps. Each step's argmax over the draft
  vocabulary and its softmax probability are the replay's outputs: k ids and k probabilities per row come back.
The prompt: the prefill's taps come back to the host once per request (PromptTaps) and are written to the tap tile
32 rows at a time for feed-only replays, the last of which drafts.

The head's layer is written with ttnn ops on DRAM-interleaved tiles (TT-Transformers' Attention, MLP and norms are
built for the model's own width and sharded program configs; the head's attention reads 2 * dim): rms_norm, linear,
concat, the paged cache update and paged SDPA decode TT's attention uses, with its own paged KV cache (a page-table
row per user, as the target's). Rotary embeddings in the checkpoint's rotate-half layout: the rotation is folded into
extra q/k columns of the qkv weight (rotate_half(W x) = (R W) x), so the step is q * cos + q_rot * sin with cos/sin
rows gathered by position (ttnn.embedding, head_dim wide) and repeated across the q and k heads (ttnn.repeat):
elementwise on equal shapes. (The wheel's rotary_embedding_hf would spare the extra columns; its decode mode wants
height-sharded inputs and caches, not modelled here: left.)
Weights are converted once and cached as TT-Transformers caches its own (ttnn.as_tensor with cache_file_name), in
its performance preset's dtypes (bfloat8_b matmul weights, bfloat16 norms and tables; the KV cache bfloat8_b).
Meshes: the head is replicated on every device (the target's traced step all-gathers the taps, so no head trace
holds a collective: two traces with CCL ops deadlocked on a multi-chip mesh in tt-metal's Gemma-4 work).
"""
import contextlib
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..native_build import cache_root
from ..speculative.head_drafter import HeadFeed
from ..torch_backend.draft_head import HeadConfig, estimated_run_cost, parameter_names
from ..torch_backend.model_config import ModelArgs
from ..torch_backend.rope import rope_tables
from .generator import MESH_MODELS, TtnnCausalLM, captured, device_tensors, prepare_mesh, release_all
from .model import BLOCK_SIZE, TILE_ROWS, blocks_per_user
from .trace_plan import HeadKey, head_trace_bytes, head_trace_keys, pass_ladder, passes_for


@dataclass
class HeadInputs:
    """The persistent device tensors every head replay reads (refreshed in place before each replay)."""

    embeds: Any  # [1, 1, 32, dim]: each fed row's next-token embedding
    positions: Any  # [32] int32: each fed row's position, -1 elsewhere (attention)
    rope_rows: Any  # [1, 1, 1, 32] uint32: the same positions clamped at 0 (rotary rows, ttnn.embedding indices)
    page_table: Any  # [32, blocks] int32: each row's user's page-table row of the head's cache
    pass_positions: list  # per pass (up to the widest feed's) [32] int32: pass j writes each user's j-th fed row
    chain_positions: list  # chain step j: [32] int32, the drafting users' last fed rows at position + j, -1 elsewhere
    chain_rope_rows: list  # the same clamped at 0, [1, 1, 1, 32] uint32


@dataclass
class HeadTrace:
    trace_id: Any
    ids: list  # per chain step: [1, 1, 32, 1] uint32, the argmax over the draft vocabulary of each row
    probs: list  # per chain step: [1, 1, 32, 1], the softmax probability of that argmax
    logits: list  # per chain step: [1, 1, 32, V'] (kept on the device; tests read them)
    chain_ids: Any = None  # [1, 1, 32, k] uint32: the steps' ids side by side, read in one go
    chain_probs: Any = None  # [1, 1, 32, k]: their probabilities, read in one go


@dataclass
class HeadKernelConfigs:
    """The compute-kernel and SDPA configs the head's ops run with (issue 31, finding 1: without them each op took
    its defaults, SDPA decode an approximate exp). TT's own decode: RMSNorm in HiFi2 with fp32 accumulation
    (models/common/rmsnorm.py), SDPA decode in HiFi2 with exp_approx_mode False (tt/model_config.py,
    SDPA_DECODE_PROGCFG and sdpa_decode_compute_kernel_cfg: chunks of 256 over the compute grid); the matmuls in
    HiFi4 with fp32 accumulation, as tt-metal's own DFlash drafter runs its draft layers (dflash_tt.py: "five serial
    draft layers amplify projection error enough to change proposal top-1 under HiFi2"). Accepted by ttnn 0.81.1 at
    both shapes on the mock device (make tt-mock); their effect on the drafts only hardware can measure."""

    norm: Any
    matmul: Any
    sdpa: Any
    sdpa_program: Any

    @classmethod
    def for_mesh(cls, mesh) -> "HeadKernelConfigs":
        import ttnn

        def kernel(fidelity, fp32):
            return ttnn.WormholeComputeKernelConfig(math_fidelity=fidelity, math_approx_mode=False,
                                                    fp32_dest_acc_en=fp32, packer_l1_acc=fp32)
        grid = mesh.compute_with_storage_grid_size()
        return cls(norm=kernel(ttnn.MathFidelity.HiFi2, True), matmul=kernel(ttnn.MathFidelity.HiFi4, True),
                   sdpa=kernel(ttnn.MathFidelity.HiFi2, False),
                   sdpa_program=ttnn.SDPAProgramConfig(compute_with_storage_grid_size=grid, q_chunk_size=256,
                                                       k_chunk_size=256, exp_approx_mode=False))


def head_weights(config: HeadConfig, weights: dict) -> dict[str, torch.Tensor]:
    """The head's own tensors as the device program reads them (float32, converted once per dtype): linear weights
    transposed [in, out]; qkv with the rotate-half copies of q and k appended; norms [1, 1, dim / 32, 32] as
    TT-Transformers' RMSNorm stores them (models/common/rmsnorm.py)."""
    a = config.layer
    H, Hk, D = a.n_heads, a.n_kv_heads, a.head_dim
    out = {}
    for name, parts in parameter_names(config).items():
        w = torch.cat([weights[p] for p in parts]).float()
        if name.endswith("wqkv.weight"):
            qk = w[: (H + Hk) * D].view(H + Hk, D, -1)
            rotated = torch.cat([-qk[:, D // 2 :], qk[:, : D // 2]], dim=1).reshape((H + Hk) * D, -1)
            w = torch.cat([w, rotated])
        out[name] = w.view(1, 1, -1, 32) if w.dim() == 1 else w.t().contiguous()
    return out


class TtnnDraftHead:
    """The `ChainDraftHead` of speculative/head_drafter.py on a TT device, beside its target (a TtnnCausalLM whose
    steps write the tap tile). Traces are keyed by (feed write passes, chain length k) and made with every other model
    on the mesh (generator.prepare_mesh), as the target's are."""

    def __init__(self, target: TtnnCausalLM, config: HeadConfig, weights: dict, embedding: torch.Tensor,
                 chain_len: int, target_args: ModelArgs, weights_dtype=None, cache_dir: Optional[Path] = None):
        import ttnn

        if not 1 <= chain_len <= TILE_ROWS:
            raise ValueError(f"--n_draft_tokens {chain_len}: a draft head on the device drafts chains of 1 to "
                             f"{TILE_ROWS} tokens (one 32-row tile); lower it, or use --draft_mode suffix")
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
        host = head_weights(config, weights)
        self.embedding = embedding.to(torch.bfloat16)  # the feed's next tokens are looked up on the host
        # the chain's table: the embedding in draft-id order, [1, 1, V', dim] as tt/embedding.py stores its own
        # (ttnn.embedding: "First two dimensions for the weights must be 1")
        host["draft_embedding"] = embedding[self.vocab].float().view(1, 1, len(self.vocab), -1)
        cos, sin = rope_tables(a, self.max_seq_len, torch.float32)
        host["rope_cos"], host["rope_sin"] = cos.view(1, 1, self.max_seq_len, -1), sin.view(1, 1, self.max_seq_len, -1)
        self.cache_dir = cache_dir or cache_root() / "tt_draft_heads" / head_id(config, weights)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.weights = {name: self._device_weight(name, w) for name, w in host.items()}
        shape = (target.max_batch_size * self.blocks, a.n_kv_heads, BLOCK_SIZE, a.head_dim)
        self.kv_cache = [ttnn.as_tensor(torch.zeros(shape), dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT,
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
        self.draft_cost = estimated_run_cost(config, target_args)  # one chain step, until measured (RunCost)
        MESH_MODELS[id(self.mesh)].add(self)

    # ---- weights -------------------------------------------------------------------------------------------------

    def _device_weight(self, name: str, w: torch.Tensor):
        """One tensor on every device: the head's own weights converted once and cached as TT-Transformers caches its
        own (ttnn.as_tensor with cache_file_name, which appends the dtype and layout to the file name and loads an
        existing file whatever its shape: the folder is keyed by the head's tensors), matmul weights in the head's
        dtype (TILE), norm weights bfloat16 ROW_MAJOR (models/common/rmsnorm.py). The gathered tables (the draft-id
        embedding, taken from the target's, and the rotary rows, as long as this run's max_seq_len) are built each
        time, bfloat16 ROW_MAJOR (tt/embedding.py; a ttnn.embedding table must be "BFLOAT16",
        embedding_device_operation.cpp)."""
        import ttnn

        table = name in ("draft_embedding", "rope_cos", "rope_sin")
        return ttnn.as_tensor(w, dtype=ttnn.bfloat16 if table or "norm" in name else self.dtype,
                              layout=ttnn.ROW_MAJOR_LAYOUT if table or "norm" in name else ttnn.TILE_LAYOUT,
                              device=self.mesh, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh),
                              memory_config=ttnn.DRAM_MEMORY_CONFIG,
                              cache_file_name=None if table else self.cache_dir / name)

    # ---- the program ---------------------------------------------------------------------------------------------

    def _norm(self, x, name: str):
        import ttnn

        return ttnn.rms_norm(x, epsilon=self.args.norm_eps, weight=self.weights[name],
                             memory_config=ttnn.DRAM_MEMORY_CONFIG, compute_kernel_config=self.configs.norm)

    def _linear(self, x, name: str):
        import ttnn

        return ttnn.linear(x, self.weights[name], dtype=ttnn.bfloat16, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                           compute_kernel_config=self.configs.matmul)

    def _cols(self, x, start: int, end: int):
        import ttnn

        return ttnn.slice(x, [0, 0, 0, start], [1, 1, TILE_ROWS, end], memory_config=ttnn.DRAM_MEMORY_CONFIG)

    def _heads(self, x, n_heads: int, sharded: bool):
        """[1, 1, 32, n * D] -> [1, 32, n, D] (the decode layout of TT's attention: batch rows, then heads; a tiled
        reshape, reshape.cpp). For the cache update, height sharded one row per core, shard [32, D] on 32 cores, as
        TT-Transformers' CREATE_QKV_DECODE_SHARD on Blackhole (tt/model_config.py): paged_update_cache wants "input_tensor
        to be sharded", not width sharded, one core per user (paged_update_cache_device_operation.cpp)."""
        import ttnn

        x = ttnn.reshape(x, [1, TILE_ROWS, n_heads, self.args.head_dim])
        if not sharded:
            return x
        width = math.ceil(self.args.head_dim / 32) * 32  # "shard width equal to" the tile-padded head_dim
        config = ttnn.create_sharded_memory_config((TILE_ROWS, width), ttnn.CoreGrid(y=4, x=8),
                                                   ttnn.ShardStrategy.HEIGHT, use_height_and_width_as_shard_shape=True)
        return ttnn.to_memory_config(x, config)

    def _project(self, taps):
        """The taps [1, 1, 32, len(taps) * dim] -> the first state (fc, after the config's norms)."""
        import ttnn

        c = self.config
        if c.norm_before_fc:
            taps = self._norm(taps, "input_norm.weight")
        if c.fc_norm:
            dim = c.target_hidden
            taps = ttnn.concat([self._norm(self._cols(taps, i * dim, (i + 1) * dim), f"fc_norm.{i}.weight")
                                for i in range(len(c.taps))], dim=3, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        return self._linear(taps, "fc.weight")

    def _layer(self, embeds, state, positions, rope_rows, passes: list):
        """The head's decoder layer over the tile (Eagle3Layer.forward, torch_backend/draft_head.py): returns the
        state fed forward and the draft-vocabulary logits [1, 1, 32, V']."""
        import ttnn

        a, c, dram = self.args, self.config, ttnn.DRAM_MEMORY_CONFIG
        H, Hk, D = a.n_heads, a.n_kv_heads, a.head_dim
        normed = self._norm(state, "layer.hidden_norm.weight")
        residual = normed if c.norm_before_residual else state
        x = ttnn.concat([self._norm(embeds, "layer.input_layernorm.weight"), normed], dim=3, memory_config=dram)
        qkv = self._linear(x, "layer.attention.wqkv.weight")  # q, k, v, then rotate_half(q), rotate_half(k)
        width = (H + Hk) * D
        cos, sin = (ttnn.repeat(ttnn.reshape(ttnn.embedding(rope_rows, self.weights[name], layout=ttnn.TILE_LAYOUT,
                                                            memory_config=dram), [1, 1, TILE_ROWS, D]),
                                [1, 1, 1, H + Hk], memory_config=dram)  # each row's cos/sin across the q and k heads
                    for name in ("rope_cos", "rope_sin"))
        qk = ttnn.add(ttnn.mul(self._cols(qkv, 0, width), cos, memory_config=dram),
                      ttnn.mul(self._cols(qkv, width + Hk * D, 2 * width + Hk * D), sin, memory_config=dram),
                      memory_config=dram)
        q = self._heads(self._cols(qk, 0, H * D), H, sharded=False)
        k = self._heads(self._cols(qk, H * D, width), Hk, sharded=True)
        v = self._heads(self._cols(qkv, width, width + Hk * D), Hk, sharded=True)
        keys, values = self.kv_cache
        page_table = self.inputs.page_table
        for pass_positions in passes:  # ordered: no two rows of one op share a cache block (attention.py)
            ttnn.experimental.paged_update_cache(keys, k, update_idxs_tensor=pass_positions, page_table=page_table)
            ttnn.experimental.paged_update_cache(values, v, update_idxs_tensor=pass_positions, page_table=page_table)
        attn = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, keys, values, page_table_tensor=page_table, cur_pos_tensor=positions, scale=D ** -0.5,
            sliding_window_size=a.sliding_window, program_config=self.configs.sdpa_program,
            compute_kernel_config=self.configs.sdpa, memory_config=dram)
        attn = ttnn.reshape(ttnn.slice(attn, [0, 0, 0, 0], [1, TILE_ROWS, H, D], memory_config=dram),
                            [1, 1, TILE_ROWS, H * D])
        h = ttnn.add(residual, self._linear(attn, "layer.attention.wo.weight"), memory_config=dram)
        gate_up = self._linear(self._norm(h, "layer.ffn_norm.weight"), "layer.feed_forward.w_gate_up.weight")
        hidden = a.hidden_dim
        mlp = ttnn.mul(ttnn.silu(self._cols(gate_up, 0, hidden), memory_config=dram),
                       self._cols(gate_up, hidden, 2 * hidden), memory_config=dram)
        h = ttnn.add(h, self._linear(mlp, "layer.feed_forward.w_down.weight"), memory_config=dram)
        normed_out = self._norm(h, "norm.weight")
        return (normed_out if c.norm_output else h), self._linear(normed_out, "lm_head.weight")

    def _choose(self, logits):
        """Each row's argmax over the draft vocabulary ([1, 1, 32, 1] uint32, from the untilized logits as the
        target's) and its softmax probability."""
        import ttnn

        dram = ttnn.DRAM_MEMORY_CONFIG
        ids = ttnn.argmax(ttnn.untilize(logits, use_multicore=True, memory_config=dram), dim=-1, keepdim=True,
                          memory_config=dram)
        probs = ttnn.max(ttnn.softmax(logits, dim=-1, memory_config=dram, compute_kernel_config=self.configs.norm),
                         dim=-1, keepdim=True, memory_config=dram)
        return ids, probs

    def _forward(self, key: HeadKey):
        """The traced program for (passes, k): the feed over the tile, then k - 1 chain steps."""
        import ttnn

        passes, k = key
        i = self.inputs
        state, logits = self._layer(i.embeds, self._project(self.target.tap_tile(self.taps)), i.positions,
                                    i.rope_rows, i.pass_positions[:passes])
        ids, probs = self._choose(logits)
        out = HeadTrace(None, [ids], [probs], [logits])
        for j in range(k - 1):
            tokens = ttnn.reshape(ids, [1, 1, 1, TILE_ROWS])  # as TT's decode tokens (tt/model.py)
            embeds = ttnn.reshape(ttnn.embedding(tokens, self.weights["draft_embedding"], layout=ttnn.TILE_LAYOUT,
                                                 memory_config=ttnn.DRAM_MEMORY_CONFIG), [1, 1, TILE_ROWS, self.args.dim])
            state, logits = self._layer(embeds, state, i.chain_positions[j], i.chain_rope_rows[j],
                                        [i.chain_positions[j]])
            ids, probs = self._choose(logits)
            out.ids.append(ids)
            out.probs.append(probs)
            out.logits.append(logits)
        # the chain's outputs side by side, so a replay ends in two reads, not 2 x k (issue 31, finding 3)
        dram = ttnn.DRAM_MEMORY_CONFIG
        out.chain_ids = ttnn.concat(out.ids, dim=3, memory_config=dram) if k > 1 else ids
        out.chain_probs = ttnn.concat(out.probs, dim=3, memory_config=dram) if k > 1 else probs
        return out

    # ---- traces (made with the mesh's other models: generator.prepare_mesh) --------------------------------------

    def warm_up(self) -> float:
        """Plan the head's traces (trace_plan.head_trace_keys), made with every other model's on the mesh by the
        target's prepare_traces (or the first replay that needs them); seconds spent. The target must have planned
        steps with the head's taps (they write its input)."""
        if not any(taps == self.taps for *_, taps in self.target.planned):
            raise ValueError(f"the target's steps do not write taps {list(self.taps)}: warm it up with them first")
        start = time.perf_counter()
        self.planned |= set(head_trace_keys(self.chain_len))
        self.target.check_trace_region()
        return time.perf_counter() - start

    def _trace_bytes(self, key: HeadKey) -> int:
        args = self.target.tt.args
        return head_trace_bytes(args.model_name, args.device_name, self.target.tt.full_layers, key)

    def compile(self, key: HeadKey) -> None:
        """Run the program once outside a trace with every position -1 (nothing written), so its kernels are built."""
        import ttnn

        self._write_inputs(key, [], [])
        self._deallocate(self._forward(key))

    @staticmethod
    def _deallocate(out: HeadTrace) -> None:
        import ttnn

        for tensor in device_tensors([out.ids, out.probs, out.logits, out.chain_ids if len(out.ids) > 1 else None,
                                      out.chain_probs if len(out.ids) > 1 else None]):
            ttnn.deallocate(tensor)

    def capture(self, key: HeadKey) -> None:
        trace_id, out = captured(self.mesh, lambda: self._forward(key))
        out.trace_id = trace_id
        self.traces[key] = out

    def release_traces(self) -> None:
        traces, self.traces = self.traces, {}
        release_all(self.mesh, [t.trace_id for t in traces.values()])

    def __del__(self):  # as TtnnCausalLM: a dropped head's traces leave the trace region
        with contextlib.suppress(Exception):
            self.release_traces()

    def release(self) -> None:
        self.release_traces()
        self.planned.clear()
        self.compiled.clear()
        MESH_MODELS[id(self.mesh)].discard(self)

    # ---- inputs --------------------------------------------------------------------------------------------------

    def _write_inputs(self, key: HeadKey, feeds: list[tuple[int, list[int], int, list[int]]],
                      chains: list[tuple[int, int]]) -> None:
        """feeds: (user, tile rows, first position, next tokens) of every row fed; chains: (user, tile row of its last
        fed row) of every drafting user. The first call allocates every input (the widest feed's pass tensors and the
        longest chain's); later calls copy in the ones the key's trace reads."""
        import ttnn

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

        def rope_rows(t):  # rotary rows: positions clamped at 0, as TT's rot_mat_idxs
            return ttnn.from_torch(t.clamp(min=0).view(1, 1, 1, -1), dtype=ttnn.uint32, mesh_mapper=replicated)

        embeds = ttnn.from_torch(self.embedding[tokens].view(1, 1, TILE_ROWS, -1), dtype=ttnn.bfloat16,
                                 layout=ttnn.TILE_LAYOUT, mesh_mapper=replicated)
        n_passes, k = key
        if self.inputs is None:
            host = [embeds, ints(positions), rope_rows(positions), ints(page_table), [ints(p) for p in passes],
                    [ints(c) for c in chain], [rope_rows(c) for c in chain]]
            self.inputs = HeadInputs(*(
                [ttnn.to_device(t, self.mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG) for t in part]
                if isinstance(part, list) else ttnn.to_device(part, self.mesh, memory_config=ttnn.DRAM_MEMORY_CONFIG)
                for part in host))
            return
        i = self.inputs
        pairs = [(embeds, i.embeds), (ints(positions), i.positions), (rope_rows(positions), i.rope_rows),
                 (ints(page_table), i.page_table), *((ints(p), d) for p, d in zip(passes[:n_passes], i.pass_positions)),
                 *((ints(c), d) for c, d in zip(chain[: k - 1], i.chain_positions)),
                 *((rope_rows(c), d) for c, d in zip(chain[: k - 1], i.chain_rope_rows))]
        for src, dst in pairs:
            ttnn.copy_host_to_device_tensor(src, dst)

    # ---- drafting ------------------------------------------------------------------------------------------------

    def draft(self, feeds: Sequence[HeadFeed], chain_users: Sequence[int], k: int) -> dict[int, tuple[list, list]]:
        """Feed every row in `feeds` (a verified step's rows in the tap tile, or a prompt's states), then draft k
        tokens (1 or chain_len) for each user in chain_users from its last fed row. Returns {user: (target ids,
        the head's probability of each)}."""
        import ttnn

        if k not in (1, self.chain_len):
            raise ValueError(f"a device head drafts 1 or {self.chain_len} tokens per replay, not {k}")
        tile = [f for f in feeds if f.tile_rows is not None]
        prompt = [f for f in feeds if f.tile_rows is None]
        if tile and prompt:
            raise ValueError("a prompt's rows and a verified step's come in separate proposals (every user starts "
                             "with the same first step)")
        replays = [([(f.user, list(f.tile_rows), f.start_pos, list(f.next_tokens)) for f in tile], None)] if tile \
            else self._prompt_replays(prompt)
        missing = set(chain_users) - {row[0] for row in replays[-1][0]}
        if missing:
            raise ValueError(f"users {sorted(missing)} have no rows to feed: the head drafts from a user's last fed row")
        for n, (replay, states) in enumerate(replays):
            final = n == len(replays) - 1
            chains = [(user, rows[-1]) for user, rows, *_ in replay if final and user in chain_users]
            key = (passes_for(max(len(rows) for _, rows, *_ in replay), self.ladder), k if final else 1)
            if key not in (self.traces if self.trace else self.compiled):
                self.planned.add(key)
                self.target.check_trace_region()
                prepare_mesh(self.mesh)
            if states is not None:  # a prompt's states: the tap tile is the feed's input
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

    def _prompt_replays(self, feeds: Sequence[HeadFeed]) -> list[tuple[list, torch.Tensor]]:
        """The prompts' rows in replays of up to prompt_rows rows per user (each user its own run of tile rows), counted
        back from each prompt's end so that every user's last rows share the final replay: (rows fed, the tap tile's
        contents) per replay."""
        share = max(1, min(self.prompt_rows, TILE_ROWS // len(feeds)))
        n_replays = max(math.ceil(len(f.next_tokens) / share) for f in feeds)
        replays = []
        for n in range(n_replays):
            replay, states = [], torch.zeros(TILE_ROWS, feeds[0].states.shape[1])
            for slot, f in enumerate(feeds):
                end = len(f.next_tokens) - (n_replays - 1 - n) * share
                begin = max(0, end - share)
                if end <= 0:
                    continue
                rows = list(range(slot * share, slot * share + end - begin))
                states[rows] = f.states[begin:end].float()
                replay.append((f.user, rows, f.start_pos + begin, list(f.next_tokens[begin:end])))
            replays.append((replay, states))
        return replays

    def _read(self, trace: HeadTrace, rows: list[int]) -> list[tuple[list[int], list[float]]]:
        """The drafted ids (mapped to the target's) and probabilities of the given rows: one read of each."""
        import ttnn

        def read(t):
            return ttnn.to_torch(ttnn.get_device_tensors(t)[0]).reshape(TILE_ROWS, -1)[:, : len(trace.ids)]

        ids, probs = read(trace.chain_ids).long()[rows], read(trace.chain_probs).float()[rows]
        return [(self.vocab[i].tolist(), p.tolist()) for i, p in zip(ids, probs)]

    def read_logits(self, step: int) -> torch.Tensor:
        """Chain step `step`'s draft-vocabulary logits [32, V'] of the last replay (rows: last_rows; for checks: the
        loop reads ids and probabilities only)."""
        import ttnn

        logits = (self.traces[self.last_key] if self.trace else self.last_eager).logits[step]
        return ttnn.to_torch(ttnn.get_device_tensors(logits)[0]).reshape(TILE_ROWS, -1).float()


def head_id(config: HeadConfig, weights: dict) -> str:
    """A cache folder name for one head's converted weights: its shapes and a hash of its tensors' bytes."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].contiguous()
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.view(-1)[:: max(1, t.numel() // 4096)].float().numpy().tobytes())  # a sample of each tensor
    return f"eagle3-{config.layer.dim}-{config.draft_vocab_size}-{digest.hexdigest()[:12]}"

