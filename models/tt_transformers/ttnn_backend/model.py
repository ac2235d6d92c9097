# SPDX-License-Identifier: Apache-2.0
"""Building TT-Transformers models for the ttnn backend with tt-metal's own helpers (pinned: tt-metal v0.81.1,
the release of the ttnn 0.81.1 wheel; README "On a Tenstorrent machine").

A model is TT-Transformers' `Transformer` built from `ModelArgs` for HF_MODEL, with a paged KV cache
(`PagedAttentionConfig`, blocks of 32 positions) and the decode batch of one 32-row tile (`max_batch_size=32`,
the row budget of a verification step). Each user owns a fixed run of cache blocks: its page-table row. The
attention is TT-Transformers' own through the `attention_class` hook, with ordered cache writes (attention.py).
"""
import inspect
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .attention import KVWritePasses, ordered_write_attention

TILE_ROWS = 32  # rows of the decode batch: one tile; every verify row of every user shares it
BLOCK_SIZE = 32  # KV-cache positions per page


def supported_kwargs(fn, **kwargs) -> dict:
    """The keyword arguments `fn` accepts: TT-Transformers' signatures gained arguments between tags."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


@contextmanager
def hf_model_env(folder: str):
    """TT-Transformers' ModelArgs reads the checkpoint from HF_MODEL and caches converted weights under
    TT_CACHE_PATH/<device> (model_cache/<HF_MODEL>/<device> when unset): a target and a separate draft checkpoint
    get a cache folder each, TT_CACHE_PATH/<model>/<device>."""
    saved = {name: os.environ.get(name) for name in ("HF_MODEL", "TT_CACHE_PATH")}
    os.environ["HF_MODEL"] = folder
    if saved["TT_CACHE_PATH"]:
        os.environ["TT_CACHE_PATH"] = os.path.join(saved["TT_CACHE_PATH"], os.path.basename(folder.rstrip("/")))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
                       None)


def build_tt_model(mesh_device, checkpoint_folder: str, max_users: int, max_seq_len: int, instruct: bool,
                   n_layers: Optional[int] = None, weights_dtype=None, optimizations=None) -> TTModel:
    """TT-Transformers' Transformer for the checkpoint, with ordered cache writes and a page-table row per user.
    n_layers: the first N layers only (TT-Transformers' `num_layers`); weights_dtype: default bfloat8_b, as
    create_tt_model."""
    import ttnn
    from models.tt_transformers.tt.attention import Attention
    from models.tt_transformers.tt.common import PagedAttentionConfig
    from models.tt_transformers.tt.generator import Generator
    from models.tt_transformers.tt.model import Transformer
    from models.tt_transformers.tt.model_config import ModelArgs

    weights_dtype = weights_dtype or ttnn.bfloat8_b
    blocks_per_user = math.ceil(max_seq_len / BLOCK_SIZE)
    with hf_model_env(checkpoint_folder):
        args = ModelArgs(mesh_device, instruct=instruct, max_batch_size=TILE_ROWS, max_seq_len=max_seq_len,
                         optimizations=optimizations)
    if n_layers is not None:
        args.n_layers = n_layers
    args.use_qk_fused = False  # the cache update is paged_update_cache, which attention.py orders
    passes = KVWritePasses()
    paged = PagedAttentionConfig(block_size=BLOCK_SIZE, max_num_blocks=max_users * blocks_per_user)
    model = Transformer(args=args, dtype=weights_dtype, mesh_device=mesh_device, state_dict=args.load_state_dict(),
                        weight_cache_path=args.weight_cache_path(weights_dtype), paged_attention_config=paged,
                        attention_class=ordered_write_attention(Attention, passes))
    kv_cache = [layer.attention.layer_past for layer in model.layers]
    page_table = torch.arange(max_users * blocks_per_user, dtype=torch.int32).view(max_users, blocks_per_user)
    return TTModel(model, args, mesh_device, kv_cache, page_table, passes, Generator([model], [args], mesh_device))
