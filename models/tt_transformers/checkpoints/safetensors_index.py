# SPDX-License-Identifier: Apache-2.0
"""Safetensors checkpoints read tensor by tensor from their file headers (sharded or not), and the token embedding
alone (what a draft head on a TT device looks its fed tokens up in)."""
import json
from pathlib import Path

import torch

from .checkpoint import Checkpoint, CheckpointError, safetensors_files

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class SafetensorsIndex:
    """Where each tensor of a (possibly sharded) safetensors checkpoint lives, from the file headers alone.

    Tensors are read one at a time with plain file reads straight into their destination, not through a memory
    map: mapped pages would stay resident for as long as a shard is open, and the point is to hold no more than
    the model being built plus one tensor.
    """

    def __init__(self, files: list[Path]):
        self.entries: dict[str, tuple[Path, int, str, list[int]]] = {}  # name -> (file, byte offset, dtype, shape)
        for f in files:
            size = f.stat().st_size
            broken = CheckpointError(f"{f} is corrupt or incomplete (a safetensors file cut short or damaged): "
                                     "download or convert it again")
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 + n:
                    raise broken
                try:
                    header = json.loads(fh.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise broken from None
            header.pop("__metadata__", None)
            for name, e in header.items():
                if 8 + n + e["data_offsets"][1] > size:
                    raise broken
                self.entries[name] = (f, 8 + n + e["data_offsets"][0], e["dtype"], e["shape"])

    def rows(self, name: str) -> int:
        return self.entries[name][3][0]

    def read_into(self, name: str, out: torch.Tensor, row0: int = 0) -> None:
        """Read rows [row0, row0 + len(out)) of tensor `name` into `out` (all of it by default), converting dtype
        and device if they differ."""
        path, offset, dtype, shape = self.entries[name]
        if tuple(shape[1:]) != tuple(out.shape[1:]) or row0 + out.shape[0] > shape[0] or (
                not shape[1:] and out.shape[0] != shape[0]):
            raise CheckpointError(f"{path.name}: tensor {name!r} has shape {tuple(shape)}, but config.json implies "
                                  f"{tuple(out.shape)}")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name!r} is {dtype}; only {', '.join(SAFETENSORS_DTYPES)} "
                                  "weights are read")
        src = SAFETENSORS_DTYPES[dtype]
        direct = src == out.dtype and out.device.type == "cpu" and out.is_contiguous()
        buffer = out if direct else torch.empty(out.shape, dtype=src)
        with open(path, "rb") as fh:
            fh.seek(offset + row0 * buffer[0].numel() * src.itemsize if out.dim() > 1 else offset)
            view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
            if fh.readinto(view) != len(view):
                raise CheckpointError(f"{path.name} ends inside tensor {name!r}: the file is truncated")
        if not direct:
            out.copy_(buffer)


EMBEDDING = "model.embed_tokens.weight"


def read_embedding(ckpt: Checkpoint, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The token embedding [vocab, dim] alone: what a draft head on a TT device looks its fed tokens up in."""
    index = SafetensorsIndex(safetensors_files(ckpt.folder))
    name = EMBEDDING
    if name not in index.entries:
        raise CheckpointError(f"checkpoint {ckpt.folder} is missing tensor {name!r}; is it a complete checkpoint?")
    out = torch.empty(index.entries[name][3], dtype=dtype)
    index.read_into(name, out)
    return out
