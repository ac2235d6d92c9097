# SPDX-License-Identifier: Apache-2.0
"""The ttnn side of serving: TT-Transformers' own vLLM Llama and Mistral classes, speculating.

`SpecLlamaForCausalLM` and `SpecMistralForCausalLM` subclass TT-Transformers' `generator_vllm.LlamaForCausalLM` and
`generator_vllm.MistralForCausalLM` (tt-metal's models/tt_transformers/tt/generator_vllm.py), imported when first
asked for: tt-metal is not installed where this package is tested, so the classes are made by this module's
`__getattr__`, which the plugin's lazy "module:Class" registration reaches (vLLM imports the module and getattr's the
class). Everything this file does not override is TT-Transformers' own: prefill, the ordinary decode and its traces,
KV-cache allocation, prefill warm-up. Launched without a speculative config the class is TT's, unchanged.

What speculating adds (docs/serving.md; the contract: serving/contract.py, pinned there):
- `model_capabilities` gains plan.SPEC_CAPABILITIES; `spec_plan` is plan.plan_speculation (the 32-row tile rule).
- `initialize_vllm_model(..., vllm_config=None)` (the plugin's loader passes vllm_config: vllm-tt-plugin
  src/vllm_tt_plugin/loader.py@0cd06959, TTModelLoader.load_model) reads K from the launch's speculative config and
  builds TT's model through TT's own `initialize_vllm_model`, with three changes: each layer's attention is
  TT-Transformers' `Attention` with ordered cache writes (ttnn_backend/attention.py, through `Transformer`'s
  `attention_class` hook), built with `use_qk_fused = False` (outside a verify it issues TT's own single cache
  update); and the model is built for the 32-row tile (max_batch_size 32, one of TT's batch sizes), every row of
  which a verify can fill, so TT's ordinary decode gets the plugin's B rows padded to 32 and its results cut back;
  and its ModelArgs hold max_model_len's longest prompt as TT pads it (ttnn_backend.model.model_args_seq_len: 1,024
  at a max_model_len of 129 to 1,023), as the demo's do.
- `decode_forward` with `spec_mode` is the verify: the [B, 1+K] block (or the [B, 1] one-column verify the runner
  pinned, model_runner.py@02f45e5f, sends on a step without drafts: the one-pass program) becomes rows of ONE decode
  step of the 32-row tile (serving/core.py SpecDecodeCore.verify over ttnn_backend's TtnnCausalLM.step: ordered cache
  writes, argmax and top-k on the device), on vLLM's `kv_cache` and the page table the scheduler sends with this step:
  row r of the tile carries its request's page-table row, staged with every other input into the persistent device
  inputs before the replay (TtnnCausalLM._run_inputs). No page table is built once.
- warm-up: the plugin's runner calls `warmup_model_decode(enable_trace=False, ...)` then `(enable_trace=True, ...)`
  (vllm-tt-plugin src/vllm_tt_plugin/model_runner.py@02f45e5f, TTModelRunner.warmup_model), with no K: TT's own
  decode warm-up runs first, then every verify program the plan's K can reach (a block's longest row needs 1 to 1+K
  ordered write passes: trace_plan.pass_ladder(1 + K)) is compiled in the first call and each captured once in the
  second. A verify step whose program was not prepared at warm-up raises: nothing is compiled or captured while
  serving.
- `propose_draft_tokens` is serving/proposer.py's CopiedDraftProposer (copied drafts, num_valid from the package's
  draft-length policy); `release_request`, `note_state_slots_moved` and `release_persistent_capture` are the
  contract's lifecycle hooks.
- registration: `write_model_bundles(folder)` writes the EXTRA_MODELS_DIR bundles the plugin registers before its
  built-in map (vllm-tt-plugin src/vllm_tt_plugin/platform.py, _iter_extra_model_bundles and
  _register_models_from_extra_dir: each folder's vllm_metadata.json names `arch` and `main_class`; the arch is
  registered as "TT" + arch, first registration wins).
"""
import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger

from .contract import MODEL_OWNED_DRAFTER, SpecReject, check_page_table, to_plugin
from .core import SpecDecodeCore
from .plan import SPEC_CAPABILITIES, plan_speculation, tt_layout_refusal

TT_GENERATOR_VLLM = "models.tt_transformers.tt.generator_vllm"
# HF architecture -> (this module's class, TT-Transformers' class it subclasses in generator_vllm.py)
SPEC_CLASSES = {"LlamaForCausalLM": ("SpecLlamaForCausalLM", "LlamaForCausalLM"),
                "MistralForCausalLM": ("SpecMistralForCausalLM", "MistralForCausalLM")}
SPEC_ARGUMENTS = ("num_valid_drafts", "accepted_counts", "spec_mode")  # they come together or not at all
# the trace region vllm-tt-plugin opens the mesh with unless its TT config names one (src/vllm_tt_plugin/worker.py
# @074b07f8 device_params_from_tt_config: additional_config["tt"]["trace_region_size"], config.py get_tt_config)
PLUGIN_TRACE_REGION = 50_000_000


