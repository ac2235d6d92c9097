# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE for the TT-Transformers modules the ttnn backend imports (models.tt_transformers.tt.*), built on the
REAL ttnn 0.81.1 wheel running on tt-metal's Mock Device (`make tt-mock`). TT-Transformers is not in the wheel; this
double computes nothing (no weights, and the mock device reads every tensor back as zeros). What it does is hand the
backend real ttnn device tensors of the shapes, dtypes, layouts and memory configs TT-Transformers hands over, and
call the backend's hooks (the attention class, the layer objects the taps wrap, the cache update) the way
TT-Transformers calls them, so that every ttnn call the backend makes goes through ttnn's own validation, program
factories and allocators. Numerics and traces stay with the torch stand-in (tests/tt_stand_in); what TT-Transformers
does beyond this stays with the source reviews.

Mirrored from tt-metal's sources (the pinned v0.81.1 is not in the searchable index; the versions read are named):
- tt/model_config.py ModelArgs (17a8a99d): HF_MODEL required, device name from the device count, the decode residual
  memory config (WIDTH-sharded, shard (32, dim / cores / devices) over find_grid's grid closest to 32 cores),
  get_state_dict_prefix's module map, weight_cache_path, use_qk_fused True for text models. Neither
  padded_vocab_size nor full_model_n_layers is set (not found in the base class): the backend derives them
  (tt_surface.py).
- tt/model.py Transformer (the 2026 version "C"): prepare_decode_inputs_host (uint32 tokens [1, 1, 1, 32],
  int32 positions and page table, replicated), ttnn_decode_forward with on_device_logits (each device's TILE share
  of the logits, positions advanced with ttnn.plus_one) or the gathered, untilized (logits, None), the residual
  moved to its memory config before every layer, each layer called as a LightweightModule. TransformerAB: the older
  ttnn_decode_forward (versions "A"/"B", and tt/generator.py at 87700c07 still calls it) with sampling_on_device and
  capture_sampling_trace, whose split-sampling branch returns each device's share.
- tt/decoder.py TransformerBlock.forward: asserts its input's memory config (decode: the residual's; prefill: DRAM).
- tt/attention.py Attention (00b769dd, whose calls match 5cd1b56c's): forward_decode: nlp_create_qkv_heads_decode
  into L1 height-sharded heads, ttnn.experimental.paged_update_cache(keys, k, update_idxs_tensor=current_pos,
  page_table=page_table), looked up at call time (the backend's ordered writes replace it there), then paged SDPA
  decode over the paged cache with each row's position (cur_pos_tensor: a verify step's rows at consecutive
  positions, idle rows at -1; TT's SDPA_DECODE_PROGCFG and its HiFi2 SDPA compute config), to_memory_config onto a
  user per core and nlp_concat_heads_decode; forward_prefill: nlp_create_qkv_heads, K and V typecast to the cache's
  bfloat8_b, paged_fill_cache through the chunk's page table (or the prompt's, sliced to the rows it pages), then
  chunked_scaled_dot_product_attention over the cache at chunk_start_idx (q in bfloat8_b) or causal
  scaled_dot_product_attention, with TT's SDPA_PROGCFG(seq_len). No weights: q, k and v come from a zero qkv of the
  right shape. use_qk_fused read into an attribute.
- tt/ccl.py TT_CCL and tt_all_gather (013eaee3): double-buffered global semaphores per axis slot, all_gather_async
  over the whole mesh (cluster_axis None), the input to DRAM first and deallocated after.
- tt/common.py copy_host_to_device, PagedAttentionConfig, get_padded_prefill_len (622c6fb9).
- tt/generator.py Generator.prefill_forward_text: the prompt padded, the user's page table cut to the padded prompt's
  blocks and padded with -1 (_get_prefill_user_page_table at 622c6fb9), prefill_forward_single_user_text: chunks of
  get_max_prefill_chunk_size rows past max_prefill_chunk_size (tt/model_config.py's table: 4k on N150 for Llama-3.1-8B), the page table padded with zeros
  and each chunk's slice of it paging the fill, as the stand-in's mirror; the layers run on x [1, 1, S, dim /
  devices] in DRAM (the taps' prefill reads), the last token's logits to the host.
- tt/generator.py create_submeshes (622c6fb9): a Galaxy's 1 x 8 submeshes, on which the backend builds its model
  there (device.model_mesh); no model is built over all 32 devices (device.check_tensor_parallel refuses it first).
One KV-cache pair is shared by every layer (the shapes and configs are what is checked; 32 layers of an 8B cache at
8,192 positions would not fit the mock device's DRAM). Every layer runs its decode attention (the backend counts each
layer's ordered cache writes when it compiles a step); in prefill only the first and last layers run attention
(every layer's calls are the same: 30 more copies of them would only slow the run).
"""
import json
import math
import os
from functools import partial
from enum import Enum
from pathlib import Path

import torch
import ttnn

# the stand-in's mirrors of TT-Transformers' ttnn-free pieces (tests/tt_stand_in/tt_transformers.py), shared
from tests.tt_stand_in import tt_transformers as stand_in
from tests.tt_stand_in.tt_transformers import (  # noqa: F401: the names TT-Transformers' modules export
    MAX_PREFILL_CHUNK_SIZES_DIV1024,
    DecodersPrecision,
    LightweightModule,
    Mode,
    PagedAttentionConfig,
    determine_device_name,
    find_grid,
    get_base_model_name,
    get_block_size,
    get_max_prefill_chunk_size,
    get_padded_prefill_len,
    prefill_user_page_table,
    num_blocks_in_seq,
)


copy_host_to_device = partial(stand_in.copy_host_to_device, ttnn=ttnn)  # tt/common.py, on the real ttnn
create_submeshes = partial(stand_in.create_submeshes, ttnn=ttnn)  # tt/generator.py, on the real ttnn


class ModelArgs:
    """tt/model_config.py ModelArgs (17a8a99d): the settings the backend and this double read."""

    def __init__(self, mesh_device, instruct=False, dummy_weights=False, max_batch_size=1, max_seq_len=1024 * 128,
                 optimizations=None, cache_hf=False):
        hf_model = os.getenv("HF_MODEL")
        assert hf_model, "Please set HF_MODEL to a HuggingFace name e.g. meta-llama/Llama-3.1-8B-Instruct"
        config = json.loads((Path(hf_model) / "config.json").read_text())
        self.mesh_device, self.instruct = mesh_device, instruct
        self.num_devices = mesh_device.get_num_devices()
        self.device_name = determine_device_name(mesh_device)
        self.cluster_shape = list(mesh_device.shape)
        self.is_galaxy = self.num_devices == 32
        assert max_batch_size in {1, 2, 4, 8, 16, 32}, f"Batch size {max_batch_size} not supported"
        self.max_batch_size, self.max_seq_len, self.tile_size = max_batch_size, max_seq_len, 32
        self.tile_padded_batch_rows = 32 * math.ceil(max_batch_size / 32)
        self.model_name = hf_model.strip("/").split("/")[-1]
        cache = os.getenv("TT_CACHE_PATH")
        self.model_cache_path = Path(cache, self.device_name) if cache else Path("model_cache", hf_model,
                                                                                   self.device_name)
        self.dim, self.n_layers = config["hidden_size"], config["num_hidden_layers"]
        self.n_heads, self.n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or self.dim // self.n_heads
        self.vocab_size = config["vocab_size"]
        self.use_qk_fused = True  # `not self.is_multimodal`
        self.optimizations = optimizations(self) if callable(optimizations) else optimizations
        div1024 = MAX_PREFILL_CHUNK_SIZES_DIV1024.get(get_base_model_name(self.model_name), {}).get(self.device_name, 4)
        self.max_prefill_chunk_size = div1024 * 1024  # get_max_prefill_chunk_size (div 1024)

    def dram_shard_core_grid_for_k(self, k: int):
        rows, cols = find_grid(k // self.tile_size)
        return ttnn.CoreGrid(x=cols, y=rows)

    def get_residual_mem_config(self, mode, prefetcher=None):
        """The decode residual: WIDTH-sharded in L1 over dram_shard_core_grid_for_k(dim / devices); prefill: DRAM."""
        if mode != Mode.DECODE:
            return ttnn.DRAM_MEMORY_CONFIG
        grid = self.dram_shard_core_grid_for_k(self.dim // self.num_devices)
        return ttnn.create_sharded_memory_config(
            (self.tile_padded_batch_rows, self.dim // grid.num_cores // self.num_devices), grid,
            ttnn.ShardStrategy.WIDTH, ttnn.ShardOrientation.ROW_MAJOR, use_height_and_width_as_shard_shape=True)

    def get_state_dict_prefix(self, module_name, layer_num, is_vision=False):
        module_map = {"MLP": "feed_forward", "Attention": "attention", "TransformerBlock": "", "": ""}
        return (f"layers.{layer_num}." if layer_num is not None else "") + module_map[module_name]

    def weight_cache_path(self, dtype):
        kind = {ttnn.bfloat16: "bf16", ttnn.bfloat8_b: "bfp8"}[dtype]
        return self.model_cache_path / (f"tensor_cache_instruct_{kind}" if self.instruct else f"tensor_cache_{kind}")

    def load_state_dict(self):
        return {}  # no weights: nothing here computes


class TT_CCL(stand_in.TT_CCL):
    """tt/ccl.py TT_CCL (013eaee3), its semaphores handed out in turn as the stand-in's mirror does, made on the real
    ttnn over the device's whole compute grid."""

    def __init__(self, mesh_device):
        self.mesh_device = mesh_device
        grid = mesh_device.compute_with_storage_grid_size()
        cores = ttnn.CoreRangeSet({ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(grid.x - 1, grid.y - 1))})
        self.barrier_idx, self.ag_idx = [0, 0, 0], [0, 0, 0]
        self.barrier = [[ttnn.create_global_semaphore(mesh_device, cores, 0) for _ in range(2)] for _ in range(3)]
        self.ag = [[[ttnn.create_global_semaphore(mesh_device, cores, 0) for _ in range(2)] for _ in range(2)]
                   for _ in range(3)]

    def get_num_links(self, cluster_axis=None):
        """ccl.py get_num_links: links per (axis 0, axis 1), N150 (0, 0), N300 and T3K (1, 1); the smaller of the
        two without an axis."""
        links = {"N150": (0, 0), "N300": (1, 1), "T3K": (1, 1)}[determine_device_name(self.mesh_device)]
        return links[cluster_axis] if cluster_axis in (0, 1) else min(links)


def tt_all_gather(input_tensor, mesh_device, tt_ccl, cluster_axis, dim, num_links=None, memory_config=None,
                  sharded=False, topology=ttnn.Topology.Linear, dtype=ttnn.bfloat16):
    """tt/ccl.py tt_all_gather (013eaee3)."""
    if list(mesh_device.shape) == [1, 1] or (cluster_axis == 1 and 1 in list(mesh_device.shape)):
        return input_tensor
    if num_links is None:
        num_links = tt_ccl.get_num_links(cluster_axis)
    if not sharded:
        input_tensor = ttnn.to_memory_config(input_tensor, ttnn.DRAM_MEMORY_CONFIG)
    if input_tensor.dtype != dtype:
        input_tensor = ttnn.to_memory_config(input_tensor, ttnn.L1_MEMORY_CONFIG, dtype)
    axis = {} if cluster_axis is None else {"cluster_axis": cluster_axis}
    gathered = ttnn.experimental.all_gather_async(
        input_tensor, persistent_output_buffer=None, dim=dim,
        multi_device_global_semaphore=tt_ccl.get_and_cycle_ag_semaphore_handles(cluster_axis), num_links=num_links,
        memory_config=memory_config, topology=topology,
        barrier_semaphore=tt_ccl.get_and_cycle_barrier_semaphore_handle(cluster_axis), chunks_per_sync=10,
        num_workers_per_link=2, num_buffers_per_channel=2, **axis)
    input_tensor.deallocate(True)
    return gathered


SHARED_CACHES: dict = {}  # (mesh, shape) -> [keys, values]: one pair for every layer (module docstring)


def replicated(mesh_device, t: torch.Tensor, dtype, layout=ttnn.TILE_LAYOUT, memory_config=ttnn.DRAM_MEMORY_CONFIG):
    return ttnn.from_torch(t, dtype=dtype, layout=layout, device=mesh_device, memory_config=memory_config,
                           mesh_mapper=ttnn.ReplicateTensorToMesh(mesh_device))


def num_to_corerange(x: int):
    """tt/model_config.py num_to_corerange: x cores from (0, 0), rows of 8."""
    assert x < 8 or x % 8 == 0
    num_x = min(x, 8)
    return ttnn.CoreRange(ttnn.CoreCoord(0, 0), ttnn.CoreCoord(num_x - 1, x // num_x - 1))


def sdpa_prefill_config(seq_len: int):
    """tt/model_config.py SDPA_PROGCFG(seqlen): "Chunk values based on what works best empirically"."""
    return ttnn.SDPAProgramConfig(compute_with_storage_grid_size=(8, 8), exp_approx_mode=False,
                                  q_chunk_size=256 if seq_len >= 2048 else 64,
                                  k_chunk_size=256 if seq_len >= 2048 else 64)


class Attention(LightweightModule):
    """tt/attention.py Attention: its attention ops over zero q, k and v (no weights, module docstring)."""

    def __init__(self, mesh_device, tt_ccl, args, state_dict, weight_cache_path, layer_num, dtype,
                 transformation_mats, configuration, paged_attention_config=None, use_paged_kv_cache=False,
                 prefetcher=None):
        configuration.get_state_dict_prefix(self.__class__.__name__, layer_num)  # KeyError for an unknown class name
        self.mesh_device, self.args, self.use_qk_fused = mesh_device, args, configuration.use_qk_fused
        # tt/attention.py Attention.__init__ off a TG: every device holds n_kv_heads / devices heads of every user
        self.num_devices = args.num_devices
        self.batch_size_per_device_group = args.max_batch_size
        self.n_local_heads = args.n_heads // self.num_devices
        self.n_local_kv_heads = args.n_kv_heads // self.num_devices
        self.scale = args.head_dim ** -0.5
        shape = (paged_attention_config.max_num_blocks, self.n_local_kv_heads, paged_attention_config.block_size,
                 args.head_dim)
        key = (id(mesh_device), shape)
        if key not in SHARED_CACHES:
            SHARED_CACHES[key] = [replicated(mesh_device, torch.zeros(shape), ttnn.bfloat8_b) for _ in range(2)]
        self.layer_past = SHARED_CACHES[key]
        # tt/model_config.py SDPA_DECODE_PROGCFG (Wormhole) and the decoders' SDPA decode compute config (HiFi2)
        self.sdpa_decode_program = ttnn.SDPAProgramConfig(compute_with_storage_grid_size=(8, 8), exp_approx_mode=False,
                                                          q_chunk_size=256, k_chunk_size=256)
        self.sdpa_compute = ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi2,
                                                             math_approx_mode=False, fp32_dest_acc_en=False,
                                                             packer_l1_acc=False)

    def _qkv(self, rows: int, memory_config):
        heads = (self.n_local_heads + 2 * self.n_local_kv_heads) * self.args.head_dim
        return replicated(self.mesh_device, torch.zeros(1, 1, rows, heads), ttnn.bfloat16, memory_config=memory_config)

    def forward_decode(self, x, current_pos, rot_mats=None, page_table=None, kv_cache=None):
        # the fused qkv reshaped to (1, 1, batch_size_per_device_group, qkv) padded to 32 rows (tt/attention.py
        # forward_decode): the tile on one device or a 1 x N mesh
        q, k, v = ttnn.experimental.nlp_create_qkv_heads_decode(
            self._qkv(self.batch_size_per_device_group, ttnn.L1_MEMORY_CONFIG), num_heads=self.n_local_heads,
            num_kv_heads=self.n_local_kv_heads, memory_config=ttnn.L1_HEIGHT_SHARDED_MEMORY_CONFIG)
        keys, values = kv_cache if kv_cache else self.layer_past
        if self.use_qk_fused:
            ttnn.experimental.paged_fused_update_cache(keys, k, values, v, update_idxs_tensor=current_pos,
                                                       page_table=page_table)
        else:
            ttnn.experimental.paged_update_cache(keys, k, update_idxs_tensor=current_pos, page_table=page_table)
            ttnn.experimental.paged_update_cache(values, v, update_idxs_tensor=current_pos, page_table=page_table)
        attn = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, keys, values, cur_pos_tensor=current_pos, page_table_tensor=page_table, scale=self.scale,
            program_config=self.sdpa_decode_program, compute_kernel_config=self.sdpa_compute,
            memory_config=ttnn.DRAM_MEMORY_CONFIG)
        # tt/model_config.py SCORES_BATCHED_MM_OUTPUT_MEMCFG(batch_size_per_device_group): a user's heads (padded to
        # a tile) per core, height-sharded over num_to_corerange(users)
        users = ttnn.create_sharded_memory_config(
            (math.ceil(self.n_local_heads / 32) * 32, self.args.head_dim),
            ttnn.CoreRangeSet({num_to_corerange(self.batch_size_per_device_group)}), ttnn.ShardStrategy.HEIGHT,
            ttnn.ShardOrientation.ROW_MAJOR, use_height_and_width_as_shard_shape=True)
        ttnn.experimental.nlp_concat_heads_decode(ttnn.to_memory_config(attn, users), num_heads=self.n_local_heads)
        return x

    def forward_prefill(self, x, rot_mats, user_id=0, page_table=None, chunk_page_table=None, chunk_start_idx=None,
                        kv_cache=None):
        seq_len = x.shape[-2]
        assert seq_len % 128 == 0 and seq_len > 0, "Seqlen must be divisible by 128"
        q, k, v = ttnn.experimental.nlp_create_qkv_heads(
            self._qkv(seq_len, ttnn.DRAM_MEMORY_CONFIG), num_heads=self.n_local_heads,
            num_kv_heads=self.n_local_kv_heads, transpose_k_heads=False, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        keys, values = kv_cache if kv_cache else self.layer_past
        k, v = (ttnn.typecast(t, dtype=ttnn.bfloat8_b) for t in (k, v))  # "paged_fill_cache ... requires matching"
        fill_page_table = chunk_page_table if chunk_page_table is not None else page_table
        page_len = fill_page_table.shape[1] * keys.shape[2]
        for cache, t in ((keys, k), (values, v)):
            fill = t[:, :, :page_len, :] if page_len < t.shape[2] else t
            ttnn.experimental.paged_fill_cache(cache, fill, fill_page_table, batch_idx=user_id)
        if chunk_start_idx is not None:
            ttnn.transformer.chunked_scaled_dot_product_attention(
                ttnn.typecast(q, dtype=ttnn.bfloat8_b), keys, values, page_table, chunk_start_idx,
                compute_kernel_config=self.sdpa_compute, program_config=sdpa_prefill_config(seq_len))
        else:
            ttnn.transformer.scaled_dot_product_attention(
                ttnn.typecast(q, dtype=ttnn.bfloat8_b), k, v, is_causal=True, scale=self.scale,
                compute_kernel_config=self.sdpa_compute, program_config=sdpa_prefill_config(seq_len))
        return x


class TransformerBlock(LightweightModule):
    """tt/decoder.py TransformerBlock: checks its input's memory config, runs the attention (decode)."""

    def __init__(self, args, mesh_device, tt_ccl, dtype, state_dict, weight_cache_path, layer_num,
                 transformation_mats, paged_attention_config=None, use_paged_kv_cache=False, attention_class=None,
                 prefetcher=None):
        self.args, self.updates_cache = args, layer_num in (0, args.n_layers - 1)
        self.attention = (attention_class or Attention)(mesh_device, tt_ccl, args, state_dict, weight_cache_path,
                                                        layer_num, dtype, transformation_mats, args,
                                                        paged_attention_config, use_paged_kv_cache)

    def forward(self, x, current_pos, rot_mats_global=None, rot_mats_local=None, user_id=0, mode=Mode.DECODE,
                page_table=None, chunk_page_table=None, chunk_start_idx=None, kv_cache=None, batch_size=1):
        skip_mem_cfg = self.args.get_residual_mem_config(mode, None)
        assert x.memory_config() == skip_mem_cfg, f"decoder input memcfg mismatch: {x.memory_config()} != {skip_mem_cfg}"
        if mode == Mode.DECODE:  # every layer, as TT's: the backend checks that each layer's cache writes are ordered
            return self.attention.forward_decode(x, current_pos, rot_mats_global, page_table=page_table,
                                                 kv_cache=kv_cache)
        if not self.updates_cache:  # prefill: the first and last layers' attention (the same calls in every layer)
            return x
        return self.attention.forward_prefill(x, rot_mats_global, user_id, page_table=page_table,
                                              chunk_page_table=chunk_page_table, chunk_start_idx=chunk_start_idx,
                                              kv_cache=kv_cache)


class Transformer(LightweightModule):
    """tt/model.py Transformer (2026, "C")."""

    def __init__(self, args, dtype, mesh_device, state_dict, weight_cache_path, paged_attention_config=None,
                 use_paged_kv_cache=False, attention_class=None, rope_setup_class=None, prefetcher=None):
        self.args, self.mesh_device, self.vocab_size, self.n_layers = args, mesh_device, args.vocab_size, args.n_layers
        self.tt_ccl = TT_CCL(mesh_device)
        self.layers = [TransformerBlock(args, mesh_device, self.tt_ccl, dtype, state_dict, weight_cache_path, i, {},
                                        paged_attention_config, use_paged_kv_cache, attention_class)
                       for i in range(self.n_layers)]
        splits = args.num_devices if list(mesh_device.shape) != [1, 1] else 2
        self.sampling = object() if args.vocab_size // splits <= 64 * 1024 else None  # SamplingGenerator or None
        unit = 32 * args.num_devices  # tt/lm_head.py: the vocabulary split evenly, whole tiles per device
        self.lm_head_width = math.ceil(args.vocab_size / unit) * unit

    def _mapper(self, dims):
        return ttnn.ShardTensor2dMesh(self.mesh_device, dims=dims, mesh_shape=self.args.cluster_shape)

    def prepare_decode_inputs_host(self, tokens, current_pos, page_table=None):
        B = tokens.shape[0]
        assert current_pos.shape[0] == B, "Batch size mismatch"
        assert B == self.args.max_batch_size, f"Batch size {B} must be equal to max_batch_size"
        tokens = torch.nn.functional.pad(tokens.view(-1), (0, 32 - len(tokens)), "constant", 0)
        tokens = ttnn.unsqueeze_to_4D(ttnn.from_torch(tokens, device=None, dtype=ttnn.uint32,
                                                      mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh_device)))
        rot = torch.maximum(current_pos, torch.tensor(0, dtype=torch.int64))
        rope_idxs = ttnn.from_torch(torch.nn.functional.pad(rot.view(1, -1), (0, 32 - len(rot))), device=None,
                                    dtype=ttnn.uint32, mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh_device))
        # tt/model.py@5cd1b56c: the positions and the page table replicated (split over the columns only on a TG)
        current_pos_tt = ttnn.from_torch(current_pos, device=None, dtype=ttnn.int32,
                                         mesh_mapper=self._mapper((None, None)))
        if page_table is not None:
            page_table = ttnn.from_torch(page_table, device=None, dtype=ttnn.int32,
                                         mesh_mapper=self._mapper((None, None)))
        return tokens, current_pos_tt, rope_idxs, page_table

    def _residual(self, rows: int, mode):
        """x as the embedding leaves it ([1, 1, rows, dim / devices] bfloat16 in DRAM), in the mode's config."""
        x = ttnn.from_torch(torch.zeros(1, 1, rows, self.args.dim), dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                            device=self.mesh_device, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                            mesh_mapper=self._mapper((None, 3)))
        return ttnn.to_memory_config(x, self.args.get_residual_mem_config(mode, None))

    def forward(self, x, current_pos, rot_mats_global=None, rot_mats_local=None, user_id=0, mode=Mode.DECODE,
                page_table=None, chunk_page_table=None, chunk_start_idx=None, get_last_token=-1, kv_cache=None,
                batch_size=1, page_tables_per_layer=None):
        for i, layer in enumerate(self.layers):
            if mode == Mode.DECODE:
                x = ttnn.to_memory_config(x, self.args.get_residual_mem_config(mode, None), None)
            x = layer(x, current_pos, rot_mats_global=rot_mats_global, rot_mats_local=rot_mats_local,
                      user_id=user_id, mode=mode, page_table=page_table, chunk_page_table=chunk_page_table,
                      chunk_start_idx=chunk_start_idx, kv_cache=kv_cache[i] if kv_cache is not None else None,
                      batch_size=batch_size)
        return x

    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            on_device_logits=False, page_tables_per_layer=None):
        """Form C: on_device_logits returns each device's share (positions advanced on the device)."""
        logits = self._decode(current_pos, rot_mat_idxs, page_table, kv_cache)
        if on_device_logits:
            return self._device_shares(logits, current_pos, rot_mat_idxs)
        return self._gathered(logits), None

    def _decode(self, current_pos, rot_mat_idxs, page_table, kv_cache):
        """The layers over the decode tile, then the LM head's output: each device's share of the columns (bfloat8_b,
        TILE)."""
        self.forward(self._residual(32, Mode.DECODE), current_pos, rot_mats_global=rot_mat_idxs, mode=Mode.DECODE,
                     page_table=page_table, kv_cache=kv_cache)
        # tt/lm_head.py LMHead.forward (622c6fb9): the splits' outputs concatenated into L1_MEMORY_CONFIG (observed
        # [1, 1, 32, 128256 / devices] bfloat8_b TILE, L1 interleaved, on the mock N150, N300 and T3K)
        return ttnn.from_torch(torch.zeros(1, 1, 32, self.lm_head_width), dtype=ttnn.bfloat8_b,
                               layout=ttnn.TILE_LAYOUT, device=self.mesh_device,
                               memory_config=ttnn.L1_MEMORY_CONFIG, mesh_mapper=self._mapper((None, 3)))

    def _device_shares(self, logits, current_pos, rot_mat_idxs):
        assert self.sampling is not None
        ttnn.plus_one(current_pos, skip_negative_entries=True)
        ttnn.plus_one(rot_mat_idxs)
        return logits

    def _gathered(self, logits):
        if self.args.num_devices > 1:
            logits = tt_all_gather(logits, self.mesh_device, self.tt_ccl, None, 3)
        return ttnn.untilize(logits, use_multicore=True, memory_config=ttnn.DRAM_MEMORY_CONFIG)


class TransformerAB(Transformer):
    """tt/model.py Transformer, versions "A" (00a9ba8f) and "B" (5cd1b56c): ttnn_decode_forward takes
    sampling_on_device and capture_sampling_trace (tt/generator.py at 87700c07 calls it so), and with both returns
    each device's share as a bare tensor (the split-sampling trace's input); otherwise the gathered logits, (logits,
    None) as B returns them."""

    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            sampling_on_device=False, capture_sampling_trace=False):
        logits = self._decode(current_pos, rot_mat_idxs, page_table, kv_cache)
        if sampling_on_device and capture_sampling_trace:
            return self._device_shares(logits, current_pos, rot_mat_idxs)
        assert not sampling_on_device, "the double samples nothing: TT's own on-device sampling is not modelled"
        return self._gathered(logits), None


class Generator:
    """tt/generator.py Generator: prefill_forward_text pads each prompt, cuts the user's page table to its blocks and
    runs prefill_forward_single_user_text, in chunks past max_prefill_chunk_size (the stand-in's mirror, on the real
    ttnn; no warm-up sweep)."""

    def __init__(self, model, model_args, mesh_device, processor=None, tokenizer=None):
        self.model, self.model_args, self.mesh_device = model, model_args, mesh_device

    def prefill_forward_text(self, tokens, page_table=None, kv_cache=None, prompt_lens=None, empty_slots=None,
                             enable_trace=True, model_id_warmup=None, sampling_params=None, start_pos=None,
                             return_hidden_states=False, warmup_prefill=True, **kwargs):
        block_size = get_block_size(kv_cache[0])
        for idx, n in enumerate(prompt_lens):
            padded_len = get_padded_prefill_len(int(n))
            page_table_user = prefill_user_page_table(page_table[idx : idx + 1], block_size, padded_len)
            self.prefill_forward_single_user_text(padded_len, page_table_user, int(n) - 1, kv_cache[0])
        return torch.zeros(tokens.shape[0], 1, self.model[0].vocab_size)

    def prefill_forward_single_user_text(self, seq_len: int, page_table, last_token_idx: int, kv_cache):
        model = self.model[0]

        def on_device(table):
            return replicated(self.mesh_device, table, ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT)
        if seq_len <= self.model_args[0].max_prefill_chunk_size:
            model.forward(model._residual(seq_len, Mode.PREFILL), None, mode=Mode.PREFILL,
                          page_table=on_device(page_table), kv_cache=kv_cache)
            return
        chunk_size = get_max_prefill_chunk_size(seq_len, self.model_args[0].max_prefill_chunk_size)
        block_size = get_block_size(kv_cache)
        padded = torch.cat([page_table, torch.zeros(1, num_blocks_in_seq(seq_len, block_size) - page_table.shape[1],
                                                    dtype=torch.int32)], dim=-1)
        padded_tt = on_device(padded)
        for chunk_start in range(0, (last_token_idx // chunk_size + 1) * chunk_size, chunk_size):
            chunk_page_table = padded[:, chunk_start // block_size : (chunk_start + chunk_size) // block_size]
            model.forward(model._residual(chunk_size, Mode.PREFILL), None, mode=Mode.PREFILL, page_table=padded_tt,
                          chunk_page_table=on_device(chunk_page_table), chunk_start_idx=chunk_start,
                          kv_cache=kv_cache)
