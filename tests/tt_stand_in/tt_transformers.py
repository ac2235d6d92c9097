# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE standing in for the TT-Transformers surface the ttnn backend drives (models.tt_transformers.tt:
ModelArgs, Transformer, TransformerBlock, Attention, DistributedNorm, TT_CCL, tt_all_gather, PagedAttentionConfig,
copy_host_to_device, Generator). It is not TT-Transformers: it computes the checkpoint's model in torch through the
stand-in ttnn ops (stand-in ttnn.py). What it keeps of the real code, each piece naming the tt-metal file and
function it mirrors, is what the backend depends on and what can fail there: the signatures and keyword arguments,
the module-name map behind get_state_dict_prefix, model_name and the weight-cache folder from HF_MODEL and
TT_CACHE_PATH, the device name from the mesh, the optimizations default, the prefill warm-up's power-of-two rule,
the vocabulary padded per device, CCL ops on meshes of several devices, tokens padded to a 32-row tile, RoPE
positions clamped at 0, the cache update through ttnn.experimental.paged_update_cache with
update_idxs_tensor=current_pos on q/k/v height-sharded as nlp_create_qkv_heads_decode leaves them, paged SDPA decode
bounded by each row's position, and the residual stream: Transformer.forward calling each layer (a
LightweightModule) on x, the decoder asserting its input's memory config -- in decode x split over the devices
along dim and width-sharded in L1, in prefill [1, 1, S, dim] split the same way and interleaved in DRAM.

