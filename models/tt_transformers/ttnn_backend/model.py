# SPDX-License-Identifier: Apache-2.0
"""Building TT-Transformers models for the ttnn backend with tt-metal's own helpers (pinned: tt-metal v0.81.1,
the release of the ttnn 0.81.1 wheel; README "On a Tenstorrent machine").

A model is TT-Transformers' `Transformer` built from `ModelArgs` for HF_MODEL, with a paged KV cache
(`PagedAttentionConfig`, blocks of 32 positions) and the decode batch of one 32-row tile (`max_batch_size=32`,
the row budget of a verification step), in the configuration tt-metal's text generation runs (bfloat8_b weights, the
performance precision preset; docs/ttnn_backend.md names where each setting comes from). Each user owns a fixed run of cache blocks: its page-table row. Physical block 0 belongs to no
user (SINK_BLOCK): TT-Transformers' chunked prefill pads a user's page table with zeros to the padded prompt's blocks
and fills the cache through it (tt/generator.py prefill_forward_single_user_text: page_table_user_padded), and
paged_fill_cache skips only -1 entries (writer_fill_cache_interleaved.cpp in the ttnn 0.81.1 wheel:
SKIP_PAGE_TABLE_ENTRY = (uint32_t)-1), so a long prompt's padding K/V land in block 0; TT's prefill warm-up pages
everything there too (warmup_model_prefill: a page table of zeros). The attention is TT-Transformers' own through the
`attention_class` hook, with ordered cache writes (attention.py).
"""
import dataclasses
import hashlib
import inspect
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger

from ..checkpoints.cache import cache_root
from ..checkpoints.checkpoint import Checkpoint
from ..checkpoints.model_shape import ModelShape
from .attention import KVWritePasses, ordered_write_attention
from .device import check_tensor_parallel
from .tt_surface import full_layers
from .ttnn_api import ttnn

TILE_ROWS = 32  # rows of the decode batch: one tile; every verify row of every user shares it
BLOCK_SIZE = 32  # KV-cache positions per page
SINK_BLOCK = 0  # the physical cache block no user owns: where zero-padded page tables write (module docstring)


def blocks_per_user(positions: int) -> int:
    """A page-table row's blocks for `positions`, rounded up to a multiple of 8: int32 rows of a multiple of 32 bytes,
    as TT pads its own prefill page tables (generator.py _pad_or_create_page_table) and paged_fill_cache requires
    (`page_table_stick_size_B % 32 == 0`)."""
    return math.ceil(math.ceil(positions / BLOCK_SIZE) / 8) * 8


def paged_cache(max_users: int, max_seq_len: int) -> tuple[Any, torch.Tensor]:
    """TT's PagedAttentionConfig for max_users users of max_seq_len positions, and the page table [max_users, blocks]
    int32 (user u's cache blocks): every block but SINK_BLOCK belongs to one user."""
    from models.tt_transformers.tt.common import PagedAttentionConfig

    blocks = blocks_per_user(max_seq_len)
    owned = torch.arange(max_users * blocks, dtype=torch.int32).view(max_users, blocks) + (SINK_BLOCK + 1)
    return PagedAttentionConfig(block_size=BLOCK_SIZE, max_num_blocks=max_users * blocks + 1), owned


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
    tt-metal's text generation parametrizes it (its `optimizations` parameter)."""
    from models.tt_transformers.tt.model_config import DecodersPrecision

    preset = {"performance": DecodersPrecision.performance, "accuracy": DecodersPrecision.accuracy}[optimizations]
    return lambda model_args: preset(model_args.n_layers, model_args.model_name)


def model_args_seq_len(max_seq_len: int) -> int:
    """What ModelArgs gets as max_seq_len: the length TT pads a prompt of max_seq_len tokens to
    (tt/common.py get_padded_prefill_len: at 622c6fb9 128, else 1,024, else the next power of two), at least the next
    power of two. ModelArgs' max_seq_len sizes the rotary tables, and Transformer.prepare_inputs_prefill (tt/model.py)
    asserts the padded prompt fits them ("Sequence length 1024 exceeds max seq len 256": TT's own prefill warm-up and
    any prompt over 128 tokens would stop there at --max_seq_len 256); TT's prefill warm-up (the first
    Generator.prefill_forward_text) asserts that min(max_prefill_chunk_size, max_seq_len) is a power of two
    (tt/model_config.py get_warmup_prefill_supported_seq_lens), so --max_seq_len 1280 would stop there. Both rules give
    a power of two. The KV cache is our paged one, sized by the real max_seq_len: a padded prompt's positions past a
    user's blocks are skipped (-1) or go to SINK_BLOCK (zeros), as TT pads the page table."""
    from models.tt_transformers.tt.common import get_padded_prefill_len

    return max(1 << (max_seq_len - 1).bit_length(), get_padded_prefill_len(max_seq_len))


