# SPDX-License-Identifier: Apache-2.0
"""The decode traces of every model on one mesh, made together (MeshTraces), and the trace primitives they use.

A buffer allocated while a trace is live may be overwritten when that trace replays (tt-metal's allocator warns of
it, allocator.cpp verify_safe_allocation), so traces are made for the whole mesh at once: every model on it releases
its traces, allocates its persistent inputs and compiles every planned program (kernel binaries are device buffers
too), and only then is anything captured. The target, its draft views, a separate draft model and a device draft
head on one mesh share one MeshTraces, passed to each when it is built; each is a traced model:

- `traces` (key -> its captured program), `planned` and `compiled` (sets of keys), `trace` (False: eager);
- `compile(key)`, `capture(key)`, `release_traces()`, `trace_bytes(key)` (trace_plan's estimate).
"""
import contextlib
import math
import re
import time
import weakref
from typing import Optional

from loguru import logger

from .device import TRACE_REGIONS
from .trace_plan import region_bytes
from .ttnn_api import ttnn


def cli_region_fix(size: int) -> str:
    """How a user of the CLI, make tt-smoke or the pytest fixture opens the mesh with a trace region of `size`."""
    return f"rerun with --trace_region_size {size} (or device_params' trace_region_size)"


class MeshTraces:
    """The traced models on one mesh: planned apart, made together (prepare), remade after host work that compiled
    under live traces (remake_after), checked together against the trace region (check_region). region_fix: the
    words naming how this mesh's user opens it with a region of N bytes (cli_region_fix; serving names vLLM's)."""

    def __init__(self, mesh, region_fix=cli_region_fix):
        self.mesh, self.region_fix = mesh, region_fix
        self.models = weakref.WeakSet()  # a dropped model leaves (its destructor releases its traces)

    def add(self, model) -> None:
        self.models.add(model)

    def discard(self, model) -> None:
        self.models.discard(model)

    def prepare(self) -> None:
        """Make every planned trace of every model on the mesh: all traces released, then every model's persistent
        inputs allocated and every planned program compiled, then every trace captured (eager models, trace=False,
        compile only). Nothing is allocated or compiled while a trace is live. Runs only where the traces differ from
        the plans (one missing, or one no longer planned), so that a run whose models were all planned first (a caller's
        warm_up) captures each trace once."""
        models = list(self.models)
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
                    error = region_error(e, models, lm, key, self.region_fix)
                    if error is None:
                        raise
                    raise error from e

    def remake_after(self, before: Optional[int], what: str) -> None:
        """After host work that may compile programs (a prefill: TT's last-token slice and paged_fill_cache compile per
        last-token tile and page-table width, beyond what the warm-up covers): if programs were added to the cache while
        decode traces were live, their kernel binaries were allocated under those traces and a replay may overwrite them
        (allocator.cpp verify_safe_allocation), so every trace on the mesh is released and made again (prepare)
        before any replay; the binaries now sit outside every trace's buffers. Logged with what it cost."""
        after = program_cache_entries(self.mesh)
        models = list(self.models)
        if before is None or after is None or after == before or not any(lm.traces for lm in models):
            return
        start = time.perf_counter()
        for lm in models:
            lm.release_traces()
        self.prepare()
        logger.info(f"{what} compiled {after - before} program(s) while the decode traces were live: every trace on "
                    f"the mesh made again ({time.perf_counter() - start:.1f}s)")

    def check_region(self) -> None:
        """Stop before capturing with an error that names the fix when the planned traces of every model on the mesh
        would not fit the region it was opened with (known for meshes opened through device.open_mesh: the CLI, our
        pytest fixture and make tt-smoke)."""
        region = TRACE_REGIONS.get(id(self.mesh))
        needed = sum(lm.trace_bytes(key) for lm in self.models if lm.trace for key in lm.planned)
        if region and needed > region:
            raise ValueError(f"the planned decode traces take about {needed / 1e6:.0f} MB of trace region and the mesh "
                             f"was opened with {region / 1e6:.0f} MB: {self.region_fix(region_bytes([needed]))}, "
                             "or plan fewer traces (lower --n_draft_tokens)")


