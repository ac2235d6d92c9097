# SPDX-License-Identifier: Apache-2.0
"""The `CausalLM` contract on a Tenstorrent device, over a TT-Transformers model (model.py).

- prefill: TT-Transformers' own `Generator.prefill_forward_text` for one user (padded, chunked), into the user's
  page-table row; the last token's logits come back, as in tt-metal's text demo. Its first call runs TT's prefill
  warm-up sweep, which `warm_up` triggers before anything is timed.
- step: ONE traced decode forward over the 32-row tile. Row r carries one token of one user at its position with
  the user's page-table row: a verification step is every user's [last token, d1..dK] at consecutive positions,
  attention bounded per row by its own position (paged SDPA decode); unused rows and idle users sit at position
  -1, which every op skips. Cache writes go in ordered passes (attention.py).
- argmax on device, per device: on one device (or where TT gathers the logits: a Galaxy, or no on-device sampling
  support) over the LM head's output with the padded columns sliced off; on N300/T3K-style meshes each device takes
  the argmax and the max of its own vocabulary share (padded columns masked to -inf) and only 32 ids and 32 values
  per device come back, merged on the host, instead of TT's all-gather of every logit (`ttnn_decode_forward` with
  `sampling_on_device=True, capture_sampling_trace=True` returns the per-device shares: TT's split-sampling hook).
  The logits come back only when sampling asks for them.
- top k (token recycling): `ttnn.topk` runs multi-core only on power-of-two widths (trace_plan.vocab_slices); each
  device's vocabulary share is cut into slices of such a width (the last padded with -inf), the top k of each taken
  on device, and the few candidates merged on the host.
- taps (for an EAGLE-3 draft head on the device, draft_head.py): a step asked for layers `taps` also copies the
  residual stream entering each of those decoder layers to DRAM inside the trace (TapCapture), all-gathers each on a
  mesh (the residual is split over the devices along dim) and concatenates them, in the order asked, into the tap tile
  [1, 1, 32, len(taps) * dim], a persistent tensor the head's traces read: nothing comes back to the host, the step
  returns where each user's rows sit in the tile (DeviceRows). A prefill asked for them reads each tapped layer's
  prefill input back to the host as TT-Transformers' prefill runs it (PromptTaps): once per request, for the head's
  prompt rows.
- traces: one per (write passes, top k, taps) for the pass counts a run can need (trace_plan.pass_ladder), planned
  by `warm_up` and replayed. A buffer allocated while a trace is live may be overwritten when that trace replays
  (tt-metal's allocator warns of it, allocator.cpp verify_safe_allocation), so traces are made for the whole mesh at
  once (`prepare_mesh`): every model on it releases its traces, allocates its persistent inputs and compiles every
  planned program (kernel binaries are device buffers too), and only then is anything captured. Every input is a
  persistent device tensor (a draft view shares its target's) refreshed with `ttnn.copy_host_to_device_tensor` (only
  the pass tensors the trace reads), so the loop allocates nothing on the device.
"""
import contextlib
import math
import re
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from loguru import logger

from ..speculative.backend import DeviceRows, StepOutput, UserRows
from .device import TRACE_REGIONS
from .model import TILE_ROWS, TTModel, prefill_into_sink, prefill_warm_prompts, supported_kwargs
from .tt_surface import can_keep_shares, decode_forward_kwargs, decode_logits, mesh_column_rows, padded_vocab
from .trace_plan import TraceKey, pass_ladder, passes_for, region_bytes, trace_bytes, trace_keys, vocab_slices

# What a step costs, in units of streaming the weights once (a decode step of the tile, which computes all 32 rows
# whatever is in them): each cache-write pass adds two paged_update_cache ops per layer, and paged SDPA decode reads
# each active row's cached K and V, so its work grows with rows x context (model.key_cost, from the model's shapes
# and dtypes). Estimates (no device here): the hardware perf test records the step time of every traced shape
# (TtnnCausalLM.step_times) to replace them.
WRITE_PASS_COST = 0.01
# Row counts a sampled step reads its logits in: each program a sampled run traces (TraceKey.logits) also slices the
# logits' first R rows (row-major, a copy of R x share values on the device), and a step reads the smallest slice
# holding its rows; a greedy run's programs make none.
LOGIT_READS = (4, 8, 16)
# The models on each mesh (id(mesh) -> TtnnCausalLMs): traces are prepared for all of them at once.
MESH_MODELS: defaultdict = defaultdict(weakref.WeakSet)


@dataclass
class StepInputs:
    """The persistent device tensors every traced step reads (refreshed in place before each replay)."""

    tokens: Any
    current_pos: Any
    rope_idxs: Any
    page_table: Any
    pass_positions: list  # TILE_ROWS tensors of positions, -1 outside their pass


@dataclass
class DeviceInputs:
    """A model's persistent device inputs, shared by a target and its draft views (each refreshes them in full
    before every replay): the step's inputs, on split-vocabulary meshes the padded-column mask, and per taps the tap
    tile a tapped step writes (a draft head's input)."""

    step: Optional[StepInputs] = None
    vocab_mask: Any = None
    taps: dict = field(default_factory=dict)  # taps -> [1, 1, 32, len(taps) * dim] on every device


@dataclass
class Trace:
    trace_id: Any
    ids: Any  # [1, 1, 32, 1] uint32 per device: each device's argmax over its vocabulary share
    best: Any  # [1, 1, 32, 1] per device: each device's max (merging across devices), or None on one share
    logits: Any  # [1, 1, 32, share] row-major per device
    top: Optional[list]  # per vocabulary slice: (values, indices) [1, 1, 32, k] per device, or None
    first_rows: dict = field(default_factory=dict)  # R -> the logits' first R rows [1, 1, R, share] (LOGIT_READS)
    tap_parts: Any = None  # tap_gather "host" on a mesh: the tapped layers' copies stacked, [1, 1, 32 * taps, dim / n]


def device_tensors(outputs) -> list:
    """The device tensors in a traced program's outputs (nested lists, tuples and dicts, None where absent)."""
    if outputs is None:
        return []
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in device_tensors(o)]
    return [outputs]