# Prompts up to this many tokens have every last-token tile warmed (prefill_warm_prompts): one prefill per 32
# positions, 32 prefills of 32 to 1,024 tokens (22,016 positions in all, about 20 x TT's own sweep at max_seq_len
# 1024). Past it each tile would cost a prefill as long as the prompt (256 more prefills, 1.2 M positions, at
# max_seq_len 8192): not warmed, covered by remaking the traces after a prefill that compiled
# (traces.MeshTraces.remake_after).
PER_TILE_WARM_POSITIONS = 1024


def prefill_warm_prompts(args, max_seq_len: int) -> list[int]:
    """The prompt lengths the backend's warm-up prefills (TtnnCausalLM._warm_up_prefill) so that no prompt of up to
    max_seq_len tokens compiles a prefill program while decode traces are live, as far as that is cheap:
    - one prompt of each padded length (TT's get_padded_prefill_len of 1..max_seq_len) that TT's own warm-up sweep
      does not run (ModelArgs.get_warmup_prefill_supported_seq_lens, tt/model_config.py: 128 and 1024 x 2^k up to
      capped_warmup_seq_len, plus the trace-supported lengths): tt/common.py@622c6fb9 pads to 128 up to 128 tokens,
      to 1,024 up to 1,024, then to the next power of two (older trees padded to powers of 2 or multiples of 2,048;
      the function is TT's, so either rule is followed), which also covers the lengths TT prefills in chunks (past
      max_prefill_chunk_size: chunked SDPA compiles once per chunk_start_idx and page-table width in real ttnn
      0.81.1, counted with num_program_cache_entries on the mock device). A prompt of the padded length runs every
      chunk a shorter one of that length runs;
    - one prompt of 32 b tokens for every block count b of the prompts up to PER_TILE_WARM_POSITIONS: TT's
      Transformer.forward slices the last token's 32 rows, `ttnn.slice(x, (0, 0, get_last_token, 0), (1, 1,
      get_last_token + 32, x.shape[-1]))` (tt/model.py@622c6fb9), and ttnn keys a slice's program by its offsets: a
      prompt of 32 b tokens has its last token in tile b - 1. (Its attention fills the cache through the user's page
      table, which Generator._get_prefill_user_page_table cuts to the padded length's blocks and pads with -1 at
      622c6fb9, to the prompt's blocks in older trees, where paged_fill_cache's program also follows b.)
    A prompt stands for its (padded length, blocks) class; the classes TT's sweep already ran (its lengths as whole
    prompts) and the one-token prefill that triggers the sweep are left out. args' rotary tables hold every padded
    prompt (model_args_seq_len, build_tt_model's and the serving class's sizing). Without
    get_warmup_prefill_supported_seq_lens (older ModelArgs) every padded length is prefilled."""
    from models.tt_transformers.tt.common import get_padded_prefill_len

    def kind(n: int) -> tuple[int, int]:
        return get_padded_prefill_len(n), math.ceil(n / BLOCK_SIZE)
    swept = getattr(args, "get_warmup_prefill_supported_seq_lens", None)
    done = {kind(n) for n in (swept() if callable(swept) else ())} | {kind(1)}
    padded = {get_padded_prefill_len(n) for n in range(1, max_seq_len + 1)}
    candidates = [min(length, max_seq_len) for length in sorted(padded)]  # past max_seq_len: its longest prompt
    per_tile = min(max_seq_len, PER_TILE_WARM_POSITIONS)
    candidates += [min(b * BLOCK_SIZE, per_tile) for b in range(1, math.ceil(per_tile / BLOCK_SIZE) + 1)]
    prompts = {}
    for n in candidates:
        if kind(n) not in done:
            prompts.setdefault(kind(n), n)
    return sorted(prompts.values())


