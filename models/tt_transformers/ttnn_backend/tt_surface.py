# SPDX-License-Identifier: Apache-2.0
"""Every TT-Transformers detail the ttnn backend relies on beyond the calls tt-metal's vLLM integration makes, in one
place, each with the variants known from tt-metal's history, and a probe that checks them all against the installed
tt-metal without opening a device (`make tt-smoke`'s first stage prints one line per detail).

The backend pins tt-metal v0.81.1 (d80d9482), which the searchable index does not hold: each variant below names the
commit it was read at (models/tt_transformers/tt/...). "A", "B" and "C" are three versions of tt/model.py, oldest
first: A = 00a9ba8f, B = 5cd1b56c, C = a 2026 version whose commit the index does not show (Mode enum, prefetcher,
on_device_logits). The backend calls the helpers here instead of reaching into TT-Transformers itself.
"""
import inspect
import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

from .ttnn_api import ttnn

# ---- what the backend calls -------------------------------------------------------------------------------------


def decode_forward_kwargs(model, device_shares: bool) -> dict:
    """The keywords that make Transformer.ttnn_decode_forward hand back each device's own vocabulary share of the
    logits (device_shares: TILE, not gathered), else the gathered, untilized logits.
    - C: `on_device_logits=True` returns the raw LM-head output (and advances the positions on the device);
    - A and B: `sampling_on_device=True, capture_sampling_trace=True` does the same (the split-sampling hook);
    - without either keyword there is no such path: TT gathers every logit (device_shares must be False)."""
    params = inspect.signature(model.ttnn_decode_forward).parameters
    if not device_shares:
        return {}
    if "on_device_logits" in params:
        return {"on_device_logits": True}
    if "capture_sampling_trace" in params:
        return {"sampling_on_device": True, "capture_sampling_trace": True}
    raise ValueError("this TT-Transformers' ttnn_decode_forward has neither on_device_logits nor "
                     "capture_sampling_trace: the logits cannot stay split over the devices")


def can_keep_shares(model) -> bool:
    """Whether ttnn_decode_forward can return each device's vocabulary share (decode_forward_kwargs)."""
    params = inspect.signature(model.ttnn_decode_forward).parameters
    return "on_device_logits" in params or "capture_sampling_trace" in params