def plugin_region_flag(size: int) -> str:
    """The vLLM launch option that has vllm-tt-plugin open the mesh with a trace region of `size` bytes."""
    return f"""--additional-config '{{"tt": {{"trace_region_size": {size}}}}}'"""


def launch_config(vllm_config):
    """The launch's vLLM config: the loader's (loader.py@0cd06959 passes it; the plugin's main @e3fc8494 does not),
    else the one vLLM holds as current while it builds a model (vllm.config: get_current_vllm_config_or_none where
    it exists, else get_current_vllm_config, which newer vLLMs make raise when none is set); None without vLLM."""
    if vllm_config is not None:
        return vllm_config
    try:
        from vllm import config
    except ImportError:
        return None
    current = getattr(config, "get_current_vllm_config_or_none", None)
    if current is not None:
        return current()
    try:
        return config.get_current_vllm_config()
    except AssertionError:
        return None


def speculative_k(vllm_config) -> Optional[int]:
    """The launch's draft length (speculative_config.num_speculative_tokens, which the plugin sets to the admitted
    plan's effective_k), or None for a launch without speculation."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    if spec_config is None:
        return None
    k = getattr(spec_config, "num_speculative_tokens", None)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}")
    return k


@contextlib.contextmanager
def ordered_write_models(passes):
    """While TT-Transformers builds its models, each `Transformer` is built with ordered cache writes: TT's
    Transformer.__init__ (tt/model.py: args, dtype, mesh_device, state_dict, weight_cache_path, ...,
    attention_class=None, ...) is wrapped on the class itself, so whatever builds it (generator_vllm's
    initialize_vllm_text_transformer, by keyword or position, through any import path or a subclass) gets
    `attention_class` set after `args.use_qk_fused = False` (read once by TT's Attention.__init__: the fused update
    cannot be split into ordered passes). A caller that brings its own attention_class is refused: the verify's writes
    would not be ordered. Yields the list of models built so, to check that TT's path went through it."""
    from models.tt_transformers.tt.attention import Attention
    from models.tt_transformers.tt.model import Transformer

    from ..ttnn_backend.attention import ordered_write_attention

    original, built = Transformer.__init__, []
    signature, attention = inspect.signature(original), ordered_write_attention(Attention, passes)

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        if call.arguments.get("attention_class") is not None:
            raise RuntimeError(f"TT-Transformers built its Transformer with attention_class "
                               f"{call.arguments['attention_class'].__name__}: the verify's ordered cache writes "
                               "(ttnn_backend/attention.py) cannot replace it")
        call.arguments["args"].use_qk_fused = False
        call.arguments["attention_class"] = attention
        original(*call.args, **call.kwargs)
        built.append(self)

    Transformer.__init__ = init
    try:
        yield built
    finally:
        Transformer.__init__ = original


def checkpoint_shapes(hf_config):
    """The checkpoint's shapes (checkpoints.model_shape): from vLLM's hf_config (a transformers config), or the
    config.json of the folder it names."""
    from ..checkpoints.model_shape import ModelShape

    config = (hf_config.to_dict() if hasattr(hf_config, "to_dict") else
              json.loads((Path(hf_config._name_or_path) / "config.json").read_text()))
    return ModelShape.from_hf_config(config)


