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
- every device tensor has a memory config (DRAM or L1, interleaved or height/width-sharded over cores, the shard spec
  given as its shard shape); ops put their output where `memory_config` says (else where their first input is),
  to_memory_config hands back the same tensor when the config already matches, and clone refuses to move a sharded
  tensor to an interleaved config or back;
- paged_update_cache takes its update height-sharded, one user per core; paged SDPA decode takes q height-sharded or
  in DRAM, bfloat16/bfloat8_b (no float32);
- the ops a device draft head uses (as_tensor with its cache file, linear, rms_norm, concat, copy, mul, silu,
  embedding, repeat, reshape, softmax) with the refusals their validate functions make; concat refuses a
  preallocated output and all_gather_async refuses a single device, as the wheel does.
Each rule that mirrors a tt-metal check names the file and function it follows (read at versions near v0.81.1; the
error texts are the ones in the ttnn 0.81.1 wheel's libraries).
"""
import builtins
import math
import os
import types
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from models.tt_transformers.ttnn_backend.bfp8 import bfp8_round

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


class Topology:  # ttnn.Topology (some members)
    Linear, Ring = "Linear", "Ring"


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


L1_WIDTH_SHARDED_MEMORY_CONFIG = MemoryConfig(ShardStrategy.WIDTH, "L1")  # no shard spec: the op computes it


class TensorMemoryLayout:  # ttnn.TensorMemoryLayout (the stand-in's layouts are ShardStrategy's strings)
    INTERLEAVED, HEIGHT_SHARDED, WIDTH_SHARDED, BLOCK_SHARDED = ("INTERLEAVED", ShardStrategy.HEIGHT,
                                                                 ShardStrategy.WIDTH, ShardStrategy.BLOCK)


class BufferType:  # ttnn.BufferType (some members)
    DRAM, L1, TRACE = "DRAM", "L1", "TRACE"


class CoreRange:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def num_cores(self) -> int:
        return (self.end.x - self.start.x + 1) * (self.end.y - self.start.y + 1)


class CoreRangeSet:
    def __init__(self, ranges):
        self.ranges = list(ranges)

    def num_cores(self) -> int:
        return sum(r.num_cores() for r in self.ranges)


def ShardSpec(grid, shape, orientation):  # noqa: N802 (ttnn.ShardSpec): the stand-in's (shape, cores, orientation)
    return tuple(shape), grid.num_cores(), orientation


class MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig:
    def __init__(self, *, in0_block_w, per_core_M, per_core_N, fused_activation=None):  # noqa: N803 (ttnn's names)
        self.in0_block_w, self.per_core_M, self.per_core_N = in0_block_w, per_core_M, per_core_N
        self.fused_activation = fused_activation


class MatmulMultiCoreReuseMultiCastProgramConfig:
    def __init__(self, *, compute_with_storage_grid_size, in0_block_w, out_subblock_h, out_subblock_w,  # noqa: N803
                 per_core_M, per_core_N, transpose_mcast, fused_activation=None, fuse_batch=True, out_block_h=None,
                 out_block_w=None, allowed_worker_cores=None):
        self.grid, self.in0_block_w, self.per_core_M, self.per_core_N = (compute_with_storage_grid_size, in0_block_w,
                                                                         per_core_M, per_core_N)
        self.out_subblock_h, self.out_subblock_w = out_subblock_h, out_subblock_w


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
        self.warnings: list = []
        self.corrupted_programs: set = set()  # ops whose binaries a replay overwrote
        self.live = weakref.WeakSet()  # device tensors (not replay outputs), for get_memory_view's DRAM figure
        self.parent, self.submeshes, self.closed = None, weakref.WeakSet(), False  # a dropped submesh closes itself

    def allocated_under_trace(self, what) -> None:
        """0.81.1 logs a warning (once) and goes on (allocator.cpp verify_safe_allocation); the buffer is corrupted
        when a trace next replays (execute_trace)."""
        if not self.warnings:
            self.warnings.append("Allocating device buffers is unsafe due to the existence of an active trace. These "
                                 "buffers may be corrupted once a trace is executed.")
            warnings.warn(self.warnings[0], RuntimeWarning, stacklevel=3)
        self.unsafe.append(what)

    def get_num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def reshape(self, new_shape) -> None:
        """MeshDevice.reshape: the same devices in another logical shape ("The old_shape volume must equal the
        new_shape volume")."""
        if new_shape[0] * new_shape[1] != self.get_num_devices():
            raise RuntimeError(f"stand-in: cannot reshape a {self.shape} mesh to {tuple(new_shape)}")
        self.shape = tuple(new_shape)

    @property
    def cq_in_use(self) -> bool:
        """The command queue's in-use state (FDMeshCommandQueue::in_use): set by running anything on the mesh."""
        return self.ops_run > 0

    def create_submeshes(self, submesh_shape) -> list:
        """MeshDevice.create_submeshes: the mesh tiled by submeshes of that shape, each over its own devices, whose
        trace region is the parent's (each chip's own)."""
        if self.shape[0] % submesh_shape[0] or self.shape[1] % submesh_shape[1]:
            raise RuntimeError(f"stand-in: a {self.shape} mesh is not tiled by {tuple(submesh_shape)} submeshes")
        count = self.get_num_devices() // (submesh_shape[0] * submesh_shape[1])
        made = [MeshDevice(submesh_shape, self.trace_region_size) for _ in range(count)]
        for submesh in made:
            submesh.parent = self
            self.submeshes.add(submesh)
        return made

    def num_program_cache_entries(self) -> int:
        """MeshDevice.num_program_cache_entries (ttnn/cpp/ttnn/distributed/distributed_pybind.cpp: "Number of entries
        in the program cache for this device"): the stand-in's compiled programs."""
        return len(self.compiled)

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
    """close_mesh_device; refused as 0.81.1's MeshDeviceImpl::close_impl refuses it (mesh_device.cpp) where the
    command queue a submesh shares with its parent is in use by the other: a parent with an open submesh, a submesh
    whose parent ran anything."""
    if any(not submesh.closed and submesh.cq_in_use for submesh in mesh_device.submeshes):
        raise RuntimeError("TT_THROW: MeshDevice cq ID 0 is in use by child submesh ID 1 during close of mesh ID 0")
    if mesh_device.parent is not None and mesh_device.parent.cq_in_use:
        raise RuntimeError("TT_THROW: MeshDevice cq ID 0 is in use by parent mesh ID 0 during close of mesh ID 1")
    mesh_device.traces.clear()
    mesh_device.closed = True
    if mesh_device.parent is None:  # a submesh is not an open mesh of its own
        FABRIC["open_meshes"] -= 1


class MathFidelity:  # ttnn.MathFidelity members (ttnn 0.81.1)
    LoFi, HiFi2, HiFi3, HiFi4 = "LoFi", "HiFi2", "HiFi3", "HiFi4"


class WormholeComputeKernelConfig:
    """ttnn.WormholeComputeKernelConfig: keyword-only, as the wheel's constructor (the stand-in computes as it does
    without it: fidelity is a device matter)."""

    def __init__(self, *, math_fidelity=None, math_approx_mode=True, fp32_dest_acc_en=False, packer_l1_acc=False,
                 dst_full_sync_en=False, throttle_level=None):
        self.math_fidelity, self.math_approx_mode = math_fidelity, math_approx_mode
        self.fp32_dest_acc_en, self.packer_l1_acc = fp32_dest_acc_en, packer_l1_acc


class SDPAProgramConfig:
    """ttnn.SDPAProgramConfig: keyword-only; q_chunk_size and k_chunk_size required, as the wheel's constructor."""

    def __init__(self, *, compute_with_storage_grid_size, q_chunk_size, k_chunk_size, exp_approx_mode=None,
                 sub_core_grids=None, max_cores_per_head_batch=16, max_k_splits=1, matmul_math_fidelity=None,
                 segmented_accumulation=False):
        self.q_chunk_size, self.k_chunk_size, self.exp_approx_mode = q_chunk_size, k_chunk_size, exp_approx_mode


ARCH = {"name": "wormhole_b0"}  # get_arch_name(); a test sets "blackhole"


class FabricTensixConfig:  # ttnn.FabricTensixConfig members (ttnn 0.81.1)
    DISABLED, MUX = "DISABLED", "MUX"


class DispatchCoreAxis:  # ttnn.DispatchCoreAxis members
    ROW, COL = "ROW", "COL"


class DispatchCoreConfig:
    """ttnn/device.py DispatchCoreConfig(type=None, axis=None, fabric_tensix_config=None) (ttnn 0.81.1)."""

    def __init__(self, type=None, axis=None, fabric_tensix_config=None):
        self.type, self.axis, self.fabric_tensix_config = type, axis, fabric_tensix_config


def _is_blackhole(device=None) -> bool:  # ttnn/device.py is_blackhole: the arch name without a device
    return "blackhole" in get_arch_name()


device = types.SimpleNamespace(is_wormhole_b0=lambda mesh_device: True, is_blackhole=_is_blackhole)


class ClusterType:  # ttnn.cluster.ClusterType (some members)
    N150, N300, T3K, GALAXY, TG, P150, BLACKHOLE_GALAXY = range(7)


cluster = types.SimpleNamespace(ClusterType=ClusterType, get_cluster_type=lambda: ClusterType.T3K)


def get_arch_name() -> str:
    return ARCH["name"]


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
            device.live.add(self)
            if device.capturing is not None:
                device.capture_allocations += 1
            elif device.traces:
                device.allocated_under_trace(weakref.ref(self))

    @property
    def data(self) -> torch.Tensor:
        """A tensor deallocated while a trace was being captured stays readable by that trace's replays (its commands
        keep the buffer's address); any other use of a deallocated tensor fails."""
        if self.deallocated and not (self.deallocated == "in capture" and self.device.replaying):
            raise RuntimeError("stand-in: use of a deallocated device tensor")
        return self._data

    @property
    def shape(self):
        """Each device's shape, as ttnn's on a mesh: a tensor split over 2 devices along its last dim reports half of
        it (checked on ttnn 0.81.1, mock N300: ShardTensor2dMesh(dims=(None, 3)) of [1, 1, 32, 256] has shape
        [1, 1, 32, 128])."""
        shape = tuple(self._data.shape)
        return shape[:-1] + (shape[-1] // self.shards,) if self.shards > 1 else shape

    def memory_config(self) -> MemoryConfig:
        return self.mem

    def is_sharded(self) -> bool:
        return self.mem.is_sharded()

    def deallocate(self, force: bool = True) -> None:
        self.deallocated = "in capture" if self.device is not None and self.device.capturing is not None else True


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


def stored(data: torch.Tensor, dtype) -> torch.Tensor:
    """Values as a device holds them in `dtype`: bfloat8_b as ttnn's own host conversion rounds it (ttnn_backend/bfp8.py,
    checked against the wheel by make tt-mock; 16 values share an exponent, so an infinity has no encoding and reads
    back as NaN). bfloat16 stays float32 here (the stand-in's float32 mode relies on it)."""
    if dtype != bfloat8_b or not data.is_floating_point():
        return data
    finite = data.isfinite()
    return torch.where(finite, bfp8_round(torch.where(finite, data, 0.0)), float("nan"))


def from_torch(tensor, dtype=None, *, layout=ROW_MAJOR_LAYOUT, device=None, mesh_mapper=None, memory_config=None,
               **kwargs) -> Tensor:
    """py_to_tt_tensor.cpp: bfloat8_b only in TILE layout ("Layout must be Layout::TILE for bfloat8_b or bfloat4_b!",
    the wheel's message)."""
    dtype = dtype or float32
    if dtype == bfloat8_b and layout != TILE_LAYOUT:
        raise RuntimeError("TT_FATAL: Layout must be Layout::TILE for bfloat8_b or bfloat4_b!")
    shards = getattr(mesh_mapper, "shards", 1)
    return Tensor(stored(tensor.detach().to(TORCH_DTYPES[dtype]).clone(), dtype), dtype, layout, device, shards,
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
    tensor.deallocate(force)


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
    if name in device.corrupted_programs and not device.replaying:
        raise RuntimeError(f"stand-in: the kernel binaries of {name}, compiled while a trace was live, were "
                           "overwritten by a replay (allocator.cpp verify_safe_allocation's warning)")
    if key not in device.compiled and device.traces:  # its kernel binaries go to DRAM while a trace is live
        device.allocated_under_trace(("program", name))
    device.compiled.add(key)
    device.ops_run += 1
    result = fn(*args, **kwargs)
    return None if inplace else _wrap(result, device, shards, mem)


def _wrap(result, device, shards, mem, garbage=False):
    """`mem` one memory config for every output, or a list of one per output."""
    if isinstance(result, tuple) and not isinstance(result[0], torch.Tensor):
        mems = mem if isinstance(mem, list) else [mem] * len(result)
        return tuple(_wrap(r, device, shards, m, garbage) for r, m in zip(result, mems))
    data, dtype, layout = result
    data = stored(data, dtype)
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
    if mesh_device.trace_region_size and used + size > mesh_device.trace_region_size:  # mesh_trace.cpp's TT_FATAL
        raise RuntimeError(f"TT_FATAL: Creating trace buffers of size {used + size}B on MeshDevice {id(mesh_device)}, "
                           f"but only {mesh_device.trace_region_size}B is allocated for trace region.")
    mesh_device.traces[trace_id], mesh_device.trace_sizes[trace_id] = ops, size


def execute_trace(mesh_device: MeshDevice, trace_id: int, *, cq_id=None, blocking: bool = True) -> None:
    if trace_id not in mesh_device.traces:
        raise RuntimeError(f"stand-in: trace {trace_id} was never captured")
    # what was allocated under a live trace and is still alive may be overwritten now: the stand-in overwrites it
    # (NaN in a tensor; a program's binaries: every later op it runs raises), as the warning says may happen
    for u in mesh_device.unsafe:
        if isinstance(u, weakref.ref) and u() is not None and not u().deallocated and u()._data.is_floating_point():
            u()._data.fill_(float("nan"))
    mesh_device.corrupted_programs |= {name for kind, name in
                                       (u for u in mesh_device.unsafe if not isinstance(u, weakref.ref))}
    mesh_device.replaying = True
    try:
        for fn, args, kwargs, outputs in mesh_device.traces[trace_id]:
            result = fn(*args, **kwargs)
            if outputs is None:
                continue
            for out, (data, dtype, _) in zip(outputs if isinstance(outputs, tuple) else (outputs,),
                                             result if isinstance(outputs, tuple) else (result,)):
                out.data.copy_(stored(data, dtype))
            mesh_device.ops_run += 1
    finally:
        mesh_device.replaying = False


def release_trace(mesh_device: MeshDevice, trace_id: int) -> None:
    del mesh_device.traces[trace_id], mesh_device.trace_sizes[trace_id]
    if not mesh_device.traces:  # no live trace left to overwrite anything
        mesh_device.unsafe.clear()


def synchronize_device(device, cq_id=None, sub_device_ids=()) -> None:
    pass


@dataclass
class MemoryView:  # ttnn.device MemoryView (its fields the backend reads)
    num_banks: int
    total_bytes_allocated_per_bank: int


def get_memory_view(device: MeshDevice, buffer_type) -> MemoryView:
    """ttnn.get_memory_view(device, buffer_type) (checked on ttnn 0.81.1's mock device: DRAM 12 banks, and TRACE, the
    trace region, per bank): DRAM as the bytes of the device tensors alive and not deallocated (each buffer once: views
    share theirs), TRACE as the live traces' sizes (TRACE_OP_BYTES an op)."""
    if buffer_type == BufferType.TRACE:
        return MemoryView(12, -(-sum(device.trace_sizes.values()) // 12))
    if buffer_type != BufferType.DRAM:
        raise NotImplementedError("stand-in: memory views of DRAM and the trace region only")
    buffers = {t._data.untyped_storage().data_ptr(): t._data.untyped_storage().nbytes()
               for t in list(device.live) if not t.deallocated}
    return MemoryView(12, -(-sum(buffers.values()) // 12))


def slice(input_tensor: Tensor, slice_start, slice_end, slice_step=None, *, memory_config=None, **kwargs) -> Tensor:
    """On a sharded tensor each device slices its own shard (local coordinates). A program per offsets, as ttnn
    0.81.1 keys a slice's program (counted with num_program_cache_entries on the mock device: one entry per offset of
    the same shape)."""
    index = tuple(builtins.slice(start, end) for start, end in zip(slice_start, slice_end))
    return run_op(f"slice@{tuple(slice_start)}:{tuple(slice_end)}",
                  lambda t: (per_shard(t, lambda d: d[index].clone()), t.dtype, t.layout), input_tensor,
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
    if output_tensor is not None:  # argmax_device_operation.cpp: its spec is the output's (no shape check, only
        # dtype, layout and placement), so TT writes [1, 1, 32] ids into its [1, 1, 1, 32] token input
        t = output_tensor
        if t.dtype != uint32 or t.layout != ROW_MAJOR_LAYOUT or t.mem.is_sharded():
            raise RuntimeError("Optional output tensor must be UINT32, ROW_MAJOR and INTERLEAVED")
        if t.data.numel() != input_tensor.data[..., 0].numel():
            raise RuntimeError(f"stand-in: argmax's output tensor {t.shape} holds a different number of ids")

        def write(i, out):
            out.data.copy_(i.data.argmax(dim=-1).reshape(out.data.shape))
        run_op("argmax", write, input_tensor, t, inplace=True)
        return t
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


def interleaved_to_sharded(input_tensor: Tensor, memory_config, output_dtype=None, **kwargs) -> Tensor:
    """interleaved_to_sharded: an interleaved tensor into a sharded config (TT's rope.py get_rot_mats)."""
    if input_tensor.mem.is_sharded() or not memory_config.is_sharded():
        raise RuntimeError("interleaved_to_sharded: an interleaved input and a sharded memory config")
    return to_memory_config(input_tensor, memory_config, output_dtype)


def transpose(input_tensor: Tensor, dim1: int, dim2: int, *, memory_config=None, pad_value=0.0) -> Tensor:
    return run_op("transpose", lambda t: (t.data.transpose(dim1, dim2).contiguous(), t.dtype, t.layout), input_tensor,
                  mem=memory_config)


def typecast(input_tensor: Tensor, dtype, *, memory_config=None, **kwargs) -> Tensor:
    """The values in `dtype` (bfloat8_b rounded as the device stores it: _wrap)."""
    return run_op("typecast", lambda t: (t.data.clone(), dtype, t.layout), input_tensor, mem=memory_config)


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
    width = shape[-1]  # each device's
    if len(shape) != 4:
        raise RuntimeError(f"Input shape must be 4D, got {shape}")
    if input_tensor.layout != TILE_LAYOUT:
        raise RuntimeError("The input must be in tiled format")
    if width < 64:  # the host wrapper pads the width to 64 (topk.cpp), with float's smallest positive value when largest
        pad = torch.finfo(torch.float32).tiny if largest else torch.finfo(torch.float32).max
        padded = run_op("topk_pad", lambda t: (per_shard(t, lambda d: F.pad(d, (0, 64 - width), value=pad)), t.dtype,
                                               t.layout), input_tensor)
        return topk(padded, k, dim, largest, sorted, memory_config=memory_config)
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
    """A CCL op: on one device it stops ("all_gather_async op will only work for num_devices > 1, but has {}", the
    0.81.1 wheel's text of all_gather_async's validate); on a mesh opened without a fabric, tt-metal's control plane
    stops it ("Trying to get un-initialized fabric context", ControlPlane::get_fabric_context; libtt_metal.so
    0.81.1). The result holds every device's part on every device."""
    mesh = input_tensor.device
    if mesh.get_num_devices() < 2:
        raise RuntimeError(f"all_gather_async op will only work for num_devices > 1, but has {mesh.get_num_devices()}")
    if mesh.fabric == FabricConfig.DISABLED:
        raise RuntimeError("TT_FATAL: Trying to get un-initialized fabric context")
    return run_op("all_gather_async", lambda t: (_gathered(t), t.dtype, t.layout), input_tensor, shards=1,
                  mem=memory_config)


def _gathered(t: Tensor) -> torch.Tensor:
    """Every device's part side by side along the last dim: a split tensor whole, a replicated one devices times."""
    return t.data.clone() if t.shards > 1 else torch.cat([t.data] * t.device.get_num_devices(), -1)


# ---- ops of a device draft head (keywords as the 0.81.1 wheel's docstrings; inputs replicated unless said) ------

def _padded_shape(t: Tensor) -> tuple:
    """TT's padded shape: a TILE tensor's last two dims rounded up to the 32 x 32 tile."""
    shape = list(t.shape)
    if t.layout == TILE_LAYOUT:
        shape[-2:] = [-(-n // 32) * 32 for n in shape[-2:]]
    return tuple(shape)


def _dtype_name(dtype) -> str:
    return str(dtype).upper()  # ttnn.DataType.name / ttnn.Layout.name: "BFLOAT16", "TILE", ...


def as_tensor(tensor, dtype=None, *, layout=ROW_MAJOR_LAYOUT, device=None, memory_config=None, cache_file_name=None,
              preprocess=None, mesh_mapper=None, cache_dump_mode=None) -> Tensor:
    """ttnn/operations/core.py as_tensor (the Python in the 0.81.1 wheel): memory_config is required with a device;
    with cache_file_name the file is f"{cache_file_name}_dtype_{dtype.name}_layout_{layout.name}.tensorbin" (no part for
    the mesh mapping in this version: a replicated tensor is cached unsharded, "so that it can be loaded on any
    device"), written when absent (dump_tensor_flatbuffer; here torch.save of the data, placement and memory config)
    and read back when present (load_tensor_flatbuffer, which keeps the stored memory config); preprocess runs on a
    miss only."""
    if device is not None and memory_config is None:
        raise RuntimeError("memory_config must be specified when device is specified")
    if cache_file_name is None:
        return from_torch(preprocess(tensor) if preprocess else tensor, dtype, layout=layout, device=device,
                          mesh_mapper=mesh_mapper, memory_config=memory_config)
    path = Path(f"{cache_file_name}_dtype_{_dtype_name(dtype)}_layout_{_dtype_name(layout)}.tensorbin")
    if path.is_file():
        saved = torch.load(path)
        mem = MemoryConfig(*saved["mem"][:2], saved["mem"][2])
        return Tensor(saved["data"], saved["dtype"], saved["layout"], device, saved["shards"], mem)
    host = from_torch(preprocess(tensor) if preprocess else tensor, dtype, layout=layout, memory_config=memory_config,
                      mesh_mapper=None if isinstance(mesh_mapper, ReplicateTensorToMesh) else mesh_mapper)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # whole or absent: tests run in parallel processes
    torch.save({"data": host.data, "dtype": host.dtype, "layout": host.layout, "shards": host.shards,
                "mem": (host.mem.memory_layout, host.mem.buffer_type, host.mem.shard_spec)}, partial)
    partial.replace(path)
    return to_device(host, device, memory_config) if device is not None else host


def linear(input_tensor_a: Tensor, input_tensor_b: Tensor, *, bias=None, transpose_a=False, transpose_b=False,
           memory_config=None, dtype=None, program_config=None, activation=None, compute_kernel_config=None,
           core_grid=None, output_tile=None, optional_output_tensor=None, global_cb=None, prefetcher_pipes=None,
           in0_column_offset=None) -> Tensor:
    """matmul_device_operation.cpp (read at 001cea9a; the operand checks at a later version, validate_matmul_operand_
    basics): both operands on device and tilized, b of rank >= 2, a's last dim equal to b's second-last (b [K, N] or
    [1, 1, K, N]). Output [..., M, N] TILE in `dtype` or a's, DRAM unless memory_config says (the docstring);
    computed in float32."""
    a, b = input_tensor_a, input_tensor_b
    if transpose_a or transpose_b or activation or optional_output_tensor is not None or global_cb or prefetcher_pipes:
        raise NotImplementedError("stand-in: linear without transposes, activation, output tensor or prefetcher")
    if a.device is None or b.device is None:
        raise RuntimeError("Operands to matmul need to be on device!")
    if a.layout != TILE_LAYOUT or b.layout != TILE_LAYOUT:
        raise RuntimeError("Inputs to matmul must be tilized")
    if len(b.shape) < 2:
        raise RuntimeError(f"Matmul expects input B rank >= 2, got {len(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise RuntimeError("The width of the first tensor must be equal to the height of the second tensor. "
                           f"Mismatch: width={a.shape[-1]} height={b.shape[-2]}")
    if a.shards != 1 or b.shards != 1:
        raise NotImplementedError("stand-in: linear of replicated tensors")
    out_mem = memory_config or DRAM_MEMORY_CONFIG
    if isinstance(program_config, MatmulMultiCoreReuseMultiCastDRAMShardedProgramConfig):
        out_mem = _dram_sharded_output(a, b, program_config, out_mem)
    elif b.mem.is_sharded() and not isinstance(program_config, MatmulMultiCoreReuseMultiCastProgramConfig):
        # the automatic config's MatmulMultiCoreProgramConfig (ttnn 0.81.1 on the mock device, matmul_device_
        # operation.cpp:1573); the 2-D multicast program reads a DRAM-sharded weight, as TT's prefill matmuls do
        raise RuntimeError("MatmulMultiCoreProgramConfig: Input B memory layout must be INTERLEAVED, got: "
                           f"{b.mem.memory_layout}")
    if isinstance(program_config, MatmulMultiCoreReuseMultiCastProgramConfig):
        c = program_config
        tiles_m, tiles_n = math.prod(a.shape[:-1]) // 32, b.shape[-1] // 32
        if c.per_core_M * c.grid.y < tiles_m or c.per_core_N * c.grid.x < tiles_n or c.per_core_N % c.out_subblock_w \
                or (a.shape[-1] // 32) % c.in0_block_w:
            raise RuntimeError("stand-in: the multicast program config does not cover the output or divide its blocks")

    def fn(a, b, *bias_):
        out = a.data.float() @ b.data.float().reshape(b.shape[-2], b.shape[-1])
        return (out + bias_[0].data.float().reshape(-1) if bias_ else out), dtype or a.dtype, TILE_LAYOUT
    return run_op("linear", fn, a, b, *([bias] if bias is not None else []), mem=out_mem)


def _dram_sharded_output(a: Tensor, b: Tensor, config, out: MemoryConfig) -> MemoryConfig:
    """matmul_device_operation.cpp validate_matmul_dram_sharded_config and compute_output_specs (index copy of 2026)
    and the DRAM-sharded program factory (read at 01502698): a width-sharded ROW_MAJOR in0 of one tile row (M == 32,
    per_core_M 1) whose output config has its buffer type and layout (L1 width sharded), in0_block_w dividing K and
    the shard width in tiles, K split evenly over the shards, a width-sharded weight whose padding fills fewer banks
    than there are (12). Output shard (32, per_core_N tiles) on ceil(N / per_core_N) cores."""
    tiles_k, tiles_n = a.shape[-1] // 32, b.shape[-1] // 32
    if not a.mem.is_sharded():
        raise RuntimeError("Input tensor A must be sharded for DRAM sharded program config")
    if not out.is_sharded():
        raise RuntimeError("Output memory config must be sharded for DRAM sharded program config")
    if a.mem.memory_layout != ShardStrategy.WIDTH:
        raise RuntimeError("Input tensor A must be WIDTH_SHARDED for DRAM sharded program config")
    if (a.mem.buffer_type, a.mem.memory_layout) != (out.buffer_type, out.memory_layout):
        raise RuntimeError("Input tensor A and output memory config must have the same buffer type and layout")
    if a.mem.shard_spec[2] != ShardOrientation.ROW_MAJOR:
        raise RuntimeError("Only ROW_MAJOR shard orientation is supported")
    if math.prod(a.shape[:-1]) != 32 or config.per_core_M != 1:
        raise RuntimeError("currently only support in0 tensor height of tile height")
    shard_tiles = a.mem.shard_spec[0][1] // 32
    if tiles_k % config.in0_block_w or shard_tiles % config.in0_block_w:
        raise RuntimeError(f"in0_block_w {config.in0_block_w} must divide K ({tiles_k} tiles) and the shard width "
                           f"({shard_tiles} tiles)")
    if tiles_k % shard_tiles:
        raise RuntimeError("in DRAM sharded Matmul we don't have support for un-even sharding currently")
    if b.mem.memory_layout != ShardStrategy.WIDTH or b.mem.buffer_type != "DRAM":
        raise RuntimeError("Input B memory layout must be WIDTH_SHARDED (in DRAM)")
    bank_tiles, banks = b.mem.shard_spec[0][1] // 32, b.mem.shard_spec[1]
    if bank_tiles * banks < tiles_n or (bank_tiles * banks - tiles_n) // bank_tiles >= banks:
        raise RuntimeError(f"Padding banks count must be less than workers count {banks}")
    cores = math.ceil(tiles_n / config.per_core_N)
    return MemoryConfig(ShardStrategy.WIDTH, out.buffer_type, ((32, config.per_core_N * 32), cores,
                                                               ShardOrientation.ROW_MAJOR))


def sharded_to_interleaved(input_tensor: Tensor, memory_config=None, output_dtype=None, **kwargs) -> Tensor:
    if not input_tensor.mem.is_sharded():
        raise RuntimeError("sharded_to_interleaved: the input must be sharded")
    return to_memory_config(input_tensor, memory_config or DRAM_MEMORY_CONFIG, output_dtype)


def rms_norm(input_tensor: Tensor, *, memory_config=None, epsilon=1e-12, weight=None, bias=None,
             residual_input_tensor=None, program_config=None, compute_kernel_config=None) -> Tensor:
    """layernorm_device_operation.cpp LayerNormDeviceOperation::validate_on_program_cache_miss (read at 90095175; error
    texts of the 0.81.1 wheel): a TILE input of FLOAT32, BFLOAT16 or BFLOAT8_B, not height-sharded; a TILE weight as
    wide as the input's padded last dim, or a ROW_MAJOR FLOAT32/BFLOAT16 one whose last padded dim is 32
    (TILE_WIDTH) holding as many values as that dim ([1, 1, dim / 32, 32], as models/common/rmsnorm.py stores it).
    Computes x * rsqrt(mean(x^2) + eps) * weight in float32."""
    x = input_tensor
    if bias is not None or residual_input_tensor is not None or x.shards != 1:
        raise NotImplementedError("stand-in: rms_norm of a replicated input, without bias or residual")
    if x.layout != TILE_LAYOUT:
        raise RuntimeError(f"Input tensor must have TILE layout, got: {x.layout}")
    if x.dtype not in (float32, bfloat16, bfloat8_b):
        raise RuntimeError(f"Input tensor must be FLOAT32, BFLOAT16, or BFLOAT8_B, got: {_dtype_name(x.dtype)}")
    if x.mem.memory_layout == ShardStrategy.HEIGHT:
        raise RuntimeError("Height sharded inputs are not supported.")
    width = _padded_shape(x)[-1]
    if weight is not None and weight.layout == TILE_LAYOUT and _padded_shape(weight)[-1] != width:
        raise RuntimeError(f"{width} != {_padded_shape(weight)[-1]}")
    if weight is not None and weight.layout == ROW_MAJOR_LAYOUT:
        if weight.shape[-1] != 32 or weight.data.numel() // 32 != width // 32:
            raise RuntimeError("Gamma's last padded dim needs to equal tile width and gamma's volume needs to align "
                               f"with last padded dim of input. Error with gamma.value().padded_shape(): "
                               f"{list(weight.shape)}, tile_width: 32, gamma.value().physical_volume(): "
                               f"{weight.data.numel()}, a.padded_shape(): {list(_padded_shape(x))}")
        if weight.dtype not in (float32, bfloat16):
            raise RuntimeError(f"Gamma tensor must be FLOAT32 or BFLOAT16, got: {_dtype_name(weight.dtype)}")

    def fn(x, *w):
        d = x.data.float()
        d = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + epsilon)
        return (d * w[0].data.float().reshape(-1)[: d.shape[-1]] if w else d), x.dtype, TILE_LAYOUT
    return run_op("rms_norm", fn, x, *([weight] if weight is not None else []), mem=memory_config)


def concat(input_tensor, dim, *, memory_config=None, output_tensor=None, groups=1, sub_core_grids=None) -> Tensor:
    """concat.cpp ConcatOperation::invoke (read at 015e459a; in the 0.81.1 wheel too a preallocated output is refused
    there, "optional output tensor currently unsupported!", data_movement/concat/concat.cpp:272, checked by calling
    the wheel; DRAM unless memory_config says; one input is to_memory_config'd) and concat_device_operation.cpp
    ConcatDeviceOperation::validate_on_program_cache_miss (read at 6e62c116: same layout, dtype, rank and non-concat
    dims; all sharded or all interleaved). Inputs of one placement; a split one is concatenated per
    device (each device its own shards)."""
    tensors = list(input_tensor)
    if not tensors:
        raise RuntimeError("ttnn.concat: expected a non-empty list of Tensors!")
    if output_tensor is not None:
        raise RuntimeError("optional output tensor currently unsupported!")
    if groups != 1:
        raise NotImplementedError("stand-in: concat with groups=1")
    mem = memory_config or DRAM_MEMORY_CONFIG
    if len(tensors) == 1:
        return to_memory_config(tensors[0], mem)
    first, rank = tensors[0], len(tensors[0].shape)
    dim = dim + rank if dim < 0 else dim
    if not 0 <= dim < rank:
        raise RuntimeError(f"ttnn: Dimension out of range: dim {dim} cannot be used for tensors of rank {rank}")
    if any(len(t.shape) != rank or any(i != dim and n != first.shape[i] for i, n in enumerate(t.shape))
           for t in tensors):
        raise RuntimeError("All dimensions must be the same size except for the dimension along which the "
                           "contenation is taking place.")
    if any(t.layout != first.layout for t in tensors):
        raise RuntimeError("All Tensors should have same layouts.")
    if any(t.dtype != first.dtype for t in tensors):
        raise RuntimeError("All Tensors should have same dtypes.")
    if any(t.mem.is_sharded() != first.mem.is_sharded() for t in tensors):
        raise RuntimeError("All tensors must be sharded or all must be interleaved")
    if any(t.shards != first.shards for t in tensors):
        raise NotImplementedError("stand-in: concat of tensors of one placement")

    def fn(*ts):
        parts = [t.data.chunk(first.shards, -1) for t in ts]
        return torch.cat([torch.cat([p[d] for p in parts], dim) for d in range(first.shards)], -1), first.dtype, \
            first.layout
    return run_op("concat", fn, *tensors, mem=mem)


def copy(input_a: Tensor, input_b: Tensor) -> Tensor:
    """ttnn.copy: input_a's elements into input_b, in place (its docstring; copy_device_operation.cpp
    validate_on_program_cache_miss, read at 3ed4ffc8, texts of the 0.81.1 wheel: the same shape, layout and memory
    layout; a dtype change on TILE only). An op like any other: in a trace, replay writes input_b again -- the way to
    refresh a persistent tensor from a traced result (concat's output_tensor is refused)."""
    a, b = input_a, input_b
    if a.shape != b.shape or a.shards != b.shards:
        raise RuntimeError(f"Input tensor shape {list(a.shape)} does not match output tensor shape {list(b.shape)}")
    if a.layout != b.layout:
        raise RuntimeError(f"Input tensor layout ({a.layout}) must equal output tensor layout ({b.layout})")
    if a.mem.memory_layout != b.mem.memory_layout:
        raise RuntimeError(f"Input tensor memory layout ({a.mem.memory_layout}) must equal output tensor memory layout "
                           f"({b.mem.memory_layout})")
    if a.dtype != b.dtype and a.layout != TILE_LAYOUT:
        raise RuntimeError("Only tile layout supports dtype conversion")
    run_op("copy", lambda x, out: out.data.copy_(x.data), a, b, inplace=True)
    return b


def mul(input_tensor_a: Tensor, input_tensor_b: Tensor, *, dtype=None, memory_config=None, output_tensor=None,
        fast_and_approximate_mode=False, activations=None, input_tensor_a_activations=None,
        input_tensor_b_activations=None) -> Tensor:
    """As stand-in add: the result takes input_tensor_a's dtype unless `dtype` says otherwise (its docstring), and
    its data input_tensor_a's torch dtype (bfloat16 data stays bfloat16, as a device's bfloat16 output)."""
    if input_tensor_a.shape != input_tensor_b.shape or input_tensor_a.shards != input_tensor_b.shards:
        raise RuntimeError("stand-in: mul of tensors of one shape and placement only")
    if output_tensor is not None or activations or input_tensor_a_activations or input_tensor_b_activations:
        raise NotImplementedError("stand-in: mul without output tensor or activations")
    return run_op("mul", lambda a, b: ((a.data.float() * b.data.float()).to(a.data.dtype), dtype or a.dtype,
                                       a.layout), input_tensor_a,
                  input_tensor_b, mem=memory_config)


def silu(input_tensor: Tensor, *, memory_config=None, output_tensor=None, sub_core_grids=None) -> Tensor:
    if output_tensor is not None:
        raise NotImplementedError("stand-in: silu without output tensor")
    return run_op("silu", lambda t: (F.silu(t.data.float()), t.dtype, t.layout), input_tensor, mem=memory_config)


def embedding(input_tensor: Tensor, weight: Tensor, *, memory_config=None, output_tensor=None, padding_idx=None,
              layout=ROW_MAJOR_LAYOUT, embeddings_type=None, dtype=None) -> Tensor:
    """embedding_device_operation.cpp EmbeddingsDeviceOperation::validate_on_program_cache_miss (read at 5acfb5ff,
    texts of the 0.81.1 wheel): UINT32 or BFLOAT16 ids, a ROW_MAJOR BFLOAT16 table (no FLOAT32), both interleaved; a
    table's first two dims 1 ("First two dimensions for the weights must be 1"); ROW_MAJOR ids [batch, 1, 1, seq]
    (the op's wrapper makes a 2-D [batch, seq] so; "Only dim 0 && 3 for the input can be non 1"). A TILE output is
    tilized in the op when the ids' width and the table's are multiples of 32 (embedding.cpp
    EmbeddingOperation::invoke at 02a75206, fused_tilized), else converted after it. ids -> [batch, seq, width] in
    `layout`, dtype `dtype` or the table's. A table split over the mesh along its width gives each device its
    columns."""
    ids, table = input_tensor, weight
    if output_tensor is not None or padding_idx is not None or embeddings_type is not None:
        raise NotImplementedError("stand-in: embedding without output tensor, padding or embeddings type")
    if table.layout != ROW_MAJOR_LAYOUT:
        raise RuntimeError(f"Weights tensor layout must be ROW_MAJOR but got {table.layout}")
    if ids.dtype not in (uint32, bfloat16):
        raise RuntimeError("Input must be UINT32 or BFLOAT16")
    if table.dtype != bfloat16:
        raise RuntimeError("Weights tensor must have BFLOAT16 dtype")
    if ids.mem.is_sharded():
        raise RuntimeError("Embedding does not currently support sharded inputs")
    if table.mem.is_sharded():
        raise RuntimeError("Embedding does not currently support sharded weights")
    if len(table.shape) == 4 and table.shape[:2] != (1, 1):
        raise RuntimeError(f"First two dimensions for the weights must be 1 but got {table.shape[0]} and "
                           f"{table.shape[1]}")
    if len(ids.shape) == 4 and ids.layout == ROW_MAJOR_LAYOUT and ids.shape[1:3] != (1, 1):
        raise RuntimeError("Only dim 0 && 3 for the input can be non 1")

    def fn(i, w):
        rows = w.data.reshape(-1, w.shape[-1])[i.data.long().reshape(-1)]
        return rows.reshape(i.shape[0], i.shape[-1], -1), dtype or w.dtype, layout
    return run_op("embedding", fn, ids, table, shards=table.shards, mem=memory_config)


def repeat(input_tensor: Tensor, repetition_vector, *, memory_config=None, optional_output_tensor=None) -> Tensor:
    """ttnn.repeat: the input repeated along each dim as many times as the vector says (its docstring; one entry per
    dim). A replicated input only."""
    t = input_tensor
    reps = list(repetition_vector)
    if len(reps) != len(t.shape):
        raise RuntimeError(f"stand-in: repetition vector {reps} must have one entry per dim of {list(t.shape)}")
    if optional_output_tensor is not None or t.shards != 1:
        raise NotImplementedError("stand-in: repeat of a replicated tensor, without output tensor")
    return run_op("repeat", lambda x: (x.data.repeat(*reps), x.dtype, x.layout), t, mem=memory_config)


def reshape(input_tensor: Tensor, shape, padded_shape=None, *, memory_config=None, pad_value=0,
            reshape_tile_mode=None, sub_core_grids=None, skip_padding_fill=False) -> Tensor:
    """The same data viewed in `shape` (-1 inferred); the volume must match (reshape_common.cpp:50 `new_volume ==
    old_volume`, "Invalid arguments to reshape": checked by calling the 0.81.1 wheel). A split tensor keeps its last
    dim. With padded_shape (TT's `ttnn.reshape(x, logical, padded)`): the TILE tensor's padded data (the tile's
    padding rows zero here) viewed in padded_shape, and `shape` the logical part of it."""
    t = input_tensor
    if padded_shape is not None:
        if t.layout != TILE_LAYOUT or t.shards > 1 or math.prod(padded_shape) != math.prod(_padded_shape(t)):
            raise RuntimeError("Invalid arguments to reshape")

        def view(x):
            padded = F.pad(x.data, [0, _padded_shape(x)[-1] - x.shape[-1], 0, _padded_shape(x)[-2] - x.shape[-2]])
            part = padded.reshape(list(padded_shape))[tuple(builtins.slice(0, n) for n in shape)]
            return part.clone(), x.dtype, x.layout
        return run_op("reshape", view, t, mem=memory_config)
    shape = list(shape)  # each device's, as the tensor's own shape
    volume = t.data.numel() // t.shards
    if shape.count(-1) == 1:
        known = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = volume // known if known and volume % known == 0 else -2
    if math.prod(shape) != volume or any(n < 0 for n in shape):
        raise RuntimeError("Invalid arguments to reshape")
    if t.shards > 1 and shape[-1] != t.shape[-1]:
        raise NotImplementedError("stand-in: reshape of a split tensor keeps its last dim")
    return run_op("reshape", lambda x: (per_shard(x, lambda d: d.reshape(shape)), x.dtype, x.layout), t,
                  mem=memory_config)


def softmax(input_tensor: Tensor, dim=-1, *, memory_config=None, compute_kernel_config=None,
            numeric_stable=True) -> Tensor:
    """softmax_device_operation.cpp SoftmaxDeviceOperation::validate_on_program_cache_miss (read at 0b6b67d7): a
    tilized FLOAT32,
    BFLOAT16 or BFLOAT8_B input (texts of the 0.81.1 wheel); the output TILE in the input's dtype (its docstring). The
    stand-in reduces over the last dim, each device over its own shard."""
    t = input_tensor
    _last_dim(t, dim)
    if t.layout != TILE_LAYOUT:
        raise RuntimeError("Inputs to softmax must be tilized")
    if t.dtype not in (float32, bfloat16, bfloat8_b):
        raise RuntimeError(f"Input tensor must be FLOAT32, BFLOAT16, or BFLOAT8_B, got: {_dtype_name(t.dtype)}")
    return run_op("softmax", lambda x: (per_shard(x, lambda d: torch.softmax(d.float(), -1)), x.dtype, TILE_LAYOUT),
                  t, mem=memory_config)


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
        tile[:, pos % BLOCK] = stored(update.data[0, b], cache.dtype)  # packed into the cache's dtype
        tiles[block] = tile  # and writes it back whole: a later row of the same block undoes an earlier one
    for block, tile in tiles.items():
        cache.data[block] = tile


def _check_update(cache, update, idxs, page_table, op: str) -> None:
    """paged_update_cache_device_operation.cpp and paged_fused_update_cache_device_operation.cpp
    validate_on_program_cache_miss (read at 06bd3735 and 04b3405, texts of the 0.81.1 wheel), the checks that apply
    to an update_idxs tensor and a page table: the update is FLOAT32 or BFLOAT16 (the op repacks into the cache dtype)
    and sharded, not width-sharded, one user's heads per core (shard width = head_dim, ROW_MAJOR orientation; "input
    is height sharded on B cores", the docstring; the one-user-per-core count is the non-fused op's); update_idxs INT32,
    ROW_MAJOR, in DRAM, one per user; the page table INT32, ROW_MAJOR, one row per user, no wider than the cache.
    (Not modelled: the fused op's two inputs on non-overlapping cores.)"""
    if op == "paged_update_cache" and update.layout != TILE_LAYOUT:
        raise RuntimeError("Input tensor in non-fused update_cache must be tilized")
    if cache.layout != TILE_LAYOUT:
        raise RuntimeError("Cache tensor in update_cache must be tilized")
    if page_table.dtype != int32:
        raise RuntimeError("Expect page table to have datatype INT32")
    if page_table.layout != ROW_MAJOR_LAYOUT:
        raise RuntimeError("Expect page table to have memory layout in ROW MAJOR")
    if page_table.shape[0] != update.shape[1]:
        raise RuntimeError("Batch size between page_table and input_tensor must match")
    if page_table.shape[1] > cache.shape[0]:
        raise RuntimeError(f"max_num_blocks_per_seq must be less than max_num_blocks: max_num_blocks_per_seq="
                           f"{page_table.shape[1]}, max_num_blocks={cache.shape[0]}")
    if idxs.dtype != int32:
        raise RuntimeError("Expected update_idxs to have datatype INT32")
    if idxs.layout != ROW_MAJOR_LAYOUT:
        raise RuntimeError("Expected update_idxs to have memory layout in ROW MAJOR")
    if idxs.mem.is_sharded():
        raise NotImplementedError("stand-in: update_idxs interleaved in DRAM")
    if idxs.mem.buffer_type != "DRAM":
        raise RuntimeError("Expect update_idxs to have buffer type DRAM")
    if idxs.shape[0] != update.shape[1]:
        raise RuntimeError(f"Number of update_idxs ({idxs.shape[0]}) should match batch size ({update.shape[1]})")
    mem = update.mem
    if not mem.is_sharded():
        raise RuntimeError("Expect input_tensor to be sharded")
    if mem.memory_layout == ShardStrategy.WIDTH:
        raise RuntimeError("Expect input_tensor to NOT have memory layout WIDTH SHARDED")
    (shard_height, shard_width), cores, orientation = mem.shard_spec
    padded = _padded_shape(update)
    if shard_width != padded[-1]:
        raise RuntimeError(f"Expect input_tensor to have shard width ({shard_width}) equal to the last dimension of "
                           f"the input tensor padded shape ({padded[-1]})")
    height = math.prod(padded[:-1])
    if height % shard_height:
        raise RuntimeError("Input tensor's height must be divisible by the number of shards along the height "
                           f"dimension. Got height = {height}, number of shards = {shard_height}.")
    if orientation != ShardOrientation.ROW_MAJOR:
        raise RuntimeError("Only ROW_MAJOR sharding is supported")
    if op == "paged_update_cache" and cores != padded[1]:
        raise RuntimeError(f"Input tensor shard grid must have num_cores ({cores}) equal to the number of users / "
                           f"batch ({padded[1]}). The kernel dispatches one user per core; use a {{num_users, 1}} grid "
                           "(or any CoreRangeSet whose num_cores == num_users).")
    if update.dtype not in (float32, bfloat16):
        raise RuntimeError(f"Data type of input tensor for {op} must be FLOAT32 or BFLOAT16; decode update repacks "
                           "into the cache dtype and should not receive low-precision packed input")


UPDATE_KEYWORDS = {"update_idxs", "share_cache", "batch_offset", "compute_kernel_config", "mesh_coords", "block_size",
                   "num_kv_heads", "cache_position_modulo"}


def _paged_update_op(cache_tensor, input_tensor, *, update_idxs_tensor=None, page_table=None, **kwargs):
    if update_idxs_tensor is None or page_table is None:
        raise NotImplementedError("stand-in: paged_update_cache with update_idxs_tensor and page_table only")
    unknown = set(kwargs) - UPDATE_KEYWORDS
    if unknown:
        raise TypeError(f"paged_update_cache() got unexpected keyword arguments {sorted(unknown)}")
    _check_update(cache_tensor, input_tensor, update_idxs_tensor, page_table, "paged_update_cache")
    run_op("paged_update_cache", lambda c, i, p, t: _paged_update(c, i, p, t), cache_tensor, input_tensor,
           update_idxs_tensor, page_table, inplace=True)


def _paged_fused_update_op(cache_tensor1, input_tensor1, cache_tensor2, input_tensor2, *, update_idxs_tensor=None,
                           page_table=None, **kwargs):
    for cache, update in ((cache_tensor1, input_tensor1), (cache_tensor2, input_tensor2)):
        _check_update(cache, update, update_idxs_tensor, page_table, "paged_fused_update_cache")
    for cache, update in ((cache_tensor1, input_tensor1), (cache_tensor2, input_tensor2)):
        run_op("paged_update_cache", lambda c, i, p, t: _paged_update(c, i, p, t), cache, update,
               update_idxs_tensor, page_table, inplace=True)


def paged_keys(cache: torch.Tensor, page_row: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Positions [first, end) of one user's paged cache: [kv heads, end - first, head_dim]."""
    positions = torch.arange(first, end)
    blocks = page_row[positions // BLOCK]
    return cache[blocks, :, positions % BLOCK].transpose(0, 1)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale) -> torch.Tensor:
    """Attention of query rows [..., rows, head_dim] over keys and values [..., n, head_dim], in float64 and returned
    in the query's dtype: a row's result does not depend on which other rows share the call (float32 or bfloat16
    matmuls on a CPU sum in an order that depends on the shapes), so the per-row op and spec_multi_pos_tiles give a
    row the same values, as the device does when both split the flash reduction alike (tt-metal's
    test_sdpa_decode_spec_multi_pos.py: bit-identical then)."""
    return F.scaled_dot_product_attention(query.double(), keys.double(), values.double(), scale=scale).to(query.dtype)


def _sdpa_decode(q: Tensor, k: Tensor, v: Tensor, page_table: Tensor, positions: Tensor, scale, window):
    """q [1, 32, heads, head_dim]; row b attends to its own positions 0..positions[b] (a window's worth)."""
    out = torch.zeros_like(q.data)
    heads, kv_heads = q.shape[2], k.shape[1]
    for b, pos in enumerate(positions.data.tolist()):
        if pos == -1:
            continue  # "If a position is given as (-1), compute for the corresponding index in the batch is skipped."
        first = 0 if window is None else builtins.max(0, pos + 1 - window)
        query = q.data[0, b].view(kv_heads, heads // kv_heads, -1)
        # the cache's values in q's compute format: a cache made by from_torch/as_tensor (vLLM's, generator_vllm.py
        # allocate_vllm_kv_cache) holds bfloat8_b values in a float32 container, exact in bfloat16
        keys = paged_keys(k.data, page_table.data[b], first, pos + 1).to(query.dtype)
        values = paged_keys(v.data, page_table.data[b], first, pos + 1).to(query.dtype)
        out[0, b] = _attend(query, keys, values, scale).reshape(heads, -1)
    return out, q.dtype, q.layout


def _sdpa_decode_groups(q: Tensor, k: Tensor, v: Tensor, page_table: Tensor, positions: Tensor, scale, tiles: int):
    """spec_multi_pos_tiles: q [1, groups, tiles x 32, head_dim], one KV head; candidate j of group b (row tile j)
    attends to positions 0..positions[b x tiles + j] of page-table row b (the wheel's dataflow_common.hpp
    generate_mask_spec_multi_pos masks each row tile at its own bound), over the one scan up to the group's last bound
    (reader_decode_all.cpp: cur_pos = index_ptr[cur_batch * T + T - 1]); a group whose last bound is -1 is skipped."""
    out = torch.zeros_like(q.data)
    bounds = positions.data.view(-1, tiles).tolist()
    for b, group in enumerate(bounds):
        if group[-1] == -1:
            continue
        keys = paged_keys(k.data, page_table.data[b], 0, group[-1] + 1)[0].to(q.data.dtype)
        values = paged_keys(v.data, page_table.data[b], 0, group[-1] + 1)[0].to(q.data.dtype)
        for j, bound in enumerate(group):
            rows = q.data[0, b, j * 32:(j + 1) * 32]
            out[0, b, j * 32:(j + 1) * 32] = _attend(rows, keys[:bound + 1], values[:bound + 1], scale)
    return out, q.dtype, q.layout


def _check_groups(q: Tensor, k: Tensor, table: Tensor, pos: Tensor, tiles: int, window, mask) -> None:
    """sdpa_decode_device_operation.cpp SdpaDecodeDeviceOperation::validate_on_program_cache_miss with
    spec_multi_pos_tiles (the texts of the 0.81.1 wheel's libraries; the source of that version is not at hand): one
    KV head; Q BFLOAT16, TILE, interleaved in DRAM, tiles x 32 rows per group; one page-table row per group; cur_pos
    tiles entries per group, non-decreasing within a group (on a device an out-of-order group silently drops keys:
    the stand-in refuses it, to catch the caller); no sliding window or mask."""
    if k.shape[1] != 1:
        raise RuntimeError(f"spec_multi_pos_tiles requires num_kv_heads == 1, got {k.shape[1]}")
    if window is not None:
        raise RuntimeError("spec_multi_pos_tiles is not supported with sliding_window_size")
    if mask is not None:
        raise RuntimeError("spec_multi_pos_tiles is not supported with an explicit attn_mask")
    if q.dtype != bfloat16:
        raise RuntimeError(f"spec_multi_pos_tiles requires a BFLOAT16 Q tensor, got {_dtype_name(q.dtype)}")
    if q.layout != TILE_LAYOUT:
        raise RuntimeError(f"spec_multi_pos_tiles requires a TILE layout Q tensor, got {q.layout}")
    if q.mem.is_sharded():
        raise RuntimeError("spec_multi_pos_tiles requires an unsharded (DRAM interleaved) Q tensor")
    groups = q.shape[1]
    if q.shape[2] != tiles * 32:
        raise RuntimeError(f"spec_multi_pos_tiles={tiles}: Q must have {tiles * 32} padded rows per batch (one 32-row "
                           f"tile per candidate), got {q.shape[2]}")
    if table.shape[0] != groups:
        raise RuntimeError(f"spec_multi_pos_tiles: page_table must have one row per Q batch group, got "
                           f"{table.shape[0]} rows for Q batch {groups}")
    if pos.shape[-1] != groups * tiles:
        raise RuntimeError(f"spec_multi_pos_tiles={tiles}: cur_pos must have {groups * tiles} entries (B={groups} "
                           f"groups of {tiles}), got {pos.shape[-1]}")
    for b, group in enumerate(pos.data.view(-1, tiles).tolist()):
        if group != sorted(group):
            raise RuntimeError(f"spec_multi_pos_tiles={tiles}: cur_pos entries within candidate group {b} must be "
                               "non-decreasing")


def _paged_sdpa_decode(input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor=None, *, is_causal=True,
                       attn_mask=None, cur_pos_tensor=None, scale=None, sliding_window_size=None, memory_config=None,
                       spec_multi_pos_tiles=None, **kwargs):
    """sdpa_decode_device_operation.cpp SdpaDecodeDeviceOperation::validate_on_program_cache_miss (read at 00b0fa3f,
    texts of the 0.81.1 wheel), causal paged decode: q, k, v BFLOAT16/BFLOAT8_B/BFLOAT4_B (no FLOAT32), k and v
    tilized and in DRAM; q height-sharded or interleaved in DRAM (both allowed); cur_pos INT32 ROW_MAJOR, one per page
    table row; the page table INT32 ROW_MAJOR; one head_dim. The output goes where memory_config says (height-sharded
    if sharded), else DRAM (sdpa_decode.cpp: DEFAULT_OUTPUT_MEMORY_CONFIG)."""
    q, k, v, table, pos = input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor, cur_pos_tensor
    if not is_causal or attn_mask is not None or table is None or pos is None:
        raise NotImplementedError("stand-in: causal paged SDPA decode with cur_pos_tensor")
    for t in (q, k, v):
        if t.dtype not in (bfloat16, bfloat8_b, "bfloat4_b"):
            raise RuntimeError(f"Unsupported data type {_dtype_name(t.dtype)}.")
    if k.layout != TILE_LAYOUT or v.layout != TILE_LAYOUT:
        raise RuntimeError("Inputs to SDPA must be tilized except for Q")
    if q.mem.is_sharded() and q.mem.memory_layout != ShardStrategy.HEIGHT:
        raise RuntimeError(f"Q tensor memory layout must be HEIGHT_SHARDED when sharded but got {q.mem.memory_layout}")
    if not q.mem.is_sharded() and q.mem.buffer_type != "DRAM":
        raise RuntimeError(f"Q tensor buffer type must be DRAM when not sharded but got {q.mem.buffer_type}")
    for i, t in ((1, k), (2, v)):
        if t.mem.buffer_type != "DRAM":
            raise RuntimeError(f"Input tensor {i} buffer type must be DRAM but got {t.mem.buffer_type}")
    out = memory_config or DRAM_MEMORY_CONFIG
    if out.is_sharded() and out.memory_layout != ShardStrategy.HEIGHT:
        raise RuntimeError(f"Output memory config layout must be HEIGHT_SHARDED when sharded but got "
                           f"{out.memory_layout}")
    if pos.dtype != int32:
        raise RuntimeError(f"Expect cur_pos to be INT32, got {_dtype_name(pos.dtype)}")
    if pos.layout != ROW_MAJOR_LAYOUT:
        raise RuntimeError(f"Expect cur_pos to be ROW_MAJOR, got {pos.layout}")
    if spec_multi_pos_tiles:
        _check_groups(q, k, table, pos, spec_multi_pos_tiles, sliding_window_size, attn_mask)
    elif pos.shape[-1] != table.shape[0]:
        raise RuntimeError(f"cur_pos must have batch size equal to Q, got {pos.shape[0]} and {table.shape[0]}")
    if table.dtype != int32:
        raise RuntimeError("Error: SDPA currently only supports INT32 datatype")
    if table.layout != ROW_MAJOR_LAYOUT:
        raise RuntimeError(f"Page table tensor layout must be ROW_MAJOR but got {table.layout}")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise RuntimeError("Q, K, V must have same hidden size")
    if k.shape[1] > 1:  # grouped-query attention (several KV heads)
        if out.is_sharded():
            raise RuntimeError("Sharded output not supported for GQA")
        if q.dtype != bfloat16:
            raise RuntimeError(f"GQA expects BFLOAT16 input tensor, but got {_dtype_name(q.dtype)}")
        if q.shape[2] % k.shape[1]:
            raise RuntimeError(f"GQA expects Q to have a multiple of K heads, but got {q.shape[2]} and {k.shape[1]}")
    if spec_multi_pos_tiles:
        return run_op(f"paged_sdpa_decode@{spec_multi_pos_tiles}",
                      lambda q, k, v, t, p: _sdpa_decode_groups(q, k, v, t, p, scale, spec_multi_pos_tiles),
                      q, k, v, table, pos, mem=out)
    return run_op("paged_sdpa_decode", lambda q, k, v, t, p: _sdpa_decode(q, k, v, t, p, scale, sliding_window_size),
                  q, k, v, table, pos, mem=out)


# ---- TT's attention head ops (tt/attention.py decode and prefill), as the device draft head runs them ---------------

def _per_core(shape: tuple, cores: int) -> MemoryConfig:
    return MemoryConfig(ShardStrategy.HEIGHT, "L1", (tuple(shape), cores, ShardOrientation.ROW_MAJOR))


def _cores(t: Tensor) -> int:
    return t.mem.shard_spec[1]


def _nlp_create_qkv_heads_decode(input_tensor, *, num_heads, num_kv_heads=None, overlap_qk_coregrid=None,
                                 batch_offset=None, slice_size=None, memory_config=None):
    """nlp_create_qkv_heads_decode_device_operation.cpp validate_on_program_cache_miss (read at 5acfb5ff) and the
    host wrapper's head-count check: a bfloat16/float32 TILE [1, 1, users <= 32, (H + 2 Hk) D], interleaved or width
    sharded; the output config height sharded (only its grid is used: the op rebuilds it), one user per core, at
    least as many cores as users (q and k share cores). Outputs [1, users, heads, D] per user core, shard (32, D)."""
    x, Hk = input_tensor, num_kv_heads or num_heads
    shape = x.shape
    if x.dtype not in (float32, bfloat16):
        raise RuntimeError("Unsupported data format")
    if x.layout != TILE_LAYOUT:
        raise RuntimeError("Only tile layout is supported for input tensor")
    if shape[3] % (num_heads + 2 * Hk):
        raise RuntimeError(f"Input shape {shape} must be divisible by num_heads + 2*num_kv_heads = "
                           f"{num_heads + 2 * Hk}")
    if shape[0] != 1 or shape[1] != 1 or shape[2] > 32:
        raise RuntimeError(f"Input shape {shape}: [1, 1, users <= 32, width] only")
    if x.mem.is_sharded() and x.mem.memory_layout != ShardStrategy.WIDTH:
        raise RuntimeError("Input tensor must be width sharded when sharded")
    if memory_config is None or memory_config.memory_layout != ShardStrategy.HEIGHT:
        raise RuntimeError("Output tensor must be height sharded")
    if num_heads > 32 or num_heads < Hk:
        raise RuntimeError(f"num_q_heads {num_heads} must be <= 32 and >= num_kv_heads {Hk}")
    users, D = shape[2], shape[3] // (num_heads + 2 * Hk)
    if memory_config.shard_spec[1] < users:
        raise RuntimeError(f"Output core grid ({memory_config.shard_spec[1]} cores) must hold the {users} users")
    out = _per_core((32, D), users)

    def fn(t):
        q, k, v = t.data[0, 0].split([num_heads * D, Hk * D, Hk * D], dim=-1)
        return tuple((part.reshape(1, users, n, D).clone(), t.dtype, TILE_LAYOUT)
                     for part, n in ((q, num_heads), (k, Hk), (v, Hk)))
    return run_op("nlp_create_qkv_heads_decode", fn, x, mem=out)


def _nlp_create_qkv_heads(input_tensor, input_tensor_kv=None, *, num_heads, num_kv_heads=None, transpose_k_heads=True,
                          memory_config=None):
    """nlp_create_qkv_heads_device_operation.cpp (read at 55e3268f): float32/bfloat16/bfloat8_b TILE [B, 1, S, (H +
    2 Hk) D], S tile-aligned; interleaved input -> interleaved outputs q [B, H, S, D], k [B, Hk, S, D] (or [B, Hk, D,
    S] with transpose_k_heads), v [B, Hk, S, D]."""
    x, Hk = input_tensor, num_kv_heads or num_heads
    shape = x.shape
    if input_tensor_kv is not None:
        raise NotImplementedError("stand-in: fused qkv input only")
    if x.dtype not in (float32, bfloat16, bfloat8_b) or x.layout != TILE_LAYOUT:
        raise RuntimeError("Unsupported data format")
    if shape[2] % 32:
        raise RuntimeError(f"Input sequence {shape[2]} is not tile aligned")
    if shape[1] != 1:
        raise RuntimeError(f"Input shape {shape}: dim 1 must be 1")
    if shape[3] % (num_heads + 2 * Hk):
        raise RuntimeError(f"Input shape {shape} must be divisible by num_heads + 2*num_kv_heads")
    if memory_config is not None and memory_config.is_sharded() and not x.mem.is_sharded():
        raise RuntimeError("Output must be interleaved for an interleaved input")
    D = shape[3] // (num_heads + 2 * Hk)

    def fn(t):
        B, S = t.data.shape[0], t.data.shape[2]
        q, k, v = (part.reshape(B, S, n, D).transpose(1, 2).contiguous()
                   for part, n in zip(t.data[:, 0].split([num_heads * D, Hk * D, Hk * D], dim=-1), (num_heads, Hk, Hk)))
        return tuple((part, t.dtype, TILE_LAYOUT) for part in (q, k.transpose(2, 3) if transpose_k_heads else k, v))
    return run_op("nlp_create_qkv_heads", fn, x, mem=memory_config or DRAM_MEMORY_CONFIG)


def _rotary_embedding_llama(input_tensor, cos_cache, sin_cache, trans_mat, is_decode_mode=False, *,
                            memory_config=None, compute_kernel_config=None):
    """rotary_embedding_llama_device_operation.cpp validate (read at 07b4a3f7) and the sharded program factory's
    buffers (read at d6e1aec2, allocated on the input's shard grid: cos, sin and the rotation matrix on the same
    cores): all four TILE bfloat16, head_dim a multiple of 32 and <= 256, the output layout the input's, cos and sin
    of one shape. Decode: every tensor height sharded, input [1, users, heads, D], cos/sin [1, users, 1 (a tile), D]
    shard rows 32, the matrix [1, 1, 32 users, 32] shard (32, 32). Prefill: interleaved input [1, heads, S, D], cos
    and sin [1, 1 or heads, S, D], the matrix [1, 1, 32, 32]. Computes x * cos + (x @ trans_mat) * sin."""
    x, cos, sin, mat = input_tensor, cos_cache, sin_cache, trans_mat
    D = x.shape[-1]
    for t in (x, cos, sin, mat):
        if t.layout != TILE_LAYOUT:
            raise RuntimeError("Input tensors must be tilized")
        if t.dtype != bfloat16:
            raise RuntimeError("All input tensors must have dtype = bfloat16")
    if D % 32 or D > 256:
        raise RuntimeError(f"head_dim {D} must be a multiple of 32 and <= 256")
    out = memory_config or x.mem
    if out.memory_layout != x.mem.memory_layout:
        raise RuntimeError("Input tensor and output tensor must have same memory layout")
    if cos.shape != sin.shape:
        raise RuntimeError("Cos and Sin dims must match")
    if is_decode_mode:
        if x.shape[0] != 1:
            raise RuntimeError("Input tensor must have seq_len (in dim 0) must be 1.")
        for t in (x, cos, sin, mat):
            if t.mem.memory_layout != ShardStrategy.HEIGHT:
                raise RuntimeError("Sharded inputs for RoPE must be HEIGHT_SHARDED.")
        if x.shape[1] != cos.shape[1]:
            raise RuntimeError("Cos and Sin must have the same batch size as the input")
        if cos.mem.shard_spec[0][0] != 32:
            raise RuntimeError("Cos and Sin must be sharded with n_heads (shard_shape[0]) less than equal to "
                               "TILE_HEIGHT")
        if mat.shape[:2] != (1, 1) or mat.mem.shard_spec[0] != (32, 32):
            raise RuntimeError("Transformation matrix must be [1, 1, ...] sharded in tiles (32, 32)")
        if not _cores(x) == _cores(cos) == _cores(sin) == _cores(mat):
            raise RuntimeError("stand-in: cos, sin and the transformation matrix must sit on the input's cores (the "
                               "program's buffers are allocated on the input's shard grid)")
    else:
        if x.mem.is_sharded():
            raise RuntimeError("Input tensor must be interleaved in prefill mode")
        if cos.shape[0] != 1 or cos.shape[-1] != D or cos.shape[1] not in (1, x.shape[1]):
            raise RuntimeError(f"Cos and Sin shape {cos.shape} do not fit the input {x.shape}")
        if mat.shape != (1, 1, 32, 32):
            raise RuntimeError("Transformation matrix must be [1, 1, 32, 32] in prefill mode")

    def fn(t, c, s, m):
        rot = m.data[0, 0, :32, :32]
        pairs = t.data.reshape(*t.data.shape[:-1], D // 32, 32) @ rot  # the 32 x 32 matrix on each tile's columns
        return t.data * c.data + pairs.reshape(t.data.shape) * s.data, t.dtype, t.layout
    return run_op("rotary_embedding_llama", fn, x, cos, sin, mat, mem=out)


def _nlp_concat_heads_decode(input_tensor, *, num_heads, memory_config=None, sub_core_grids=None):
    """nlp_concat_heads_decode_device_operation.cpp validate (read at bc2f1398): bfloat16/float32 TILE [1, users <=
    32, heads (padded to 32), D], height sharded one user per core, shard (32, D). Output [1, 1, 32, heads * D] width
    sharded one head per core (memory_config ignored)."""
    x = input_tensor
    shape = x.shape
    if x.dtype not in (float32, bfloat16) or x.layout != TILE_LAYOUT:
        raise RuntimeError("Unsupported data format")
    if shape[0] != 1:
        raise RuntimeError("seqlen=1 for decode")
    if shape[1] > 32:
        raise RuntimeError("currently only support less than 32 users")
    if shape[2] < num_heads:
        raise RuntimeError(f"input heads {shape[2]} must be >= num_heads {num_heads}")
    if not x.mem.is_sharded():
        raise RuntimeError("Input tensor must be sharded")
    if x.mem.memory_layout != ShardStrategy.HEIGHT:
        raise RuntimeError("Input tensor must be HEIGHT_SHARDED")
    if x.mem.shard_spec[0] != (32, shape[3]):
        raise RuntimeError(f"Input shard shape {x.mem.shard_spec[0]} must be (32 padded heads, {shape[3]})")
    if _cores(x) != shape[1]:
        raise RuntimeError("Input core grid num_cores must be equal to num users")
    out = MemoryConfig(ShardStrategy.WIDTH, "L1", ((32, shape[3]), num_heads, ShardOrientation.ROW_MAJOR))

    def fn(t):
        users = t.data.shape[1]
        rows = torch.zeros(1, 1, 32, num_heads * shape[3])
        rows[0, 0, :users] = t.data[0, :, :num_heads].reshape(users, -1)
        return rows, t.dtype, TILE_LAYOUT
    return run_op("nlp_concat_heads_decode", fn, x, mem=out)


def _paged_fill_cache(cache_tensor, input_tensor, page_table, *, batch_idx=0, batch_idx_tensor=None, **kwargs):
    """paged_fill_cache_device_operation.cpp (read at 587257e1) and the 0.81.1 docstring: a raw tile copy (input dtype
    equal to the cache's), input [1, Hk, S, D] interleaved TILE, page table INT32 interleaved, S within the page
    table's blocks; input tile t goes to block page_table[batch_idx][t * 32 / block_size], no start offset."""
    cache, x, table = cache_tensor, input_tensor, page_table
    if batch_idx_tensor is not None or kwargs:
        raise NotImplementedError("stand-in: paged_fill_cache with batch_idx only")
    if x.dtype != cache.dtype:
        raise RuntimeError(f"paged_fill_cache: input dtype {_dtype_name(x.dtype)} must match the cache's "
                           f"{_dtype_name(cache.dtype)} (no conversion: typecast first)")
    if x.mem.is_sharded() or table.mem.is_sharded():
        raise RuntimeError("paged_fill_cache: input and page table must be interleaved")
    if table.dtype != int32:
        raise RuntimeError("page_table must be INT32")
    if x.layout != TILE_LAYOUT or x.shape[0] != 1 or x.shape[1] != cache.shape[1] or x.shape[3] != cache.shape[3]:
        raise RuntimeError(f"paged_fill_cache: input {x.shape} does not fit the cache {cache.shape}")
    if x.shape[2] > cache.shape[2] * table.shape[1]:
        raise RuntimeError("Input seq_len must fit in max_num_blocks_per_seq")

    def fn(c, t, p):  # -1 entries skipped (writer_fill_cache_interleaved.cpp: SKIP_PAGE_TABLE_ENTRY)
        blocks = p.data[batch_idx].long()[torch.arange(t.data.shape[2]) // BLOCK]
        positions = torch.arange(t.data.shape[2])[blocks >= 0]
        c.data[blocks[blocks >= 0], :, positions % BLOCK] = stored(t.data[0].transpose(0, 1)[positions], c.dtype)
    run_op("paged_fill_cache", fn, cache, x, table, inplace=True)


experimental = types.SimpleNamespace(paged_update_cache=_paged_update_op,
                                     paged_fused_update_cache=_paged_fused_update_op, all_gather_async=_all_gather_async,
                                     nlp_create_qkv_heads_decode=_nlp_create_qkv_heads_decode,
                                     nlp_create_qkv_heads=_nlp_create_qkv_heads,
                                     rotary_embedding_llama=_rotary_embedding_llama,
                                     nlp_concat_heads_decode=_nlp_concat_heads_decode, paged_fill_cache=_paged_fill_cache)
transformer = types.SimpleNamespace(paged_scaled_dot_product_attention_decode=_paged_sdpa_decode)
