# SPDX-License-Identifier: Apache-2.0
"""Taps: the residual stream entering chosen decoder layers, copied out of TT-Transformers' forward for an EAGLE-3
draft head. In a traced step the copies stay on the device and land in the tap tile, [1, 1, 32, len(taps) * dim], a
persistent tensor the head's traces read (gathered over a mesh by one all-gather in the trace, or on the host with
tap_gather "host"); a prefill's come back to the host once per request, for the head's prompt rows."""
from typing import Sequence

import torch

from .model import TILE_ROWS, supported_kwargs
from .ttnn_api import ttnn


def dram_copy(x):
    """A copy of a device tensor in DRAM (interleaved), a trace output of its own. The decode residual is
    width-sharded in L1, and ttnn.clone refuses a sharded input with an interleaved output ("Clone: mixed
    sharded/interleaved layout not currently supported", ttnn 0.81.1 clone_device_operation.cpp validate_inputs);
    ttnn.to_memory_config moves it with sharded_to_interleaved into a new DRAM buffer (to_memory_config_op.cpp). An
    interleaved input (a Galaxy's L1 residual) is cloned: to_memory_config would hand back the same tensor when the
    config already matches (to_memory_config_op.cpp: `return tensor`), and no trace output may alias the program's
    own buffers."""
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
    between tt-metal versions): refused (causal_lm.TtnnCausalLM._check_taps)."""

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


def prefill_state_to_host(x, mesh, num_devices: int, dim: int) -> torch.Tensor:
    """A prefill's x [1, 1, S, dim / devices] read back as [S, dim] bfloat16 (device parts side by side)."""
    if num_devices > 1:
        host = ttnn.to_torch(x, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=3))
    else:
        host = ttnn.to_torch(ttnn.get_device_tensors(x)[0])
    return host.reshape(-1, host.shape[-1])[:, : dim].to(torch.bfloat16)


def write_taps(model, dim: int, num_devices: int, tap_gather: str, copies: dict, taps: tuple[int, ...], tile):
    """The tapped layers' inputs, in the order asked, into `tile` ([1, 1, 32, len(taps) * dim], whole rows on every
    device, as the replicated head reads them), from TT-Transformers' `model`. On a mesh each copy holds dim / devices
    columns (TapCapture), so the copies are stacked along the rows ([1, 1, 32 * len(taps), dim / devices]) and
    all-gathered along dim once (one collective per step, not one per tap), then each tap's 32 rows go side by side. The
    gather is TT-Transformers' own (tt/ccl.py tt_all_gather: the model's TT_CCL semaphores, persistent as a trace
    needs), cluster_axis None: over the whole 1 x N mesh; not called on one device (some versions' "# N150" guard
    compares a list with a tuple, `list(mesh_device.shape) == (1, 1)`, and would go on to all_gather_async, which needs
    two devices). With tap_gather "host" the stacked copies are returned instead, an output of the program, which the
    host reads and writes into the tile after the replay (gather_taps_on_host): the traced program holds no collective
    of ours. Returns those copies, or None."""
    from models.tt_transformers.tt.ccl import tt_all_gather

    dram = ttnn.DRAM_MEMORY_CONFIG
    parts = [copies[i][0] for i in taps]
    if num_devices > 1:
        stacked = ttnn.concat(parts, dim=2, memory_config=dram)
        if tap_gather == "host":
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


def gather_taps_on_host(mesh, stacked, taps: tuple[int, ...], tap_tile) -> None:
    """tap_gather "host": the stacked copies [1, 1, 32 * len(taps), dim / devices] per device read back as one
    [32 * len(taps), dim] (the devices' columns side by side, ConcatMeshToTensor), each tap's 32 rows put side by
    side, and the result written into the tap tile on every device: a read and a write of 32 x len(taps) x dim
    bfloat16 values a step, where the device gather moves none through the host."""
    rows = ttnn.to_torch(stacked, mesh_composer=ttnn.ConcatMeshToTensor(mesh, dim=3)).reshape(
        len(taps) * TILE_ROWS, -1)
    tile = torch.cat(rows.split(TILE_ROWS), dim=1).view(1, 1, TILE_ROWS, -1)
    ttnn.copy_host_to_device_tensor(ttnn.from_torch(tile, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT,
                                                    mesh_mapper=ttnn.ReplicateTensorToMesh(mesh)),
                                    tap_tile)


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