def tt_prefill_warm_up(generator, kv_cache) -> None:
    """TT's own prefill warm-up without its on-device sampling sweep. TT's first prefill_forward_text runs
    Generator.warmup_model_prefill (tt/generator.py), a prefill of every get_warmup_prefill_supported_seq_lens length,
    the first of them once per sampling configuration when the model has TT's sampling module
    (models/common/warmup/warmup_utils.py _create_sampling_params: penalties, log-probs, top k/p). This backend never
    samples through TT's module (its argmax and top k run on the logits, vocab.py), and that sweep fails on one device
    with the ttnn 0.81.1 wheel: at tt-metal 622c6fb9, tt_sampling.py's multi-step reduction (on a 1x1 mesh) hands
    ttnn.topk an indices tensor half its input's width, which 0.81.1's topk refuses ("indices_tensor->logical_shape()
    == input_tensor.logical_shape()"). So the warm-up runs here first with can_sample_on_device=False (one pass per
    length, sampling_params None), which marks it done for every later prefill_forward_text. A Generator without that
    argument (older tags) keeps its own warm-up, run by its first prefill."""
    warm = getattr(generator, "warmup_model_prefill", None)
    if warm is not None and supported_kwargs(warm, can_sample_on_device=False):
        warm(kv_cache=kv_cache, enable_trace=False, can_sample_on_device=False)


def prefill_into_sink(generator, kv_cache, blocks: int, lengths) -> None:
    """One prefill of each length (zeros) through TT's prefill_forward_text into SINK_BLOCK (a page-table row of
    `blocks` sink entries, which TT cuts to the prompt's blocks as it cuts a user's), for the programs it compiles:
    the warm-ups of TtnnCausalLM and of the serving class (serving/ttnn_model.py), after TT's own
    (tt_prefill_warm_up)."""
    tt_prefill_warm_up(generator, kv_cache)
    sink = torch.full((1, blocks), SINK_BLOCK, dtype=torch.int32)
    for n in lengths:
        generator.prefill_forward_text(torch.zeros(1, n, dtype=torch.long), **supported_kwargs(
            generator.prefill_forward_text, kv_cache=kv_cache, prompt_lens=[n], empty_slots=[0], page_table=sink,
            enable_trace=False))


# Bytes per value as TT stores them: a 32 x 32 tile of bfloat8_b is 1,024 mantissa bytes and 64 shared exponents, one
# of bfloat4_b 512 bytes of 4-bit mantissas and the same 64 exponents (tt-metal's tile_size for Bfp8_b and Bfp4_b)
VALUE_BYTES = {"bfloat16": 2.0, "bfloat8_b": 1088 / 1024, "bfloat4_b": 576 / 1024, "float32": 4.0}


def dtype_name(dtype) -> str:
    """A ttnn dtype's name as VALUE_BYTES keys it (ttnn.bfloat8_b prints as DataType.BFLOAT8_B)."""
    return str(dtype).rsplit(".", 1)[-1].lower()


def key_cost(config: ModelShape, n_layers: int, weights_dtype: str, optimizations: str, cache_dtype: str) -> float:
    """What one row reading one cached position adds to a step, in units of streaming the weights once (the step cost's
    unit, TtnnCausalLM.step_cost): paged SDPA decode reads the K and V of every layer at each position up to each
    row's own, so its bytes grow with rows x context, against the weights every step streams (each layer's matmuls and
    the LM head: the embedding is a lookup). Dtypes as TT stores them: the KV cache's own, the weights' with FF1/FF3
    in bfloat4_b under the performance preset (tt/model_config.py ModelOptimizations.performance: "All models use bfp4
    in FF1 and FF3 MLPs in this configuration"). Llama-3.1-8B's figure: docs/ttnn_backend.md."""
    a, w = config, VALUE_BYTES[weights_dtype]
    ff1_ff3 = VALUE_BYTES["bfloat4_b"] if optimizations == "performance" and weights_dtype == "bfloat8_b" else w
    layer = (a.dim * a.head_dim * (2 * a.n_heads + 2 * a.n_kv_heads) * w  # wqkv and wo
             + 2 * a.dim * a.hidden_dim * ff1_ff3 + a.dim * a.hidden_dim * w)  # FF1, FF3; FF2
    kv_per_position = n_layers * 2 * a.n_kv_heads * a.head_dim * VALUE_BYTES[cache_dtype]
    return kv_per_position / (n_layers * layer + a.dim * a.vocab_size * w)


