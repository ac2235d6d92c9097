# SPDX-License-Identifier: Apache-2.0
"""Which decode traces a run captures, and how much of the device's trace region they take.

A trace is keyed by (write passes, top k, taps): the number of ordered cache-write passes (attention.py) is part
of the program, and so are the layers whose input it copies out (taps, a tuple of layer ids; () for none). A run
whose steps carry at most R rows per user (R = n_draft_tokens + 1 for the target) captures
the pass counts of `pass_ladder(R)`: 1, the powers of two below R, and R itself. A step with r rows replays the
smallest count >= r, so it never launches as many as r empty passes (fewer than r: at most 2r - 1 in all), and the
number of traces grows with log2 R instead of R.

Sizes: tt-metal sizes the trace region per model and device (TT-Transformers' trace_region_config.py,
get_supported_trace_region_size, beside its text-generation script) for TT-Transformers' own decode trace; TT_TRACE_REGION below is that table and
TT_DEFAULT_TRACE_REGION TT's parametrized default (device_params) where the table has none. One of our
traces is that size scaled by its op count over a plain TT-Transformers decode step's: each extra write pass adds
two `paged_update_cache` ops per layer, each top-k slice a slice, a pad and a topk, each tapped layer a copy and a
slice, and the tap tile a stack, a gather, a concat and a copy.
"""
import math
import re
from typing import NamedTuple, Optional, Sequence

from .model import TILE_ROWS

# Decode ops per layer in TT-Transformers' traced decode step on one device (tt/decoder.py TransformerBlock.forward,
# tt/attention.py forward_decode, tt/mlp.py forward, tt/distributed_norm.py): norms, QKV matmul, create heads,
# rotary x2, cache update x2, SDPA decode, concat heads, WO, residual adds, MLP matmuls x3 and the gate multiply,
# with the memory-config moves between them. An estimate to scale TT's measured region by, not a count from a device.
OPS_PER_LAYER = 30
HEAD_OPS = 8  # embedding, final norm, LM head matmul(s), untilize / gather
TT_TRACE_REGION = {  # trace_region_config.py, get_supported_trace_region_size (bytes per device)
    "Llama-3.1-8B": {"N150": 25_000_000, "N300": 38_000_000, "T3K": 50_000_000, "TG": 50_000_000},
    "Llama-3.3-70B": {"T3K": 90_000_000, "TG": 80_000_000, "P150": 80_000_000, "P300": 80_000_000,
                      "P150x4": 95_000_000, "P150x8": 83_000_000},
    "Llama-3.1-70B": {"T3K": 90_000_000, "TG": 90_000_000, "P150": 90_000_000, "P300": 90_000_000,
                      "P150x4": 90_000_000, "P150x8": 90_000_000},
    "Qwen3-32B": {"T3K": 90_000_000, "TG": 102_000_000, "P150": 90_000_000, "P300": 90_000_000,
                  "P150x4": 90_000_000, "P150x8": 90_000_000},
    "Qwen2.5-72B": {"T3K": 70_000_000, "TG": 70_000_000},
    "DeepSeek-R1-Distill-Llama-70B": {"P150x4": 90_000_000},
    "Llama-3.2-3B": {"N150": 10_000_000},
}
TT_DEFAULT_TRACE_REGION = 30_000_000  # TT's device_params when the table has no entry
MARGIN = 1.25  # the op-count scaling is an estimate: room for it to be low


def pass_ladder(max_rows_per_user: int) -> list[int]:
    """The write-pass counts traced for steps of up to max_rows_per_user rows per user."""
    top = max(1, min(max_rows_per_user, TILE_ROWS))
    return sorted({1, top} | {2 ** i for i in range(1, math.ceil(math.log2(top)))})


def passes_for(rows_per_user: int, ladder: list[int]) -> int:
    """The traced pass count a step whose longest user has rows_per_user rows replays."""
    for passes in ladder:
        if passes >= rows_per_user:
            return passes
    raise ValueError(f"a step with {rows_per_user} rows for one user is longer than the {ladder[-1]} rows the traces "
                     "were planned for (warm_up)")


class TraceKey(NamedTuple):
    """What one traced step program computes beyond the greedy ids."""

    passes: int  # cache-write passes
    top_k: int  # each row's top k ids (token recycling), 0: none
    taps: tuple[int, ...]  # the layers whose inputs go to the tap tile (a device draft head's)
    logits: bool  # the logits' first rows sliced for a sampled step's reads (generator.LOGIT_READS); greedy: none


def trace_keys(max_rows_per_user: int, top_k: int, taps: Sequence[int], logits: bool = False) -> list[TraceKey]:
    """Every trace a run uses: its steps at each pass count, and one plain step (a baseline or warm-up run: 1 pass, no
    top k or taps); `logits`: a sampled run's, which read the logits."""
    taps = tuple(taps) if taps else ()  # (None or False from a caller that asks for none)
    return sorted({TraceKey(passes, top_k, taps, logits) for passes in pass_ladder(max_rows_per_user)}
                  | {TraceKey(1, 0, (), logits)})


def vocab_slices(vocab_size: int) -> tuple[int, int]:
    """(slice width, slices) for the top k. ttnn.topk runs multi-core only on a width that is a power of two below
    65535 and at least 8192, or at least 1024 when the input is at most 2 tile rows, as our 32 rows are
    (topk_utils.cpp, topk_multicore_structurally_eligible; topk_constants.hpp); otherwise one core walks every
    tile. So the vocabulary is cut into slices of such a width, the last padded: the fewest slices, then the least
    padding."""
    widths = [2 ** i for i in range(10, 16)]  # 1024 .. 32768
    return min(((w, math.ceil(vocab_size / w)) for w in widths), key=lambda ws: (ws[1], ws[0] * ws[1]))


