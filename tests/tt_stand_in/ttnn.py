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
"""
import builtins
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F

uint32, int32, bfloat16, bfloat8_b, float32 = "uint32", "int32", "bfloat16", "bfloat8_b", "float32"
ROW_MAJOR_LAYOUT, TILE_LAYOUT = "ROW_MAJOR", "TILE"
DRAM_MEMORY_CONFIG = "DRAM"
TORCH_DTYPES = {uint32: torch.int64, int32: torch.int64, bfloat16: torch.float32, bfloat8_b: torch.float32,
                float32: torch.float32}


class MeshDevice:
    """One device's worth of state: tensors it holds, compiled programs, traces."""

    def __init__(self, shape=(1, 1)):
        self.shape = tuple(shape)
        self.allocations = 0  # device tensors created outside trace replay
        self.compiled: set = set()
        self.capturing: Optional[list] = None
        self.traces: dict[int, list] = {}
        self.replaying = False
        self.ops_run = 0

    def get_num_devices(self) -> int:
        return self.shape[0] * self.shape[1]


class MeshShape(tuple):
    def __new__(cls, rows, cols):
        return super().__new__(cls, (rows, cols))


def open_mesh_device(mesh_shape=None, l1_small_size=0, trace_region_size=0, num_command_queues=1, **kwargs):
    return MeshDevice(mesh_shape or (1, 1))


def close_mesh_device(mesh_device) -> None:
    mesh_device.traces.clear()


class Tensor:
    def __init__(self, data: torch.Tensor, dtype: str, layout: str, device: Optional[MeshDevice]):
        self._data, self.dtype, self.layout, self.device = data, dtype, layout, device
        self.deallocated = False
        if device is not None and not device.replaying:
            device.allocations += 1

    @property
    def data(self) -> torch.Tensor:
        if self.deallocated:
            raise RuntimeError("stand-in: use of a deallocated device tensor")
        return self._data

    @property
    def shape(self):
        return tuple(self._data.shape)


class ReplicateTensorToMesh:
    def __init__(self, mesh_device):
        self.mesh_device = mesh_device


class ShardTensor2dMesh:
    def __init__(self, mesh_device, dims, mesh_shape):
        if tuple(dims) != (None, None):
            raise NotImplementedError("stand-in: only replicated placement on a 1x1 mesh")
        self.mesh_device = mesh_device


def from_torch(tensor, dtype=None, *, layout=ROW_MAJOR_LAYOUT, device=None, mesh_mapper=None, memory_config=None,
               **kwargs) -> Tensor:
    dtype = dtype or float32
    return Tensor(tensor.detach().to(TORCH_DTYPES[dtype]).clone(), dtype, layout, device)


def to_torch(tensor: Tensor, dtype=None, **kwargs) -> torch.Tensor:
    return tensor.data.clone()


def to_device(tensor: Tensor, device: MeshDevice, memory_config=None) -> Tensor:
    return Tensor(tensor.data.clone(), tensor.dtype, tensor.layout, device)


def get_device_tensors(tensor: Tensor) -> list:
    return [tensor]


def unsqueeze_to_4D(tensor: Tensor) -> Tensor:
    data = tensor.data
    while data.dim() < 4:
        data = data.unsqueeze(0)
    return Tensor(data, tensor.dtype, tensor.layout, tensor.device)


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


def run_op(name: str, fn, *args, inplace: bool = False, **kwargs) -> Any:
    """fn computes on the tensors' data (torch) and returns torch tensors (with dtype/layout) or None when it works
    in place. Captured ops are recorded, not run; their outputs are garbage until the trace replays."""
    device = _device_of([*args, *kwargs.values()])
    key = (name, tuple(a.shape for a in [*args, *kwargs.values()] if isinstance(a, Tensor)))
    if device.capturing is not None:
        if key not in device.compiled:
            raise RuntimeError(f"stand-in: {name} was not compiled before trace capture (run the step once first)")
        if inplace:
            device.capturing.append((fn, args, kwargs, None))
            return None
        outputs = _wrap(fn(*args, **kwargs), device, garbage=True)
        device.capturing.append((fn, args, kwargs, outputs))
        return outputs
    device.compiled.add(key)
    device.ops_run += 1
    result = fn(*args, **kwargs)
    return None if inplace else _wrap(result, device)