class TracedModel:
    """The trace lifecycle every traced model on a mesh shares (TtnnCausalLM, TtnnDraftHead): its `traces` (key ->
    a captured program with a `trace_id`), `planned` and `compiled` keys, and the mesh's `mesh_traces`."""

    def release_traces(self) -> None:
        traces, self.traces = self.traces, {}
        release_all(self.mesh_traces.mesh, [t.trace_id for t in traces.values()])

    def __del__(self):  # a dropped model's traces leave the trace region (as the 2026 TT-Transformers'
        # Generator.__del__ releases its own, tt/generator.py; tests/tt_baseline.py releases TT's)
        with contextlib.suppress(Exception):  # a destructor never raises (the mesh may be closed already)
            self.release_traces()

    def release(self) -> None:
        """Its traces given back, and nothing of it traced again: the model is being dropped."""
        self.release_traces()
        self.planned.clear()
        self.compiled.clear()
        self.mesh_traces.discard(self)


# tt-metal's refusal when the trace buffers outgrow the region (mesh_trace.cpp populate_mesh_buffer, TT_FATAL; the
# text is in the ttnn 0.81.1 wheel's libtt_metal.so): the first number is every live trace's size with the failing one's
TRACE_REGION_FULL = re.compile(r"Creating trace buffers of size (\d+)B on MeshDevice \S+, but only (\d+)B is allocated "
                               r"for trace region")


def region_error(error: RuntimeError, models: list, failing, failing_key,
                 region_fix=cli_region_fix) -> Optional[ValueError]:
    """tt-metal's trace-region refusal as one line naming the size to open the mesh with (in region_fix's words), or
    None for any other error. tt-metal reports what the traces captured so far took on the device; trace_plan's
    estimate for the same traces says how far off it was, and every planned trace scaled by that, with trace_plan's
    margin, is the size."""
    found = TRACE_REGION_FULL.search(str(error))
    if not found:
        return None
    needed, region = int(found.group(1)), int(found.group(2))
    done = [(lm, key) for lm in models for key in lm.traces] + [(failing, failing_key)]
    estimated_done = sum(lm.trace_bytes(key) for lm, key in done)
    planned = [lm.trace_bytes(key) for lm in models if lm.trace for key in lm.planned]
    size = region_bytes([math.ceil(needed * sum(planned) / max(estimated_done, 1))])
    return ValueError(f"the decode traces outgrew the trace region: {len(done)} of the {len(planned)} planned traces "
                      f"took {needed / 1e6:.0f} MB on the device and the mesh was opened with {region / 1e6:.0f} MB "
                      f"(trace_plan estimated {estimated_done / 1e6:.0f} MB for them); {region_fix(size)}")


def program_cache_entries(mesh) -> Optional[int]:
    """The mesh's program-cache entries (MeshDevice.num_program_cache_entries, ttnn/cpp/ttnn/distributed/
    distributed_pybind.cpp: "Number of entries in the program cache for this device"), None where it has none."""
    count = getattr(mesh, "num_program_cache_entries", None)
    return int(count()) if callable(count) else None


def captured(mesh, program):
    """(trace id, outputs) of `program()` captured as a trace. A failure between begin and end of the capture ends and
    releases that capture before it is raised again: a capture left open would turn every later op, the teardown's
    included, into a recording, and the failure the user must send back would be lost behind another."""
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
    for trace_id in trace_ids:
        try:
            ttnn.release_trace(mesh, trace_id)
        except Exception as e:  # noqa: BLE001: teardown reports and goes on
            logger.warning(f"trace {trace_id} could not be released ({type(e).__name__}: {e}); going on")


def device_tensors(outputs) -> list:
    """The device tensors in a traced program's outputs (nested lists, tuples and dicts, None where absent)."""
    if outputs is None:
        return []
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in device_tensors(o)]
    return [outputs]