def decode_logits(out):
    """The logits tensor of what ttnn_decode_forward returned: `(logits, None)` (B and C on the gathered path), a bare
    tensor (A on every path, B and C with the device-share keywords), or a list of such pairs (Generator's no-trace
    path wraps them per data-parallel model). Also prefill_forward_text's: a bare tensor in every version read
    (generator.py@87700c07 returns output_tensor without sampling parameters), unwrapped the same way should one
    return a pair."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def uses_qk_fused(attention) -> bool:
    """Whether TT's attention updates the cache with the fused op (paged_fused_update_cache), which the backend's
    ordered writes cannot split: an attribute of the attention object in 2026 versions (`self.use_qk_fused =
    configuration.use_qk_fused`), read from its args in attention.py@5cd1b56c (`self.args.use_qk_fused`)."""
    if "use_qk_fused" in vars(attention):
        return bool(attention.use_qk_fused)
    return bool(getattr(getattr(attention, "args", None), "use_qk_fused", False))


def full_layers(args) -> int:
    """The checkpoint's layer count before a truncation (ModelArgs.full_model_n_layers where it exists; the versions at
    17a8a99d have only n_layers, read before the backend truncates it)."""
    return getattr(args, "full_model_n_layers", None) or args.n_layers


def mesh_column_rows(model, args, rows: int) -> int:
    """The decode rows one mesh column of a Galaxy computes, of the `rows` (a 32-row tile) a step carries. TT's
    Attention on a TG (tt/attention.py, __init__ at 00b769dd and 5cd1b56c: `self.TG = self.num_devices == 32`,
    `num_device_groups = num_devices // n_kv_heads`, `batch_size_per_device_group = max(max_batch_size //
    num_device_groups, 1) if self.TG else max_batch_size`) gives mesh column c the users c * 8 .. c * 8 + 7 of the
    tile (forward_decode's slice_mat: device i takes rows (i % 4) * 8 .. + 8; the 2026 form's batch_offset [0, 8, 16,
    24]), and prepare_decode_inputs_host splits the positions and page-table rows over the columns the same way
    (tt/model.py@5cd1b56c: `dims=(None, 0) if (self.args.is_galaxy and B > 1)`); each column's devices hold their own
    KV caches. Read from ModelArgs where a version sets it, else from the first layer's Attention, else computed as
    TT computes it. Not a Galaxy: every row."""
    if not args.is_galaxy:
        return rows
    group = getattr(args, "batch_size_per_device_group", None)
    if not group and model.layers:
        group = getattr(model.layers[0].attention, "batch_size_per_device_group", None)
    if not group:
        group = max(rows // max(args.num_devices // args.n_kv_heads, 1), 1)
    return min(int(group), rows)


def galaxy_mesh() -> bool:
    """Whether this run opens a Galaxy (8 x 4): MESH_DEVICE TG or BHGLX, or unset on a system of 32 devices (the
    system mesh, device.open_mesh). For the probe, before any device is open."""
    import os

    from .device import MESH_SHAPES

    name = os.environ.get("MESH_DEVICE")
    if name:
        return MESH_SHAPES.get(name) == (8, 4)
    try:
        return len(ttnn.get_device_ids()) == 32
    except Exception:  # noqa: BLE001: no ttnn or no device to count: not known to be a Galaxy
        return False


def padded_vocab(args) -> int:
    """The LM head's output width over all devices: ModelArgs.padded_vocab_size where set, else the vocabulary padded
    so that each device's share is whole tiles (tt/lm_head.py splits the columns evenly; checked against the logits'
    real width when the first step compiles, VocabShares.check_width)."""
    padded = getattr(args, "padded_vocab_size", None)
    if padded:
        return padded
    unit = 32 * args.num_devices
    return math.ceil(args.vocab_size / unit) * unit


# ---- the probe --------------------------------------------------------------------------------------------------


@dataclass
class Detail:
    name: str
    where: str  # the file to look at when it is missing
    check: Callable[[], Optional[str]]  # the variant found (a short description), or raises / returns None: missing
    # True: a signature or method the backend calls (missing: the run would fail there, so the probe stops it); False:
    # a detail read from TT-Transformers' source text or attributes, which a property, a rename or a refactor can hide
    # while the run works, and which a later stage checks by running it (missing: a warning, and that stage tells);
    # also False for a function only the stages after the target path call (they fail naming it)
    called: bool = True


def _source(obj) -> str:
    return inspect.getsource(obj)


def _tt(module: str):
    import importlib

    return importlib.import_module(f"models.tt_transformers.tt.{module}")


def _signature_has(fn, *names) -> str:
    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())]
    if missing:
        raise LookupError(f"no parameter {', '.join(missing)}")
    return "takes " + ", ".join(names)


def _decode_forward() -> str:
    model = _tt("model").Transformer
    if "on_device_logits" in inspect.signature(model.ttnn_decode_forward).parameters:
        return "C: on_device_logits (each device's share, bare tensor)"
    if "capture_sampling_trace" in inspect.signature(model.ttnn_decode_forward).parameters:
        return "A/B: sampling_on_device + capture_sampling_trace (each device's share, bare tensor)"
    raise LookupError("neither on_device_logits nor capture_sampling_trace")


def _decode_return() -> str:
    text = _source(_tt("model").Transformer.ttnn_decode_forward)
    pair = re.search(r"return [^\n]*, None\s*$", text, re.MULTILINE)
    return ("(logits, None) on the gathered path, a bare tensor on the per-device one" if pair
            else "a bare tensor on every path")


def _qk_fused() -> str:
    attention = _source(_tt("attention").Attention)
    if "self.use_qk_fused" in attention:
        return "an attribute of Attention (uses_qk_fused reads it)"
    if "self.args.use_qk_fused" in attention:
        return "read from Attention.args (uses_qk_fused reads it)"
    if "use_qk_fused" not in _source(_tt("model_config").ModelArgs):
        raise LookupError("no use_qk_fused in ModelArgs or Attention")
    return "ModelArgs only (never fused in Attention)"


def _update_cache_at_call_time() -> str:
    text = _source(_tt("attention").Attention)
    if "ttnn.experimental.paged_update_cache(" not in text:
        raise LookupError("Attention does not call ttnn.experimental.paged_update_cache by its module path: the "
                          "ordered cache writes (attention.py) would not reach it")
    return "ttnn.experimental.paged_update_cache looked up at call time"


def _layer_call() -> str:
    from models.common.lightweightmodule import LightweightModule

    class Probe(LightweightModule):
        def forward(self):
            return "class"

    probe = Probe()
    probe.forward = lambda: "instance"
    if probe() != "instance":
        raise LookupError("LightweightModule.__call__ does not reach an instance's forward: taps would see nothing")
    if "layer(" not in _source(_tt("model").Transformer.forward):
        raise LookupError("Transformer.forward does not call each layer object")
    return "LightweightModule.__call__ -> self.forward; Transformer.forward calls layer(x, ...)"


def _module_map() -> str:
    text = _source(_tt("model_config").ModelArgs.get_state_dict_prefix)
    if '"Attention"' not in text and "'Attention'" not in text:
        raise LookupError("get_state_dict_prefix's module map has no \"Attention\": the backend's Attention subclass "
                          "would find no weights")
    return 'module map knows "Attention"'


def _model_args_reads() -> str:
    """Set in __init__ (`self.<name>` in the source of ModelArgs or a base) or a class attribute (a property)."""
    model_args = _tt("model_config").ModelArgs
    text = "".join(_source(c) for c in model_args.__mro__ if c is not object)  # and its bases

    def sets(name: str) -> bool:
        return f"self.{name}" in text or hasattr(model_args, name)
    needed = ["device_name", "cluster_shape", "num_devices", "is_galaxy", "vocab_size", "dim", "model_name",
              "model_cache_path", "n_layers", "max_prefill_chunk_size"]
    missing = [a for a in needed if not sets(a)]
    if missing:
        raise LookupError(f"ModelArgs sets no {', '.join(missing)}")
    optional = [a for a in ("padded_vocab_size", "full_model_n_layers") if not sets(a)]
    return "all read attributes set" + (f" ({', '.join(optional)} derived: padded_vocab, full_layers)" if optional
                                        else "")


def _residual_config() -> str:
    args = _tt("model_config").ModelArgs
    if hasattr(args, "get_residual_mem_config"):
        return "get_residual_mem_config(mode, prefetcher)"
    if "DECODE_RESIDUAL_MEMCFG" in _source(args):
        return 'model_config["DECODE_RESIDUAL_MEMCFG"]'
    raise LookupError("no decode residual memory config")


def _decode_inputs_returned() -> str:
    """What prepare_decode_inputs_host returns, read from its `return` statements: the backend unpacks four device
    inputs (tokens, current_pos, rot_mat_idxs, page_table; tt/model.py@00a9ba8f and @5cd1b56c); the version at 000ec121
    returns five (rot_mat_idxs_global and rot_mat_idxs_local apart), which the backend cannot drive."""
    import ast
    import textwrap

    fn = _tt("model").Transformer.prepare_decode_inputs_host
    tree = ast.parse(textwrap.dedent(_source(fn)))
    returned = {len(node.value.elts) for node in ast.walk(tree)
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)}
    if not returned:
        return "returns no tuple literal: counted when the first step runs (TtnnCausalLM._run_inputs)"
    if returned != {4}:
        raise LookupError(f"returns {' or '.join(map(str, sorted(returned)))} values where the backend unpacks 4 "
                          "(tokens, current_pos, rot_mat_idxs, page_table)")
    return "returns (tokens, current_pos, rot_mat_idxs, page_table)"


def _galaxy_columns() -> str:
    """On a Galaxy the backend keeps a step's rows in mesh column 0's users (mesh_column_rows), which is right when
    TT's Attention groups the decode users per mesh column (batch_size_per_device_group) and column 0's caches hold
    each user's prompt: the newer forward_prefill fills every column with a page table (`if self.TG and not
    page_table:` before prefill_prepare_tensor_for_kv_cache), the older one the column of `user_id //
    batch_size_per_device_group` (`single_column_tensors = tensors[user_id // self.batch_size_per_device_group ::
    4]`), column 0 for the users 0..7 the cap allows (and TT's Generator prefills as user 0 with a page table:
    tt/generator.py `group_user_id = ... if page_table is None else 0`). Not a Galaxy: nothing to check."""
    if not galaxy_mesh():
        return "not a Galaxy mesh: not needed"
    attention = _source(_tt("attention").Attention)
    if "batch_size_per_device_group" not in attention:
        raise LookupError("Attention has no batch_size_per_device_group: how this version spreads a decode step's "
                          "rows over a Galaxy's mesh columns is unknown")
    if "self.TG and not page_table" in attention:
        return "users grouped per mesh column; a paged prefill fills every column's cache"
    if "prefill_prepare_tensor_for_kv_cache" in attention:
        return "users grouped per mesh column; a prefill fills the column of user_id // batch_size_per_device_group"
    raise LookupError("Attention's prefill fills the caches of a Galaxy's mesh columns in a way this backend does not "
                      "know (neither `self.TG and not page_table` nor prefill_prepare_tensor_for_kv_cache)")


def _all_gather() -> str:
    fn = _tt("ccl").tt_all_gather
    params = inspect.signature(fn).parameters
    return ("tt_ccl (all_gather_async with TT_CCL's semaphores)" if "tt_ccl" in params
            else "no tt_ccl (plain all_gather)")


DETAILS = [
    Detail("ModelArgs(mesh_device, instruct, max_batch_size, max_seq_len, optimizations)", "tt/model_config.py",
           lambda: _signature_has(_tt("model_config").ModelArgs, "instruct", "max_batch_size", "max_seq_len",
                                  "optimizations")),
    Detail("ModelArgs attributes the backend reads", "tt/model_config.py", _model_args_reads, called=False),
    Detail("ModelArgs.weight_cache_path / load_state_dict", "tt/model_config.py",
           lambda: "both present" if all(hasattr(_tt("model_config").ModelArgs, a)
                                         for a in ("weight_cache_path", "load_state_dict")) else None),
    Detail("DecodersPrecision.performance / accuracy", "tt/model_config.py",
           lambda: "both present" if all(hasattr(_tt("model_config").DecodersPrecision, a)
                                         for a in ("performance", "accuracy")) else None),
    Detail("get_state_dict_prefix module map", "tt/model_config.py", _module_map, called=False),
    Detail("decode residual memory config", "tt/model_config.py", _residual_config, called=False),
    Detail("Transformer(..., attention_class=)", "tt/model.py",
           lambda: _signature_has(_tt("model").Transformer, "attention_class", "paged_attention_config")),
    Detail("ttnn_decode_forward: per-device logits", "tt/model.py", _decode_forward, called=False),
    Detail("ttnn_decode_forward: return convention", "tt/model.py", _decode_return, called=False),
    Detail("prepare_decode_inputs_host(tokens, current_pos, page_table)", "tt/model.py",
           lambda: _signature_has(_tt("model").Transformer.prepare_decode_inputs_host, "tokens", "current_pos",
                                  "page_table")),
    # read from TT's source: the first step checks the count it gets (TtnnCausalLM._run_inputs), so a warning here
    Detail("prepare_decode_inputs_host returns 4 device inputs", "tt/model.py", _decode_inputs_returned,
           called=False),
    Detail("ttnn_decode_forward(x, current_pos, rot_mat_idxs=, page_table=, kv_cache=)", "tt/model.py",
           lambda: _signature_has(_tt("model").Transformer.ttnn_decode_forward, "rot_mat_idxs", "page_table",
                                  "kv_cache")),
    # literal strings of TT's attention.py: the Galaxy's lossless check (a verify step against plain decoding through
    # the same step) tells whether its rows sit in the users TT gives mesh column 0, so a warning here
    Detail("Galaxy: decode users grouped per mesh column", "tt/attention.py", _galaxy_columns, called=False),
    Detail("use_qk_fused", "tt/attention.py", _qk_fused, called=False),
    Detail("paged_update_cache looked up at call time", "tt/attention.py", _update_cache_at_call_time, called=False),
    Detail("layers called as LightweightModules (taps)", "models/common/lightweightmodule.py, tt/model.py",
           _layer_call, called=False),
    Detail("copy_host_to_device(host, device_tensors, mesh_device)", "tt/common.py",
           lambda: _signature_has(_tt("common").copy_host_to_device, "device_tensors", "mesh_device")),
    Detail("PagedAttentionConfig(block_size, max_num_blocks)", "tt/common.py",
           lambda: _signature_has(_tt("common").PagedAttentionConfig, "block_size", "max_num_blocks")),
    Detail("Generator.prefill_forward_text(tokens, page_table, kv_cache, prompt_lens)", "tt/generator.py",
           lambda: _signature_has(_tt("generator").Generator.prefill_forward_text, "page_table", "kv_cache",
                                  "prompt_lens")),
    # called only by the device taps (taps.py, tap_gather="device": --full and the draft-head stages), never by the
    # target path, whose verdict a missing one must not stop: those stages fail with its name
    Detail("tt_all_gather", "tt/ccl.py", _all_gather, called=False),
]


@dataclass
class ProbeLine:
    name: str
    found: bool
    text: str  # the variant found, or what is missing and the file to look at
    called: bool  # Detail.called: a missing one stops the run, a missing read detail is a warning


def probe() -> list[ProbeLine]:
    """One line per detail against the installed tt-metal; opens no device."""
    lines = []
    for d in DETAILS:
        try:
            variant = d.check()
        except Exception as e:  # noqa: BLE001: a missing module, attribute or parameter is the finding
            variant, error = None, f"{type(e).__name__}: {e}"
        else:
            error = "not found"
        where = d.where if d.where.startswith("models/") else f"models/tt_transformers/{d.where}"
        text = variant or f"missing ({error}): look at {where}"
        lines.append(ProbeLine(d.name, variant is not None, text, d.called))
    return lines
