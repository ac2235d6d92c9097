# SPDX-License-Identifier: Apache-2.0
"""A checkpoint's weights into our Transformer, streamed layer by layer (on the bf16 CPU kernels, each linear packed a
chunk of rows at a time straight from its file)."""
from typing import Optional, Union

import torch
from loguru import logger
from torch import nn

from ..checkpoints.cache import cache_root
from ..checkpoints.checkpoint import Checkpoint, CheckpointError
from ..errors import UserError, check_bool, check_choice, check_instance, check_int, described
from ..checkpoints.model_shape import ModelShape
from ..checkpoints.safetensors_index import EMBEDDING, SafetensorsIndex, safetensors_files
from .cpu_isa import PATHS
from .cpu_kernels import load_cpu_kernels, packed_shape
from .model import Transformer, can_prepack

PACK_CHUNK_ROWS = 512  # rows read at a time when a weight is packed for the CPU kernels straight from its file


def read_packed(index: SafetensorsIndex, names: list[str], k: int, kernels) -> torch.Tensor:
    """The [rows, k] matrix made of tensors `names` stacked, packed for the CPU kernels a chunk of rows at a
    time: no unpacked copy of the whole matrix ever exists."""
    total = sum(index.rows(n) for n in names)
    packed = torch.empty(packed_shape(total, k), dtype=torch.bfloat16)
    chunk = torch.empty(PACK_CHUNK_ROWS, k, dtype=torch.bfloat16)
    row = 0
    for name in names:
        for start in range(0, index.rows(name), PACK_CHUNK_ROWS):
            rows = chunk[: min(PACK_CHUNK_ROWS, index.rows(name) - start)]
            index.read_into(name, rows, start)
            kernels.pack_rows_into(packed, row, rows)
            row += len(rows)
    return packed


def hf_tensor_names(args: ModelShape) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensors it is made of (q/k/v and gate/up are fused, in that order)."""
    names = {"tok_embeddings.weight": [EMBEDDING], "norm.weight": ["model.norm.weight"]}
    if not args.tie_word_embeddings:
        names["output.weight"] = ["lm_head.weight"]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        names.update({
            f"layers.{i}.attention.wqkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            f"layers.{i}.attention.wo.weight": [p + "self_attn.o_proj.weight"],
            f"layers.{i}.feed_forward.w_gate_up.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            f"layers.{i}.feed_forward.w_down.weight": [p + "mlp.down_proj.weight"],
            f"layers.{i}.attention_norm.weight": [p + "input_layernorm.weight"],
            f"layers.{i}.ffn_norm.weight": [p + "post_attention_layernorm.weight"],
        })
    return names


def _load_parameters(module: nn.Module, prefix: str, names: dict[str, list[str]], index: SafetensorsIndex,
                     dtype: torch.dtype, device: str, skip: tuple[str, ...] = ()) -> None:
    """Fill every parameter of `module` (built on the meta device) but those under `skip` from the checkpoint, fused
    parts read straight into their rows."""
    for local, meta in list(module.named_parameters()):
        if local.startswith(skip):
            continue
        out = torch.empty(meta.shape, dtype=dtype, device=device)
        row = 0
        for part in names[prefix + local]:
            rows = index.rows(part) if out.dim() > 1 else out.shape[0]
            index.read_into(part, out[row : row + rows])
            row += rows
        if row != out.shape[0]:
            raise CheckpointError(f"tensors {names[prefix + local]} give {row} rows for {prefix + local}, config.json "
                                  f"implies {out.shape[0]}")
        owner, _, attr = local.rpartition(".")
        setattr(module.get_submodule(owner), attr, nn.Parameter(out, requires_grad=False))


DTYPES = (torch.bfloat16, torch.float32)  # what the Transformer runs (bf16 on the CPU kernels)


def check_load_arguments(args: ModelShape, dtype, max_seq_len, device, cpu_kernels, n_layers) -> None:
    """load_model's arguments, before anything is read: each of the right type and within what the model allows."""
    if dtype not in DTYPES:
        raise UserError(f"dtype must be torch.bfloat16 or torch.float32, got {described(dtype)}", "dtype")
    check_int("max_seq_len", max_seq_len, 2, fix="positions of prompt and answer together")
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise UserError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {described(device)}", "device") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r}: torch sees no CUDA device here; use 'cpu'", "device")
    if isinstance(cpu_kernels, str):
        check_choice("cpu_kernels", cpu_kernels, [p.name for p in PATHS])
    else:
        check_bool("cpu_kernels", cpu_kernels)
    if n_layers is not None:
        check_int("n_layers", n_layers, 0, args.n_layers, fix="0: the embedding, final norm and LM head alone")