def dram_copy(x):
    """A copy of a device tensor in DRAM (interleaved), a trace output of its own. The decode residual is
    width-sharded in L1, and ttnn.clone refuses a sharded input with an interleaved output ("Clone: mixed
    sharded/interleaved layout not currently supported", ttnn 0.81.1 clone_device_operation.cpp validate_inputs);
    ttnn.to_memory_config moves it with sharded_to_interleaved into a new DRAM buffer (to_memory_config_op.cpp). An
    interleaved input (a Galaxy's L1 residual) is cloned: to_memory_config would hand back the same tensor when the
    config already matches (to_memory_config_op.cpp: `return tensor`), and no trace output may alias the program's
    own buffers."""
    import ttnn

    if x.memory_config().is_sharded():
        return ttnn.to_memory_config(x, ttnn.DRAM_MEMORY_CONFIG)
    return ttnn.clone(x, memory_config=ttnn.DRAM_MEMORY_CONFIG)


class TapCapture:
    """While a traced step is captured (or compiled), or TT-Transformers' prefill runs, the decoder layers named by
    `taps` hand their input x, the residual stream entering the layer, to `copy` before they run: in a traced step a
    copy to DRAM (dram_copy), an output of the trace like the logits; in a prefill a read back to the host (each call's
    results are kept in call order: a long prompt's prefill runs the layers once per chunk).

    TT-Transformers' Transformer.forward (tt/model.py, read at 3c5c3944) runs `for i, layer in enumerate(self.layers)`:
    in decode (not on a Galaxy) `x = ttnn.to_memory_config(x, self.args.get_residual_mem_config(mode, ...),
    activation_dtype)`, then `x = layer(x, current_pos, rot_mats_global=..., ..., kv_cache=kv_cache[i])`; layer 0's x
    is the embedding (`_transform_decode_inputs_device`). A layer is a TransformerBlock, a LightweightModule whose
    __call__ is `return self.forward(*args, **kwargs)` (models/common/lightweightmodule.py), so an instance attribute
    `forward` on the layer object sees exactly that x. The layer objects stay in self.layers, unchanged otherwise
    (model.py reads `layer.attention.layer_past` for the cache; TT's generator and our draft views index the same
    list); the attribute is removed again when the capture ends.

    What x is there (tt/model_config.py ModelArgs.get_residual_mem_config, read at 87700c07; tt/decoder.py
    TransformerBlock.forward, read at 01229001: "x is fractured across devices and interleaved in DRAM (for prefill)
    and sharded in L1 (for decode)", with `assert x.memory_config() == skip_mem_cfg`): [1, 1, 32, dim / devices] per
    device, width-sharded in L1 over dram_shard_core_grid_for_k(dim // devices), device d holding columns
    [d * dim / devices, (d + 1) * dim / devices) as the embedding's weights are split (tt/embedding.py,
    ShardTensor2dMesh(dims=(None, 3))). So on N300/T3K the copies are all-gathered along the last dim and on one
    device taken as they are. In prefill x is [1, 1, S, dim / devices], interleaved in DRAM (tt/decoder.py, same
    comment). A Galaxy keeps x split over its 4 mesh columns and replicated over its 8 rows (its layout differs
    between tt-metal versions): refused (TtnnCausalLM._check_taps)."""

    def __init__(self, layers, taps: Sequence[int], copy=None):
        self.layers, self.taps, self.copy, self.saved = layers, sorted(set(taps)), copy or dram_copy, {}
        self.outputs: dict[int, list] = {i: [] for i in self.taps}

    def __enter__(self):
        for i in self.taps:
            layer = self.layers[i]
            self.saved[i] = layer.__dict__.get("forward")  # an instance attribute already there, else None
            layer.forward = self._tapped(i, layer.forward)
        return self

    def _tapped(self, i: int, forward):
        def tapped_forward(x, *args, **kwargs):
            self.outputs[i].append(self.copy(x))  # before the layer's own ops: x as the layer receives it
            return forward(x, *args, **kwargs)
        return tapped_forward

    def __exit__(self, *exc):
        for i, saved in self.saved.items():
            if saved is None:
                del self.layers[i].forward  # the class's forward again
            else:
                self.layers[i].forward = saved


def prepare_mesh(mesh) -> None:
    """Make every planned trace of every model on the mesh: all traces released, then every model's persistent inputs
    allocated and every planned program compiled, then every trace captured (eager models, trace=False, compile only).
    Nothing is allocated or compiled while a trace is live. Runs only where the traces differ from the plans (one
    missing, or one no longer planned), so that a run whose models were all planned first (the demo's warm_up)
    captures each trace once."""
    models = list(MESH_MODELS[id(mesh)])
    if all(set(lm.traces) == (lm.planned if lm.trace else set()) and lm.compiled >= lm.planned for lm in models):
        return
    for lm in models:
        lm.release_traces()
    for lm in models:
        for key in sorted(lm.planned - lm.compiled):
            lm.compile(key)
            lm.compiled.add(key)
    for lm in models:
        for key in sorted(lm.planned if lm.trace else ()):
            try:
                lm.capture(key)
            except RuntimeError as e:
                error = region_error(e, models, lm, key)
                if error is None:
                    raise
                raise error from e


# tt-metal's refusal when the trace buffers outgrow the region (mesh_trace.cpp populate_mesh_buffer, TT_FATAL; the
# text is in the ttnn 0.81.1 wheel's libtt_metal.so): the first number is every live trace's size with the failing one's
TRACE_REGION_FULL = re.compile(r"Creating trace buffers of size (\d+)B on MeshDevice \S+, but only (\d+)B is allocated "
                               r"for trace region")