class PagedVerify:
    """The verify on the device: ttnn_backend's TtnnCausalLM (one traced decode step of the 32-row tile, ordered
    cache writes, argmax and top-k on the device) over TT-Transformers' model, reading vLLM's KV cache and the page
    table each step brings. Built before vLLM allocates the cache; `warm` binds the cache and the page-table width
    the scheduler sends (max_num_blocks_per_req: the runner's warm-up passes it as num_blocks), plans the programs of
    the plan's K, and compiles (warm-up phase 1) or captures (phase 2) them; `step` runs one verify."""

    def __init__(self, model, args, mesh_device, passes, max_seq_len: int, num_drafts: int, config,
                 optimizations: str):
        """config: the checkpoint's shapes (checkpoint_shapes), for the step cost (TTModel.key_cost); the weights are
        bfloat8_b, initialize_vllm_text_transformer's default dtype."""
        from ..ttnn_backend.causal_lm import TtnnCausalLM
        from ..ttnn_backend.traces import MeshTraces
        from ..ttnn_backend.model import TILE_ROWS, TTModel
        from ..ttnn_backend.tt_surface import full_layers

        self.tt = TTModel(model=model, args=args, mesh_device=mesh_device, kv_cache=None, page_table=None,
                          passes=passes, generator=None, full_layers=full_layers(args), config=config,
                          weights_dtype="bfloat8_b", optimizations=optimizations)
        mesh_traces = MeshTraces(mesh_device, region_fix=lambda size: f"relaunch vLLM with {plugin_region_flag(size)}")
        self.lm = TtnnCausalLM(self.tt, TILE_ROWS, max_seq_len, mesh_traces=mesh_traces, trace=False)
        self.num_drafts = num_drafts
        self.width: Optional[int] = None  # the page table's blocks per row, fixed at warm-up

    def warm(self, kv_cache, num_blocks: int, top_k: int, trace: bool) -> None:
        """Warm-up: the first call binds vLLM's cache (kv_cache[0]: the one data-parallel model's per-layer [k, v])
        and the page-table width, and plans every verify program of the plan's K: the write-pass counts
        trace_plan.pass_ladder(1 + K), each with the proposer's top k (trace_plan.trace_keys; its plain baseline key,
        which a verify never uses, is left out). trace False compiles them (each run once, writing nothing to the
        cache); trace True captures each once (ttnn_backend.traces.MeshTraces.prepare). Until a step brings the
        scheduler's page table the inputs hold a table of zeros, as TT's own decode warm-up pages every row into
        block 0 (models/common/warmup/warmup_utils.py, WarmupForwardMixin._create_decode_warmup_inputs). Phase 1 logs
        the trace region the launch needs before anything is captured (the plugin's default is sized for TT's traces
        only), and a region error at capture names the plugin's option."""
        from ..ttnn_backend.trace_plan import pass_ladder, region_bytes, trace_keys, tt_trace_region

        if self.tt.kv_cache is None:
            self.tt.kv_cache, self.width = kv_cache[0], int(num_blocks)
            self.lm.key_cost = self.tt.key_cost()  # the cache's dtype as vLLM's preset allocated it
            self.tt.page_table = torch.zeros(self.lm.max_batch_size, self.width, dtype=torch.int32)
            self.lm.ladder = pass_ladder(1 + self.num_drafts)
            self.lm.planned = {key for key in trace_keys(1 + self.num_drafts, top_k, ()) if key[1] == top_k}
        elif kv_cache[0] is not self.tt.kv_cache or int(num_blocks) != self.width:
            raise ValueError(f"warm-up with another KV cache or page-table width ({num_blocks}, first {self.width}): "
                             "the verify programs are bound to the first")
        self.lm.trace = bool(trace)
        if not trace:
            args, planned = self.tt.args, self.trace_bytes()
            size = tt_trace_region(args.model_name, args.device_name) + region_bytes([planned])
            logger.info(f"speculative verify, K={self.num_drafts}: {len(self.lm.planned)} traces planned (write passes "
                        f"{self.lm.ladder}), about {planned / 1e6:.0f} MB of trace region beyond TT-Transformers' own "
                        f"decode trace: the mesh needs about {size} B of trace region (vllm-tt-plugin opens it with "
                        f"{PLUGIN_TRACE_REGION} B unless launched with {plugin_region_flag(size)})")
        try:
            self.lm.mesh_traces.prepare()
        finally:
            self.tt.passes.positions = []  # TT's own decode issues its single cache update again
        if trace:
            logger.info(f"speculative verify, K={self.num_drafts}: {len(self.lm.traces)} traces captured (write passes "
                        f"{sorted(key[0] for key in self.lm.traces)}), about {self.trace_bytes() / 1e6:.0f} MB of "
                        "trace region beyond TT-Transformers' own decode trace")

    def trace_bytes(self) -> int:
        """The planned traces' estimated trace-region bytes (trace_plan.trace_bytes, scaled from TT's own figures)."""
        from ..ttnn_backend.trace_plan import trace_bytes

        args = self.tt.args
        return sum(trace_bytes(args.model_name, args.device_name, self.tt.full_layers, self.lm.n_layers, key,
                               self.lm.vocab.share) for key in self.lm.planned)

    def check(self, rows, top_k: int, page_table, kv_cache) -> None:
        """What a verify over `rows` (UserRows: user = decode row = page-table row) refuses, before anything runs or
        changes: what check_table refuses (a page table narrower than warm-up's is padded: step), more rows than a step
        holds, a chain longer than 1 + K, a program warm-up did not prepare (nothing is compiled or captured while
        serving)."""
        from ..ttnn_backend.trace_plan import passes_for

        self.check_table(rows, page_table, kv_cache, "verify", narrower=True)
        self.lm._check_rows(sum(len(r.tokens) for r in rows))
        longest = max(len(r.tokens) for r in rows)
        if longest > self.lm.ladder[-1]:
            raise ValueError(f"a verify row chain of {longest} tokens is longer than 1 + K = {self.lm.ladder[-1]}")
        passes = passes_for(longest, self.lm.ladder)
        ready = self.lm.traces if self.lm.trace else self.lm.compiled
        if not any(key[0] == passes and key[1] == top_k and not key[2] for key in ready):
            raise RuntimeError(f"no verify program for {passes} write passes and top {top_k} was "
                               f"{'captured' if self.lm.trace else 'compiled'} at warm-up: nothing is compiled or "
                               "captured while serving")

    def check_table(self, rows, page_table, kv_cache, call: str, narrower: bool = False) -> None:
        """What a decode over `rows` (a verify, or TT's own decode) refuses of its cache and page table: no warm-up,
        another KV cache, a page table of another width than warm-up's (TT's decode trace was captured with that
        width: models/common/warmup/warmup_utils.py, WarmupForwardMixin._create_decode_warmup_inputs; `narrower`: a
        verify pads a narrower one, step), or rows whose blocks contract.check_page_table refuses (tt/attention.py
        Attention.forward_decode's paged_update_cache writes whatever block the table names; a row's blocks must
        reach its last position)."""
        if self.width is None:
            raise RuntimeError(f"a {call} before warmup_model_decode: its programs are compiled and captured there")
        if kv_cache is not None and kv_cache[0] is not self.tt.kv_cache:
            raise ValueError(f"decode_forward's kv_cache is not the one the {call} was warmed up on")
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or not (
                page_table.shape[1] <= self.width if narrower else page_table.shape[1] == self.width):
            shape = list(page_table.shape) if isinstance(page_table, torch.Tensor) else type(page_table).__name__
            raise ValueError(f"{call} page_table must be [B, {'<= ' if narrower else ''}{self.width}] (the width "
                             f"warm-up was given as num_blocks), got {shape}")
        blocks = self.tt.kv_cache[0][0].shape  # vLLM's [num_blocks, n_kv_heads, block_size, head_dim]
        check_page_table(page_table, [(r.user, r.start_pos, r.start_pos + len(r.tokens)) for r in rows],
                         int(blocks[0]), int(blocks[2]), call)

    def step(self, rows, top_k: int, page_table):
        """One checked verify (check) with this step's page table, replaying the program warm-up prepared for the
        rows' longest chain. A table narrower than warm-up's is padded to it with -1, as TT pads a prefill's page table
        to the width its program was built for (tt/generator.py _pad_or_create_page_table; TT's decode stages the
        table it is given into its trace's input as it is, _decode_forward_trace_text): the padded blocks lie past
        every row's last position (check), which is as far as the cache update and the attention of a row read its
        page-table row."""
        extra = self.width - page_table.shape[1]
        if extra > 0:
            page_table = torch.cat([page_table, torch.full((page_table.shape[0], extra), -1, dtype=page_table.dtype)],
                                   dim=1)
        try:
            return self.lm.step(rows, top_k=top_k, page_table=page_table)
        finally:
            self.tt.passes.positions = []  # an eager step leaves its pass positions set: TT's decode must not see them

    def release(self) -> None:
        self.lm.release()