def check_vocabulary(ckpt: Checkpoint, args: ModelShape, index: SafetensorsIndex, names: dict) -> None:
    """config.json's vocab_size and hidden_size against the embedding and LM head in the weights, which the CPU
    kernels pack from the file as it is: a config that disagrees is named here, not in a kernel at the first step."""
    tensors = names["tok_embeddings.weight"] + names.get("output.weight", [])
    for name in tensors:
        path, _, _, shape = index.entries[name]
        if tuple(shape) != (args.vocab_size, args.dim):
            raise CheckpointError(f"{ckpt.folder / 'config.json'} says vocab_size {args.vocab_size:,} and hidden_size "
                                  f"{args.dim:,}, but {path.name}'s {name} is {list(shape)}; fix config.json or "
                                  "download the checkpoint again")


def load_model(ckpt: Checkpoint, dtype: torch.dtype, max_seq_len: int, device: str = "cpu",
               cpu_kernels: Union[bool, str] = True, n_layers: Optional[int] = None) -> Transformer:
    """Our Transformer with the checkpoint's weights; bf16 on CPU runs on the bf16 CPU kernels where they build
    (cpu_kernels: a path name of cpu_isa.PATHS to run that one; False or TT_CPU_KERNELS=0: torch ops, with
    oneDNN-prepacked linears where the CPU has them). n_layers: load only the first n layers (0: the embedding,
    final norm and LM head).

    Streams: one layer at a time is read (tensor by tensor, from whichever shards hold it), converted, fused and
    packed before the next; on the kernels every linear layer is packed a chunk of rows at a time straight from
    the file. Peak memory stays close to the finished model's (tests/checkpoints/test_checkpoint_memory.py).

    Raises:
        UserError: an argument of the wrong type or out of range (check_load_arguments), a checkpoint that is
            incomplete or whose config.json disagrees with its weights (CheckpointError).
    """
    check_instance("ckpt", ckpt, Checkpoint, "find one with resolve_checkpoint(folder, .gguf file or hub id)")
    args = ModelShape.from_hf_config(ckpt.config)
    check_load_arguments(args, dtype, max_seq_len, device, cpu_kernels, n_layers)
    index = SafetensorsIndex(safetensors_files(ckpt.folder))
    names = hf_tensor_names(args)
    missing = [n for parts in names.values() for n in parts if n not in index.entries]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.folder} is missing tensor {missing[0]!r}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; is it a complete "
                              f"{args.model_type} checkpoint?")
    check_vocabulary(ckpt, args, index, names)
    with torch.device("meta"):
        model = Transformer(args, dtype, max_seq_len)
    if n_layers is not None:
        model.layers = model.layers[:n_layers]
    kernels = (load_cpu_kernels(cache_root() / "kernels", cpu_kernels if isinstance(cpu_kernels, str) else None)
               if cpu_kernels and model.supports_cpu_kernels(device) else None)
    prepack = kernels is None and can_prepack(dtype, device)
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}."
        if kernels is None:
            _load_parameters(layer, prefix, names, index, dtype, device)
            if prepack:
                layer.prepack_linears()
        else:  # norms first: use_cpu_kernels checks the block's weights
            _load_parameters(layer, prefix, names, index, dtype, device, skip=layer.LINEARS)
            layer.use_cpu_kernels(kernels, {name: read_packed(index, names[f"{prefix}{name}.weight"],
                                                                    layer.get_submodule(name).in_features, kernels)
                                            for name in layer.LINEARS})
    tied = args.tie_word_embeddings
    if kernels is not None:  # the head packed from the file; a tied embedding reads its rows from it
        model.use_cpu_kernels_for_head(kernels, read_packed(index, names["tok_embeddings.weight" if tied else
                                                                        "output.weight"], args.dim, kernels))
    loaded = ["norm"] + ([] if kernels is not None and tied else ["tok_embeddings"]) + ([] if tied or kernels else
                                                                                        ["output"])
    for name in loaded:
        _load_parameters(getattr(model, name), f"{name}.", names, index, dtype, device)
    if tied and kernels is None:
        model.output.weight = model.tok_embeddings.weight
    model.init_rope(device)
    model.checkpoint = ckpt
    logger.info(f"{ckpt.name} in {str(dtype).removeprefix('torch.')} on {device}: " + (
        f"the bf16 CPU kernels ({kernels.path.name})" if kernels else
        "torch ops, oneDNN-prepacked bf16 linears" if prepack else "torch ops"))
    return model.eval()