def trace_ops(n_layers: int, key: TraceKey, vocab_size: int) -> int:
    # + slice off the padded vocab and argmax, the three first-rows slices a sampled step reads (generator.LOGIT_READS)
    ops = n_layers * (OPS_PER_LAYER + 2 * (key.passes - 1)) + HEAD_OPS + 2 + (3 if key.logits else 0)
    if key.top_k:
        ops += 3 * vocab_slices(vocab_size)[1]
    return ops + (2 * len(key.taps) + 4 if key.taps else 0)  # per tap a copy and a slice; stack, gather, concat, copy


HeadKey = tuple[int, int]  # a device draft head's trace: (feed write passes, chain length k)
# one head-layer step (eagle3_head.py _layer and _choose: norms, DRAM-sharded matmuls in column chunks with their
# reshards, TT's head and rotary ops, attention, MLP, argmax, a top k of one vocabulary slice: draft vocabularies up
# to 32,768), fc included: about 51 at SmolLM2's shapes (tests/ttnn_backend/test_ttnn_draft_head.py checks it), 61 at Llama-3.1-8B's
# (more column chunks: the review's count)
HEAD_LAYER_OPS = 64
# a feed-only replay (k = 0: eagle3_head.py _cache_rows after fc): fc (and the config's norms), the embedding's and the
# state's norms and their concat, the qkv matmul and its reshards, TT's head and rotary ops; the cache writes counted
# apart (2 per pass)
HEAD_FEED_OPS = 32


def head_trace_keys(chain_len: int) -> list[HeadKey]:
    """Every trace a device draft head uses: feeds of each pass count a verified step's rows can need (up to
    chain_len + 1 per user), each feed-only (k = 0: no user drafts) and drafting (k = chain_len)."""
    return sorted({(passes, k) for passes in pass_ladder(chain_len + 1) for k in (0, chain_len)})


def head_trace_ops(key: HeadKey) -> int:
    passes, k = key
    if k == 0:
        return HEAD_FEED_OPS + 2 * passes
    return k * HEAD_LAYER_OPS + 2 * (passes - 1) + (2 if k > 1 else 0)  # + the chain's ids and probabilities joined


def base_model_name(model_name: str) -> str:
    """trace_region_config.py, get_base_model_name: "Llama-3.1-8B-Instruct" -> "Llama-3.1-8B"."""
    match = re.search(r"(.*?\d+[bB])-", model_name)
    return match.group(1) if match else model_name


def tt_trace_region(model_name: str, device_name: Optional[str]) -> int:
    """The trace region TT-Transformers opens the mesh with for its own traces (trace_region_config.py)."""
    return TT_TRACE_REGION.get(base_model_name(model_name), {}).get(device_name, TT_DEFAULT_TRACE_REGION)


def op_bytes(model_name: str, device_name: Optional[str], full_layers: int) -> float:
    """Trace region per op: TT's region for the whole model (trace_region_config.py) over its decode step's ops."""
    return tt_trace_region(model_name, device_name) / (full_layers * OPS_PER_LAYER + HEAD_OPS)


def trace_bytes(model_name: str, device_name: Optional[str], full_layers: int, n_layers: int,
                key: TraceKey, vocab_size: int) -> int:
    """One trace of an n_layers model (a view of a full_layers model: TT's figure is for the whole model)."""
    return math.ceil(op_bytes(model_name, device_name, full_layers) * trace_ops(n_layers, key, vocab_size))


def head_trace_bytes(model_name: str, device_name: Optional[str], full_layers: int, key: HeadKey) -> int:
    """One trace of a device draft head beside a full_layers target."""
    return math.ceil(op_bytes(model_name, device_name, full_layers) * head_trace_ops(key))


def region_bytes(traces: list[int], margin: Optional[float] = None) -> int:
    """The trace_region_size for traces of these sizes, with the margin (MARGIN unless given), rounded up to a MB."""
    return math.ceil(sum(traces) * (MARGIN if margin is None else margin) / 1e6) * 1_000_000


def device_names_for(shape: tuple[int, int], mesh_name: Optional[str]) -> list[str]:
    """TT's device name for a mesh: MESH_DEVICE where set; else the names a mesh of that many devices has on Wormhole
    and Blackhole (tt/model_config.py determine_device_name), the region sized for the larger."""
    if mesh_name:
        return [mesh_name]
    count = shape[0] * shape[1]
    wormhole = {1: "N150", 2: "N300", 4: "N150x4", 8: "T3K", 32: "TG"}
    blackhole = {1: "P150", 2: "P300", 4: "P150x4", 8: "P150x8", 32: "BHGLX"}
    return [names[count] for names in (wormhole, blackhole) if count in names]


def model_trace_bytes(model_name: str, device_names: list[str], n_devices: int, full_layers: int, n_layers: int,
                      vocab_size: int, max_rows_per_user: int, top_k: int, taps: Sequence[int],
                      logits: bool = False) -> list[int]:
    """Every trace one model of a run captures, before it is built (its vocabulary share per device as TT pads it,
    tt/model_config.py compute_padded_vocab_size), for the largest of the device names it may have."""
    share = math.ceil(vocab_size / (32 * n_devices)) * 32 if n_devices > 1 else vocab_size
    return [max(trace_bytes(model_name, device, full_layers, n_layers, key, share) for device in device_names or [None])
            for key in trace_keys(max_rows_per_user, top_k, taps, logits)]


def head_region_bytes(model_name: str, device_names: list[str], full_layers: int, chain_len: int) -> list[int]:
    """Every trace a device draft head captures (head_trace_keys), for the largest of the device names."""
    return [max(head_trace_bytes(model_name, device, full_layers, key) for device in device_names or [None])
            for key in head_trace_keys(chain_len)]