@dataclass
class SpecState:
    """A speculating model's additions: the plan's K, the plugin's decode batch B (TT's model is built for the 32-row
    tile), the write passes its attention reads, the device verify, the contract's shared core (checks, verify
    mapping, drafter, counters)."""

    num_drafts: int
    batch: int
    passes: Any  # ttnn_backend.attention.KVWritePasses
    verify: PagedVerify
    core: SpecDecodeCore
    warming: bool = False  # inside TT's own decode warm-up: its calls carry no request
    prefill_warmed: bool = False  # warmup_model_prefill's added prompt lengths have run
    tt_inputs_stale: bool = False  # a verify ran since TT's own decode last wrote its resident inputs
    # the slot_remaps of the verifies since TT's last decode, composed (compose_remaps): TT's per-slot state (its
    # sampler's seeds and penalties, its resident tokens) is read only by its decode, which gets it with its own remap
    tt_remap: Optional[list] = None
    verify_ids: Any = None  # the last verify's argmax_ids (host), which the runner's read-back may hand back


def compose_remaps(first, then) -> Optional[list]:
    """Two slot_remaps (row i reads the state slot remap[i] held) applied one after the other, as one: row i reads what
    slot first[then[i]] held before both; None when neither is given."""
    if first is None or then is None:
        given = then if first is None else first
        return None if given is None else torch.as_tensor(given).tolist()
    then = torch.as_tensor(then).tolist()
    if len(then) != len(first):
        raise ValueError(f"slot_remap of {len(then)} rows after a verify's of {len(first)}: the decode batch changed")
    return [first[j] for j in then]


def pad_rows(value, rows: int, fill):
    """A per-row value of B rows (a tensor's first dim, or a list) padded to `rows`: with `fill`, or with its last
    row's value where fill is None."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        extra = rows - value.shape[0]
        if extra <= 0:
            return value
        tail = value[-1:].expand(extra, *value.shape[1:]) if fill is None else \
            torch.full((extra, *value.shape[1:]), fill, dtype=value.dtype)
        return torch.cat([value, tail.to(value.dtype)])
    if isinstance(value, list) and len(value) < rows:
        return value + [value[-1] if fill is None else fill] * (rows - len(value))
    return value


def pad_sampling_params(params, batch: int, rows: int):
    """TT's SamplingParams with every per-row field of `batch` entries padded to `rows` by its last row (a padding
    row's outputs are never read); scalar fields as they are."""
    if params is None:
        return None
    values = ({f.name: getattr(params, f.name) for f in dataclasses.fields(params)} if dataclasses.is_dataclass(params)
              else dict(vars(params)))
    per_row = {name: value for name, value in values.items() if (isinstance(value, list) or (
        isinstance(value, torch.Tensor) and value.dim() > 0)) and len(value) == batch}
    if not per_row:
        return params
    padded = {name: pad_rows(value, rows, None) for name, value in per_row.items()}
    if dataclasses.is_dataclass(params):
        return dataclasses.replace(params, **padded)
    params = copy.copy(params)
    for name, value in padded.items():
        setattr(params, name, value)
    return params