def region_error(error: RuntimeError, models: list, failing, failing_key) -> Optional[ValueError]:
    """tt-metal's trace-region refusal as one line naming the size to open the mesh with, or None for any other
    error. tt-metal reports what the traces captured so far took on the device; trace_plan's estimate for the same
    traces says how far off it was, and every planned trace scaled by that, with trace_plan's margin, is the size."""
    found = TRACE_REGION_FULL.search(str(error))
    if not found:
        return None
    needed, region = int(found.group(1)), int(found.group(2))
    done = [(lm, key) for lm in models for key in lm.traces] + [(failing, failing_key)]
    estimated_done = sum(lm._trace_bytes(key) for lm, key in done)
    planned = [lm._trace_bytes(key) for lm in models if lm.trace for key in lm.planned]
    size = region_bytes([math.ceil(needed * sum(planned) / max(estimated_done, 1))])
    return ValueError(f"the decode traces outgrew the trace region: {len(done)} of the {len(planned)} planned traces "
                      f"took {needed / 1e6:.0f} MB on the device and the mesh was opened with {region / 1e6:.0f} MB "
                      f"(trace_plan estimated {estimated_done / 1e6:.0f} MB for them); rerun with --trace_region_size "
                      f"{size} (or device_params' trace_region_size)")


def program_cache_entries(mesh) -> Optional[int]:
    """The mesh's program-cache entries (MeshDevice.num_program_cache_entries, ttnn/cpp/ttnn/distributed/
    distributed_pybind.cpp: "Number of entries in the program cache for this device"), None where it has none."""
    count = getattr(mesh, "num_program_cache_entries", None)
    return int(count()) if callable(count) else None


def remake_traces_after(mesh, before: Optional[int], what: str) -> None:
    """After host work that may compile programs (a prefill: TT's last-token slice and paged_fill_cache compile per
    last-token tile and page-table width, beyond what the warm-up covers): if programs were added to the cache while
    decode traces were live, their kernel binaries were allocated under those traces and a replay may overwrite them
    (allocator.cpp verify_safe_allocation), so every trace on the mesh is released and made again (prepare_mesh)
    before any replay; the binaries now sit outside every trace's buffers. Logged with what it cost."""
    after = program_cache_entries(mesh)
    models = list(MESH_MODELS[id(mesh)])
    if before is None or after is None or after == before or not any(lm.traces for lm in models):
        return
    start = time.perf_counter()
    for lm in models:
        lm.release_traces()
    prepare_mesh(mesh)
    logger.info(f"{what} compiled {after - before} program(s) while the decode traces were live: every trace on the "
                f"mesh made again ({time.perf_counter() - start:.1f}s)")


def captured(mesh, program):
    """(trace id, outputs) of `program()` captured as a trace. A failure between begin and end of the capture ends and
    releases that capture before it is raised again: a capture left open would turn every later op, the teardown's
    included, into a recording, and the failure the user must send back would be lost behind another."""
    import ttnn

    trace_id = ttnn.begin_trace_capture(mesh, cq_id=0)
    try:
        outputs = program()
    except BaseException:
        with contextlib.suppress(Exception):
            ttnn.end_trace_capture(mesh, trace_id, cq_id=0)
        with contextlib.suppress(Exception):
            ttnn.release_trace(mesh, trace_id)
        raise
    ttnn.end_trace_capture(mesh, trace_id, cq_id=0)
    return trace_id, outputs


def release_all(mesh, trace_ids) -> None:
    """Release traces, going on past one that will not release (a teardown after a failed run must still close the
    mesh); the failures are logged."""
    import ttnn

    for trace_id in trace_ids:
        try:
            ttnn.release_trace(mesh, trace_id)
        except Exception as e:  # noqa: BLE001: teardown reports and goes on
            logger.warning(f"trace {trace_id} could not be released ({type(e).__name__}: {e}); going on")