@dataclass
class TTModel:
    """A TT-Transformers model on a mesh device with its paged cache, page table and write passes."""

    model: Any  # models.tt_transformers.tt.model.Transformer (or a view of its first layers)
    args: Any  # its ModelArgs
    mesh_device: Any
    kv_cache: list  # per layer [k_cache, v_cache]
    page_table: torch.Tensor  # [max_users, blocks per user] int32: user u's cache blocks (paged_cache)
    passes: KVWritePasses
    generator: Any  # models.tt_transformers.tt.generator.Generator, for prefill
    full_layers: int  # the checkpoint's layers (a view's args are the target's, truncated or not)
    config: ModelShape  # the checkpoint's shapes (config.json)
    weights_dtype: str  # dtype_name of the weights
    optimizations: str  # TT's precision preset: performance or accuracy
    checkpoint: Optional[Checkpoint] = None  # its files: a draft head's embedding, the head shipped for its name

    @property
    def n_layers(self) -> int:
        return len(self.model.layers)

    def key_cost(self) -> float:
        """key_cost for these layers, the cache's dtype as allocated."""
        return key_cost(self.config, self.n_layers, self.weights_dtype, self.optimizations,
                        dtype_name(self.kv_cache[0][0].dtype))

    def first_layers(self, n_layers: int) -> "TTModel":
        """The first n_layers layers with the same embedding, final norm, LM head and cache: the target's weights
        and cache, no copy. TT-Transformers' forward loops over `model.layers` and indexes kv_cache by layer."""
        import copy

        view = copy.copy(self.model)
        view.layers = self.model.layers[:n_layers]
        view.n_layers = n_layers
        return dataclasses.replace(self, model=view, kv_cache=self.kv_cache[:n_layers], generator=None)


def build_tt_model(mesh_device, checkpoint_folder: Path, name: str, max_users: int, max_seq_len: int, instruct: bool,
                   n_layers: Optional[int] = None, weights_dtype=None, optimizations: str = "performance") -> TTModel:
    """TT-Transformers' Transformer for the checkpoint (named `name`, its real model name), with ordered cache writes
    and a page-table row per user. n_layers: the first N layers only (as create_tt_model's num_layers);
    weights_dtype: default bfloat8_b and optimizations "performance", tt-metal's own text-generation defaults."""
    from models.tt_transformers.tt.attention import Attention
    from models.tt_transformers.tt.generator import Generator
    from models.tt_transformers.tt.model import Transformer
    from models.tt_transformers.tt.model_config import ModelArgs

    check_tensor_parallel(mesh_device)
    weights_dtype = weights_dtype or ttnn.bfloat8_b
    with model_env(Path(checkpoint_folder), name):
        args = ModelArgs(mesh_device, instruct=instruct, max_batch_size=TILE_ROWS,
                         max_seq_len=model_args_seq_len(max_seq_len), optimizations=precision(optimizations))
    logger.info(f"TT-Transformers {args.model_name} on {args.device_name}: weights cached in {args.model_cache_path}")
    checkpoint_layers = full_layers(args)
    if n_layers is not None:
        args.n_layers = n_layers
    args.use_qk_fused = False  # the cache update is paged_update_cache, which attention.py orders
    passes = KVWritePasses()
    paged, page_table = paged_cache(max_users, max_seq_len)
    model = Transformer(args=args, dtype=weights_dtype, mesh_device=mesh_device, state_dict=args.load_state_dict(),
                        weight_cache_path=args.weight_cache_path(weights_dtype), paged_attention_config=paged,
                        attention_class=ordered_write_attention(Attention, passes))
    kv_cache = [layer.attention.layer_past for layer in model.layers]
    return TTModel(model, args, mesh_device, kv_cache, page_table, passes, Generator([model], [args], mesh_device),
                   checkpoint_layers, ModelShape.from_hf_config(json.loads((Path(checkpoint_folder) /
                                                                              "config.json").read_text())),
                   dtype_name(weights_dtype), optimizations, Checkpoint(Path(checkpoint_folder), name))