Prefill runs TT's path: Generator.prefill_forward_text -> prefill_forward_single_user_text ->
Transformer.prepare_inputs_prefill / ttnn_prefill_forward -> Transformer.forward(mode=Mode.PREFILL) -> every layer
(Attention.forward_prefill: QKV, rotary, paged_fill_cache of the blocks the prompt covers, causal SDPA with the
sliding window, WO; then the MLP) -> the last token's 32 rows -> norm -> LM head -> process_output_prefill. A padded
prompt longer than max_prefill_chunk_size runs TT's chunked prefill: chunks of get_max_prefill_chunk_size rows, the
user's page table padded with zeros to the padded prompt's blocks (physical block 0), each chunk filling the cache
through its slice of that padded table (so the padding's K/V go to block 0, as paged_fill_cache skips only -1 entries)
and attending through chunked SDPA over the cache; the chunks after the last token's are not run. Not modelled:
traced prefill. The stand-in keys its compiled programs by the shapes of an op's tensors, and for chunked SDPA also by
its chunk_start_idx (real ttnn 0.81.1 compiles one program per chunk_start_idx and page-table width: counted with
num_program_cache_entries on the mock device), paged_fill_cache by the fill page table's width and ttnn.slice (the
prefill's last-token slice among them) by its offsets, as real ttnn does (counted the same way): a prompt whose length,
last-token tile or blocks no warm-up prefilled compiles programs, flagged when decode traces are live.

The tt-metal tag the backend pins (v0.81.1, d80d9482) is not in the searchable index: the files were read at the
nearest versions found (model_config.py and generator.py at 87700c07, model.py, attention.py, common.py and ccl.py
at 3c5c3944, decoder.py and distributed_norm.py at 01229001; the prefill path at 5cd1b56c (model.py, attention.py)
and 000ec121 (generator.py)), and ttnn's own checks against the 0.81.1 wheel."""
import json
import math
import os
import re
from collections import defaultdict
from enum import Enum
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.checkpoints.model_shape import ModelShape as TorchModelArgs
from models.tt_transformers.torch_backend.attention import apply_rope
from models.tt_transformers.torch_backend.load import load_model

from . import ttnn

PADDED_VOCAB_GARBAGE = 1e4  # the padded LM-head columns are not vocabulary: the backend must never pick them
ROPE_POSITIONS = 8192  # the stand-in's rotary tables (a padded prompt of up to 8,192 rows, chunked prefill's included)


COMPUTE_DTYPES = {ttnn.float32: torch.float32, ttnn.bfloat16: torch.bfloat16, ttnn.bfloat8_b: torch.bfloat16}


@lru_cache(maxsize=2)
def torch_model(folder: str, dtype: torch.dtype):
    """The checkpoint as our torch model (torch ops): where the stand-in takes its weights from. Rotary tables
    reach ROPE_POSITIONS: a padded prefill may run past a short max_seq_len."""
    return load_model(resolve_checkpoint(folder), dtype, ROPE_POSITIONS, cpu_kernels=False)


class PagedAttentionConfig:  # tt/common.py
    def __init__(self, block_size=32, max_num_blocks=1024):
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks


class Mode(Enum):  # tt/common.py
    DECODE = "decode"
    PREFILL = "prefill"


def copy_host_to_device(host_tensors, device_tensors=None, mesh_device=None, shard_specs=None, ttnn=ttnn):
    """tt/common.py copy_host_to_device (ttnn: which one; the mock-device double passes the real one)."""
    if device_tensors is None:
        assert mesh_device is not None, "mesh_device is required when device_tensors is None"
        return [ttnn.to_device(t, device=mesh_device) if t else None for t in host_tensors]
    for host, device in zip(host_tensors, device_tensors):
        if host is None:
            assert device is None
            continue
        ttnn.copy_host_to_device_tensor(host, device)
    return device_tensors


def get_block_size(kv_cache) -> int:  # tt/common.py
    return kv_cache[0][0].shape[2]


def num_blocks_in_seq(seq_len: int, block_size: int) -> int:  # tt/common.py
    return math.ceil(seq_len / block_size)


def prefill_user_page_table(page_table, block_size: int, prefill_seq_len: int):
    """tt/generator.py Generator._get_prefill_user_page_table (622c6fb9, not batched): the user's page table cut to the
    padded prompt's blocks, padded with -1 where the row is narrower ("prefill kernels run on the padded prefill
    length ... so the page table must expose blocks for that padded length"); paged_fill_cache skips -1 entries."""
    num_blocks = num_blocks_in_seq(prefill_seq_len, block_size)
    if page_table.shape[1] < num_blocks:
        padding = torch.full((page_table.shape[0], num_blocks - page_table.shape[1]), -1, dtype=torch.int32)
        page_table = torch.cat([page_table, padding], dim=1)
    return page_table[:, :num_blocks]


def get_max_prefill_chunk_size(seq_len: int, max_prefill_seq_len: int) -> int:
    """tt/common.py get_max_prefill_chunk_size: "the largest multiple of 2048 that divides `seq_len` and is less than
    or equal to `max_prefill_seq_len`" (both must be multiples of 2048)."""
    if seq_len % 2048 or max_prefill_seq_len % 2048:
        raise ValueError(f"seq_len ({seq_len}) and max_prefill_seq_len ({max_prefill_seq_len}) must be multiples of "
                         "2048")
    return next(c for c in range(min(max_prefill_seq_len, seq_len), 0, -2048) if seq_len % c == 0)


def get_padded_prefill_len(seq_len: int) -> int:
    """tt/common.py get_padded_prefill_len (622c6fb9, "TODO #34117"): 128, else 1,024, else the next power of two
    (553f842d's "whichever is smaller: a power of 2 or a multiple of 2048" is gone there)."""
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

    @classmethod
    def from_string(cls, name):
        """The preset named "performance" or "accuracy" (generator_vllm.py's initialize_vllm_model takes the plugin's
        optimizations string through it)."""
        return {"performance": cls.performance, "accuracy": cls.accuracy}[name]

    def get_tensor_dtype(self, decoder_id, tensor):
        """The stand-in's presets name no tensor dtypes: None, which generator_vllm.py's allocate_vllm_kv_cache turns
        into bfloat8_b for the KV cache, as TT does when a preset names none."""
        return None


class TensorGroup(Enum):  # tt/model_config.py TensorGroup (the member generator_vllm.py reads)
    KV_CACHE = "kv_cache"


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
    """tt/ccl.py TT_CCL (013eaee3): built by every Transformer, one mesh or many; for each axis slot (cluster axis 0,
    1, none: `2 if not cluster_axis else cluster_axis`, so axis 0 shares slot 2) two barrier semaphores and two pairs
    of all-gather semaphores, handed out in turn (`(idx + 1) % 2`, "double buffered"). The stand-in does not model two
    collectives racing on one semaphore (a hardware check); it hands them out as TT does."""

    def __init__(self, mesh_device):
        grid = mesh_device.compute_with_storage_grid_size()
        self.mesh_device, self.mode = mesh_device, "decode"

        def semaphore():
            return ttnn.create_global_semaphore(mesh_device, (grid.x, grid.y), 0)
        self.barrier_idx, self.ag_idx = [0, 0, 0], [0, 0, 0]
        self.barrier = [[semaphore() for _ in range(2)] for _ in range(3)]
        self.ag = [[[semaphore() for _ in range(2)] for _ in range(2)] for _ in range(3)]

    @staticmethod
    def _cycle(idx, handles, cluster_axis):
        slot = 2 if not cluster_axis else cluster_axis
        current = idx[slot]
        idx[slot] = (current + 1) % 2
        return handles[slot][current]

    def get_and_cycle_ag_semaphore_handles(self, cluster_axis=None):
        return self._cycle(self.ag_idx, self.ag, cluster_axis)

    def get_and_cycle_barrier_semaphore_handle(self, cluster_axis=None):
        return self._cycle(self.barrier_idx, self.barrier, cluster_axis)


def tt_all_gather(input_tensor, mesh_device, tt_ccl, cluster_axis, dim, num_links=2, memory_config=None,
                  sharded=False, topology=ttnn.Topology.Linear, dtype=ttnn.bfloat16, buffer_key=None):
    """tt/ccl.py tt_all_gather (read at 7d857b2a and in a later copy taking tt_ccl, whose commit the index does not
    show; in both its "# N150" guard compares a list with a tuple, `list(mesh_device.shape) == (1, 1)`, which is
    never true: on one device only cluster_axis=1 returns the input, cluster_axis=None goes on to all_gather_async,
    which stops there. At 013eaee3 the guard compares lists and returns the input on one device: the backend, which
    calls it only on meshes of several devices, works with either). The input to DRAM (not sharded), cast to
    `dtype`, gathered with all_gather_async, then deallocated."""
    if list(mesh_device.shape) == (1, 1) or (cluster_axis == 1 and 1 in list(mesh_device.shape)):
        return input_tensor
    if buffer_key is not None:
        raise NotImplementedError("stand-in: tt_all_gather without persistent buffers")
    if not sharded:
        input_tensor = ttnn.to_memory_config(input_tensor, ttnn.DRAM_MEMORY_CONFIG)
    if input_tensor.dtype != dtype:
        input_tensor = ttnn.to_memory_config(input_tensor, ttnn.L1_MEMORY_CONFIG, dtype)
        if sharded and memory_config is not None:
            input_tensor = ttnn.to_memory_config(input_tensor, memory_config, dtype)
    gathered = ttnn.experimental.all_gather_async(
        input_tensor, persistent_output_buffer=None, dim=dim,
        multi_device_global_semaphore=tt_ccl.get_and_cycle_ag_semaphore_handles(cluster_axis), num_links=num_links,
        cluster_axis=cluster_axis, topology=topology, memory_config=memory_config,
        barrier_semaphore=tt_ccl.get_and_cycle_barrier_semaphore_handle(cluster_axis), chunks_per_sync=10,
        num_workers_per_link=2, num_buffers_per_channel=2)
    input_tensor.deallocate(True)
    return gathered


def decode_heads_mem(n_heads: int, head_dim: int):
    """Where nlp_create_qkv_heads_decode leaves q, k and v in decode (tt/model_config.py
    get_attn_create_head_output_mem_config: L1 height-sharded): one user per core over 32 cores, each shard that
    user's heads padded to a tile's 32 rows and head_dim to its 32 columns -- the sharding paged_update_cache requires
    ("input_tensor is height sharded on B cores", its docstring)."""
    return ttnn.create_sharded_memory_config((32 * math.ceil(n_heads / 32), 32 * math.ceil(head_dim / 32)),
                                             ttnn.CoreGrid(y=4, x=8),
                                             ttnn.ShardStrategy.HEIGHT, ttnn.ShardOrientation.ROW_MAJOR,
                                             use_height_and_width_as_shard_shape=True)


class Attention:
    """tt/attention.py Attention (read at 3c5c3944; forward_prefill at 5cd1b56c): __init__ finds its weights under
    configuration.get_state_dict_prefix(self.__class__.__name__, layer_num), and caches them as files named from that
    prefix under weight_cache_path; forward_decode updates the paged cache then runs paged SDPA decode on q, k, v
    height-sharded as nlp_create_qkv_heads_decode leaves them; forward_prefill (the padded prompt, a multiple of 128
    rows) fills the user's pages with K/V of the positions its page table covers (page_len = blocks x block size:
    the prompt rounded up to a block) and runs causal SDPA over the prompt's own K/V (sliding window included)."""

    def __init__(self, mesh_device, tt_ccl, args, state_dict, weight_cache_path, layer_num, dtype,
                 transformation_mats, configuration, paged_attention_config=None, use_paged_kv_cache=False,
                 prefetcher=None):
        layer_name = configuration.get_state_dict_prefix(self.__class__.__name__, layer_num)
        if weight_cache_path is not None:  # ttnn.as_tensor(..., cache_file_name=weight_cache_path / f"{layer_name}.wqkv")
            weight_cache_path.mkdir(parents=True, exist_ok=True)
            (weight_cache_path / f"{layer_name}.wqkv").touch()
        a = args.torch_args
        self.use_qk_fused = configuration.use_qk_fused  # read once, at construction, as TT's Attention
        # tt/attention.py __init__: on a TG (32 devices) each mesh column's users, else the whole batch
        self.TG = args.num_devices == 32
        num_device_groups = args.num_devices // a.n_kv_heads
        self.batch_size_per_device_group = (max(args.max_batch_size // num_device_groups, 1) if self.TG
                                            else args.max_batch_size)
        self.args, self.model, self.block = args, state_dict, state_dict.layers[layer_num]
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale, self.sliding_window = a.head_dim ** -0.5, a.sliding_window
        if use_paged_kv_cache:  # "vLLM provides its own kv cache": TT's Attention.__init__ calls init_kv_cache only
            self.layer_past = None  # when not use_paged_kv_cache; every forward gets kv_cache
            return
        shape = (paged_attention_config.max_num_blocks, a.n_kv_heads, paged_attention_config.block_size, a.head_dim)
        # bfloat8_b as TT's performance preset (its writes rounded so); in the stand-in's float32 mode labelled
        # bfloat16, which the stand-in keeps unrounded (SDPA decode takes no float32 cache)
        kv_dtype = ttnn.bfloat16 if state_dict.dtype == torch.float32 else ttnn.bfloat8_b
        self.layer_past = [ttnn.Tensor(torch.zeros(shape, dtype=state_dict.dtype), kv_dtype, ttnn.TILE_LAYOUT,
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
        if mode == Mode.PREFILL:
            return self.forward_prefill(x, rot_mats, user_id, page_table=page_table,
                                        chunk_page_table=chunk_page_table, chunk_start_idx=chunk_start_idx,
                                        kv_cache=kv_cache)
        return self.forward_decode(x, current_pos, rot_mats, page_table=page_table, kv_cache=kv_cache)

    def forward_prefill(self, x_11SH, rot_mats, user_id=0, page_table=None, chunk_page_table=None,
                        chunk_start_idx=None, kv_cache=None):
        """The padded prompt (or, chunk_start_idx set, one chunk of it at that position): QKV and rotary, the K/V
        into the cache through the page table (a chunk through chunk_page_table, its slice of the user's padded
        table), then causal SDPA: over the prompt's own K/V, or, for a chunk, over the cache through page_table
        (chunked_scaled_dot_product_attention), positions 0 .. the chunk's end."""
        seq_len = x_11SH.shape[-2]
        assert seq_len % 128 == 0 and seq_len > 0, "Seqlen must be divisible by 128"
        H, Hk, D, S = self.n_heads, self.n_kv_heads, self.head_dim, seq_len

        def qkv_rope(x, cos, sin):  # QKV matmul, heads, rotary embeddings (rot_mats: cos/sin of the rows' positions)
            qkv = self.block.attention.wqkv(x.data.view(1, S, -1)).view(1, S, H + 2 * Hk, D)
            qk = apply_rope(qkv[:, :, : H + Hk], cos.data.view(1, S, 1, D), sin.data.view(1, S, 1, D))
            return ((qk[:, :, :H], ttnn.bfloat16, ttnn.TILE_LAYOUT), (qk[:, :, H:], ttnn.bfloat16, ttnn.TILE_LAYOUT),
                    (qkv[:, :, H + Hk :], ttnn.bfloat16, ttnn.TILE_LAYOUT))
        q, k, v = ttnn.run_op("qkv_prefill", qkv_rope, x_11SH, *rot_mats)
        keys, values = kv_cache if kv_cache else self.layer_past
        block = keys.shape[2]
        if page_table is not None:
            fill_page_table = chunk_page_table if chunk_page_table is not None else page_table
            page_len = min(fill_page_table.shape[1] * block, S)
            blocks = fill_page_table.data[user_id].long()[torch.arange(page_len) // block]
            positions = torch.arange(page_len)[blocks >= 0]  # -1: skipped (writer_fill_cache_interleaved.cpp)
            blocks = blocks[blocks >= 0]

            def fill(cache, new):  # ttnn.experimental.paged_fill_cache(cache, new[:, :, :page_len], page table)
                cache.data[blocks, :, positions % block] = ttnn.stored(new.data[0, positions],
                                                                       cache.dtype).to(cache.data.dtype)
            # the fill page table is an input of the op: its width is part of the program (module docstring)
            for cache, new in ((keys, k), (values, v)):
                ttnn.run_op("paged_fill_cache", lambda c, n, _table: fill(c, n), cache, new, fill_page_table,
                            inplace=True)

        def causal(queries, keys_at):  # query i (at queries[i]) sees key j (at keys_at[j]) within the sliding window
            visible = queries.view(-1, 1) >= keys_at.view(1, -1)
            if self.sliding_window is not None:
                visible &= queries.view(-1, 1) - keys_at.view(1, -1) < self.sliding_window
            return visible

        def attend(q, k, v, visible):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(H // Hk, 1),
                                                 v.transpose(1, 2).repeat_interleave(H // Hk, 1), attn_mask=visible)
            return out.transpose(1, 2).reshape(1, 1, S, H * D), ttnn.bfloat16, ttnn.TILE_LAYOUT
        if chunk_start_idx is None:
            def sdpa(q, k, v):  # causal over the prompt's own K/V
                pos = torch.arange(S)
                return attend(q.data, k.data, v.data, causal(pos, pos))
            attn = ttnn.run_op("sdpa_prefill", sdpa, q, k, v)
        else:
            end = chunk_start_idx + S

            def chunked_sdpa(q, cache_k, cache_v, table):
                """ttnn.transformer.chunked_scaled_dot_product_attention(q, K cache, V cache, page_table,
                chunk_start_idx): the keys of positions 0 .. end - 1 read from the cache as stored."""
                row = table.data[user_id].long()
                cached = [ttnn.paged_keys(c.data, row, 0, end).transpose(0, 1).float().to(q.data.dtype).unsqueeze(0)
                          for c in (cache_k, cache_v)]  # [1, end, Hk, D]
                return attend(q.data, *cached, causal(torch.arange(chunk_start_idx, end), torch.arange(end)))
            # one program per chunk_start_idx (and page-table width, a shape), as real ttnn 0.81.1 (module docstring)
            attn = ttnn.run_op(f"chunked_sdpa@{chunk_start_idx}", chunked_sdpa, q, keys, values, page_table)
        # WO, then the all-reduce's reduce-scatter: each device keeps dim / devices columns (as in decode)
        return ttnn.run_op("wo", lambda a: (self.block.attention.wo(a.data), ttnn.bfloat16, ttnn.TILE_LAYOUT), attn,
                           shards=self.args.num_devices)

    def forward_decode(self, x, current_pos, rot_mats=None, page_table=None, kv_cache=None):
        q, k, v = ttnn.run_op("qkv_rope", self._qkv_rope, x, rot_mats, mem=[
            decode_heads_mem(self.n_heads, self.head_dim), *[decode_heads_mem(self.n_kv_heads, self.head_dim)] * 2])
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
        """tokens [1, 1, 1, n] (32 in decode, the padded prompt in prefill) -> [1, 1, n, dim]."""
        return ttnn.run_op("embedding", lambda t: (self.table(t.data.view(-1)).view(1, 1, t.data.numel(), -1),
                                                   ttnn.bfloat16, ttnn.TILE_LAYOUT), x, shards=self.args.num_devices,
                           mem=memory_config or ttnn.DRAM_MEMORY_CONFIG)


class Transformer:
    """tt/model.py Transformer (read at 3c5c3944)."""

    def __init__(self, args, dtype, mesh_device, state_dict, weight_cache_path, paged_attention_config=None,
                 use_paged_kv_cache=False, attention_class=None, rope_setup_class=None, prefetcher=None):
        model = torch_model(state_dict["folder"], COMPUTE_DTYPES[dtype])  # computes in the weights' dtype
        self.args, self.mesh_device, self.model = args, mesh_device, model
        # TT's LM head writes bfloat8_b logits (tt/lm_head.py LMHead.forward), rounded as the device stores them; the
        # stand-in's float32 mode (numerics checks against torch, not TT) keeps them float32
        self.logits_dtype = ttnn.float32 if COMPUTE_DTYPES[dtype] == torch.float32 else ttnn.bfloat8_b
        self.vocab_size, self.n_layers = args.vocab_size, args.n_layers
        self.tt_ccl = TT_CCL(mesh_device)
        self.embd = Embedding(model.tok_embeddings, args)
        # RotarySetup's cos/sin matrices [1, 1, positions, head_dim] (the stand-in's reach ROPE_POSITIONS: where TT
        # pads a prefill running past max_seq_len with zeros, prepare_inputs_prefill, only padded rows differ)
        self.rope_cos, self.rope_sin = (ttnn.Tensor(t.view(1, 1, *t.shape), ttnn.bfloat16, ttnn.TILE_LAYOUT,
                                                    mesh_device) for t in (model.rope_cos, model.rope_sin))
        self.norm = DistributedNorm(model.norm, args, tt_ccl=self.tt_ccl, prefetcher=prefetcher, TG=args.is_galaxy)
        self.layers = [TransformerBlock(args=args, mesh_device=mesh_device, tt_ccl=self.tt_ccl, dtype=dtype,
                                        state_dict=model, weight_cache_path=weight_cache_path, layer_num=i,
                                        transformation_mats={}, paged_attention_config=paged_attention_config,
                                        use_paged_kv_cache=use_paged_kv_cache, attention_class=attention_class,
                                        prefetcher=prefetcher)
                       for i in range(self.n_layers)]
        # On-device sampling (and the split-sampling trace hook) where each device's vocabulary share fits 64k
        splits = args.num_devices if list(mesh_device.shape) != [1, 1] else 2
        self._supports_on_device_sampling = prefetcher is None and args.vocab_size // splits <= 64 * 1024
        self.sampling = SamplingGenerator(mesh_device, args.vocab_size) if self._supports_on_device_sampling else None

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
        """tt/model.py Transformer.forward (3c5c3944): every layer called on x (in decode moved to the residual memory
        config first, a no-op when it is there already); in prefill x comes back as it is when get_last_token is -1,
        else its 32 rows from get_last_token on go on; the final norm, the LM head (row-major in DRAM in prefill)."""
        for i, layer in enumerate(self.layers):
            if mode == Mode.DECODE and not self.args.is_galaxy:
                x = ttnn.to_memory_config(x, self.args.get_residual_mem_config(mode, None), None)
            x = layer(x, current_pos, rot_mats_global=rot_mats_global, rot_mats_local=rot_mats_local,
                      user_id=user_id, mode=mode, page_table=page_table, chunk_page_table=chunk_page_table,
                      chunk_start_idx=chunk_start_idx, kv_cache=kv_cache[i] if kv_cache is not None else None,
                      batch_size=batch_size)
        if mode == Mode.PREFILL and get_last_token == -1:
            return x
        if get_last_token != -1:  # "Slicing the tensor to the nearest ceiling/floor multiples of 32 ..."
            x = ttnn.slice(x, (0, 0, get_last_token, 0), (1, 1, get_last_token + 32, x.shape[-1]))
        x = self.norm(x, mode=mode)
        m = self.model

        def lm_head(t):  # columns past the vocabulary are padding
            logits = m.output(t.data).float()
            padded = torch.full((*logits.shape[:-1], self.args.padded_vocab_size), PADDED_VOCAB_GARBAGE)
            padded[..., : self.vocab_size] = logits
            return padded, self.logits_dtype, ttnn.TILE_LAYOUT
        x = ttnn.run_op("lm_head", lm_head, x, shards=self.args.num_devices)
        if mode == Mode.PREFILL:
            x = ttnn.to_layout(x, layout=ttnn.ROW_MAJOR_LAYOUT, memory_config=ttnn.DRAM_MEMORY_CONFIG)
        return x

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

    def prepare_inputs_prefill(self, tokens, start_pos=0, page_table=None, chunk_page_table=None, trace_enabled=False,
                               last_token_idx=None, **kwargs):
        """tt/model.py Transformer.prepare_inputs_prefill (5cd1b56c), untraced: the tokens [1, S] embedded on device
        ([1, 1, S, dim], split over the devices along dim, in DRAM), cos/sin of positions start_pos.. start_pos + S
        sliced from the rotary matrices, the page tables on device (int32, row-major, replicated)."""
        if trace_enabled:
            raise NotImplementedError("stand-in: traced prefill")
        assert tokens.dim() == 2, "tokens must be a 2D tensor"
        tokens = tokens.reshape(1, 1, 1, -1)
        S = tokens.shape[-1]
        # tt/model.py prepare_inputs_prefill (622c6fb9): the rotary tables hold ModelArgs.max_seq_len positions
        # (RotarySetup(max_seq_len=args.max_seq_len)) and the padded prompt must fit them
        assert self.args.max_seq_len >= S, f"Sequence length {S} exceeds max seq len {self.args.max_seq_len}"
        replicated = ttnn.ReplicateTensorToMesh(self.mesh_device)
        tokens = ttnn.from_torch(tokens, device=self.mesh_device, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT,
                                 mesh_mapper=replicated)
        tokens_embd = ttnn.unsqueeze_to_4D(self.embd(tokens))
        rot_mats = [ttnn.slice(m, (0, 0, start_pos, 0), (1, 1, start_pos + S, m.shape[-1]))
                    for m in (self.rope_cos, self.rope_sin)]
        tables = [None if t is None else ttnn.from_torch(t, device=self.mesh_device, dtype=ttnn.int32,
                                                         layout=ttnn.ROW_MAJOR_LAYOUT, mesh_mapper=replicated)
                  for t in (page_table, chunk_page_table)]
        return tokens_embd, rot_mats, None, *tables

    def ttnn_prefill_forward(self, x, rot_mats_global=None, rot_mats_local=None, user_id=0, page_table=None,
                             chunk_page_table=None, chunk_start_idx=None, get_last_token=-1, kv_cache=None,
                             batch_size=1):
        return self.forward(x, current_pos=None, rot_mats_global=rot_mats_global, rot_mats_local=rot_mats_local,
                            user_id=user_id, mode=Mode.PREFILL, page_table=page_table,
                            chunk_page_table=chunk_page_table, chunk_start_idx=chunk_start_idx,
                            get_last_token=get_last_token, kv_cache=kv_cache, batch_size=batch_size)

    def process_output_decode(self, tt_out, B):
        """tt/model.py process_output_decode: device 0's copy of the gathered logits, the first B rows."""
        out = ttnn.to_torch(ttnn.get_device_tensors(tt_out)[0]).float()
        return out.reshape(-1, out.shape[-1])[:B, : self.vocab_size]

    def process_output_prefill(self, tt_out, last_token_idx):
        """tt/model.py (5cd1b56c): concat_host_output (the devices' parts side by side) at row last_token_idx of the
        last token's tile, cut to the vocabulary."""
        parts = [ttnn.to_torch(t) for t in ttnn.get_device_tensors(tt_out)]
        return torch.cat(parts, dim=-1)[0, 0, last_token_idx, : self.vocab_size]


class SamplingGenerator:
    """models/common/sampling/generator.py SamplingGenerator (read at 00b0fa3f), greedy only (TT's force_argmax): the
    model's `sampling`, with traces of its own, one per slot of _trace_states, which capture_trace makes (a
    precompiling run, then the capture), sample replays (its logits must be the tensor it was captured with) and only
    reset_trace releases: TT's Generator releases neither these nor its decode traces (tt/generator.py's __del__ closes
    submeshes only). The pick: each row's argmax over the vocabulary (the padded columns sliced off, as its _forward
    does), written into tt_out_tok, the decode trace's token input."""

    def __init__(self, mesh_device, vocab_size):
        self.mesh_device, self.vocab_size = mesh_device, vocab_size
        self.enable_internal_trace = True
        self._trace_states: dict = {}

    def _run_sampling(self, logits, tt_out_tok):
        def pick(scores, out):
            ids = scores.data[0, 0, :, : self.vocab_size].float().argmax(dim=-1)
            out.data.copy_(ids.reshape(out.data.shape).to(out.data.dtype))
        ttnn.run_op("sampling", pick, logits, tt_out_tok, inplace=True)
        return tt_out_tok, None

    def capture_trace(self, logits, *, tt_out_tok=None, skip_precompile=False):
        if not skip_precompile:
            self._run_sampling(logits, tt_out_tok)
        trace_id = ttnn.begin_trace_capture(self.mesh_device, cq_id=0)
        output = self._run_sampling(logits, tt_out_tok)
        ttnn.end_trace_capture(self.mesh_device, trace_id, cq_id=0)
        self._trace_states["force_argmax"] = {"id": trace_id, "input": logits, "output": output}
        return output

    def sample(self, logits, *, enable_trace=True, tt_out_tok=None, skip_precompile=False):
        slot = self._trace_states.get("force_argmax")
        if slot is None:
            return self.capture_trace(logits, tt_out_tok=tt_out_tok, skip_precompile=skip_precompile)
        if logits is not slot["input"]:
            raise ValueError("The provided logits tensor does not match the tensor used during trace capture. Call "
                             "`reset_trace()` before tracing with new tensors.")
        ttnn.execute_trace(self.mesh_device, slot["id"], cq_id=0, blocking=False)
        return slot["output"]

    def reset_trace(self):
        for slot in self._trace_states.values():
            ttnn.release_trace(self.mesh_device, slot["id"])
        self._trace_states.clear()


class SamplingParams:  # models/common/sampling (re-exported by tt/generator.py)
    def __init__(self, temperature=0.0, top_k=-1, top_p=1.0):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p


def create_tt_model(mesh_device, instruct, max_batch_size, optimizations, max_seq_len, paged_attention_config=None,
                    dtype=ttnn.bfloat8_b, state_dict=None, num_layers=None):
    """tt/common.py create_tt_model: ModelArgs, the Transformer with TT's own attention, each layer's cache."""
    args = ModelArgs(mesh_device, instruct=instruct, max_batch_size=max_batch_size, optimizations=optimizations,
                     max_seq_len=max_seq_len)
    if num_layers is not None:
        args.n_layers = num_layers
    state_dict = state_dict or args.load_state_dict()
    model = Transformer(args=args, mesh_device=mesh_device, dtype=dtype, state_dict=state_dict,
                        weight_cache_path=args.weight_cache_path(dtype), paged_attention_config=paged_attention_config)
    return args, model, [layer.attention.layer_past for layer in model.layers], state_dict


def create_submeshes(mesh_device, data_parallel, ttnn=ttnn):
    """tt/generator.py create_submeshes (622c6fb9): the mesh itself for one data-parallel model; a Galaxy's 32
    devices reshaped to 4 x 8 and split into _galaxy_data_parallel_submesh_shape's submeshes (rows of 8 for groups of
    8 or more), any other mesh into 1 x (devices / data_parallel). (ttnn: which one; the mock-device double passes
    the real one.)"""
    if data_parallel == 1:
        return [mesh_device]
    num_devices = mesh_device.get_num_devices()
    assert num_devices % data_parallel == 0, f"Unsupported device split: {num_devices} devices, {data_parallel} groups"
    per_group = num_devices // data_parallel
    if num_devices == 32:
        if tuple(mesh_device.shape) != (4, 8):
            mesh_device.reshape(ttnn.MeshShape(4, 8))
        shape = (per_group // 8, 8) if per_group >= 8 and per_group % 8 == 0 else (1, per_group)
        return mesh_device.create_submeshes(ttnn.MeshShape(*shape))
    return mesh_device.create_submeshes(ttnn.MeshShape(1, per_group))


class WarmupForwardMixin:
    """models/common/warmup/warmup_utils.py WarmupForwardMixin ("This class is used by vLLM"; read in its 2026 version
    whose warmup_model_decode takes the plugin's keywords: kv_cache, enable_trace, max_batch_size, num_blocks,
    can_sample_on_device, the rest defaulted): decode inputs of zeros -- tokens [B, 1], positions [B], a page table
    [B, num_blocks] of zeros -- through self.decode_forward once per sampling configuration. The stand-in samples
    greedily only, so its configurations are greedy and None (TT adds non-greedy ones unless greedy_only)."""

    def _create_decode_warmup_inputs(self, max_batch_size, num_blocks):
        tokens = torch.zeros(max_batch_size, 1, dtype=torch.int32)
        start_pos = torch.zeros(max_batch_size, dtype=torch.int32)
        page_table = torch.zeros(max_batch_size, num_blocks, dtype=torch.int32)
        return tokens, start_pos, page_table

    def _create_sampling_params(self, can_sample_on_device, batch_size, greedy_only=False):
        """warmup_utils.py _create_sampling_params (622c6fb9): [None] without on-device sampling; else a non-greedy
        configuration for each of penalties and log-probs on and off (unless greedy_only), a greedy one, and None."""
        if not can_sample_on_device:
            return [None]
        non_greedy = [] if greedy_only else [SamplingParams(temperature=[1.0] * batch_size, top_k=[10] * batch_size,
                                                            top_p=[0.9] * batch_size) for _ in range(4)]
        return non_greedy + [SamplingParams(temperature=[0.0] * batch_size, top_k=[1] * batch_size,
                                            top_p=[1.0] * batch_size), None]

    def warmup_model_decode(self, kv_cache, enable_trace, max_batch_size, num_blocks, can_sample_on_device,
                            can_sample_device_grammar=False, read_from_device=True, greedy_only=False,
                            skip_trace_precompile=False, sampling_trace_variants_prepared=False):
        tokens, start_pos, page_table = self._create_decode_warmup_inputs(max_batch_size, num_blocks)
        greedy = SamplingParams(temperature=0.0, top_k=1, top_p=1.0)
        for param in ([greedy, None] if can_sample_on_device else [None]):
            self.decode_forward(tokens=tokens, start_pos=start_pos, page_table=page_table, kv_cache=kv_cache,
                                enable_trace=enable_trace, read_from_device=read_from_device, sampling_params=param)


class Generator(WarmupForwardMixin):
    """tt/generator.py Generator (read at 87700c07; the prefill path at 000ec121 and 5cd1b56c's model.py): the first
    prefill_forward_text (warmup_prefill=True) runs the prefill warm-up sweep over
    ModelArgs.get_warmup_prefill_supported_seq_lens(), on user 0 with a page table of zeros, once per Generator.
    prefill_forward_text pads each prompt (get_padded_prefill_len), cuts the user's page table to the blocks the prompt
    fills (_get_prefill_user_page_table) and runs prefill_forward_single_user_text: prepare_inputs_prefill, then
    ttnn_prefill_forward with get_last_token at the last token's tile, whose logits come back through
    process_output_prefill; a prompt longer than max_prefill_chunk_size in chunks (prefill_forward_single_user_text)."""

    def __init__(self, model, model_args, mesh_device, processor=None, tokenizer=None):
        self.model, self.model_args, self.mesh_device = model, model_args, mesh_device
        self.already_warmed_up_prefill = False
        self.mode = None  # Mode.PREFILL or Mode.DECODE: the first decode after a prefill reloads its inputs
        self.prev_on_device_sampling = None
        self.resident = None  # the traced decode's token and position inputs as the device holds them
        self.trace_ids_decode = defaultdict(lambda: None)  # {sampling on device: {model: trace id}}
        self.trace_inputs_decode, self.trace_output_decode = {}, {}

    def warmup_model_prefill(self, kv_cache, enable_trace, can_sample_on_device, greedy_only=False):
        """tt/generator.py warmup_model_prefill (622c6fb9): each supported length once through prefill_forward_text;
        the first of them once per sampling configuration (sampling_parameters_sweeped: the sweep runs once), which
        with can_sample_on_device is WarmupForwardMixin._create_sampling_params' (warmup_utils.py): four non-greedy
        ones (penalties and log-probs on and off) unless greedy_only, a greedy one, and None."""
        if self.already_warmed_up_prefill:
            return
        self.already_warmed_up_prefill = True
        for i, seq_len in enumerate(self.model_args[0].get_warmup_prefill_supported_seq_lens()):
            blocks = num_blocks_in_seq(seq_len, get_block_size(kv_cache[0]))
            for param in (self._create_sampling_params(can_sample_on_device, 1, greedy_only) if i == 0 else [None]):
                self.prefill_forward_text(torch.zeros(1, seq_len, dtype=torch.long), kv_cache=kv_cache,
                                          page_table=torch.zeros(1, blocks, dtype=torch.int32), prompt_lens=[seq_len],
                                          empty_slots=[0], enable_trace=enable_trace, model_id_warmup=0,
                                          sampling_params=param)

    def _get_prefill_user_page_table(self, page_table, kv_cache, prefill_len, prefill_seq_len=None):
        return prefill_user_page_table(page_table, get_block_size(kv_cache),
                                       prefill_seq_len if prefill_seq_len is not None else prefill_len)

    def prefill_forward_text(self, tokens, page_table=None, kv_cache=None, prompt_lens=None, empty_slots=None,
                             enable_trace=True, model_id_warmup=None, sampling_params=None, start_pos=None,
                             return_hidden_states=False, warmup_prefill=True, **kwargs):
        self.mode = Mode.PREFILL
        if warmup_prefill:  # generator.py: on-device sampling enabled when the model built TT's sampling module
            self.warmup_model_prefill(kv_cache=kv_cache, enable_trace=enable_trace, can_sample_on_device=getattr(
                self.model[0], "_supports_on_device_sampling", False) and self.model[0].sampling is not None)
        assert page_table is not None, "stand-in: prefill with a page table"
        batch_size = tokens.shape[0]
        out = torch.zeros(batch_size, 1, self.model_args[0].vocab_size)
        for idx, user_id in enumerate(empty_slots if empty_slots is not None else range(batch_size)):
            model_id = user_id // self.model_args[0].max_batch_size if model_id_warmup is None else model_id_warmup
            seq_len = int(prompt_lens[idx])
            last_token_idx = seq_len - 1
            prefill_ids = F.pad(tokens[idx : idx + 1, :seq_len], (0, get_padded_prefill_len(seq_len) - seq_len))
            page_table_user = self._get_prefill_user_page_table(page_table[idx : idx + 1], kv_cache[model_id], seq_len,
                                                                prefill_ids.shape[-1])
            with torch.no_grad():
                logits = self.prefill_forward_single_user_text(prefill_ids, page_table=page_table_user, user_id=0,
                                                               last_token_idx=last_token_idx,
                                                               kv_cache=kv_cache[model_id], model_id=model_id)
                out[idx, 0] = self.model[model_id].process_output_prefill(logits, last_token_idx % 32)
        if sampling_params is not None:  # TT samples the first token on the device: (tokens [B, 1], log probs)
            return out.argmax(dim=-1), None
        return out

    def decode_forward(self, tokens, start_pos, page_table=None, kv_cache=None, enable_trace=True,
                       read_from_device=True, sampling_params=None, reset_batch=False, prompt_tokens=None,
                       output_tokens=None, **kwargs):
        """Mirrors tt/generator.py Generator.decode_forward and _decode_forward_trace_text (the 2026 control flow, as a
        TT-derived Generator restating it and tt-metal's generator.py with reset_batch show it). The batch is the
        model's max_batch_size rows (tt/model.py prepare_decode_inputs_host asserts it). A traced step that samples on
        the device reads the token and position inputs resident on the device: the host's replace them only on
        reset_batch, on the first decode after a prefill (the mode switch), when the sampling mode changed, or when
        the host samples (reset_inputs); the step then leaves its sampled tokens at the next positions there
        (ttnn.plus_one, negative positions skipped). The page table is the host's each step (TT stages it when it
        changed). read_from_device: read_decode_output, then process_decode_output_host; else the device output
        (a list of (output, log probs) per data-parallel model) for the runner's read-back. A traced step that samples
        on the device runs as _decode_forward_trace_text (_decode_trace), its output the sampled ids; otherwise the
        step runs eagerly, and on-device sampling there is greedy: an argmax of the logits, taken when they are read.
        (The stand-in keeps the resident inputs on the host and writes them into the trace's inputs every step.)"""
        mode_switched, self.mode = self.mode != Mode.DECODE, Mode.DECODE
        on_device_sampling = sampling_params is not None
        sampling_mode_changed = self.prev_on_device_sampling not in (None, on_device_sampling)
        self.prev_on_device_sampling = on_device_sampling
        traced_feedback = enable_trace and on_device_sampling
        if not traced_feedback or reset_batch or mode_switched or sampling_mode_changed or self.resident is None:
            self.resident = (tokens.reshape(-1).clone(), start_pos.reshape(-1).clone())
        fed_tokens, fed_pos = self.resident
        model = self.model[0]
        host = model.prepare_decode_inputs_host(fed_tokens, fed_pos, page_table)
        if traced_feedback and model.sampling is not None:
            out = [(self._decode_trace(host, kv_cache), None)]
        else:
            tt_tokens, current_pos, rope_idxs, tt_page_table = copy_host_to_device(host, mesh_device=self.mesh_device)
            logits, _ = model.ttnn_decode_forward(tt_tokens, current_pos, rot_mat_idxs=rope_idxs,
                                                  page_table=tt_page_table, kv_cache=kv_cache[0])
            out = [(logits, None)]
        if traced_feedback:
            sampled = self.process_decode_output_host(out, is_tokens=True)[0]
            self.resident = (sampled.to(fed_tokens.dtype), torch.where(fed_pos >= 0, fed_pos + 1, fed_pos))
        if read_from_device:
            return self.process_decode_output_host(self.read_decode_output(out), is_tokens=on_device_sampling)
        return out

    def _decode_trace(self, host, kv_cache):
        """tt/generator.py _decode_forward_trace_text with TT's split sampling (on by default): the first call captures
        the decode trace (_capture_decode_trace_text: a compile run, the capture over fresh device inputs with
        capture_sampling_trace, then the sampling module's own capture_trace over its logits); every call writes the
        inputs into the trace's, replays it and runs sampling_module.sample, which leaves the ids in the trace's token
        input: the step's output."""
        model = self.model[0]
        if not self.trace_ids_decode[True]:
            compile_inputs = copy_host_to_device(host, mesh_device=self.mesh_device)
            model.sampling._run_sampling(model.ttnn_decode_forward(
                *compile_inputs, kv_cache=kv_cache[0], sampling_on_device=True, capture_sampling_trace=True),
                compile_inputs[0])
            inputs = copy_host_to_device(host, mesh_device=self.mesh_device)
            trace_id = ttnn.begin_trace_capture(self.mesh_device, cq_id=0)
            logits = model.ttnn_decode_forward(*inputs, kv_cache=kv_cache[0], sampling_on_device=True,
                                               capture_sampling_trace=True)
            ttnn.end_trace_capture(self.mesh_device, trace_id, cq_id=0)
            model.sampling.capture_trace(logits=logits, tt_out_tok=inputs[0])
            self.trace_ids_decode[True] = {0: trace_id}
            self.trace_inputs_decode[True], self.trace_output_decode[True] = inputs, logits
        copy_host_to_device(host, device_tensors=self.trace_inputs_decode[True])
        ttnn.execute_trace(self.mesh_device, self.trace_ids_decode[True][0], cq_id=0, blocking=False)
        out_tok, _ = model.sampling.sample(self.trace_output_decode[True], tt_out_tok=self.trace_inputs_decode[True][0])
        return out_tok

    def read_decode_output(self, tt_out, async_read=False):
        """tt/generator.py read_decode_output: each model's (output, log probs) to the host (the stand-in keeps one
        kind of tensor; no read events)."""
        return (list(tt_out), []) if async_read else list(tt_out)

    def process_decode_output_host(self, tt_out, is_tokens=False):
        """tt/generator.py process_decode_output_host: (values, log probs) over all max_batch_size rows: token ids [B]
        with is_tokens (ids the device sampled: an integer tensor; logits: the stand-in's greedy sampling), else logits
        [B, 1, V]; log probs of ones where none came."""
        values, batch = [], self.model_args[0].max_batch_size
        for model, (out, _) in zip(self.model, tt_out):
            if is_tokens and out.dtype in (ttnn.uint32, ttnn.int32):
                values.append(ttnn.to_torch(out).reshape(-1)[:batch].long())
                continue
            rows = model.process_output_decode(out, batch)
            values.append(rows.argmax(dim=-1) if is_tokens else rows.unsqueeze(1))
        values = torch.cat(values)
        return values, torch.ones(values.shape)

    def prefill_forward_single_user_text(self, tokens, page_table, user_id, last_token_idx, kv_cache=None, model_id=-1,
                                         **kwargs):
        """tt/generator.py prefill_forward_single_user_text (the 2026 form, with num_cached_tokens; the index shows no
        commit for it): a padded prompt longer than max_prefill_chunk_size runs in chunks of
        get_max_prefill_chunk_size rows. "page_table must also have enough entries in each chunk, so it will be padded
        with zeros if necessary": page_table_user_padded = cat(page_table_user, zeros) to the padded prompt's blocks,
        each chunk's fill pages its slice (chunk_page_table), its attention the whole padded table; user_id 0
        (CHUNK_USER_ID); the chunk holding the last token is the last one run."""
        seq_len = tokens.shape[-1]
        model = self.model[model_id]
        if seq_len <= self.model_args[model_id].max_prefill_chunk_size:
            prefill_input, rot_mats_global, rot_mats_local, page_table_tt, _ = model.prepare_inputs_prefill(
                tokens, page_table=page_table)
            return model.ttnn_prefill_forward(prefill_input, rot_mats_global=rot_mats_global,
                                              rot_mats_local=rot_mats_local, user_id=user_id, page_table=page_table_tt,
                                              get_last_token=(last_token_idx // 32) * 32, kv_cache=kv_cache)
        assert page_table is not None, "page_table must be provided for chunked prefill"
        assert kv_cache is not None, "kv_cache must be provided for chunked prefill"
        chunk_size = get_max_prefill_chunk_size(seq_len, self.model_args[model_id].max_prefill_chunk_size)
        block_size = get_block_size(kv_cache)
        last_chunk_start = (last_token_idx // chunk_size) * chunk_size
        page_table_user = page_table[user_id : user_id + 1, :]
        num_padding_blocks = num_blocks_in_seq(seq_len, block_size) - page_table_user.shape[1]
        page_table_user_padded = torch.cat(
            [page_table_user, torch.zeros(1, num_padding_blocks, dtype=torch.int32)], dim=-1)
        for chunk_start in range(0, seq_len, chunk_size):
            chunk_end = chunk_start + chunk_size
            chunk_page_table = page_table_user_padded[:, chunk_start // block_size : chunk_end // block_size]
            chunk_input, rot_mats_global, rot_mats_local, page_table_tt, chunk_page_table_tt = \
                model.prepare_inputs_prefill(tokens[:, chunk_start:chunk_end], start_pos=chunk_start,
                                             page_table=page_table_user_padded, chunk_page_table=chunk_page_table)
            tt_logits = model.ttnn_prefill_forward(
                chunk_input, rot_mats_global=rot_mats_global, rot_mats_local=rot_mats_local, user_id=0,
                page_table=page_table_tt, chunk_page_table=chunk_page_table_tt, chunk_start_idx=chunk_start,
                get_last_token=((last_token_idx % chunk_size) // 32) * 32, kv_cache=kv_cache)
            if chunk_start == last_chunk_start:
                return tt_logits