class TtnnCausalLM:
    """A TT-Transformers model (or a view of its first layers) behind the CausalLM contract."""

    def __init__(self, tt: TTModel, max_batch_size: int, max_seq_len: int, shares_target_cache: bool = False,
                 inputs: Optional[DeviceInputs] = None, trace: bool = True, tap_gather: str = "device"):
        if not 1 <= max_batch_size <= TILE_ROWS:
            raise ValueError(f"--batch_size {max_batch_size}: a TT decode step holds at most {TILE_ROWS} users "
                             "(one 32-row tile); use 32 or fewer")
        self.tt, self.max_batch_size, self.max_seq_len = tt, max_batch_size, max_seq_len
        self.n_layers, self.vocab_size = tt.n_layers, tt.args.vocab_size
        # The rows a step may use: the tile, or on a Galaxy one mesh column's users (tt_surface.mesh_column_rows).
        # A Galaxy column computes its own 8 rows against its own KV caches, and (in some attention.py versions) only
        # column 0's caches hold the prompts, so a user's rows must stay in column 0's rows at every step: a verify
        # row in tile rows 8-31 would attend to a cache that was never filled, or one its earlier rows never wrote.
        self.max_step_rows = mesh_column_rows(tt.model, tt.args, TILE_ROWS)
        if max_batch_size > self.max_step_rows:
            raise ValueError(f"--batch_size {max_batch_size}: on a Galaxy a decode step's rows must sit in one mesh "
                             f"column's {self.max_step_rows} users (TT-Transformers' attention gives each mesh column "
                             f"its own users and KV caches); use --batch_size {self.max_step_rows} or fewer")
        # Token trees need each row to see its ancestors only, which paged SDPA decode (each row sees every cached
        # position up to its own) does not express without an attention mask per step: chains only (README).
        self.supports_trees = False
        self.shares_target_cache = shares_target_cache
        self.device = torch.device("cpu")  # where the logits it returns live
        args = tt.args
        self.device_name = f"{args.device_name} ({' x '.join(map(str, args.cluster_shape))} mesh)"
        self.num_devices = args.num_devices
        # Each device reduces its own vocabulary share where TT leaves the LM head's output split (see module doc)
        # a row reading one cached position, in step costs (step_cost); a server's model gets its cache, and this,
        # at warm-up (serving/ttnn_model.py PagedVerify.warm)
        self.key_cost = tt.key_cost() if tt.kv_cache is not None else None
        self.split_vocab = (self.num_devices > 1 and not args.is_galaxy and tt.model.sampling is not None
                            and can_keep_shares(tt.model))
        self.share = padded_vocab(args) // self.num_devices if self.split_vocab else self.vocab_size
        self.ladder = pass_ladder(TILE_ROWS)  # until warm_up plans the run's
        self.planned: set[TraceKey] = set()  # (write passes, top k, taps) of every program a run uses
        self.compiled: set[TraceKey] = set()  # the planned programs already run once (kernels built)
        self.prefilled = False  # TT's prefill warm-up (its first prefill_forward_text) has run
        self.prefill_warmed = False  # _warm_up_prefill has run (its programs stay in the mesh's program cache)
        # False: every step runs its ops eagerly (TT's demos' enable_trace=False): a failure names the op, not a trace
        self.trace = trace
        # where a mesh's tapped states are gathered (_write_taps): "device", one all-gather inside each tapped trace,
        # or "host", read back and written to the tap tile after each replay (no collective of ours in a trace)
        self.tap_gather = tap_gather
        self.inputs = inputs if inputs is not None else DeviceInputs()
        self.traces: dict[TraceKey, Trace] = {}
        self.step_times: dict[TraceKey, list] = defaultdict(list)  # seconds per replay, per trace
        MESH_MODELS[id(tt.mesh_device)].add(self)

    def draft_view(self, n_layers: int) -> "TtnnCausalLM":
        """The first n_layers layers on the target's weights, cache and device inputs (no copy, no catch-up), traced
        apart."""
        if not 1 <= n_layers < self.n_layers:
            raise ValueError(f"a draft view needs 1 to {self.n_layers - 1} layers, got {n_layers}")
        return TtnnCausalLM(self.tt.first_layers(n_layers), self.max_batch_size, self.max_seq_len,
                            shares_target_cache=True, inputs=self.inputs, trace=self.trace, tap_gather=self.tap_gather)

    def step_cost(self, n_rows: int, context_len: float) -> float:
        """A step of n_rows rows: the passes are those of one user holding every row beyond the first (an upper
        bound for several users)."""
        passes = passes_for(min(n_rows, self.ladder[-1]), self.ladder)
        return 1 + WRITE_PASS_COST * passes + self.key_cost * n_rows * context_len

    # ---- warm-up, traces and the trace region ----------------------------------------------------------------

    def warm_up(self, max_rows_per_user: int, top_k: int, taps: Sequence[int], logits: bool = False) -> dict:
        """TT-Transformers' prefill warm-up (its first prefill_forward_text: every supported prefill length), then
        the programs a run with these settings uses (logits: a sampled run's, whose steps read the logits) planned and
        checked against the trace region. They are compiled
        and captured, with every other model's on the mesh, by `prepare_traces` (or the first step that needs them):
        planning every model first captures each trace once."""
        taps = self._check_taps(taps)
        start = time.perf_counter()
        if not self.shares_target_cache:  # a draft view never prefills: the target's prefill fills its cache
            self._warm_up_prefill()
        self.ladder = pass_ladder(max_rows_per_user)
        # a run's plan replaces an earlier run's (their traces are released when the mesh's are next made): runs in
        # sequence on one model never hold more traces than the most demanding of them
        self.planned = set(trace_keys(max_rows_per_user, top_k, taps, logits))
        self.check_trace_region()
        return {"compile_prefill": time.perf_counter() - start, "compile_decode": 0.0}

    def _warm_up_prefill(self) -> None:
        """TT's prefill warm-up (its first prefill_forward_text sweeps the lengths of
        ModelArgs.get_warmup_prefill_supported_seq_lens, up to capped_warmup_seq_len), then one prefill of every prompt
        length model.prefill_warm_prompts names: every padded length TT's sweep leaves out (256 and 512, the chunked
        lengths past the chunk size, ...), and every last-token tile of the prompts up to PER_TILE_WARM_POSITIONS
        tokens (TT's last-token ttnn.slice and its paged_fill_cache compile per tile and page-table width). So those
        programs are built before any decode trace is live: compiled under one, their kernel binaries may be
        overwritten when it replays (allocator.cpp verify_safe_allocation); a prefill that still compiles something
        later has the traces made again (remake_traces_after). Paged into the sink block through a page-table row as
        wide as a user's (model.prefill_into_sink), as TT's own warm-up pages its prompts (a page table of zeros)."""
        if self.prefill_warmed:  # a later run on the same model: its programs are in the program cache
            return
        programs = program_cache_entries(self.tt.mesh_device)
        self.prefill(0, [0])
        prefill_into_sink(self.tt.generator, [self.tt.kv_cache], self.tt.page_table.shape[1],
                          prefill_warm_prompts(self.tt.args, self.max_seq_len))
        self.prefill_warmed = True
        # another model's traces may already be live on the mesh (a pool's earlier run): made again if so
        remake_traces_after(self.tt.mesh_device, programs, "the prefill warm-up")

    def prepare_traces(self) -> float:
        """Compile, and capture where tracing, every program planned on this mesh (prepare_mesh); seconds spent."""
        start = time.perf_counter()
        prepare_mesh(self.tt.mesh_device)
        return time.perf_counter() - start

    def check_trace_region(self) -> None:
        """Stop before capturing with an error that names the fix when the planned traces of every model on the mesh
        would not fit the region it was opened with (known for meshes opened through device.open_mesh: the CLI, our
        pytest fixture and make tt-smoke)."""
        mesh = self.tt.mesh_device
        region = TRACE_REGIONS.get(id(mesh))
        needed = sum(lm._trace_bytes(key) for lm in MESH_MODELS[id(mesh)] if lm.trace for key in lm.planned)
        if region and needed > region:
            raise ValueError(f"the planned decode traces take about {needed / 1e6:.0f} MB of trace region and the mesh "
                             f"was opened with {region / 1e6:.0f} MB: rerun with --trace_region_size "
                             f"{region_bytes([needed])} (or device_params' trace_region_size), or plan fewer traces "
                             "(lower --n_draft_tokens)")

    def _trace_bytes(self, key: TraceKey) -> int:
        args = self.tt.args
        return trace_bytes(args.model_name, args.device_name, self.tt.full_layers, self.n_layers, key, self.share)

    def compile(self, key: TraceKey) -> None:
        """The program for this key run once, outside any trace, so its kernels are built (and, on a first call, the
        persistent inputs allocated) before anything is captured. Every write pass is -1 first: the run writes
        nothing to the cache (it may come in the middle of a generation)."""
        import ttnn

        self._run_inputs([UserRows(0, [0], 0)], write=False, passes=TILE_ROWS)
        self.tt.passes.positions = self.inputs.step.pass_positions[:key.passes]
        # a scratch tile: the tap tile may hold a verified step's states the head has not been fed yet
        scratch = ttnn.clone(self.tap_tile(key.taps), memory_config=ttnn.DRAM_MEMORY_CONFIG) if key.taps else None
        self.tt.passes.count_from_zero()
        outputs = self._forward(key, scratch)
        self._check_ordered_writes(key.passes)
        for tensor in device_tensors(outputs) + ([scratch] if key.taps else []):
            ttnn.deallocate(tensor)

    def _check_ordered_writes(self, passes: int) -> None:
        """Every layer's K and V cache writes went through the ordered writer (attention.py), each as `passes` update
        ops: otherwise TT-Transformers reached paged_update_cache some other way (bound at import, fused, a renamed
        forward_decode) and a verify step's rows would race in one op, losing writes with no error. One line naming
        the counts."""
        done = self.tt.passes
        if done.writes != 2 * self.n_layers or done.issued != 2 * self.n_layers * passes:
            raise RuntimeError(f"the ordered cache writes did not reach TT-Transformers' attention: a {self.n_layers}-"
                               f"layer decode step made {done.writes} K/V writes through them ({2 * self.n_layers} "
                               f"expected) and issued {done.issued} update ops ({2 * self.n_layers * passes} expected "
                               f"for {passes} passes); this tt-metal's tt/attention.py does not call "
                               "ttnn.experimental.paged_update_cache from Attention.forward_decode (tt_surface probe)")

    def capture(self, key: TraceKey) -> None:
        """The program for this key captured as a trace (its outputs are the trace's persistent tensors)."""
        import ttnn

        self.tt.passes.positions = self.inputs.step.pass_positions[:key.passes]
        trace_id, outputs = captured(self.tt.mesh_device,
                                     lambda: self._forward(key, self.tap_tile(key.taps) if key.taps else None))
        self.traces[key] = Trace(trace_id, *outputs)

    def release_traces(self) -> None:
        traces, self.traces = self.traces, {}
        release_all(self.tt.mesh_device, [t.trace_id for t in traces.values()])

    def __del__(self):  # a dropped model's traces leave the trace region (as the 2026 TT-Transformers'
        # Generator.__del__ releases its own, tt/generator.py; tt_baseline.py releases TT's)
        with contextlib.suppress(Exception):  # a destructor never raises (the mesh may be closed already)
            self.release_traces()

    def release(self) -> None:
        """Its traces given back, and nothing of it traced again: the model is being dropped."""
        self.release_traces()
        self.planned.clear()
        self.compiled.clear()
        MESH_MODELS[id(self.tt.mesh_device)].discard(self)

    # ---- the CausalLM calls ----------------------------------------------------------------------------------

    def prefill(self, user: int, tokens: Sequence[int], logits: bool = False, taps: Sequence[int] = ()
                ) -> StepOutput:
        taps = self._check_taps(taps)
        generator = self.tt.generator
        if taps and not self.prefilled:  # TT's first prefill runs its warm-up sweep: not under the taps' host reads
            self.prefill(user, list(tokens[:1]))
        self.prefilled = True
        programs = program_cache_entries(self.tt.mesh_device)
        with TapCapture(self.tt.model.layers, taps, copy=self._to_host) as capture:
            out = generator.prefill_forward_text(torch.tensor([list(tokens)]), **supported_kwargs(
                generator.prefill_forward_text, page_table=self.tt.page_table[user : user + 1],
                kv_cache=[self.tt.kv_cache], prompt_lens=[len(tokens)], empty_slots=[user], enable_trace=False))
        remake_traces_after(self.tt.mesh_device, programs, f"a prefill of {len(tokens)} tokens")
        row = out.reshape(-1)[: self.vocab_size].float().view(1, -1)
        states = [prompt_taps(capture.outputs, taps, len(tokens))] if taps else None
        return StepOutput([row.argmax(dim=-1).tolist()], [row] if logits else None, hidden=states)

    def _to_host(self, x) -> torch.Tensor:
        """A prefill's x [1, 1, S, dim / devices] read back as [S, dim] bfloat16 (device parts side by side)."""
        import ttnn

        if self.num_devices > 1:
            host = ttnn.to_torch(x, mesh_composer=ttnn.ConcatMeshToTensor(self.tt.mesh_device, dim=3))
        else:
            host = ttnn.to_torch(ttnn.get_device_tensors(x)[0])
        return host.reshape(-1, host.shape[-1])[:, : self.tt.args.dim].to(torch.bfloat16)

    def commit_path(self, user: int, start_pos: int, path: Sequence[int]) -> None:
        raise NotImplementedError("the ttnn backend verifies chains only (supports_trees is False)")

    def step(self, rows: Sequence[UserRows], logits: bool = False, top_k: int = 0, taps: Sequence[int] = (),
             page_table: Optional[torch.Tensor] = None) -> StepOutput:
        """page_table: this step's [users, blocks] int32 page table (user u's blocks: row u), staged into the
        persistent page-table input like every other input; None: the model's own (TTModel.page_table). A server
        passes its scheduler's table, which changes every step (serving/ttnn_model.py)."""
        if any(r.parents is not None for r in rows):
            raise ValueError("the ttnn backend verifies chains only (supports_trees is False)")
        return self._run(rows, logits, top_k, self._check_taps(taps), page_table)

    def tap_tile(self, taps: tuple[int, ...]):
        """The persistent tap tile for these taps [1, 1, 32, len(taps) * dim], bfloat16 on every device: allocated by
        the first program that compiles with it (prepare_mesh: never while a trace is live)."""
        import ttnn

        if taps not in self.inputs.taps:
            self.inputs.taps[taps] = ttnn.from_torch(
                torch.zeros(1, 1, TILE_ROWS, len(taps) * self.tt.args.dim), dtype=ttnn.bfloat16,
                layout=ttnn.TILE_LAYOUT, device=self.tt.mesh_device, memory_config=ttnn.DRAM_MEMORY_CONFIG,
                mesh_mapper=ttnn.ReplicateTensorToMesh(self.tt.mesh_device))
        return self.inputs.taps[taps]

    def read_taps(self, taps: Sequence[int]) -> torch.Tensor:
        """The tap tile the last step with these taps wrote, [32, len(taps) * dim] (what a device head reads; for
        checks: the loop never reads it)."""
        import ttnn

        tile = self.tap_tile(tuple(taps))
        return ttnn.to_torch(ttnn.get_device_tensors(tile)[0]).reshape(TILE_ROWS, -1).float()

    def _check_taps(self, taps: Sequence[int]) -> tuple[int, ...]:
        """taps as a trace key; layer ids out of range, or any on a Galaxy, refused with one line."""
        taps = tuple(taps)
        if any(not 0 <= i < self.n_layers for i in taps):
            raise ValueError(f"taps {list(taps)}: layer ids must be in [0, {self.n_layers})")
        if taps and self.tt.args.is_galaxy:
            raise ValueError("taps on a Galaxy: its decode residual is split over the mesh columns and replicated "
                             "over its rows, which this backend does not gather; use a draft mode without a draft "
                             "head there")
        return taps

    # ---- one traced step -------------------------------------------------------------------------------------

    def _run(self, rows: Sequence[UserRows], logits: bool, top_k: int, taps: tuple[int, ...],
             page_table: Optional[torch.Tensor] = None) -> StepOutput:
        """One replay of the decode trace over `rows`. A shape no warm-up planned is planned now and the mesh's traces
        made again (prepare_mesh). taps: checked (_check_taps)."""
        import ttnn

        self._check_rows(sum(len(r.tokens) for r in rows))  # before anything is planned or compiled for the step
        passes = passes_for(max(len(u.tokens) for u in rows), self.ladder)
        key = TraceKey(passes, top_k, taps, logits)
        if key not in (self.traces if self.trace else self.compiled):
            self.planned.add(key)
            self.check_trace_region()
            prepare_mesh(self.tt.mesh_device)
        r = self._run_inputs(rows, True, passes, page_table)
        start = time.perf_counter()
        if self.trace:
            trace = self.traces[key]
            ttnn.execute_trace(self.tt.mesh_device, trace.trace_id, cq_id=0, blocking=False)
        else:  # eager: the same program, op by op
            self.tt.passes.positions = self.inputs.step.pass_positions[:passes]
            trace = Trace(None, *self._forward(key, self.tap_tile(taps) if taps else None))
        # every output is read right after its own trace's replay: a later trace's capture allocated under this one
        # (prepare_mesh) may overwrite its outputs when that trace replays, never before they are read here
        ids = self._argmax(trace, r)
        all_logits = self._read_logits(trace, r) if logits else None
        top = self._top_k(trace, top_k) if top_k else None
        if trace.tap_parts is not None:
            self._gather_taps_on_host(trace.tap_parts, taps)
        self.step_times[key].append(time.perf_counter() - start)  # the step as the loop sees it: reads included
        if not self.trace:
            for tensor in device_tensors([trace.ids, trace.best, trace.logits, trace.top, trace.first_rows,
                                          trace.tap_parts]):
                ttnn.deallocate(tensor)
        out_ids, out_logits, out_top, out_hidden, start = [], [], [], [], 0
        for user_rows in rows:
            end = start + len(user_rows.tokens)
            out_ids.append(ids[start:end])
            if logits:
                out_logits.append(all_logits[start:end])
            if top_k:
                out_top.append(top[start:end])
            if taps:  # the user's tapped states stay in the tap tile, rows start..end - 1
                out_hidden.append(DeviceRows(start, user_rows.start_pos))
            start = end
        return StepOutput(out_ids, out_logits if logits else None, out_top if top_k else None,
                          out_hidden if taps else None)

    def _run_inputs(self, rows: Sequence[UserRows], write: bool, passes: int,
                    table: Optional[torch.Tensor] = None) -> int:
        """The step's inputs on the device (the first call allocates them, with every pass tensor; later calls copy
        into them, the pass tensors the trace reads only); the number of rows used."""
        import ttnn
        from models.tt_transformers.tt.common import copy_host_to_device

        n_rows = self._check_rows(sum(len(r.tokens) for r in rows))
        tokens = torch.zeros(TILE_ROWS, dtype=torch.int64)
        positions = torch.full((TILE_ROWS,), -1, dtype=torch.int64)
        table = self.tt.page_table if table is None else table  # user u's blocks: row u
        page_table = table[0].repeat(TILE_ROWS, 1)  # idle rows: any valid row, never read
        pass_positions = torch.full((passes, TILE_ROWS), -1, dtype=torch.int32)
        r = 0
        for user_rows in rows:
            for j, token in enumerate(user_rows.tokens):
                tokens[r], positions[r] = token, user_rows.start_pos + j
                page_table[r] = table[user_rows.user]
                if write:
                    pass_positions[j, r] = positions[r]
                r += 1
        decode_inputs = self.tt.model.prepare_decode_inputs_host(tokens, positions, page_table)
        if len(decode_inputs) != 4:
            raise ValueError(f"TT-Transformers' prepare_decode_inputs_host returned {len(decode_inputs)} inputs where "
                             "the backend takes 4 (tokens, current_pos, rot_mat_idxs, page_table): this tt-metal's "
                             "decode interface is not one the backend drives (tt_surface probe)")
        host = [*decode_inputs,
                *(ttnn.from_torch(p, dtype=ttnn.int32, mesh_mapper=self._replicated()) for p in pass_positions)]
        if self.inputs.step is None:
            device = copy_host_to_device(host, mesh_device=self.tt.mesh_device)
            self.inputs.step = StepInputs(*device[:4], device[4:])
            if self.split_vocab:
                self.inputs.vocab_mask = self._device_vocab_mask()
        else:
            i = self.inputs.step
            copy_host_to_device(host, [i.tokens, i.current_pos, i.rope_idxs, i.page_table, *i.pass_positions])
        return r

    def _check_rows(self, n_rows: int) -> int:
        """n_rows, or one line when a step of that many rows does not fit (max_step_rows)."""
        if n_rows > self.max_step_rows:
            where = "the decode tile" if self.max_step_rows == TILE_ROWS else "one Galaxy mesh column's rows"
            raise ValueError(f"a step of {n_rows} rows does not fit {where} ({self.max_step_rows})")
        return n_rows

    def _read(self, tensor) -> torch.Tensor:
        """A traced output read back as [32, width]: on a split-vocabulary mesh the devices' parts side by side in
        device order, in one read (ConcatMeshToTensor); otherwise one device's copy."""
        import ttnn

        rows = tensor.shape[-2]
        if self.split_vocab:
            composer = ttnn.ConcatMeshToTensor(self.tt.mesh_device, dim=3)
            return ttnn.to_torch(tensor, mesh_composer=composer).reshape(rows, -1)
        return ttnn.to_torch(ttnn.get_device_tensors(tensor)[0]).reshape(rows, -1)

    def _argmax(self, trace: Trace, rows: int) -> list[int]:
        """The greedy id of each of the first `rows` rows (the idle rows after them, at position -1, hold whatever the
        kernels left: never looked at, as TT ignores them): the device whose share holds the largest logit (the
        lowest id on ties, as argmax over the whole vocabulary), at its argmax."""
        ids = self._read(trace.ids).long()[:rows]  # [rows, devices]: each device's argmax in its own share
        if trace.best is None:
            return ids[:, 0].tolist()
        device = self._read(trace.best).float()[:rows].argmax(dim=1)  # the first device on ties
        greedy = device * self.share + ids.gather(1, device.view(-1, 1)).view(-1)
        if (greedy >= self.vocab_size).any():
            raise RuntimeError("the device's argmax chose a padded vocabulary column: its mask did not hold")
        return greedy.tolist()

    def _read_logits(self, trace: Trace, rows: int) -> torch.Tensor:
        """The logits of the first `rows` rows, from the smallest traced slice that holds them (a sampled step of a
        few rows reads a few rows, not the tile's 32 x the vocabulary: ~8 MB a step for Llama-3.1-8B)."""
        tensor = next((trace.first_rows[r] for r in sorted(trace.first_rows) if r >= rows), trace.logits)
        return self._read(tensor).float()[:rows, : self.vocab_size]

    def _top_k(self, trace: Trace, k: int) -> list[list[int]]:
        """The k best ids per row from every device's slices' candidates (ids read as unsigned 16 bits: topk
        returns uint16 indices for widths below 65,536, topk_device_operation.cpp resolve_index_dtype)."""
        width = vocab_slices(self.share)[0]
        devices = self.num_devices if self.split_vocab else 1
        offsets = torch.arange(devices).view(1, devices, 1) * self.share
        values, ids = [], []
        for s, (slice_values, slice_ids) in enumerate(trace.top):
            values.append(self._read(slice_values).float().view(TILE_ROWS, devices, -1)[:, :, :k])
            ids.append((self._read(slice_ids).long().view(TILE_ROWS, devices, -1)[:, :, :k] & 0xFFFF)
                       + offsets + s * width)
        values = torch.cat(values, dim=2).reshape(TILE_ROWS, -1)
        ids = torch.cat(ids, dim=2).reshape(TILE_ROWS, -1)
        values[ids >= self.vocab_size] = float("-inf")  # a padded column never stands for a token
        order = torch.argsort(ids, dim=1)  # ties to the lower id, then by value (stable sort keeps that order)
        values, ids = values.gather(1, order), ids.gather(1, order)
        best = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
        return ids.gather(1, best).tolist()

    def _replicated(self):
        """How TT-Transformers places the decode positions on the mesh (prepare_decode_inputs_host): replicated,
        or split over the mesh rows on a Galaxy."""
        import ttnn

        args = self.tt.args
        return ttnn.ShardTensor2dMesh(self.tt.mesh_device, dims=(None, 0) if args.is_galaxy else (None, None),
                                      mesh_shape=args.cluster_shape)

    def _device_vocab_mask(self):
        """0 over the vocabulary, -inf over the LM head's padded columns, split over the devices as the logits are."""
        import ttnn

        mask = torch.zeros(1, 1, TILE_ROWS, self.share * self.num_devices)
        mask[..., self.vocab_size :] = float("-inf")
        mapper = ttnn.ShardTensor2dMesh(self.tt.mesh_device, dims=(None, 3), mesh_shape=self.tt.args.cluster_shape)
        return ttnn.from_torch(mask, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=self.tt.mesh_device,
                               mesh_mapper=mapper)

    def _forward(self, key: TraceKey, tile=None) -> list:
        """The traced program: the decode forward over the tile, then per device the argmax (and the max, and the
        top k of each slice) over its vocabulary share; with key.taps, the tapped states written to `tile`; with
        key.logits (a sampled run), the logits' first rows sliced for its reads (a greedy trace reads ids only).
        Outputs go to DRAM (a trace keeps them: L1 is for the ops)."""
        import ttnn

        i, model, dram = self.inputs.step, self.tt.model, ttnn.DRAM_MEMORY_CONFIG
        with TapCapture(model.layers, key.taps) as capture:
            out = decode_logits(model.ttnn_decode_forward(
                i.tokens, i.current_pos, rot_mat_idxs=i.rope_idxs, page_table=i.page_table, kv_cache=self.tt.kv_cache,
                **decode_forward_kwargs(model, self.split_vocab)))
        self._check_share(out)
        if self.split_vocab:  # each device's share (the LM head's bfloat8_b): masked in bfloat16, which holds -inf
            tiles = ttnn.add(out, self.inputs.vocab_mask, dtype=ttnn.bfloat16, memory_config=dram)
            best = ttnn.max(tiles, dim=-1, keepdim=True, memory_config=dram)
            rows = ttnn.untilize(tiles, use_multicore=True, memory_config=dram)
        else:  # TT's untilized logits, whole on every device: drop the padded columns
            rows = ttnn.slice(out, [0, 0, 0, 0], [1, 1, TILE_ROWS, self.vocab_size], memory_config=dram)
            tiles = ttnn.to_layout(rows, ttnn.TILE_LAYOUT, memory_config=dram) if key.top_k else None
            best = None
        ids = ttnn.argmax(rows, dim=-1, keepdim=True, memory_config=dram)
        top = slice_top_k(tiles, key.top_k, self.share) if key.top_k else None
        tap_parts = self._write_taps(capture.outputs, key.taps, tile) if key.taps else None
        first_rows = {r: ttnn.slice(rows, [0, 0, 0, 0], [1, 1, r, rows.shape[-1]], memory_config=dram)
                      for r in (LOGIT_READS if key.logits else ())}
        return [ids, best, rows, top, first_rows, tap_parts]

    def _check_share(self, logits) -> None:
        """The logits' width per device against the share the argmax and top k index by (tt_surface.padded_vocab
        derives it where ModelArgs has no padded_vocab_size): one line naming the mismatch, not wrong ids."""
        width = logits.shape[-1]
        if (width != self.share) if self.split_vocab else (width < self.vocab_size):
            raise ValueError(f"TT-Transformers' LM head gives {width} logit columns per device where the backend "
                             f"expected {self.share if self.split_vocab else f'at least {self.vocab_size}'}: this "
                             "tt-metal pads the vocabulary another way (tt_surface.padded_vocab)")

    def _write_taps(self, copies: dict, taps: tuple[int, ...], tile):
        """The tapped layers' inputs, in the order asked, into `tile` ([1, 1, 32, len(taps) * dim], whole rows on every
        device, as the replicated head reads them). On a mesh each copy holds dim / devices columns (TapCapture), so
        the copies are stacked along the rows ([1, 1, 32 * len(taps), dim / devices]) and all-gathered along dim once
        (one collective per step, not one per tap), then each tap's 32 rows go side by side. The gather is
        TT-Transformers' own (tt/ccl.py tt_all_gather: the model's TT_CCL semaphores, persistent as a trace needs),
        cluster_axis None: over the whole 1 x N mesh; not called on one device (some versions' "# N150" guard compares
        a list with a tuple, `list(mesh_device.shape) == (1, 1)`, and would go on to all_gather_async, which needs two
        devices). With tap_gather "host" the stacked copies are returned instead, an output of the program, which
        the host reads and writes into the tile after the replay (_gather_taps_on_host): the traced program holds no
        collective of ours. Returns those copies, or None."""
        import ttnn
        from models.tt_transformers.tt.ccl import tt_all_gather

        dram, model, dim = ttnn.DRAM_MEMORY_CONFIG, self.tt.model, self.tt.args.dim
        parts = [copies[i][0] for i in taps]
        if self.num_devices > 1:
            stacked = ttnn.concat(parts, dim=2, memory_config=dram)
            if self.tap_gather == "host":
                return stacked
            rows = tt_all_gather(**supported_kwargs(
                tt_all_gather, input_tensor=stacked, mesh_device=model.mesh_device, tt_ccl=model.tt_ccl,
                cluster_axis=None, dim=3, memory_config=dram))
            parts = [ttnn.slice(rows, [0, 0, j * TILE_ROWS, 0], [1, 1, (j + 1) * TILE_ROWS, dim], memory_config=dram)
                     for j in range(len(taps))]
        # concat takes no preallocated output in 0.81.1 ("optional output tensor currently unsupported!",
        # data_movement/concat/concat.cpp): copied into the tile (ttnn.copy: input_b modified in place, equal shapes)
        ttnn.copy(ttnn.concat(parts, dim=3, memory_config=dram), tile)
        return None

    def _gather_taps_on_host(self, stacked, taps: tuple[int, ...]) -> None:
        """tap_gather "host": the stacked copies [1, 1, 32 * len(taps), dim / devices] per device read back as one
        [32 * len(taps), dim] (the devices' columns side by side, ConcatMeshToTensor), each tap's 32 rows put side by
        side, and the result written into the tap tile on every device: a read and a write of 32 x len(taps) x dim
        bfloat16 values a step, where the device gather moves none through the host."""
        import ttnn

        mesh = self.tt.mesh_device
        rows = ttnn.to_torch(stacked, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=3)).reshape(
            len(taps) * TILE_ROWS, -1)
        tile = torch.cat(rows.split(TILE_ROWS), dim=1).view(1, 1, TILE_ROWS, -1)
        ttnn.copy_host_to_device_tensor(ttnn.from_torch(tile, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                                                        mesh_mapper=ttnn.ReplicateTensorToMesh(mesh)),
                                        self.tap_tile(taps))


