# SPDX-License-Identifier: Apache-2.0
"""Building TT-Transformers models for the ttnn backend with tt-metal's own helpers (pinned: tt-metal v0.81.1,
the release of the ttnn 0.81.1 wheel; README "On a Tenstorrent machine").

A model is TT-Transformers' `Transformer` built from `ModelArgs` for HF_MODEL, with a paged KV cache
(`PagedAttentionConfig`, blocks of 32 positions) and the decode batch of one 32-row tile (`max_batch_size=32`,
the row budget of a verification step), in tt-metal's text-demo configuration (bfloat8_b weights, the performance
precision preset). Each user owns a fixed run of cache blocks: its page-table row. The attention is
TT-Transformers' own through the `attention_class` hook, with ordered cache writes (attention.py).
"""
import hashlib
import inspect
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger

from ..checkpoints.cache import cache_root
from .attention import KVWritePasses, ordered_write_attention
from .tt_surface import full_layers

TILE_ROWS = 32  # rows of the decode batch: one tile; every verify row of every user shares it
BLOCK_SIZE = 32  # KV-cache positions per page


def blocks_per_user(positions: int) -> int:
    """A page-table row's blocks for `positions`, rounded up to a multiple of 8: int32 rows of a multiple of 32 bytes,
    as TT pads its own prefill page tables (generator.py _pad_or_create_page_table) and paged_fill_cache requires
    (`page_table_stick_size_B % 32 == 0`)."""
    return math.ceil(math.ceil(positions / BLOCK_SIZE) / 8) * 8


def supported_kwargs(fn, **kwargs) -> dict:
    """The keyword arguments `fn` accepts: TT-Transformers' signatures gained arguments between tags."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def named_checkpoint(folder: Path, name: str) -> Path:
    """The checkpoint under a path whose last component is the model's name, for HF_MODEL. TT-Transformers' ModelArgs
    takes model_name from there (tt/model_config.py, ModelArgs.__init__ and _set_params_from_dict, via the path
    AutoConfig records) and keys per-model settings on it (precision presets, prefill chunk sizes, trace sizes); a
    hub snapshot's folder is named by its hash and a converted GGUF's by "hf", so those get a link named after the
    model in our cache."""
    if folder.name == name:
        return folder
    link = cache_root() / "hf_model" / hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12] / name
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder.resolve(), target_is_directory=True)
        os.replace(tmp, link)
    return link


def weight_cache_root(folder: Path, name: str) -> Path:
    """TT_CACHE_PATH for ModelArgs, which caches converted weights under TT_CACHE_PATH/<device> (without it,
    model_cache/<HF_MODEL>/<device>: inside the checkpoint store for an absolute HF_MODEL). One folder per model name
    and resolved checkpoint under our cache root ($TT_CACHE_PATH, else ~/.cache/tt_speculative), so two checkpoints
    never read each other's tensors."""
    return cache_root() / "tt_transformers" / f"{name}-{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]}"


@contextmanager
def model_env(folder: Path, name: str):
    """HF_MODEL and TT_CACHE_PATH as ModelArgs reads them, for one model's construction."""
    saved = {key: os.environ.get(key) for key in ("HF_MODEL", "TT_CACHE_PATH")}
    os.environ["HF_MODEL"] = str(named_checkpoint(folder, name))
    os.environ["TT_CACHE_PATH"] = str(weight_cache_root(folder, name))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def precision(optimizations: str):
    """TT-Transformers' decoder precision preset as ModelArgs takes it: a function of the ModelArgs, the way
    tt-metal's text demo parametrizes it (simple_text_demo.py, optimizations)."""
    from models.tt_transformers.tt.model_config import DecodersPrecision

    preset = {"performance": DecodersPrecision.performance, "accuracy": DecodersPrecision.accuracy}[optimizations]
    return lambda model_args: preset(model_args.n_layers, model_args.model_name)


