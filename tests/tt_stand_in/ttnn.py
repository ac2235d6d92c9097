# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE standing in for the `ttnn` ops the ttnn backend calls, written in torch. It is not ttnn, runs no
device code, and proves nothing about a Tenstorrent device: it exists so the backend's host-side logic runs here
against the constraints a device imposes (names and keywords are those of ttnn 0.81.1):
- device tensors are objects the host cannot read except through to_torch; copy_host_to_device_tensor needs the
  same shape, dtype and layout on both sides (a traced step cannot change shape);
- trace capture records ops without running them (their outputs hold garbage until execute_trace), an op must
  have been compiled (run once) before a trace records it, and only captured trace ids replay;
- a decode batch is 32 rows; a row at position -1 is skipped by paged_update_cache and by SDPA decode;
- the KV cache is paged, blocks of 32 positions, [blocks, kv heads, 32, head_dim], addressed through page tables;
- paged_update_cache read-modify-writes a whole cache tile per row, all rows at once: when several rows of one
  op land in the same block, only the last row's write survives (the race tt-metal's Gemma-4 work hit).
- meshes of several devices: tensors are replicated, or sharded along their last dim (`shards`), and ops on a
  sharded tensor work on each device's shard in its local coordinates; CCL ops need the fabric configured before
  the mesh opened; the trace region is a budget that traces can overflow.
- every device tensor has a memory config (DRAM or L1, interleaved or width-sharded over cores); ops put their output
  where `memory_config` says (else where their first input is), to_memory_config hands back the same tensor when the
  config already matches, and clone refuses to move a sharded tensor to an interleaved config or back.