def slice_top_k(tiles, k: int, columns: int) -> list:
    """The top k of each row of a [1, 1, 32, >= columns] TILE tensor's first `columns` columns, per slice of the
    width trace_plan.vocab_slices picks (the last padded with -inf): [(values, indices) [1, 1, 32, k]] per slice,
    indices within the slice. On such widths ttnn.topk runs multi-core."""
    import ttnn

    width, slices = vocab_slices(columns)
    dram, top = ttnn.DRAM_MEMORY_CONFIG, []
    for s in range(slices):
        end = min((s + 1) * width, columns)
        piece = ttnn.slice(tiles, [0, 0, 0, s * width], [1, 1, TILE_ROWS, end], pad_value=float("-inf"),
                           memory_config=dram)
        if end - s * width < width:
            piece = ttnn.pad(piece, [(0, 0), (0, 0), (0, 0), (0, width - (end - s * width))], float("-inf"))
        top.append(ttnn.topk(piece, k=k, dim=-1, memory_config=dram))
    return top


def prompt_taps(copies: dict, taps: Sequence[int], n: int) -> torch.Tensor:
    """A prefill's tapped states [n, len(taps) * dim] from TapCapture's host copies: per layer, the last calls' chunks
    in order, as many as cover the prompt (TT's prefill warm-up, when this prefill ran it first, comes before), cut
    to the prompt's n rows (the rest is TT's padding)."""
    per_layer = {}
    for i in set(taps):
        chunks, rows = [], 0
        for chunk in reversed(copies[i]):
            if rows >= n:
                break
            chunks.insert(0, chunk)
            rows += len(chunk)
        per_layer[i] = torch.cat(chunks)[:n]
    return torch.cat([per_layer[i] for i in taps], dim=1)