def model_args_seq_len(max_seq_len: int) -> int:
    """What ModelArgs gets as max_seq_len: the next power of two. Its prefill warm-up (the first
    Generator.prefill_forward_text) asserts that min(max_prefill_chunk_size, max_seq_len) is a power of two
    (tt/model_config.py, get_warmup_prefill_supported_seq_lens), so --max_seq_len 1280 would stop there. ModelArgs'
    max_seq_len sizes the rotary tables and bounds prefill; the KV cache is our paged one, sized by the real
    max_seq_len."""
    return 1 << (max_seq_len - 1).bit_length()


@dataclass
class TTModel:
    """A TT-Transformers model on a mesh device with its paged cache, page table and write passes."""

    model: Any  # models.tt_transformers.tt.model.Transformer (or a view of its first layers)
    args: Any  # its ModelArgs
    mesh_device: Any
    kv_cache: list  # per layer [k_cache, v_cache]
    page_table: torch.Tensor  # [max_users, blocks per user] int32: user u's cache blocks
    passes: KVWritePasses
    generator: Any  # models.tt_transformers.tt.generator.Generator, for prefill
    full_layers: int  # the checkpoint's layers (a view's args are the target's, truncated or not)

    @property
    def n_layers(self) -> int:
        return len(self.model.layers)

    def first_layers(self, n_layers: int) -> "TTModel":
        """The first n_layers layers with the same embedding, final norm, LM head and cache: the target's weights
        and cache, no copy. TT-Transformers' forward loops over `model.layers` and indexes kv_cache by layer."""
        import copy

        view = copy.copy(self.model)
        view.layers = self.model.layers[:n_layers]
        view.n_layers = n_layers
        return TTModel(view, self.args, self.mesh_device, self.kv_cache[:n_layers], self.page_table, self.passes,
                       None, self.full_layers)


def build_tt_model(mesh_device, checkpoint_folder: Path, name: str, max_users: int, max_seq_len: int, instruct: bool,
                   n_layers: Optional[int] = None, weights_dtype=None, optimizations: str = "performance") -> TTModel:
    """TT-Transformers' Transformer for the checkpoint (named `name`, its real model name), with ordered cache writes
    and a page-table row per user. n_layers: the first N layers only (as create_tt_model's num_layers);
    weights_dtype: default bfloat8_b and optimizations "performance", what tt-metal's text demo runs."""
    import ttnn
    from models.tt_transformers.tt.attention import Attention
    from models.tt_transformers.tt.common import PagedAttentionConfig
    from models.tt_transformers.tt.generator import Generator
    from models.tt_transformers.tt.model import Transformer
    from models.tt_transformers.tt.model_config import ModelArgs

    weights_dtype = weights_dtype or ttnn.bfloat8_b
    blocks = blocks_per_user(max_seq_len)
    with model_env(Path(checkpoint_folder), name):
        args = ModelArgs(mesh_device, instruct=instruct, max_batch_size=TILE_ROWS,
                         max_seq_len=model_args_seq_len(max_seq_len), optimizations=precision(optimizations))
    logger.info(f"TT-Transformers {args.model_name} on {args.device_name}: weights cached in {args.model_cache_path}")
    checkpoint_layers = full_layers(args)
    if n_layers is not None:
        args.n_layers = n_layers
    args.use_qk_fused = False  # the cache update is paged_update_cache, which attention.py orders
    passes = KVWritePasses()
    paged = PagedAttentionConfig(block_size=BLOCK_SIZE, max_num_blocks=max_users * blocks)
    model = Transformer(args=args, dtype=weights_dtype, mesh_device=mesh_device, state_dict=args.load_state_dict(),
                        weight_cache_path=args.weight_cache_path(weights_dtype), paged_attention_config=paged,
                        attention_class=ordered_write_attention(Attention, passes))
    kv_cache = [layer.attention.layer_past for layer in model.layers]
    page_table = torch.arange(max_users * blocks, dtype=torch.int32).view(max_users, blocks)
    return TTModel(model, args, mesh_device, kv_cache, page_table, passes, Generator([model], [args], mesh_device),
                   checkpoint_layers)