def first_rows(out, batch: int):
    """TT's decode output (host tensors, or a tuple of them and None) cut to the plugin's B rows."""
    if isinstance(out, torch.Tensor):
        return out[:batch]
    if isinstance(out, tuple) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        return tuple(None if o is None else o[:batch] for o in out)
    return out  # device tensors (read_from_device False): the runner reads its rows out of TT's read-back


class SpecDecodeModel:
    """Mixed in before TT-Transformers' vLLM class (spec_class): the contract's model side."""

    spec: Optional[SpecState] = None  # None: launched without speculation (TT's class as it is)

    @classmethod
    def spec_plan(cls, vllm_config, max_num_seqs, requested_k):
        """The contract's classmethod: plan.plan_speculation (never raises), as the installed plugin's own classes;
        what this class cannot serve on the launch's layout refused here, at configuration time (launch_refusal)."""
        refusal = cls.launch_refusal(vllm_config)
        return to_plugin(SpecReject(refusal) if refusal else plan_speculation(vllm_config, max_num_seqs, requested_k))

    @classmethod
    def launch_refusal(cls, vllm_config, num_devices=None, tt_data_parallel=None) -> Optional[str]:
        """Why a speculative launch of this class cannot run, in one line; None when it can: a Galaxy or TT data
        parallelism (plan.tt_layout_refusal), or a TT class that declares the decode-reload contract's version 1
        (vllm-tt-plugin docs/DECODE_RELOAD_CONTRACT.md@1f10755a: its commands, not reset_batch). This class declares
        version 0 over a TT class that declares none, as TT's LlamaForCausalLM at 622c6fb9 (generator_vllm.py; its
        Generator.decode_forward takes reset_batch and slot_remap): the contract lets a class that overrides
        decode_forward stay legacy. Under version 1 a verify would carry the four commands, which TT's decode, the
        only thing that executes them, does not see."""
        version = int(getattr(cls, "decode_input_update_contract", 0))
        if version >= 1:
            return (f"this tt-metal's {cls.__bases__[-1].__name__} declares decode_input_update_contract = {version}, "
                    "and speculative decoding serves the legacy reload (reset_batch) only: use tt-metal v0.81.1's "
                    "TT-Transformers, or launch without --speculative-config")
        return tt_layout_refusal(vllm_config, num_devices, tt_data_parallel)

    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len, *args, vllm_config=None,
                              **kwargs):
        """TT's initialize_vllm_model (its arguments passed on as given), with ordered cache writes and the verify's
        state when the launch speculates; TT's class as it is otherwise. The plugin's loader passes vllm_config
        (loader.py@0cd06959), else vLLM's current config stands in (launch_config); TT's own signature
        (generator_vllm.py: hf_config, mesh_device, max_batch_size, max_seq_len, n_layers, tt_data_parallel,
        optimizations) has no such parameter, so it is passed on only to a version that has one."""
        base = super().initialize_vllm_model
        vllm_config = launch_config(vllm_config)
        if "vllm_config" in inspect.signature(base).parameters:
            kwargs["vllm_config"] = vllm_config  # a TT version that reads it gets it
        k = speculative_k(vllm_config)
        if k is None:
            return base(hf_config, mesh_device, max_batch_size, max_seq_len, *args, **kwargs)
        from ..ttnn_backend.attention import KVWritePasses
        from ..ttnn_backend.model import TILE_ROWS, model_args_seq_len

        bound = inspect.signature(base).bind(hf_config, mesh_device, max_batch_size, max_seq_len, *args, **kwargs)
        bound.apply_defaults()
        if max_batch_size > TILE_ROWS:
            raise ValueError(f"a decode batch of {max_batch_size} rows is more than the {TILE_ROWS}-row tile")
        # every row of the 32-row tile carries a verify row: TT's model is built for it (ModelArgs max_batch_size 32,
        # one of TT's supported batch sizes, as ttnn_backend/model.py builds it); its own decode gets B rows padded
        bound.arguments["max_batch_size"] = TILE_ROWS
        # TT's ModelArgs sized for the longest prompt padded as TT pads it, as the demo's (model.model_args_seq_len:
        # tt/common.py get_padded_prefill_len takes a prompt over 128 tokens to 1,024, and at max_model_len 256 TT's
        # prepare_inputs_prefill would refuse it); vLLM's cache and the verify keep max_model_len
        bound.arguments["max_seq_len"] = model_args_seq_len(max_seq_len)
        max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", max_batch_size)
        # what spec_plan refused at configuration time, checked again on the mesh and arguments TT builds with
        refusal = cls.launch_refusal(vllm_config, mesh_device.get_num_devices(),
                                     bound.arguments.get("tt_data_parallel"))
        plan = plan_speculation(vllm_config, max_num_seqs, k)
        if refusal is not None or isinstance(plan, SpecReject):
            raise ValueError(refusal or plan.reason)
        passes = KVWritePasses()
        with ordered_write_models(passes) as built:
            model = base(*bound.args, **bound.kwargs)
        if not any(m is model.model[0] for m in built):
            raise RuntimeError(f"TT-Transformers' initialize_vllm_model served a model not built through "
                               f"Transformer.__init__ ({len(built)} were): its cache writes are not the verify's "
                               "ordered ones")
        tt_model = model.model[0]
        optimizations = bound.arguments.get("optimizations")
        verify = PagedVerify(tt_model, model.model_args[0], tt_model.mesh_device, passes, max_seq_len, k,
                             checkpoint_shapes(hf_config),
                             optimizations if isinstance(optimizations, str) else "performance")
        model.spec = SpecState(k, max_batch_size, passes, verify, SpecDecodeCore(verify.lm, k))
        logger.info(f"{cls.__name__}: speculative decoding with K={k} (copied drafts, verify rows of one 32-row "
                    f"decode step; max_num_seqs {max_num_seqs})")
        return model

    # ---- prefill and decode ---------------------------------------------------------------------------------

    def warmup_model_prefill(self, *args, **kwargs):
        """TT's prefill warm-up, then one prefill of each prompt length ttnn_backend's warm-up adds
        (model.prefill_warm_prompts: the padded lengths TT's sweep leaves out and every last-token tile of the short
        prompts) into vLLM's null block 0, as TT's own warm-up pages its prompts (a page table of zeros): TT's prefill
        compiles per padded length, last-token tile and page-table width, and a program compiled while the verify
        traces are live may be overwritten when they replay (allocator.cpp verify_safe_allocation). A prefill that
        still compiles one has the traces made again (prefill_forward)."""
        out = super().warmup_model_prefill(*args, **kwargs)
        if self.spec is not None and not self.spec.prefill_warmed:  # TT's prefill_forward_text calls this again
            self.spec.prefill_warmed = True
            from models.tt_transformers.tt.common import get_block_size

            from ..ttnn_backend.model import prefill_into_sink, prefill_warm_prompts

            kv_cache = inspect.signature(super().warmup_model_prefill).bind(*args, **kwargs).arguments["kv_cache"]
            max_seq_len = self.spec.verify.lm.max_seq_len
            # with a one-token prompt, which the backend's own warm-up runs first (TtnnCausalLM._warm_up_prefill)
            prefill_into_sink(self, kv_cache, -(-max_seq_len // get_block_size(kv_cache[0])),
                              [1] + prefill_warm_prompts(self.model_args[0], max_seq_len))
        return out

    def prefill_forward(self, *args, **kwargs):
        """TT's prefill; then each prefilled row's request starts drafting over tokens[r, :prompt_lens[r]] (its whole
        history: a resumed request brings it all) in decode slot empty_slots[r] (default range(B), as TT's
        prefill_forward_text). A prefill that compiled a program (a prompt length the warm-up did not cover) has the
        verify traces made again before their next replay (ttnn_backend.traces.MeshTraces.remake_after)."""
        from ..ttnn_backend.traces import program_cache_entries

        programs = program_cache_entries(self.mesh_device)
        out = super().prefill_forward(*args, **kwargs)
        if self.spec is not None:
            self.spec.verify.lm.mesh_traces.remake_after(programs, "a prefill")
            call = inspect.signature(self.prefill_forward_text).bind(*args, **kwargs).arguments
            tokens, lengths = torch.as_tensor(call["tokens"]), [int(n) for n in call["prompt_lens"]]
            slots = call.get("empty_slots")
            slots = list(range(tokens.shape[0])) if slots is None else [int(s) for s in slots]
            self.spec.core.prefilled(slots, [tokens[r, :n].tolist() for r, n in enumerate(lengths)])
        return out

    def decode_forward(self, *args, **kwargs):
        """With num_valid_drafts, accepted_counts and spec_mode: the verify (VerifyOutput, argmax_ids [B, 1+K], or
        [B, 1] for the one-column verify of model_runner.py@02f45e5f). Without them: TT's own decode, after the
        drafter is told what each live row feeds."""
        spec = self.spec
        if spec is None:
            given = [name for name in SPEC_ARGUMENTS if kwargs.get(name) is not None]
            if given:
                raise RuntimeError(f"decode_forward got {given}, but {type(self).__name__} was built without a "
                                   "speculative config: pass the launch's vllm_config to initialize_vllm_model")
            return super().decode_forward(*args, **kwargs)
        if len(args) > 2:
            raise TypeError("decode_forward takes tokens and start_pos positionally, everything else by keyword")
        kwargs = {**dict(zip(("tokens", "start_pos"), args)), **kwargs}
        given = [name for name in SPEC_ARGUMENTS if kwargs.get(name) is not None]
        if given and len(given) != len(SPEC_ARGUMENTS):
            raise ValueError(f"decode_forward got {given} alone: {', '.join(SPEC_ARGUMENTS)} come together (a verify) "
                             "or not at all (an ordinary decode)")
        if not given:
            return self.tt_decode(spec, kwargs)
        if spec.warming:
            raise RuntimeError("a verify inside TT's decode warm-up")
        page_table, kv_cache = kwargs.get("page_table"), kwargs.get("kv_cache")
        out = spec.core.verify(kwargs["tokens"], kwargs["start_pos"], kwargs["num_valid_drafts"],
                               kwargs["accepted_counts"], kwargs["spec_mode"],
                               lambda rows, top_k: spec.verify.step(rows, top_k, page_table), kwargs.get("slot_remap"),
                               lambda rows, top_k: spec.verify.check(rows, top_k, page_table, kv_cache))
        spec.tt_inputs_stale, spec.verify_ids = True, out.argmax_ids
        spec.tt_remap = compose_remaps(spec.tt_remap, kwargs.get("slot_remap"))
        return to_plugin(out)


    def tt_decode(self, spec: SpecState, kwargs: dict):
        """TT's own decode, with TT's single cache update (no write passes set). TT's model is built for the 32-row
        tile, so the plugin's B rows are padded to it as TT pads a short batch's idle users: token 0, position -1
        (skipped by TT's cache update and attention), page-table row 0, -1 penalty history, each sampling parameter
        list by its last row, slot_remap by the identity; host results are cut back to B rows.

        Outside warm-up each live row is checked first (its slot's request, its page-table blocks and the kv_cache:
        PagedVerify.check_table), then the drafter is told its token (the slot_remap applied to its slots). TT's own
        per-slot state gets the remaps of the verifies since its last decode composed with this call's
        (compose_remaps): the reload contract has every slot-indexed state moved exactly once before it is read
        (vllm-tt-plugin docs/DECODE_RELOAD_CONTRACT.md@1f10755a, "slot_remap"), and TT's decode reads it (its sampler's
        seeds and penalties, its resident tokens gathered by the remap: tt/generator.py Generator.decode_forward and
        sample_decode_on_device). After a verify, TT's resident decode inputs (the token and position buffers its traced
        decode keeps when it samples on the device) were not written by the verify, so this decode reloads them with
        the legacy command this class declares (decode_input_update_contract 0): reset_batch, on which TT's Generator
        copies the host's inputs into its trace's (_decode_forward_trace_text), every row's (not its device tokens at
        continuing positions: those are the last TT decode's, not the verify's)."""
        from ..ttnn_backend.model import TILE_ROWS

        spec.passes.positions = []
        tokens = torch.as_tensor(kwargs["tokens"])
        batch = tokens.shape[0]
        if not spec.warming:
            page_table, kv_cache = kwargs.get("page_table"), kwargs.get("kv_cache")
            spec.core.plain_decode_rows(kwargs["tokens"], kwargs["start_pos"], kwargs.get("slot_remap"),
                                        lambda rows, top_k: spec.verify.check_table(rows, page_table, kv_cache,
                                                                                    "decode"))
            if spec.tt_inputs_stale:
                kwargs["reset_batch"] = True
                # TT's reset merge keeps its device token and position for a row whose device position continues the
                # host's, except for the slots prefilled since its last decode, named as they were before this
                # remap (tt/generator.py@622c6fb9 Generator.decode_forward, l.1237-1300; set in prefill_forward_text,
                # l.550-556). After a verify those buffers are stale and a remap may have moved a fresh slot, so
                # every row takes the host's inputs (authoritative under --no-async-scheduling, docs/serving.md).
                self._slots_prefilled_since_decode = (set(getattr(self, "_slots_prefilled_since_decode", ()))
                                                      | set(range(TILE_ROWS)))
            remap = compose_remaps(spec.tt_remap, kwargs.get("slot_remap"))
            if remap is not None:
                kwargs["slot_remap"] = torch.tensor(remap, dtype=torch.int32)
        if batch < TILE_ROWS:
            fills = {"tokens": 0, "start_pos": -1, "page_table": 0, "prompt_tokens": -1, "output_tokens": -1}
            for name, fill in fills.items():
                if kwargs.get(name) is not None:
                    kwargs[name] = pad_rows(torch.as_tensor(kwargs[name]), TILE_ROWS, fill)
            if kwargs.get("slot_remap") is not None:
                remap = torch.as_tensor(kwargs["slot_remap"])
                kwargs["slot_remap"] = torch.cat([remap, torch.arange(len(remap), TILE_ROWS, dtype=remap.dtype)])
            kwargs["sampling_params"] = pad_sampling_params(kwargs.get("sampling_params"), batch, TILE_ROWS)
        out = super().decode_forward(**kwargs)
        if not spec.warming:
            spec.tt_inputs_stale, spec.tt_remap = False, None
        return first_rows(out, batch) if kwargs.get("read_from_device", True) else out

    def warmup_model_decode(self, *args, **kwargs):
        """TT's own decode warm-up at the 32-row batch its model was built for (the plugin calls it with enable_trace
        False, then True), then the verify's: every program the plan's K reaches compiled on the first call, captured
        once on the second (PagedVerify.warm), on the kv_cache and page-table width (num_blocks) the runner passes."""
        from ..ttnn_backend.model import TILE_ROWS

        spec = self.spec
        if spec is None:
            return super().warmup_model_decode(*args, **kwargs)
        call = inspect.signature(super().warmup_model_decode).bind(*args, **kwargs)
        call.arguments["max_batch_size"] = TILE_ROWS
        spec.warming = True
        try:
            result = super().warmup_model_decode(*call.args, **call.kwargs)
        finally:
            spec.warming = False
            spec.passes.positions = []
        arguments = call.arguments
        spec.verify.warm(arguments["kv_cache"], arguments["num_blocks"], spec.core.proposer.top_k,
                         bool(arguments["enable_trace"]))
        spec.tt_inputs_stale = True  # TT's warm-up inputs are no request's
        return result

    # ---- the drafter and the lifecycle hooks ----------------------------------------------------------------

    def propose_draft_tokens(self, num_drafts, committed_tokens, committed_positions, accepted_counts, hidden=None):
        """The copied drafts for the next step (hidden: not read; this drafter reads the committed block only)."""
        if self.spec is None:
            raise RuntimeError("propose_draft_tokens on a model launched without a speculative config")
        return to_plugin(self.spec.core.propose(num_drafts, committed_tokens, committed_positions, accepted_counts))

    def release_request(self, slot):
        if self.spec is not None:
            self.spec.core.release(slot)
        parent = getattr(super(), "release_request", None)
        if parent is not None:
            parent(slot)

    def note_state_slots_moved(self, old_to_new):
        if self.spec is not None:
            self.spec.core.slots_moved(old_to_new)
        parent = getattr(super(), "note_state_slots_moved", None)
        if parent is not None:
            parent(old_to_new)

    def release_persistent_capture(self):
        """The plugin's shutdown hook (before the mesh closes): the verify traces go, then TT's own if it has one."""
        if self.spec is not None:
            self.spec.verify.release()
        parent = getattr(super(), "release_persistent_capture", None)
        if parent is not None:
            parent()

    def spec_decode_metrics(self) -> dict:
        """vLLM's four spec-decode counters as this model counted them (a cross-check against the server's)."""
        return self.spec.core.counters.as_dict() if self.spec is not None else {}


class VerifyReadBack:
    """Mixed in where TT's class has process_decode_output_host (spec_class): the plugin's runner hands a decode's
    output to the model's process_decode_output_host after the read-back when the model defines one (vllm-tt-plugin
    src/vllm_tt_plugin/async_decode.py, TTAsyncDecodeController.finalize_decode, read at dca5656f). A verify's argmax
    ids are host tensors already and pass through; TT's own decode output goes to TT's."""

    def process_decode_output_host(self, tt_out, *args, **kwargs):
        if self.spec is not None and tt_out is self.spec.verify_ids:
            return tt_out
        return super().process_decode_output_host(tt_out, *args, **kwargs)


def spec_class(arch: str) -> type:
    """The speculating subclass of TT-Transformers' class for an HF architecture (SPEC_CLASSES)."""
    name, base_name = SPEC_CLASSES[arch]
    base = getattr(importlib.import_module(TT_GENERATOR_VLLM), base_name)
    capabilities = {**getattr(base, "model_capabilities", {}), **SPEC_CAPABILITIES}
    mixins = (SpecDecodeModel, VerifyReadBack) if hasattr(base, "process_decode_output_host") else (SpecDecodeModel,)
    attributes = {"model_capabilities": capabilities, "__module__": __name__, "__qualname__": name}
    if int(getattr(base, "decode_input_update_contract", 0)) < 1:  # legacy, said so (SpecDecodeModel.launch_refusal)
        attributes["decode_input_update_contract"] = 0
    return type(name, (*mixins, base), attributes)


_CLASSES: dict = {}


def __getattr__(name: str):
    """SpecLlamaForCausalLM and SpecMistralForCausalLM, made from TT-Transformers' classes on first use."""
    for arch, (class_name, _) in SPEC_CLASSES.items():
        if name == class_name:
            if name not in _CLASSES:
                _CLASSES[name] = spec_class(arch)
            return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def write_model_bundles(folder, archs=tuple(SPEC_CLASSES)) -> list[Path]:
    """The plugin's EXTRA_MODELS_DIR bundles for these architectures: folder/<name>/vllm_metadata.json each, with
    `arch` (the HF architecture; the plugin registers "TT" + arch) and `main_class` ("module:Class"). Point
    EXTRA_MODELS_DIR at `folder`; this repository must come before tt-metal on PYTHONPATH (models/__init__.py)."""
    written = []
    for arch in archs:
        class_name = SPEC_CLASSES[arch][0]
        path = Path(folder) / f"tt_speculative_{arch}" / "vllm_metadata.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"arch": arch, "main_class": f"{__name__}:{class_name}",
                                    "note": f"speculative decoding with copied drafts ({MODEL_OWNED_DRAFTER})"},
                                   indent=2) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":  # python -m models.tt_transformers.serving.ttnn_model FOLDER
    if len(sys.argv) != 2:
        sys.exit("usage: python -m models.tt_transformers.serving.ttnn_model EXTRA_MODELS_DIR")
    for written_path in write_model_bundles(sys.argv[1]):
        print(written_path)
