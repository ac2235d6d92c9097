# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE standing in for the TT-Transformers surface the ttnn backend drives (models.tt_transformers.tt:
ModelArgs, Transformer, TransformerBlock, Attention, DistributedNorm, TT_CCL, PagedAttentionConfig,
copy_host_to_device, Generator). It is not TT-Transformers: it computes the checkpoint's model in torch through the
stand-in ttnn ops (stand-in ttnn.py). What it keeps of the real code, each piece naming the tt-metal file and
function it mirrors, is what the backend depends on and what can fail there: the signatures and keyword arguments,
the module-name map behind get_state_dict_prefix, model_name and the weight-cache folder from HF_MODEL and
TT_CACHE_PATH, the device name from the mesh, the optimizations default, the prefill warm-up's power-of-two rule,
the vocabulary padded per device, CCL ops on meshes of several devices, tokens padded to a 32-row tile, RoPE
positions clamped at 0, the cache update through ttnn.experimental.paged_update_cache with
update_idxs_tensor=current_pos, paged SDPA decode bounded by each row's position, and the decode residual stream:
Transformer.forward calling each layer (a LightweightModule) on x moved to the residual memory config, x split over
the devices along dim and width-sharded in L1, the decoder asserting its input's memory config.

The tt-metal tag the backend pins (v0.81.1, d80d9482) is not in the searchable index: the files were read at the
nearest versions found (model_config.py and generator.py at 87700c07, model.py, attention.py, common.py and ccl.py
at 3c5c3944, decoder.py and distributed_norm.py at 01229001), and ttnn's own checks against the 0.81.1 wheel."""
import json
import math
import os
import re
from enum import Enum
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from models.tt_transformers.torch_backend.checkpoint import load_model, resolve_checkpoint
from models.tt_transformers.torch_backend.model_config import ModelArgs as TorchModelArgs
from models.tt_transformers.torch_backend.rope import apply_rope

from . import ttnn

PADDED_VOCAB_GARBAGE = 1e4  # the padded LM-head columns are not vocabulary: the backend must never pick them


COMPUTE_DTYPES = {ttnn.float32: torch.float32, ttnn.bfloat16: torch.bfloat16, ttnn.bfloat8_b: torch.bfloat16}


@lru_cache(maxsize=2)
def torch_model(folder: str, dtype: torch.dtype):
    """The checkpoint as our torch model (torch ops): where the stand-in takes its weights from. Rotary tables
    reach 2,048 positions: a 128-padded prefill may run past a short max_seq_len."""
    return load_model(resolve_checkpoint(folder), dtype, 2048, cpu_kernels=False)


class PagedAttentionConfig:  # tt/common.py
    def __init__(self, block_size=32, max_num_blocks=1024):
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks


class Mode(Enum):  # tt/common.py
    DECODE = "decode"
    PREFILL = "prefill"


def copy_host_to_device(host_tensors, device_tensors=None, mesh_device=None, shard_specs=None):
    """tt/common.py copy_host_to_device."""
    if device_tensors is None:
        assert mesh_device is not None, "mesh_device is required when device_tensors is None"
        return [ttnn.to_device(t, device=mesh_device) if t else None for t in host_tensors]
    for host, device in zip(host_tensors, device_tensors):
        if host is None:
            assert device is None
            continue
        ttnn.copy_host_to_device_tensor(host, device)
    return device_tensors


def get_padded_prefill_len(seq_len: int) -> int:
    """tt/common.py get_padded_prefill_len: 128, then 1024, then the next power of two."""
    if seq_len <= 128:
        return 128
    if seq_len <= 1024:
        return 1024
    return 2 ** (seq_len - 1).bit_length()


def get_base_model_name(model_name: str) -> str:
    """tt/common.py get_base_model_name: "Llama-3.1-8B-Instruct" -> "Llama-3.1-8B"."""
    match = re.search(r"(.*?\d+[bB])-", model_name)
    return match.group(1) if match else model_name