Each rule that mirrors a tt-metal check names the file and function it follows (read at versions near v0.81.1; the
error texts are the ones in the ttnn 0.81.1 wheel's libraries).
"""
import builtins
import types
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

uint16, uint32, int32, bfloat16, bfloat8_b, float32 = "uint16", "uint32", "int32", "bfloat16", "bfloat8_b", "float32"
ROW_MAJOR_LAYOUT, TILE_LAYOUT = "ROW_MAJOR", "TILE"


@dataclass(frozen=True)
class MemoryConfig:
    """ttnn.MemoryConfig: a layout (INTERLEAVED or *_SHARDED), a buffer type (DRAM or L1) and, when sharded, the
    shard spec (here (shard shape, core count, orientation)). Compared by value, as TT-Transformers' decoder compares
    its input's with the residual config (tt/decoder.py TransformerBlock.forward)."""

    memory_layout: str = "INTERLEAVED"
    buffer_type: str = "DRAM"
    shard_spec: Optional[tuple] = None

    def is_sharded(self) -> bool:
        return self.memory_layout != "INTERLEAVED"


DRAM_MEMORY_CONFIG = MemoryConfig("INTERLEAVED", "DRAM")
L1_MEMORY_CONFIG = MemoryConfig("INTERLEAVED", "L1")


class ShardStrategy:  # ttnn.ShardStrategy
    HEIGHT, WIDTH, BLOCK = "HEIGHT_SHARDED", "WIDTH_SHARDED", "BLOCK_SHARDED"


class ShardOrientation:  # ttnn.ShardOrientation
    ROW_MAJOR, COL_MAJOR = "ROW_MAJOR", "COL_MAJOR"


class CoreGrid:  # ttnn.CoreGrid
    def __init__(self, y, x):
        self.y, self.x = y, x

    @property
    def num_cores(self) -> int:
        return self.x * self.y


def create_sharded_memory_config(shape, core_grid, strategy, orientation=ShardOrientation.ROW_MAJOR,
                                 use_height_and_width_as_shard_shape=False) -> MemoryConfig:
    """ttnn.create_sharded_memory_config, in L1 (the only place it shards to)."""
    return MemoryConfig(strategy, "L1", (tuple(shape), core_grid.num_cores, orientation))
TORCH_DTYPES = {uint16: torch.int64, uint32: torch.int64, int32: torch.int64, bfloat16: torch.float32, bfloat8_b: torch.float32,
                float32: torch.float32}


TRACE_OP_BYTES = 4096  # what one recorded op takes in the stand-in's trace region (a stand-in figure)
AVAILABLE_DEVICES = 8  # Wormhole chips the stand-in "system" has (a T3K)


class FabricConfig:  # ttnn.FabricConfig members and values (ttnn 0.81.1)
    (DISABLED, FABRIC_1D_NEIGHBOR_EXCHANGE, FABRIC_1D, FABRIC_1D_RING, FABRIC_2D, FABRIC_2D_TORUS_X, FABRIC_2D_TORUS_Y,
     FABRIC_2D_TORUS_XY, CUSTOM) = range(9)


class FabricReliabilityMode:
    STRICT_INIT, RELAXED_INIT, DYNAMIC_RECONFIG = range(3)


FABRIC = {"config": FabricConfig.DISABLED, "open_meshes": 0}


def set_fabric_config(config, reliability_mode=FabricReliabilityMode.STRICT_INIT, num_planes=None,
                      fabric_tensix_config=None, fabric_udm_mode=None, fabric_manager_mode=None, router_config=None):
    """tt_metal's SetFabricConfig (libtt_metal.so, 0.81.1): no change to a non-DISABLED config while a mesh is open."""
    if config != FabricConfig.DISABLED and FABRIC["open_meshes"]:
        raise RuntimeError(f"SetFabricConfig({config}) is not allowed while devices are still open: Close the mesh "
                           "device before changing the fabric config to a non-DISABLED value.")
    FABRIC["config"] = config


def get_fabric_config():
    return FABRIC["config"]


def get_num_devices() -> int:
    return AVAILABLE_DEVICES


def get_device_ids() -> list:  # ttnn/distributed/distributed.py
    return list(range(get_num_devices()))


class CoreCoord:
    def __init__(self, x, y):
        self.x, self.y = x, y


class MeshDevice:
    """A mesh's worth of state: tensors it holds, compiled programs, traces and the trace region they fill."""

    def __init__(self, shape=(1, 1), trace_region_size=0):
        self.shape = tuple(shape)
        self.trace_region_size = trace_region_size
        self.fabric = FABRIC["config"]
        self.allocations = 0  # device tensors created outside trace replay
        self.compiled: set = set()
        self.capturing: Optional[list] = None
        self.capture_allocations = 0
        self.traces: dict[int, list] = {}
        self.trace_sizes: dict[int, int] = {}
        self.next_trace_id = 1
        self.replaying = False
        self.ops_run = 0
        self.single_core_topk = 0  # topk calls that took the single-core program
        # Buffers allocated and programs compiled while a trace is live (outside any capture): a later replay may
        # overwrite them (allocator.cpp verify_safe_allocation: "Allocating device buffers is potentially unsafe due
        # to the existence of an active trace. These buffers may be corrupted once a trace is executed if they are
        # not released before then"; program.cpp allocates kernel binaries through the same allocator).
        self.unsafe: list = []

    def get_num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def dram_grid_size(self) -> CoreCoord:
        return CoreCoord(12, 1)  # Wormhole: 12 DRAM channels

    def compute_with_storage_grid_size(self) -> CoreCoord:
        return CoreCoord(8, 8)


class MeshShape(tuple):
    def __new__(cls, rows, cols):
        return super().__new__(cls, (rows, cols))


def open_mesh_device(mesh_shape=None, l1_small_size=0, trace_region_size=0, num_command_queues=1,
                     dispatch_core_config=None, offset=None, physical_device_ids=(), worker_l1_size=0):
    """ttnn/distributed/distributed.py open_mesh_device: these keywords only (a fabric keyword is a TypeError). A
    fabric on one chip fails as tt-metal's control plane does (libtt_metal.so, 0.81.1)."""
    mesh = MeshDevice(mesh_shape or (1, get_num_devices()), trace_region_size)
    if mesh.get_num_devices() > get_num_devices():
        raise RuntimeError(f"stand-in: {mesh.get_num_devices()} devices requested, {get_num_devices()} available")
    if mesh.fabric != FabricConfig.DISABLED and mesh.get_num_devices() < 2:
        raise RuntimeError(f"Fabric config {mesh.fabric} requires at least 2 participating chips, but the opened mesh "
                           f"has {mesh.get_num_devices()} local device(s) on a single host.")
    FABRIC["open_meshes"] += 1
    return mesh


def close_mesh_device(mesh_device) -> None:
    mesh_device.traces.clear()
    FABRIC["open_meshes"] -= 1


device = types.SimpleNamespace(is_wormhole_b0=lambda mesh_device: True, is_blackhole=lambda mesh_device: False)


class ClusterType:  # ttnn.cluster.ClusterType (some members)
    N150, N300, T3K, GALAXY, TG, P150, BLACKHOLE_GALAXY = range(7)


cluster = types.SimpleNamespace(ClusterType=ClusterType, get_cluster_type=lambda: ClusterType.T3K)


def get_arch_name() -> str:
    return "wormhole_b0"


def create_global_semaphore(mesh_device, cores, initial_value, buffer_type=None):
    return object()


class Tensor:
    """`shards` > 1: split along the last dim over the mesh's devices in order (device d holds the d-th chunk);
    otherwise replicated."""

    def __init__(self, data: torch.Tensor, dtype: str, layout: str, device: Optional[MeshDevice], shards: int = 1,
                 mem: MemoryConfig = DRAM_MEMORY_CONFIG):
        self._data, self.dtype, self.layout, self.device, self.shards = data, dtype, layout, device, shards
        self.mem = mem
        self.deallocated = False
        if device is not None and not device.replaying:
            device.allocations += 1
            if device.capturing is not None:
                device.capture_allocations += 1
            elif device.traces:
                device.unsafe.append(weakref.ref(self))

    @property
    def data(self) -> torch.Tensor:
        if self.deallocated:
            raise RuntimeError("stand-in: use of a deallocated device tensor")
        return self._data

    @property
    def shape(self):
        return tuple(self._data.shape)

    def memory_config(self) -> MemoryConfig:
        return self.mem


class ReplicateTensorToMesh:
    def __init__(self, mesh_device):
        self.mesh_device = mesh_device


class ConcatMeshToTensor:
    """Reads a mesh tensor back with the devices' parts concatenated along `dim` (the stand-in keeps them that way
    along the last dim already)."""

    def __init__(self, mesh_device, dim):
        if dim not in (3, -1):
            raise NotImplementedError("stand-in: concatenation along the last dim only")
        self.mesh_device = mesh_device


class ShardTensor2dMesh:
    """ttnn.ShardTensor2dMesh(mesh_device, mesh_shape, dims): both required, as the wheel's signature."""

    def __init__(self, mesh_device, mesh_shape, dims):
        if tuple(dims) not in ((None, None), (None, 3), (None, -1)):
            raise NotImplementedError("stand-in: replicated, or sharded along the last dim over the mesh, only")
        self.mesh_device, self.shards = mesh_device, 1 if tuple(dims) == (None, None) else mesh_device.get_num_devices()


def from_torch(tensor, dtype=None, *, layout=ROW_MAJOR_LAYOUT, device=None, mesh_mapper=None, memory_config=None,
               **kwargs) -> Tensor:
    dtype = dtype or float32
    shards = getattr(mesh_mapper, "shards", 1)
    return Tensor(tensor.detach().to(TORCH_DTYPES[dtype]).clone(), dtype, layout, device, shards,
                  memory_config or DRAM_MEMORY_CONFIG)


def to_torch(tensor: Tensor, dtype=None, *, mesh_composer=None, **kwargs) -> torch.Tensor:
    """uint16 comes back as torch.uint16 (ttnn/core.py ttnn_dtype_to_torch_dtype), the index dtype topk returns for
    widths <= 65535 (topk_device_operation.cpp). A tensor split over several devices is read whole only through a
    mesh composer."""
    if tensor.shards > 1 and mesh_composer is None:
        raise RuntimeError("stand-in: a tensor split over the mesh's devices needs a mesh_composer to read whole")
    data = tensor.data.clone()
    return data.to(torch.uint16) if tensor.dtype == uint16 else data


def to_device(tensor: Tensor, device: MeshDevice, memory_config=None) -> Tensor:
    return Tensor(tensor.data.clone(), tensor.dtype, tensor.layout, device, tensor.shards,
                  memory_config or DRAM_MEMORY_CONFIG)


def get_device_tensors(tensor: Tensor) -> list:
    """One tensor per device: its shard, or the replicated whole."""
    n = tensor.device.get_num_devices() if tensor.device is not None else 1
    if tensor.shards == 1:
        return [tensor] * n
    return [Tensor(part.clone(), tensor.dtype, tensor.layout, None) for part in tensor.data.chunk(tensor.shards, -1)]


def per_shard(tensor: Tensor, fn) -> torch.Tensor:
    """fn applied to each device's shard (its local coordinates), the results put back side by side."""
    return torch.cat([fn(part) for part in tensor.data.chunk(tensor.shards, -1)], dim=-1)


def unsqueeze_to_4D(tensor: Tensor) -> Tensor:
    """A view: same data, placement and memory config (a traced output's view sees its replayed values)."""
    data = tensor.data
    while data.dim() < 4:
        data = data.unsqueeze(0)
    return Tensor(data, tensor.dtype, tensor.layout, tensor.device, tensor.shards, tensor.mem)


def deallocate(tensor: Tensor, force: bool = True) -> None:
    tensor.deallocated = True


def copy_host_to_device_tensor(host_tensor: Tensor, device_tensor: Tensor, cq_id=None) -> None:
    if host_tensor.device is not None or device_tensor.device is None:
        raise RuntimeError("stand-in: copy_host_to_device_tensor copies a host tensor into a device tensor")
    if (host_tensor.shape, host_tensor.dtype, host_tensor.layout) != (device_tensor.shape, device_tensor.dtype,
                                                                      device_tensor.layout):
        raise RuntimeError(f"stand-in: host and device tensors must be the same shape, dtype and layout: "
                           f"{host_tensor.shape} {host_tensor.dtype} vs {device_tensor.shape} {device_tensor.dtype}")
    device_tensor.data.copy_(host_tensor.data)


# ---- ops: run now, or recorded into the trace being captured -------------------------------------------------

def _device_of(values) -> MeshDevice:
    for v in values:
        if isinstance(v, Tensor) and v.device is not None:
            return v.device
    raise RuntimeError("stand-in: ops run on device tensors only")


def run_op(name: str, fn, *args, inplace: bool = False, shards: Optional[int] = None,
           mem: Optional[MemoryConfig] = None, **kwargs) -> Any:
    """fn computes on the tensors' data (torch) and returns torch tensors (with dtype/layout) or None when it works
    in place. Captured ops are recorded, not run; their outputs are garbage until the trace replays. Outputs are
    placed (`shards`) and kept (`mem`) like the first input unless told otherwise."""
    device = _device_of([*args, *kwargs.values()])
    key = (name, tuple(a.shape for a in [*args, *kwargs.values()] if isinstance(a, Tensor)))
    first = next((a for a in [*args, *kwargs.values()] if isinstance(a, Tensor)), None)
    if shards is None:
        shards = first.shards if first is not None else 1
    if mem is None:
        mem = first.mem if first is not None else DRAM_MEMORY_CONFIG
    if device.capturing is not None:
        if key not in device.compiled:
            raise RuntimeError(f"stand-in: {name} was not compiled before trace capture (run the step once first)")
        if inplace:
            device.capturing.append((fn, args, kwargs, None))
            return None
        outputs = _wrap(fn(*args, **kwargs), device, shards, mem, garbage=True)
        device.capturing.append((fn, args, kwargs, outputs))
        return outputs
    if key not in device.compiled and device.traces:  # its kernel binaries go to DRAM while a trace is live
        device.unsafe.append(("program", name))
    device.compiled.add(key)
    device.ops_run += 1
    result = fn(*args, **kwargs)
    return None if inplace else _wrap(result, device, shards, mem)


def _wrap(result, device, shards, mem, garbage=False):
    if isinstance(result, tuple) and not isinstance(result[0], torch.Tensor):
        return tuple(_wrap(r, device, shards, mem, garbage) for r in result)
    data, dtype, layout = result
    if dtype == bfloat8_b and data.is_floating_point():  # 16 values share an exponent: no room for an infinity
        data = torch.where(data.isinf(), float("nan"), data)
    if garbage:
        data = torch.full_like(data, -7 if dtype in (uint16, uint32, int32) else float("nan"))
    return Tensor(data, dtype, layout, device, shards, mem)


def begin_trace_capture(mesh_device: MeshDevice, *, cq_id=None) -> int:
    mesh_device.capturing, mesh_device.capture_allocations = [], 0
    trace_id, mesh_device.next_trace_id = mesh_device.next_trace_id, mesh_device.next_trace_id + 1
    return trace_id


def end_trace_capture(mesh_device: MeshDevice, trace_id: int, *, cq_id=None) -> None:
    """The trace's commands go to the trace region: with a region, live traces must fit it (tt-metal's
    "Creating trace buffers ... only {}B is allocated for trace region", libtt_metal.so 0.81.1); without one (0,
    dynamic), a capture that allocated device buffers overlaps them ("Trace buffer at address {} overlaps with
    buffers allocated during trace capture ... set a non-zero trace_region_size")."""
    ops, mesh_device.capturing = mesh_device.capturing, None
    size = len(ops) * TRACE_OP_BYTES
    if mesh_device.trace_region_size == 0 and mesh_device.capture_allocations:
        raise RuntimeError("Trace buffer overlaps with buffers allocated during trace capture. Reduce allocations "
                           "during trace capture or set a non-zero trace_region_size.")
    used = sum(mesh_device.trace_sizes.values())
    if mesh_device.trace_region_size and used + size > mesh_device.trace_region_size:
        raise RuntimeError(f"Creating trace buffers of size {used + size}B on MeshDevice, but only "
                           f"{mesh_device.trace_region_size}B is allocated for trace region.")
    mesh_device.traces[trace_id], mesh_device.trace_sizes[trace_id] = ops, size


def execute_trace(mesh_device: MeshDevice, trace_id: int, *, cq_id=None, blocking: bool = True) -> None:
    if trace_id not in mesh_device.traces:
        raise RuntimeError(f"stand-in: trace {trace_id} was never captured")
    live = [u for u in mesh_device.unsafe if not isinstance(u, weakref.ref) or (u() is not None and not u().deallocated)]
    if live:
        raise RuntimeError(f"stand-in: {len(live)} device buffers or programs were allocated while a trace was live "
                           f"({live[0] if not isinstance(live[0], weakref.ref) else 'a tensor'}): replaying the trace "
                           "may overwrite them (allocator.cpp verify_safe_allocation)")
    mesh_device.replaying = True
    try:
        for fn, args, kwargs, outputs in mesh_device.traces[trace_id]:
            result = fn(*args, **kwargs)
            if outputs is None:
                continue
            for out, (data, _, _) in zip(outputs if isinstance(outputs, tuple) else (outputs,),
                                         result if isinstance(outputs, tuple) else (result,)):
                out.data.copy_(data)
            mesh_device.ops_run += 1
    finally:
        mesh_device.replaying = False


def release_trace(mesh_device: MeshDevice, trace_id: int) -> None:
    del mesh_device.traces[trace_id], mesh_device.trace_sizes[trace_id]
    if not mesh_device.traces:  # no live trace left to overwrite anything
        mesh_device.unsafe.clear()


def synchronize_device(device, cq_id=None, sub_device_ids=()) -> None:
    pass


def slice(input_tensor: Tensor, slice_start, slice_end, slice_step=None, *, memory_config=None, **kwargs) -> Tensor:
    """On a sharded tensor each device slices its own shard (local coordinates)."""
    index = tuple(builtins.slice(start, end) for start, end in zip(slice_start, slice_end))
    return run_op("slice", lambda t: (per_shard(t, lambda d: d[index].clone()), t.dtype, t.layout), input_tensor,
                  mem=memory_config)


def _last_dim(t: Tensor, dim) -> None:
    if dim not in (-1, t.data.dim() - 1):
        raise NotImplementedError("stand-in: reductions over the last dim only")


def argmax(input_tensor: Tensor, dim=None, keepdim=False, *, sub_core_grids=None, memory_config=None,
           output_tensor=None, enable_secondary_dm=None) -> Tensor:
    """argmax's wheel signature (no use_multicore keyword: a TypeError there too). Multi-core over the last dim of a
    ROW_MAJOR tensor; a TILE tensor takes the single-core program (its docstring), which the backend avoids."""
    _last_dim(input_tensor, dim)
    if input_tensor.layout != ROW_MAJOR_LAYOUT:
        raise NotImplementedError("stand-in: argmax of a TILE tensor runs on one core; untilize first")
    return run_op("argmax", lambda t: (per_shard(t, lambda d: d.argmax(dim=-1, keepdim=keepdim)), uint32,
                                       ROW_MAJOR_LAYOUT), input_tensor, mem=memory_config)


def max(input_tensor: Tensor, dim=None, keepdim=False, *, memory_config=None, **kwargs) -> Tensor:
    _last_dim(input_tensor, dim)
    return run_op("max", lambda t: (per_shard(t, lambda d: d.amax(dim=-1, keepdim=keepdim)), t.dtype, t.layout),
                  input_tensor, mem=memory_config)


def add(input_tensor_a: Tensor, input_tensor_b: Tensor, *, dtype=None, memory_config=None, **kwargs) -> Tensor:
    """The result takes input_tensor_a's dtype unless `dtype` says otherwise (ttnn.add's docstring)."""
    if input_tensor_a.shape != input_tensor_b.shape or input_tensor_a.shards != input_tensor_b.shards:
        raise RuntimeError("stand-in: add of tensors of one shape and placement only")
    return run_op("add", lambda a, b: (a.data + b.data, dtype or a.dtype, a.layout), input_tensor_a, input_tensor_b,
                  mem=memory_config)


def clone(input_tensor: Tensor, *, dtype=None, memory_config=None, **kwargs) -> Tensor:
    """clone_device_operation.cpp (ttnn 0.81.1) CloneOperation::validate_inputs: a sharded input cannot be cloned to
    an interleaved config (nor the reverse), and two sharded configs must be the same."""
    out = memory_config or input_tensor.mem
    if input_tensor.device is None:
        raise RuntimeError("Clone: input must be on device")
    if input_tensor.mem.is_sharded() and out.is_sharded():
        if input_tensor.mem != out:
            raise RuntimeError("Clone: input and output shard specs must be identical (same grid, shape, and "
                               "orientation)")
    elif input_tensor.mem.is_sharded() or out.is_sharded():
        raise RuntimeError("Clone: mixed sharded/interleaved layout not currently supported. Both input and output "
                           "must have the same layout.")
    return run_op("clone", lambda t: (t.data.clone(), dtype or t.dtype, t.layout), input_tensor, mem=out)


def untilize(input_tensor: Tensor, *, memory_config=None, use_multicore=True, sub_core_grids=None) -> Tensor:
    if input_tensor.layout != TILE_LAYOUT:
        raise RuntimeError("stand-in: untilize takes a TILE tensor")
    return run_op("untilize", lambda t: (t.data.clone(), bfloat16, ROW_MAJOR_LAYOUT), input_tensor, mem=memory_config)


def to_layout(tensor: Tensor, layout, dtype=None, memory_config=None, **kwargs) -> Tensor:
    return run_op("to_layout", lambda t: (t.data.clone(), t.dtype, layout), tensor, mem=memory_config)


def to_memory_config(tensor: Tensor, memory_config=None, dtype=None, output_tensor=None, **kwargs) -> Tensor:
    """to_memory_config_op.cpp ttnn::to_memory_config (read at 040a27c1): the same tensor when its config already
    matches, whatever dtype is asked (`original_memory_config.value() == memory_config && !output_tensor.has_value()`
    returns `tensor`); otherwise a new buffer (sharded_to_interleaved, interleaved_to_sharded, reshard or copy), dtype
    cast if asked."""
    if tensor.mem == memory_config and output_tensor is None:
        return tensor
    return run_op("to_memory_config", lambda t: (t.data.clone(), dtype or t.dtype, t.layout), tensor,
                  mem=memory_config)


def pad(input_tensor: Tensor, padding, value, *, use_multicore=None, memory_config=None, **kwargs) -> Tensor:
    widths = [w for pair in reversed(padding) for w in pair]
    return run_op("pad", lambda t: (per_shard(t, lambda d: F.pad(d, widths, value=value)), t.dtype, t.layout),
                  input_tensor, mem=memory_config)


def plus_one(input_tensor: Tensor, *, skip_negative_entries=False, **kwargs) -> None:
    def fn(t):
        t.data.add_(torch.where(t.data < 0, 0, 1) if skip_negative_entries else 1)
    run_op("plus_one", fn, input_tensor, inplace=True)


TOPK_MULTICORE_MAX_WIDTH = 65535  # topk_constants.hpp: std::numeric_limits<uint16_t>::max(), exclusive
TOPK_MULTICORE_MAX_K = 64


def topk(input_tensor, k=32, dim=-1, largest=True, sorted=True, *, memory_config=None, sub_core_grids=None,
         indices_tensor=None, output_tensor=None, stable=False):
    """topk_device_operation.cpp: validate_on_program_cache_miss (4D, TILE, inner dim >= 64, height a multiple of
    32, k != 0, last dim), select_program_factory with topk_utils.cpp's multi-core rule (a power-of-two width below
    65535, at least 8192, or 1024 at <= 2 tile rows; k <= 64; the rest single-core, counted here), and
    resolve_index_dtype (uint16 unless the padded width is over 65535 or the input is float32)."""
    shape = input_tensor.shape
    width = shape[-1] // input_tensor.shards
    if len(shape) != 4:
        raise RuntimeError(f"Input shape must be 4D, got {shape}")
    if input_tensor.layout != TILE_LAYOUT:
        raise RuntimeError("The input must be in tiled format")
    if width < 64:
        raise RuntimeError(f"Input shape inner dim {width} must be >= 64, pad with +/-infinity if necessary")
    if (shape[0] * shape[1] * shape[2]) % 32:
        raise RuntimeError(f"Input height (combined input_shape[0-3]) {shape[0] * shape[1] * shape[2]} must be a "
                           "multiple of 32")
    if k == 0:
        raise RuntimeError("K must be non-zero")
    if dim not in (-1, 3):
        raise RuntimeError("TopK device operation expects reduction on the last dimension")
    tile_rows = shape[0] * shape[1] * shape[2] // 32
    power_of_two = width & (width - 1) == 0
    wide_enough = width >= 8192 or (tile_rows <= 2 and width >= 1024)
    if not (wide_enough and width < TOPK_MULTICORE_MAX_WIDTH and power_of_two and k <= TOPK_MULTICORE_MAX_K):
        input_tensor.device.single_core_topk += 1
    index_dtype = uint32 if width > TOPK_MULTICORE_MAX_WIDTH or input_tensor.dtype == float32 else uint16

    def fn(t):
        parts = [d.topk(k, dim=-1, largest=largest, sorted=sorted) for d in t.data.chunk(t.shards, -1)]
        values = torch.cat([p.values for p in parts], dim=-1)
        indices = torch.cat([p.indices for p in parts], dim=-1)
        if index_dtype == uint16:  # the device writes 16 bits
            indices = indices.to(torch.int32) & 0xFFFF
        return (values, t.dtype, TILE_LAYOUT), (indices, index_dtype, TILE_LAYOUT)
    return run_op("topk", fn, input_tensor, mem=memory_config)


def _all_gather_async(input_tensor, persistent_output_buffer=None, dim=None, multi_device_global_semaphore=None, *,
                      num_links=None, memory_config=None, topology=None, subdevice_id=None, cluster_axis=None,
                      barrier_semaphore=None, chunks_per_sync=None, num_workers_per_link=None,
                      num_buffers_per_channel=None, **kwargs):
    """A CCL op: on a mesh opened without a fabric, tt-metal's control plane stops it ("Trying to get
    un-initialized fabric context", ControlPlane::get_fabric_context; libtt_metal.so 0.81.1)."""
    mesh = input_tensor.device
    if mesh.get_num_devices() > 1 and mesh.fabric == FabricConfig.DISABLED:
        raise RuntimeError("TT_FATAL: Trying to get un-initialized fabric context")
    return run_op("all_gather_async", lambda t: (t.data.clone(), t.dtype, t.layout), input_tensor, shards=1,
                  mem=memory_config)


# ---- the paged KV cache -----------------------------------------------------------------------------------------

BLOCK = 32


def _paged_update(cache: Tensor, update: Tensor, positions: Tensor, page_table: Tensor) -> None:
    """update [1, 32, kv heads, head_dim]: row b's K or V goes to position positions[b] of page-table row b. Rows are
    written all at once, each read-modify-writing its block's tile: per block only the last row's write lands."""
    tiles = {}
    for b, pos in enumerate(positions.data.tolist()):
        if pos == -1:
            continue
        block = int(page_table.data[b, pos // BLOCK])
        tile = cache.data[block].clone()  # every row reads the tile as it was before the op
        tile[:, pos % BLOCK] = update.data[0, b]
        tiles[block] = tile  # and writes it back whole: a later row of the same block undoes an earlier one
    for block, tile in tiles.items():
        cache.data[block] = tile


def _paged_update_op(cache_tensor, input_tensor, *, update_idxs_tensor=None, page_table=None, **kwargs):
    """paged_update_cache_device_operation.cpp validate_on_program_cache_miss: the checks our pass tensors meet."""
    if update_idxs_tensor is None or page_table is None:
        raise NotImplementedError("stand-in: paged_update_cache with update_idxs_tensor and page_table only")
    unknown = set(kwargs) - {"update_idxs", "share_cache", "batch_offset", "compute_kernel_config", "mesh_coords",
                             "block_size", "num_kv_heads", "cache_position_modulo"}
    if unknown:
        raise TypeError(f"paged_update_cache() got unexpected keyword arguments {sorted(unknown)}")
    if update_idxs_tensor.dtype != int32:
        raise RuntimeError("Expected update_idxs to have datatype INT32")
    if update_idxs_tensor.layout != ROW_MAJOR_LAYOUT:
        raise RuntimeError("Expected update_idxs to have memory layout in ROW MAJOR")
    if update_idxs_tensor.shape[0] != input_tensor.shape[1]:
        raise RuntimeError(f"Number of update_idxs ({update_idxs_tensor.shape[0]}) should match batch size "
                           f"({input_tensor.shape[1]})")
    if page_table.dtype != int32:
        raise RuntimeError("Expect page table to have datatype INT32")
    if page_table.shape[1] > cache_tensor.shape[0]:
        raise RuntimeError("max_num_blocks_per_seq must be less than max_num_blocks")
    run_op("paged_update_cache", lambda c, i, p, t: _paged_update(c, i, p, t), cache_tensor, input_tensor,
           update_idxs_tensor, page_table, inplace=True)


def _paged_fused_update_op(cache_tensor1, input_tensor1, cache_tensor2, input_tensor2, *, update_idxs_tensor=None,
                           page_table=None, **kwargs):
    _paged_update_op(cache_tensor1, input_tensor1, update_idxs_tensor=update_idxs_tensor, page_table=page_table)
    _paged_update_op(cache_tensor2, input_tensor2, update_idxs_tensor=update_idxs_tensor, page_table=page_table)


def paged_keys(cache: torch.Tensor, page_row: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Positions [first, end) of one user's paged cache: [kv heads, end - first, head_dim]."""
    positions = torch.arange(first, end)
    blocks = page_row[positions // BLOCK]
    return cache[blocks, :, positions % BLOCK].transpose(0, 1)


def _sdpa_decode(q: Tensor, k: Tensor, v: Tensor, page_table: Tensor, positions: Tensor, scale, window):
    """q [1, 32, heads, head_dim]; row b attends to its own positions 0..positions[b] (a window's worth)."""
    out = torch.zeros_like(q.data)
    heads, kv_heads = q.shape[2], k.shape[1]
    for b, pos in enumerate(positions.data.tolist()):
        if pos == -1:
            continue  # "If a position is given as (-1), compute for the corresponding index in the batch is skipped."
        first = 0 if window is None else builtins.max(0, pos + 1 - window)
        keys = paged_keys(k.data, page_table.data[b], first, pos + 1)
        values = paged_keys(v.data, page_table.data[b], first, pos + 1)
        query = q.data[0, b].view(kv_heads, heads // kv_heads, -1)
        out[0, b] = F.scaled_dot_product_attention(query, keys, values, scale=scale).reshape(heads, -1)
    return out, q.dtype, q.layout


def _paged_sdpa_decode(input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor=None, *, is_causal=True,
                       attn_mask=None, cur_pos_tensor=None, scale=None, sliding_window_size=None, **kwargs):
    return run_op("paged_sdpa_decode", lambda q, k, v, t, p: _sdpa_decode(q, k, v, t, p, scale, sliding_window_size),
                  input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor, cur_pos_tensor)


experimental = types.SimpleNamespace(paged_update_cache=_paged_update_op,
                                     paged_fused_update_cache=_paged_fused_update_op, all_gather_async=_all_gather_async)
transformer = types.SimpleNamespace(paged_scaled_dot_product_attention_decode=_paged_sdpa_decode)
