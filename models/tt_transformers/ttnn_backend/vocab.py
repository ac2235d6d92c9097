# SPDX-License-Identifier: Apache-2.0
"""From a step's logits to ids on the device: only ids (and a few values) cross to the host.

On one device, or where TT-Transformers gathers the logits (a Galaxy, or no on-device sampling support), the argmax
runs over the LM head's output with the padded columns sliced off. On N300/T3K-style meshes each device takes the
argmax and the max of its own vocabulary share (padded columns masked to -inf) and only 32 ids and 32 values per
device come back, merged on the host, instead of TT's all-gather of every logit (`ttnn_decode_forward` with
`sampling_on_device=True, capture_sampling_trace=True` returns the per-device shares: TT's split-sampling hook). The
top k (token recycling): `ttnn.topk` runs multi-core only on power-of-two widths (trace_plan.vocab_slices); each share
is cut into slices of such a width (the last padded with -inf), the top k of each taken on device, and the few
candidates merged on the host.
"""
import torch

from .model import TILE_ROWS
from .trace_plan import vocab_slices
from .ttnn_api import ttnn


class VocabShares:
    """A model's vocabulary as its LM head leaves it on the mesh: split into one share per device (split), or whole on
    every device."""

    def __init__(self, mesh, cluster_shape, vocab_size: int, share: int, split: bool, num_devices: int):
        self.mesh, self.cluster_shape, self.vocab_size = mesh, cluster_shape, vocab_size
        self.share, self.split, self.num_devices = share, split, num_devices

    def reduce(self, out, mask, top_k: int) -> tuple:
        """In the traced program, the LM head's output `out` to (ids, best, rows, top): per device the argmax (and
        the max, on split shares, and the top k of each slice) over its vocabulary share, and the logits row-major.
        mask: device_mask's tensor on split shares. Outputs go to DRAM (a trace keeps them: L1 is for the ops)."""
        dram = ttnn.DRAM_MEMORY_CONFIG
        self.check_width(out)
        if self.split:  # each device's share (the LM head's bfloat8_b): masked in bfloat16, which holds -inf
            tiles = ttnn.add(out, mask, dtype=ttnn.bfloat16, memory_config=dram)
            best = ttnn.max(tiles, dim=-1, keepdim=True, memory_config=dram)
            rows = ttnn.untilize(tiles, use_multicore=True, memory_config=dram)
        else:  # TT's untilized logits, whole on every device: drop the padded columns
            rows = ttnn.slice(out, [0, 0, 0, 0], [1, 1, TILE_ROWS, self.vocab_size], memory_config=dram)
            tiles = ttnn.to_layout(rows, ttnn.TILE_LAYOUT, memory_config=dram) if top_k else None
            best = None
        ids = ttnn.argmax(rows, dim=-1, keepdim=True, memory_config=dram)
        top = slice_top_k(tiles, top_k, self.share) if top_k else None
        return ids, best, rows, top

    def check_width(self, logits) -> None:
        """The logits' width per device against the share the argmax and top k index by (tt_surface.padded_vocab
        derives it where ModelArgs has no padded_vocab_size): one line naming the mismatch, not wrong ids."""
        width = logits.shape[-1]
        if (width != self.share) if self.split else (width < self.vocab_size):
            raise ValueError(f"TT-Transformers' LM head gives {width} logit columns per device where the backend "
                             f"expected {self.share if self.split else f'at least {self.vocab_size}'}: this "
                             "tt-metal pads the vocabulary another way (tt_surface.padded_vocab)")

    def device_mask(self):
        """0 over the vocabulary, -inf over the LM head's padded columns, split over the devices as the logits are."""
        mask = torch.zeros(1, 1, TILE_ROWS, self.share * self.num_devices)
        mask[..., self.vocab_size :] = float("-inf")
        mapper = ttnn.ShardTensor2dMesh(self.mesh, dims=(None, 3), mesh_shape=self.cluster_shape)
        return ttnn.from_torch(mask, dtype=ttnn.bfloat16, layout=ttnn.TILE_LAYOUT, device=self.mesh,
                               mesh_mapper=mapper)

    def read(self, tensor) -> torch.Tensor:
        """A traced output read back as [32, width]: on a split-vocabulary mesh the devices' parts side by side in
        device order, in one read (ConcatMeshToTensor); otherwise one device's copy."""
        rows = tensor.shape[-2]
        if self.split:
            composer = ttnn.ConcatMeshToTensor(self.mesh, dim=3)
            return ttnn.to_torch(tensor, mesh_composer=composer).reshape(rows, -1)
        return ttnn.to_torch(ttnn.get_device_tensors(tensor)[0]).reshape(rows, -1)

    def greedy(self, ids, best, rows: int) -> list[int]:
        """The greedy id of each of the first `rows` rows (the idle rows after them, at position -1, hold whatever the
        kernels left: never looked at, as TT ignores them): the device whose share holds the largest logit (the
        lowest id on ties, as argmax over the whole vocabulary), at its argmax."""
        ids = self.read(ids).long()[:rows]  # [rows, devices]: each device's argmax in its own share
        if best is None:
            return ids[:, 0].tolist()
        device = self.read(best).float()[:rows].argmax(dim=1)  # the first device on ties
        greedy = device * self.share + ids.gather(1, device.view(-1, 1)).view(-1)
        if (greedy >= self.vocab_size).any():
            raise RuntimeError("the device's argmax chose a padded vocabulary column: its mask did not hold")
        return greedy.tolist()

    def logits(self, logits, first_rows: dict, rows: int) -> torch.Tensor:
        """The logits of the first `rows` rows, from the smallest traced slice that holds them (a sampled step of a
        few rows reads a few rows, not the tile's 32 x the vocabulary: ~8 MB a step for Llama-3.1-8B)."""
        tensor = next((first_rows[r] for r in sorted(first_rows) if r >= rows), logits)
        return self.read(tensor).float()[:rows, : self.vocab_size]

    def top_k(self, top: list, k: int) -> list[list[int]]:
        """The k best ids per row from every device's slices' candidates (ids read as unsigned 16 bits: topk
        returns uint16 indices for widths below 65,536, topk_device_operation.cpp resolve_index_dtype)."""
        width = vocab_slices(self.share)[0]
        devices = self.num_devices if self.split else 1
        offsets = torch.arange(devices).view(1, devices, 1) * self.share
        values, ids = [], []
        for s, (slice_values, slice_ids) in enumerate(top):
            values.append(self.read(slice_values).float().view(TILE_ROWS, devices, -1)[:, :, :k])
            ids.append((self.read(slice_ids).long().view(TILE_ROWS, devices, -1)[:, :, :k] & 0xFFFF)
                       + offsets + s * width)
        values = torch.cat(values, dim=2).reshape(TILE_ROWS, -1)
        ids = torch.cat(ids, dim=2).reshape(TILE_ROWS, -1)
        values[ids >= self.vocab_size] = float("-inf")  # a padded column never stands for a token
        order = torch.argsort(ids, dim=1)  # ties to the lower id, then by value (stable sort keeps that order)
        values, ids = values.gather(1, order), ids.gather(1, order)
        best = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
        return ids.gather(1, best).tolist()


def slice_top_k(tiles, k: int, columns: int) -> list:
    """The top k of each row of a [1, 1, 32, >= columns] TILE tensor's first `columns` columns, per slice of the
    width trace_plan.vocab_slices picks (the last padded with -inf): [(values, indices) [1, 1, 32, k]] per slice,
    indices within the slice. On such widths ttnn.topk runs multi-core."""
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