class LightweightModule:
    """models/common/lightweightmodule.py LightweightModule: calling a module calls its forward."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def find_grid(n_tiles: int) -> tuple[int, int]:
    """tt/model_config.py ModelArgs.find_grid (87700c07): the core count dividing n_tiles closest to 32 that fits 8 x 8
    cores, as (rows, cols)."""
    cores = sorted((k for k in range(1, 65) if n_tiles % k == 0), key=lambda k: abs(k - 32))
    for c in cores:
        for rows in range(1, 9):
            if c % rows == 0 and c // rows <= 8:
                return rows, c // rows
    raise AssertionError(f"Cannot find grid for {n_tiles} tiles")


def calculate_prefill_warmup_seq_lens(max_seq_len_to_warmup: int, trace_supported_seq_lens) -> list[int]:
    """tt/common.py: 128 and 1024 * 2^k up to the cap, plus the traced lengths."""
    lengths, k = [128], 0
    while (v := (1 << k) * 1024) <= max_seq_len_to_warmup:
        lengths.append(v)
        k += 1
    return sorted(set(lengths) | set(trace_supported_seq_lens))


def determine_device_name(mesh_device) -> str:
    """tt/model_config.py determine_device_name (Wormhole's table; the stand-in is a Wormhole system)."""
    names = {1: "N150", 2: "N300", 4: "N150x4", 8: "T3K", 32: "TG"}
    num_devices = mesh_device.get_num_devices()
    if num_devices not in names:
        raise ValueError(f"Unsupported number of devices: {num_devices} for wormhole_b0")
    return names[num_devices]


class DecodersPrecision:
    """tt/model_config.py DecodersPrecision: the per-decoder precision preset ModelArgs keeps as its optimizations."""

    def __init__(self, num_decoders, model_name, name="accuracy"):
        self.num_decoders, self.model_name, self.__name__ = num_decoders, model_name, name

    @classmethod
    def accuracy(cls, num_decoders, model_name):
        return cls(num_decoders, model_name, "accuracy")

    @classmethod
    def performance(cls, num_decoders, model_name):
        return cls(num_decoders, model_name, "performance")


# tt/model_config.py get_max_prefill_chunk_size (div 1024; an unknown model or device gets 4)
MAX_PREFILL_CHUNK_SIZES_DIV1024 = {"Llama-3.1-8B": {"N150": 4, "N300": 64, "T3K": 128, "TG": 128},
                                   "Llama-3.2-1B": {"N150": 128, "N300": 128, "T3K": 128, "TG": 128}}
# tt/model_config.py get_trace_prefill_supported_seq_lens, default_supported_seq_lens
TRACE_PREFILL_SEQ_LENS = {"N150": [128], "N300": [128, 1024], "T3K": [128, 1024], "TG": [128, 1024]}


class ModelArgs:
    """tt/model_config.py ModelArgs (read at 87700c07, a post-April-2026 version): the checks and derived settings the
    backend depends on."""

    def __init__(self, mesh_device, instruct=False, dummy_weights=False, max_batch_size=1, max_seq_len=1024 * 128,
                 optimizations=None, cache_hf=False, prefetcher=None, use_hf_rope=False):
        self.num_devices = mesh_device.get_num_devices() if mesh_device else 0
        self.device_name = determine_device_name(mesh_device)
        self.cluster_shape = list(mesh_device.shape)
        self.is_galaxy = self.num_devices == 32
        self.is_multichip = self.num_devices > 1
        self.mesh_device, self.instruct, self.dummy_weights = mesh_device, instruct, dummy_weights
        self.max_batch_size, self.max_seq_len, self.tile_size = max_batch_size, max_seq_len, 32
        self.tile_padded_batch_rows = self.tile_size * math.ceil(max_batch_size / self.tile_size)
        supported_batches = {1, 2, 4, 8, 16, 32}
        if self.max_batch_size not in supported_batches:
            raise ValueError(f"Batch size {self.max_batch_size} not supported")
        hf_model = os.getenv("HF_MODEL")
        self.CACHE_PATH = os.getenv("TT_CACHE_PATH")
        if not hf_model:
            raise ValueError("Please set HF_MODEL to a HuggingFace name e.g. meta-llama/Llama-3.1-8B-Instruct")
        self.CKPT_DIR = self.TOKENIZER_PATH = hf_model
        if not self.CACHE_PATH:
            self.CACHE_PATH = os.path.join("model_cache", hf_model, self.device_name)
        else:  # "For HF models, always append the device name (e.g. N150/N300/T3K/TG) to the cache path"
            self.CACHE_PATH = os.path.join(self.CACHE_PATH, self.device_name)
        self.model_name = hf_model.strip("/").split("/")[-1]
        self.model_cache_path = Path(self.CACHE_PATH)
        # _set_hf_params: AutoConfig.from_pretrained(CKPT_DIR), which records the path it was given as
        # _name_or_path; _set_params_from_dict then takes model_name from it.
        config_file = Path(hf_model) / "config.json"
        if not config_file.is_file():
            raise OSError(f"stand-in: AutoConfig.from_pretrained({hf_model!r}) finds no config.json")
        config = {**json.loads(config_file.read_text()), "_name_or_path": hf_model}
        normalized_path = os.path.normpath(config["_name_or_path"])
        if "snapshots" in normalized_path:  # "<model_name>/snapshots/<snapshot_id>/"
            self.model_name = normalized_path.split(os.path.sep)[-3].split("--")[-1]
        else:
            self.model_name = os.path.basename(normalized_path)
        self.torch_args = TorchModelArgs.from_hf_config(config)
        a = self.torch_args
        self.n_layers = self.full_model_n_layers = a.n_layers
        self.vocab_size, self.dim, self.n_heads, self.n_kv_heads = a.vocab_size, a.dim, a.n_heads, a.n_kv_heads
        shard_unit = 32 * self.num_devices  # compute_padded_vocab_size: each device's shard tile-aligned
        self.padded_vocab_size = 128 * 1024 if self.is_galaxy else math.ceil(a.vocab_size / shard_unit) * shard_unit
        assert self.n_heads % self.cluster_shape[1] == 0, "n_heads must be divisible by num_devices"
        assert self.n_kv_heads % self.cluster_shape[1] == 0, "n_kv_heads must be divisible by num_devices"
        self.use_qk_fused = not use_hf_rope and prefetcher is None
        self.optimizations = optimizations(self) if callable(optimizations) else optimizations
        if self.optimizations is None:
            self.optimizations = DecodersPrecision.accuracy(num_decoders=self.n_layers, model_name=self.model_name)
        div1024 = MAX_PREFILL_CHUNK_SIZES_DIV1024.get(self.base_model_name, {}).get(self.device_name, 4)
        self.max_prefill_chunk_size = div1024 * 1024
        self.capped_warmup_seq_len = min(self.max_prefill_chunk_size, self.max_seq_len)
        self.trace_prefill_supported_seq_lens = [
            n for n in TRACE_PREFILL_SEQ_LENS.get(self.device_name, []) if n <= self.capped_warmup_seq_len]

    @property
    def base_model_name(self) -> str:
        return get_base_model_name(self.model_name)

    def dram_shard_core_grid_for_k(self, k: int):
        rows, cols = find_grid(k // self.tile_size)
        return ttnn.CoreGrid(x=cols, y=rows)

    def get_residual_mem_config(self, mode, prefetcher=None):
        """tt/model_config.py ModelArgs.get_residual_mem_config (87700c07), without a prefetcher: in decode L1
        interleaved on a Galaxy, else width-sharded in L1, shard (tile_padded_batch_rows, dim // cores // devices)
        over dram_shard_core_grid_for_k(dim // devices): each device holds dim / devices columns; prefill: DRAM."""
        if mode != Mode.DECODE:
            return ttnn.DRAM_MEMORY_CONFIG
        if self.is_galaxy:
            return ttnn.L1_MEMORY_CONFIG
        grid = self.dram_shard_core_grid_for_k(self.dim // self.num_devices)
        return ttnn.create_sharded_memory_config((self.tile_padded_batch_rows,
                                                  self.dim // grid.num_cores // self.num_devices), grid,
                                                 ttnn.ShardStrategy.WIDTH, ttnn.ShardOrientation.ROW_MAJOR,
                                                 use_height_and_width_as_shard_shape=True)

    def get_warmup_prefill_supported_seq_lens(self) -> list[int]:
        assert self.capped_warmup_seq_len > 0 and (self.capped_warmup_seq_len & (self.capped_warmup_seq_len - 1)) == 0, \
            f"capped_warmup_seq_len must be a power of 2, but got {self.capped_warmup_seq_len}"
        return calculate_prefill_warmup_seq_lens(self.capped_warmup_seq_len, self.trace_prefill_supported_seq_lens)

    def get_state_dict_prefix(self, module_name, layer_num, is_vision=False):
        layer_prefix = f"layers.{layer_num}." if layer_num is not None else ""
        text_module_map = {"MLP": "feed_forward", "Attention": "attention", "TransformerBlock": "", "": ""}
        return layer_prefix + text_module_map[module_name]  # any other module name: KeyError, as in TT

    def weight_cache_path(self, dtype):
        kind = {ttnn.bfloat16: "bf16", ttnn.bfloat8_b: "bfp8"}[dtype]  # KeyError for other dtypes, as in TT
        return self.model_cache_path / (f"tensor_cache_instruct_{kind}" if self.instruct else f"tensor_cache_{kind}")

    def load_state_dict(self):
        return {"folder": self.CKPT_DIR}  # the stand-in's "state dict": where the weights are


class TT_CCL:
    """tt/ccl.py TT_CCL: built by every Transformer, one mesh or many; it makes global semaphores only."""

    def __init__(self, mesh_device):
        grid = mesh_device.compute_with_storage_grid_size()
        self.mesh_device = mesh_device
        self.semaphores = [ttnn.create_global_semaphore(mesh_device, (grid.x, grid.y), 0) for _ in range(36)]


class Attention:
    """tt/attention.py Attention (read at 3c5c3944): __init__ finds its weights under
    configuration.get_state_dict_prefix(self.__class__.__name__, layer_num), and caches them as files named from that
    prefix under weight_cache_path; forward_decode updates the paged cache then runs paged SDPA decode."""

    def __init__(self, mesh_device, tt_ccl, args, state_dict, weight_cache_path, layer_num, dtype,
                 transformation_mats, configuration, paged_attention_config=None, use_paged_kv_cache=False,
                 prefetcher=None):
        layer_name = configuration.get_state_dict_prefix(self.__class__.__name__, layer_num)
        if weight_cache_path is not None:  # ttnn.as_tensor(..., cache_file_name=weight_cache_path / f"{layer_name}.wqkv")
            weight_cache_path.mkdir(parents=True, exist_ok=True)
            (weight_cache_path / f"{layer_name}.wqkv").touch()
        a = args.torch_args
        self.use_qk_fused = configuration.use_qk_fused  # read once, at construction, as TT's Attention
        self.args, self.model, self.block = args, state_dict, state_dict.layers[layer_num]
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale, self.sliding_window = a.head_dim ** -0.5, a.sliding_window
        shape = (paged_attention_config.max_num_blocks, a.n_kv_heads, paged_attention_config.block_size, a.head_dim)
        self.layer_past = [ttnn.Tensor(torch.zeros(shape, dtype=state_dict.dtype), ttnn.bfloat8_b, ttnn.TILE_LAYOUT,
                                       mesh_device) for _ in range(2)]

    def _qkv_rope(self, x, rope_idxs):
        H, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.block.attention.wqkv(x.data.view(1, 32, -1)).view(1, 32, H + 2 * Hk, D)
        pos = rope_idxs.data.view(-1)
        cos = self.model.rope_cos[pos].view(1, 32, 1, D)
        sin = self.model.rope_sin[pos].view(1, 32, 1, D)
        qk = apply_rope(qkv[:, :, : H + Hk], cos, sin)
        return ((qk[:, :, :H].contiguous(), ttnn.bfloat16, ttnn.TILE_LAYOUT),
                (qk[:, :, H:].contiguous(), ttnn.bfloat16, ttnn.TILE_LAYOUT),
                (qkv[:, :, H + Hk :].contiguous(), ttnn.bfloat16, ttnn.TILE_LAYOUT))

    def forward(self, x, current_pos, rot_mats=None, user_id=0, mode=Mode.DECODE, page_table=None,
                chunk_page_table=None, chunk_start_idx=None, kv_cache=None):
        if mode != Mode.DECODE:
            raise NotImplementedError("stand-in: prefill goes through Transformer.prefill")
        return self.forward_decode(x, current_pos, rot_mats, page_table=page_table, kv_cache=kv_cache)

    def forward_decode(self, x, current_pos, rot_mats=None, page_table=None, kv_cache=None):
        q, k, v = ttnn.run_op("qkv_rope", self._qkv_rope, x, rot_mats)
        keys, values = kv_cache if kv_cache else self.layer_past
        if self.use_qk_fused:
            ttnn.experimental.paged_fused_update_cache(keys, k, values, v, update_idxs_tensor=current_pos,
                                                       page_table=page_table)
        else:
            ttnn.experimental.paged_update_cache(keys, k, update_idxs_tensor=current_pos, page_table=page_table)
            ttnn.experimental.paged_update_cache(values, v, update_idxs_tensor=current_pos, page_table=page_table)
        out = ttnn.transformer.paged_scaled_dot_product_attention_decode(
            q, keys, values, page_table_tensor=page_table, cur_pos_tensor=current_pos, scale=self.scale,
            sliding_window_size=self.sliding_window, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        # "Attention takes replicated inputs and produces fractured outputs" (tt/decoder.py): WO's all-reduce leaves
        # each device dim / devices columns (tt/ccl.py tt_all_reduce's reduce-scatter on N300/T3K)
        return ttnn.run_op("wo", lambda a: (self.block.attention.wo(a.data.reshape(1, 1, 32, -1)), ttnn.bfloat16,
                                            ttnn.TILE_LAYOUT), out, shards=self.args.num_devices)


class TransformerBlock(LightweightModule):
    """tt/decoder.py TransformerBlock (read at 01229001): builds attention_class (TT's Attention when None) with
    keyword arguments and calls it as attention.forward(x, current_pos, rot_mats, user_id, mode, page_table=...,
    kv_cache=...). Its forward asserts its input is in the residual memory config ("x is fractured across devices
    and interleaved in DRAM (for prefill) and sharded in L1 (for decode)"); the norms gather x ("Norms take
    fractured inputs and output replicated across devices"), attention and MLP give fractured outputs, and the
    residual adds keep the residual's config."""

    def __init__(self, args, mesh_device, tt_ccl, dtype, state_dict, layer_num, weight_cache_path,
                 transformation_mats, paged_attention_config=None, use_paged_kv_cache=False, attention_class=None,
                 prefetcher=None):
        self.args, self.layer_num, self.block = args, layer_num, state_dict.layers[layer_num]
        self.attention_norm = DistributedNorm(self.block.attention_norm, args, tt_ccl=tt_ccl, TG=args.is_galaxy)
        self.ff_norm = DistributedNorm(self.block.ffn_norm, args, tt_ccl=tt_ccl, TG=args.is_galaxy)
        self.attention = (attention_class or Attention)(
            mesh_device=mesh_device, tt_ccl=tt_ccl, args=args, state_dict=state_dict,
            weight_cache_path=weight_cache_path, layer_num=layer_num, dtype=dtype,
            transformation_mats=transformation_mats, configuration=args, paged_attention_config=paged_attention_config,
            use_paged_kv_cache=use_paged_kv_cache, prefetcher=prefetcher)

    def forward(self, x, current_pos, rot_mats_global=None, rot_mats_local=None, user_id=0, mode=Mode.DECODE,
                page_table=None, chunk_page_table=None, chunk_start_idx=None, kv_cache=None, batch_size=1):
        residual = x
        skip_mem_cfg = self.args.get_residual_mem_config(mode, None)  # model_config["DECODE_RESIDUAL_MEMCFG"] there
        assert x.memory_config() == skip_mem_cfg, \
            f"decoder input memcfg mismatch: {x.memory_config()} != {skip_mem_cfg}"
        attn_in = self.attention_norm(x, mode)
        attn_out = self.attention.forward(attn_in, current_pos, rot_mats_global, user_id, mode, page_table=page_table,
                                          chunk_page_table=chunk_page_table, chunk_start_idx=chunk_start_idx,
                                          kv_cache=kv_cache)
        attn_out = ttnn.to_memory_config(attn_out, skip_mem_cfg)
        hidden_states = ttnn.add(residual, attn_out, memory_config=skip_mem_cfg)
        residual = hidden_states
        hidden_states = self.ff_norm(hidden_states, mode)
        # "MLP takes replicated inputs and produces fractured outputs"
        hidden_states = ttnn.run_op("mlp", lambda t: (self.block.feed_forward(t.data), ttnn.bfloat16, ttnn.TILE_LAYOUT),
                                    hidden_states, shards=self.args.num_devices)
        return ttnn.add(residual, hidden_states, memory_config=skip_mem_cfg)  # "fractured across devices"


class DistributedNorm:
    """tt/distributed_norm.py DistributedNorm: on a multi-chip mesh the decode input is all-gathered
    (ttnn.experimental.all_gather_async) before the norm, so every device holds every row's whole hidden state."""

    def __init__(self, norm, args, tt_ccl=None, prefetcher=None, TG=False):
        self.norm, self.args = norm, args

    def __call__(self, x, mode=Mode.DECODE, norm_config=None):
        if self.args.is_multichip:
            x = ttnn.experimental.all_gather_async(x, persistent_output_buffer=None, dim=3)
        return ttnn.run_op("norm", lambda t: (self.norm(t.data), ttnn.bfloat16, ttnn.TILE_LAYOUT), x)


class Embedding(LightweightModule):
    """tt/embedding.py Embedding: its weights are split over the mesh along dim (ShardTensor2dMesh(dims=(None, 3))),
    so each device's embedding output holds dim / devices columns of every row, device d the d-th slice."""

    def __init__(self, table, args):
        self.table, self.args = table, args

    def forward(self, x, memory_config=None):
        return ttnn.run_op("embedding", lambda t: (self.table(t.data.view(-1)[:32]).view(1, 1, 32, -1), ttnn.bfloat16,
                                                   ttnn.TILE_LAYOUT), x, shards=self.args.num_devices,
                           mem=memory_config or ttnn.DRAM_MEMORY_CONFIG)


class Transformer:
    """tt/model.py Transformer (read at 3c5c3944)."""

    def __init__(self, args, dtype, mesh_device, state_dict, weight_cache_path, paged_attention_config=None,
                 use_paged_kv_cache=False, attention_class=None, rope_setup_class=None, prefetcher=None):
        model = torch_model(state_dict["folder"], COMPUTE_DTYPES[dtype])  # computes in the weights' dtype
        self.args, self.mesh_device, self.model = args, mesh_device, model
        self.vocab_size, self.n_layers = args.vocab_size, args.n_layers
        self.tt_ccl = TT_CCL(mesh_device)
        self.embd = Embedding(model.tok_embeddings, args)
        self.norm = DistributedNorm(model.norm, args, tt_ccl=self.tt_ccl, prefetcher=prefetcher, TG=args.is_galaxy)
        self.layers = [TransformerBlock(args=args, mesh_device=mesh_device, tt_ccl=self.tt_ccl, dtype=dtype,
                                        state_dict=model, weight_cache_path=weight_cache_path, layer_num=i,
                                        transformation_mats={}, paged_attention_config=paged_attention_config,
                                        use_paged_kv_cache=use_paged_kv_cache, attention_class=attention_class,
                                        prefetcher=prefetcher)
                       for i in range(self.n_layers)]
        # On-device sampling (and the split-sampling trace hook) where each device's vocabulary share fits 64k
        splits = args.num_devices if list(mesh_device.shape) != [1, 1] else 2
        self.sampling = object() if prefetcher is None and args.vocab_size // splits <= 64 * 1024 else None

    def prepare_decode_inputs_host(self, tokens, current_pos, page_table=None):
        B = tokens.shape[0]
        assert current_pos.shape[0] == B, "Batch size mismatch"
        assert B == self.args.max_batch_size, f"Batch size {B} must be equal to max_batch_size {self.args.max_batch_size}"
        tokens = F.pad(tokens.view(-1), (0, 32 - len(tokens)), "constant", 0)
        tokens = ttnn.unsqueeze_to_4D(ttnn.from_torch(tokens, device=None, dtype=ttnn.uint32,
                                                      mesh_mapper=ttnn.ReplicateTensorToMesh(self.mesh_device)))
        rope_idxs = ttnn.from_torch(torch.maximum(current_pos, torch.tensor(0)), dtype=ttnn.int32)
        if self.args.is_galaxy and B > 1:
            raise NotImplementedError("stand-in: a Galaxy's row-sharded positions")
        mapper = ttnn.ShardTensor2dMesh(self.mesh_device, dims=(None, None), mesh_shape=self.args.cluster_shape)
        current_pos_tt = ttnn.from_torch(current_pos, device=None, dtype=ttnn.int32, mesh_mapper=mapper)
        if page_table is not None:
            page_table = ttnn.from_torch(page_table, device=None, dtype=ttnn.int32, mesh_mapper=mapper)
        return tokens, current_pos_tt, rope_idxs, page_table

    def _transform_decode_inputs_device(self, tokens):
        """tt/model.py (3c5c3944): the embedding (to DRAM without a prefetcher), then the residual memory config."""
        decode_residual_mem_cfg = self.args.get_residual_mem_config(Mode.DECODE, None)
        tt_tokens = ttnn.unsqueeze_to_4D(self.embd(tokens, memory_config=ttnn.DRAM_MEMORY_CONFIG))
        return ttnn.to_memory_config(tt_tokens, decode_residual_mem_cfg)

    def forward(self, x, current_pos, rot_mats_global=None, rot_mats_local=None, user_id=0, mode=Mode.DECODE,
                page_table=None, chunk_page_table=None, chunk_start_idx=None, get_last_token=-1, kv_cache=None,
                batch_size=1):
        """tt/model.py Transformer.forward (3c5c3944), decode: every layer called on x moved to the residual memory
        config (a no-op when it is there already), the final norm, the LM head."""
        for i, layer in enumerate(self.layers):
            if mode == Mode.DECODE and not self.args.is_galaxy:
                x = ttnn.to_memory_config(x, self.args.get_residual_mem_config(mode, None), None)
            x = layer(x, current_pos, rot_mats_global=rot_mats_global, rot_mats_local=rot_mats_local,
                      user_id=user_id, mode=mode, page_table=page_table, chunk_page_table=chunk_page_table,
                      chunk_start_idx=chunk_start_idx, kv_cache=kv_cache[i] if kv_cache is not None else None,
                      batch_size=batch_size)
        x = self.norm(x, mode=mode)
        m = self.model

        def lm_head(t):  # bfloat8_b (tt/lm_head.py LMHead.forward); columns past the vocabulary are padding
            logits = m.output(t.data).float()
            padded = torch.full((*logits.shape[:-1], self.args.padded_vocab_size), PADDED_VOCAB_GARBAGE)
            padded[..., : self.vocab_size] = logits
            return padded, ttnn.bfloat8_b, ttnn.TILE_LAYOUT
        return ttnn.run_op("lm_head", lm_head, x, shards=self.args.num_devices)

    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            sampling_on_device=False, capture_sampling_trace=False):
        """The decode step to the LM head, whose output is split over the devices by vocabulary (TILE). With
        sampling_on_device (and on-device sampling supported): the position inputs are advanced on device
        (ttnn.plus_one) and, capture_sampling_trace, the per-device logits returned as they are. Otherwise they are
        all-gathered (more than one device) and untilized: (logits, None). (The stand-in's rotary tables are indexed
        by the positions directly: rot_mat_idxs stands for TT's rope_setup.get_rot_mats(rot_mat_idxs).)"""
        x_embed = self._transform_decode_inputs_device(x)
        tt_logits = self.forward(x_embed, current_pos, rot_mats_global=rot_mat_idxs, mode=Mode.DECODE,
                                 page_table=page_table, kv_cache=kv_cache)
        if sampling_on_device and self.sampling is not None:
            ttnn.plus_one(current_pos, skip_negative_entries=True)
            ttnn.plus_one(rot_mat_idxs)
            if capture_sampling_trace:
                return tt_logits
            raise NotImplementedError("stand-in: TT's on-device sampling")
        if self.args.num_devices > 1:
            tt_logits = ttnn.experimental.all_gather_async(tt_logits, persistent_output_buffer=None, dim=3)
        return ttnn.untilize(tt_logits, use_multicore=True, memory_config=ttnn.DRAM_MEMORY_CONFIG), None

    def prefill(self, ids: torch.Tensor, seq_len: int, page_row: torch.Tensor, kv_cache) -> torch.Tensor:
        """The padded prompt through every layer (causal), K/V of its real positions into the user's pages; the
        last real token's logits [vocab]."""
        m, a = self.model, self.args.torch_args
        S, H, Hk, D = ids.shape[-1], a.n_heads, a.n_kv_heads, a.head_dim
        x = m.tok_embeddings(ids.view(1, S))
        cos, sin = m.rope_cos[:S].view(1, S, 1, D), m.rope_sin[:S].view(1, S, 1, D)
        pos = torch.arange(S)
        visible = pos.view(-1, 1) >= pos.view(1, -1)
        if a.sliding_window is not None:
            visible &= pos.view(-1, 1) - pos.view(1, -1) < a.sliding_window
        real = torch.arange(seq_len)
        for layer, (keys, values) in zip(self.layers, kv_cache):
            b = layer.block
            qkv = b.attention.wqkv(b.attention_norm(x)).view(1, S, H + 2 * Hk, D)
            qk = apply_rope(qkv[:, :, : H + Hk], cos, sin)
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hk :]
            blocks = page_row.long()[real // 32]
            keys.data[blocks, :, real % 32] = k[0, :seq_len]
            values.data[blocks, :, real % 32] = v[0, :seq_len]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(H // Hk, 1),
                                                  v.transpose(1, 2).repeat_interleave(H // Hk, 1), attn_mask=visible)
            x = x + b.attention.wo(attn.transpose(1, 2).reshape(1, S, H * D))
            x = x + b.feed_forward(b.ffn_norm(x))
        return m.output(m.norm(x[0, seq_len - 1])).float()


class Generator:
    """tt/generator.py Generator (read at 87700c07): the first prefill_forward_text (warmup_prefill=True) runs the
    prefill warm-up sweep over ModelArgs.get_warmup_prefill_supported_seq_lens(), on user 0 with a page table of
    zeros, once per Generator."""

    def __init__(self, model, model_args, mesh_device, processor=None, tokenizer=None):
        self.model, self.model_args, self.mesh_device = model, model_args, mesh_device
        self.already_warmed_up_prefill = False

    def warmup_model_prefill(self, kv_cache, enable_trace, can_sample_on_device=False,
                             non_greedy_decoding_on_device=False):
        if self.already_warmed_up_prefill:
            return
        self.already_warmed_up_prefill = True
        for seq_len in self.model_args[0].get_warmup_prefill_supported_seq_lens():
            blocks = math.ceil(seq_len / kv_cache[0][0][0].shape[2])
            self.prefill_forward_text(torch.zeros(1, seq_len, dtype=torch.long), kv_cache=kv_cache,
                                      page_table=torch.zeros(1, blocks, dtype=torch.int32), prompt_lens=[seq_len],
                                      empty_slots=[0], enable_trace=enable_trace, model_id_warmup=0)

    def prefill_forward_text(self, tokens, page_table=None, kv_cache=None, prompt_lens=None, empty_slots=None,
                             enable_trace=True, model_id_warmup=None, sampling_params=None, start_pos=None,
                             return_hidden_states=False, warmup_prefill=True, **kwargs):
        if warmup_prefill:
            self.warmup_model_prefill(kv_cache=kv_cache, enable_trace=enable_trace)
        batch_size = tokens.shape[0]
        out = torch.zeros(batch_size, 1, self.model_args[0].vocab_size)
        for idx, user_id in enumerate(empty_slots if empty_slots is not None else range(batch_size)):
            model_id = user_id // self.model_args[0].max_batch_size
            seq_len = int(prompt_lens[idx])
            ids = F.pad(tokens[idx, :seq_len], (0, get_padded_prefill_len(seq_len) - seq_len))
            with torch.no_grad():
                out[idx, 0] = self.model[model_id].prefill(ids, seq_len, page_table[idx], kv_cache[model_id])
        return out