def _wrap(result, device, garbage=False):
    if isinstance(result, tuple) and not isinstance(result[0], torch.Tensor):
        return tuple(_wrap(r, device, garbage) for r in result)
    data, dtype, layout = result
    if garbage:
        data = torch.full_like(data, -7 if dtype in (uint32, int32) else float("nan"))
    return Tensor(data, dtype, layout, device)


def begin_trace_capture(mesh_device: MeshDevice, *, cq_id=None) -> int:
    mesh_device.capturing = []
    return len(mesh_device.traces) + 1


def end_trace_capture(mesh_device: MeshDevice, trace_id: int, *, cq_id=None) -> None:
    mesh_device.traces[trace_id], mesh_device.capturing = mesh_device.capturing, None


def execute_trace(mesh_device: MeshDevice, trace_id: int, *, cq_id=None, blocking: bool = True) -> None:
    if trace_id not in mesh_device.traces:
        raise RuntimeError(f"stand-in: trace {trace_id} was never captured")
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
    del mesh_device.traces[trace_id]


def synchronize_device(device, cq_id=None, sub_device_ids=()) -> None:
    pass


def slice(input_tensor: Tensor, slice_start, slice_end, slice_step=None, *, memory_config=None, **kwargs) -> Tensor:
    index = tuple(builtins.slice(start, end) for start, end in zip(slice_start, slice_end))
    return run_op("slice", lambda t: (t.data[index].clone(), t.dtype, t.layout), input_tensor)


def argmax(input_tensor: Tensor, dim=None, keepdim=False, *, memory_config=None, output_tensor=None,
           **kwargs) -> Tensor:
    if input_tensor.layout != ROW_MAJOR_LAYOUT or dim not in (-1, input_tensor.data.dim() - 1):
        raise NotImplementedError("stand-in: argmax over the last dim of a ROW_MAJOR tensor only")
    if input_tensor.shape[-2] % 32:
        raise RuntimeError("stand-in: multi-core argmax needs tile-aligned (32) rows")
    return run_op("argmax", lambda t: (t.data.argmax(dim=-1, keepdim=keepdim), uint32, ROW_MAJOR_LAYOUT),
                  input_tensor)


def to_layout(tensor: Tensor, layout, dtype=None, memory_config=None, **kwargs) -> Tensor:
    return run_op("to_layout", lambda t: (t.data.clone(), t.dtype, layout), tensor)


def to_memory_config(tensor: Tensor, memory_config=None, dtype=None, output_tensor=None, **kwargs) -> Tensor:
    return run_op("to_memory_config", lambda t: (t.data.clone(), t.dtype, t.layout), tensor)


def topk(input_tensor: Tensor, k=32, dim=-1, largest=True, sorted=True, **kwargs):
    if input_tensor.layout != TILE_LAYOUT:
        raise RuntimeError("stand-in: topk takes a TILE tensor")

    def fn(t):
        values, indices = t.data.topk(k, dim=dim, largest=largest, sorted=sorted)
        return (values, t.dtype, TILE_LAYOUT), (indices, uint32, TILE_LAYOUT)
    return run_op("topk", fn, input_tensor)


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
    if update_idxs_tensor is None or page_table is None:
        raise NotImplementedError("stand-in: paged_update_cache with update_idxs_tensor and page_table only")
    unknown = set(kwargs) - {"share_cache", "batch_offset", "compute_kernel_config", "mesh_coords", "block_size",
                             "num_kv_heads", "cache_position_modulo"}
    if unknown:
        raise TypeError(f"paged_update_cache() got unexpected keyword arguments {sorted(unknown)}")
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
        first = 0 if window is None else max(0, pos + 1 - window)
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
                                     paged_fused_update_cache=_paged_fused_update_op)
transformer = types.SimpleNamespace(paged_scaled_dot_product_attention_decode=_paged_sdpa_decode)
