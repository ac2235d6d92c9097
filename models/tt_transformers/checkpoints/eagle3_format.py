# SPDX-License-Identifier: Apache-2.0
"""EAGLE-3 draft heads (arXiv 2503.01840) in the layouts engines load: their config, their tensors, read and checked
against the target, and written (the torch module: torch_backend/eagle3_head.py; on a TT device:
ttnn_backend/eagle3_head.py).

At position t the head reads the residual streams entering three of the target's layers (the taps; by default
(2, N/2, N-3), as vLLM), projects them to its width (`fc`), and runs one decoder layer whose attention reads
[input_layernorm(embedding of token t+1) ; hidden_norm(state)] (2h wide) with the state as the residual; its final
norm and its own LM head over the draft vocabulary give the token at t+2, mapped to the target's ids by d2t
(target id = draft id + d2t[draft id]). Drafting further feeds the layer's output (before the norm) back as the
state. The embedding is the target's unless the head ships one.

Two layouts, one HeadConfig (docs/draft_sources.md): the EAGLE authors' (config.json with `architectures:
["LlamaForCausalLMEagle3"]`, weights `midlayer.*`, in pytorch_model.bin or safetensors) and `speculators`' (config.json
with `speculators_config`, `transformer_layer_config`, `eagle_aux_hidden_state_layer_ids`, weights `layers.0.*`). A
folder or a hub id in the local Hugging Face cache; checked against the target before anything loads. Which head a
target drafts with (the one given, else the one shipped for its checkpoint): choose_draft_head, which the demo's checks
and the backends' CausalLM.draft_head (make_drafter's) both call.
"""
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
from loguru import logger

from ..errors import UserError
from .model_shape import ModelConfigError, ModelShape

AUTHORS_ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
DRAFT_HEADS = Path(__file__).resolve().parents[1] / "draft_heads"  # shipped heads, one folder per target name


class DraftHeadError(UserError):
    """A draft head cannot be used with this target; the message names the flag and the fix."""


def default_taps(n_layers: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layers (the input of each): (2, N/2, N-3)."""
    return (2, n_layers // 2, n_layers - 3)


@dataclass(frozen=True)
class HeadConfig:
    """What a head's config.json says, in one form for both layouts."""

    layout: str  # "eagle" (the authors') or "speculators"
    layer: ModelShape  # the head's decoder layer (n_layers 1); vocab_size is the target's
    draft_vocab_size: int
    taps: tuple[int, ...]  # target layers whose input the head reads, in fc's order
    target_hidden: int  # width of each tap
    norm_before_residual: bool = False  # the residual is hidden_norm(state) instead of the state
    norm_before_fc: bool = False  # one RMSNorm (input_norm) over the concatenated taps before fc
    fc_norm: bool = False  # an RMSNorm per tap (fc_norm.i) before fc
    norm_output: bool = False  # the state fed forward is the final norm's output, not the layer's

    OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # speculators' (defaults False)

    def to_json(self) -> dict:
        """config.json in speculators' layout (what vLLM and SGLang load)."""
        a = self.layer
        layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
                 "num_hidden_layers": 1, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
                 "head_dim": a.head_dim, "intermediate_size": a.hidden_dim, "vocab_size": a.vocab_size,
                 "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
                 "max_position_embeddings": a.max_position_embeddings, "hidden_act": "silu",
                 "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
        return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden, "eagle_aux_hidden_state_layer_ids": list(self.taps),
                **{option: getattr(self, option) for option in self.OPTIONS}}


def resolve_head_folder(value, flag: str = "--draft_head") -> Path:
    """A folder, or a hub id whose snapshot is in the local Hugging Face cache (as HF_MODEL)."""
    from .checkpoint import CheckpointError, _hub_snapshot

    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DraftHeadError(f"{flag} {str(value)!r} is a file; point it at the head's folder (config.json + "
                             f"{' or '.join(WEIGHT_FILES)})")
    if str(value).count("/") == 1 and not str(value).startswith((".", "/", "~")):
        try:
            return _hub_snapshot(str(value), flag)
        except CheckpointError as e:
            raise DraftHeadError(str(e)) from None
    raise DraftHeadError(f"{flag} {str(value)!r} does not exist; give the head's folder or a hub id already in the "
                         "local Hugging Face cache (huggingface-cli download <id>)")


def head_folder(draft_head, model_name: Optional[str], required: bool, flag: str = "draft_head",
                mode_flag: str = "draft_mode") -> Optional[Path]:
    """draft_head's folder: the folder or cached hub id given, or (None) the head shipped for the checkpoint named
    model_name (draft_heads/<model_name>); None where none ships, a one-line error where a head is required."""
    if draft_head is not None:
        return resolve_head_folder(draft_head, flag)
    shipped = DRAFT_HEADS / model_name if model_name else None
    if shipped is not None and (shipped / "config.json").is_file():
        return shipped
    if required:
        name = model_name or "a target of no known checkpoint"
        raise DraftHeadError(f"{mode_flag} head: no draft head ships for {name}; pass {flag} FOLDER (train one with "
                             f"`make train-draft-head ARGS='--model <checkpoint> --out FOLDER'`) or use {mode_flag} "
                             "suffix or hybrid")
    return None


class HeadChoice(NamedTuple):
    folder: Optional[Path]  # None: no head
    config: Optional["HeadConfig"]
    note: Optional[str] = None  # why the shipped head was passed over


def choose_draft_head(draft_head, model_name: Optional[str], target: ModelShape, target_layers: int,
                      taps_last_layer: bool, required: bool, flag: str = "draft_head", mode_flag: str = "draft_mode",
                      layers_flag: str = "the target's n_layers") -> HeadChoice:
    """The head a target drafts with, checked against it before any weights are read: head_folder's, its config
    (read_head_config: hidden size, vocabulary, taps) and its taps within the target_layers layers the target runs
    (taps_last_layer: whether its backend returns the last one's output, tap target_layers; a TT device's does not).
    The shipped head gives way (no head, and a note) to a target it cannot tap unless a head is required."""
    folder = head_folder(draft_head, model_name, required, flag, mode_flag)
    if folder is None:
        return HeadChoice(None, None)
    config = read_head_config(folder, target, flag)
    taps = list(config.taps)
    if max(taps) < target_layers or taps_last_layer and max(taps) == target_layers:
        return HeadChoice(folder, config)
    if draft_head is None and not required:
        return HeadChoice(None, None, f"The shipped draft head reads layers {taps}, which this target does not run: "
                                      "hybrid drafts with the draft model")
    subject = f"{flag} {folder}" if draft_head is not None else f"{mode_flag} head: the shipped head"
    if max(taps) > target_layers:
        raise DraftHeadError(f"{subject} reads layers {taps}, but {layers_flag} keeps {target_layers}; keep all "
                             f"{target.n_layers} layers or pass a {flag} for {target_layers} layers")
    raise DraftHeadError(f"{subject} reads the last layer's output (tap {target_layers}), which a target on a TT "
                         f"device does not capture; use a head whose taps are layers 0 to {target_layers - 1}, or the "
                         "torch backend")


def find_draft_head(draft_head, model_name: Optional[str], target: ModelShape, target_layers: int,
                    taps_last_layer: bool, required: bool) -> Optional[tuple["HeadConfig", dict]]:
    """choose_draft_head's head (the library's words), read and checked; None where there is none."""
    choice = choose_draft_head(draft_head, model_name, target, target_layers, taps_last_layer, required)
    if choice.note is not None:
        logger.info(choice.note)
    return None if choice.folder is None else (choice.config, read_head_weights(choice.folder, choice.config,
                                                                                "draft_head"))


def read_head_config(folder: Path, target: ModelShape, flag: str = "--draft_head") -> HeadConfig:
    """The head's config.json in either layout, checked against the target's ModelArgs."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise DraftHeadError(f"{flag} {folder} has no config.json; give the folder of an EAGLE-3 head (the EAGLE "
                             "authors' or speculators' layout; `make train-draft-head` writes one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftHeadError(f"{flag} {path} is not valid JSON ({e}); download or train the head again") from None
    if cfg.get("speculators_model_type") == "eagle3":
        layout, layer_cfg = "speculators", dict(cfg.get("transformer_layer_config") or {})
    elif AUTHORS_ARCHITECTURE in (cfg.get("architectures") or []):
        layout, layer_cfg = "eagle", {**cfg, "model_type": cfg.get("model_type", "llama")}
    else:
        kind = cfg.get("speculators_model_type") or (cfg.get("architectures") or ["no architecture"])[0]
        raise DraftHeadError(f"{flag} {folder}: config.json describes {kind!r}, not an EAGLE-3 head; give a head in "
                             f"the EAGLE authors' layout ({AUTHORS_ARCHITECTURE}) or speculators' "
                             "(speculators_model_type eagle3)")
    layer_cfg.setdefault("num_hidden_layers", 1)
    layer_cfg.setdefault("vocab_size", cfg.get("vocab_size", target.vocab_size))
    try:
        layer = ModelShape.from_hf_config(layer_cfg)
    except (ModelConfigError, KeyError) as e:
        raise DraftHeadError(f"{flag} {folder}: its layer config cannot be read ({e}); download the head again") from None
    made_for = (f"a head for another target; use the head published for this model or train one with "
                f"`make train-draft-head ARGS='--model ...'`")
    target_hidden = int(cfg.get("target_hidden_size") or layer.dim)
    if target_hidden != target.dim or layer.dim != target.dim:
        raise DraftHeadError(f"{flag} {folder}: the head reads hidden size {target_hidden} (its own {layer.dim}), but "
                             f"this target's is {target.dim}: {made_for}")
    if layer.vocab_size != target.vocab_size:
        raise DraftHeadError(f"{flag} {folder}: the head's vocabulary has {layer.vocab_size} tokens, this target's "
                             f"{target.vocab_size} (another tokenizer): {made_for}")
    # fc reads the taps in ascending layer order whatever order the list has: vLLM, sglang and speculators' capture
    # walks the layers and keeps those whose id is listed (vllm llama.py `if idx in self.aux_hidden_state_layers`,
    # sglang `layers_to_capture`), and speculators' trainer takes the last block as the deepest
    taps = tuple(sorted(int(i) for i in (cfg.get("eagle_aux_hidden_state_layer_ids")
                                         or default_taps(target.n_layers))))
    if not taps or any(not 0 <= i <= target.n_layers for i in taps):
        raise DraftHeadError(f"{flag} {folder}: eagle_aux_hidden_state_layer_ids {list(taps)} must be layers of this "
                             f"{target.n_layers}-layer target (0 to {target.n_layers}, the last layer's output): "
                             f"{made_for}")
    options = {option: bool(cfg.get(option, False)) for option in HeadConfig.OPTIONS}
    if options["norm_before_fc"] and options["fc_norm"]:
        raise DraftHeadError(f"{flag} {folder}: config.json sets both norm_before_fc and fc_norm, which exclude each "
                             "other (speculators); download the head again")
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
    if not 1 <= draft_vocab <= layer.vocab_size:
        raise DraftHeadError(f"{flag} {folder}: draft_vocab_size {draft_vocab} must be in [1, {layer.vocab_size}]")
    # a missing option is False, as speculators' Eagle3SpeculatorConfig (vLLM reads a missing norm_before_residual
    # in a speculators config as True; speculators always writes it)
    return HeadConfig(layout, layer, draft_vocab, taps, target_hidden, **options)


def random_head(target: ModelShape, seed: int = 0, std: Optional[float] = None, draft_vocab: Optional[int] = None,
                taps: Optional[Sequence[int]] = None, embed: bool = False, layout: str = "speculators",
                options: Optional[dict] = None, **layer) -> tuple[HeadConfig, dict]:
    """(HeadConfig, tensors under speculators' names) of a random EAGLE-3 head of the target's shape, for checks where
    no trained head is at hand (make tt-smoke, check-eagle3, tests): normal weights (std, else 1/sqrt(fan-in) as a
    trained layer's), norms near 1; draft_vocab: a random share of the target's ids (with d2t and t2d); taps: default
    vLLM's; options: HeadConfig's; layer: ModelShape fields of the head's layer that differ from the target's."""
    gen = torch.Generator().manual_seed(seed)
    draft_vocab = draft_vocab or target.vocab_size
    taps = tuple(taps or default_taps(target.n_layers))
    config = HeadConfig(layout, replace(target, n_layers=1, **layer), draft_vocab, taps, target.dim, **(options or {}))
    tensors = {}
    for name, shape in expected_shapes(config).items():
        raw = torch.randn(shape, generator=gen)
        if "norm" in name:
            tensors[name] = 1 + raw * std / 3 if std else 1 + 0.1 * raw
        else:
            tensors[name] = raw * std if std else raw / shape[-1] ** 0.5
    if draft_vocab < target.vocab_size:
        ids = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool)
        tensors["t2d"][ids] = True
    if embed:
        tensors["embed_tokens.weight"] = torch.randn(target.vocab_size, target.dim, generator=gen) * (std or 1.0)
    return config, tensors


def expected_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a head file (speculators' names) and its shape; d2t only with a draft vocabulary."""
    a, h = config.layer, config.layer.dim
    p = "layers.0."
    shapes = {"fc.weight": (h, len(config.taps) * config.target_hidden), "norm.weight": (h,),
              "lm_head.weight": (config.draft_vocab_size, h),
              p + "self_attn.q_proj.weight": (a.n_heads * a.head_dim, 2 * h),
              p + "self_attn.k_proj.weight": (a.n_kv_heads * a.head_dim, 2 * h),
              p + "self_attn.v_proj.weight": (a.n_kv_heads * a.head_dim, 2 * h),
              p + "self_attn.o_proj.weight": (h, a.n_heads * a.head_dim),
              p + "mlp.gate_proj.weight": (a.hidden_dim, h), p + "mlp.up_proj.weight": (a.hidden_dim, h),
              p + "mlp.down_proj.weight": (h, a.hidden_dim),
              p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,),
              p + "post_attention_layernorm.weight": (h,)}
    if config.draft_vocab_size < a.vocab_size:
        shapes["d2t"] = (config.draft_vocab_size,)
    if config.norm_before_fc:
        shapes["input_norm.weight"] = (len(config.taps) * config.target_hidden,)
    if config.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (config.target_hidden,) for i in range(len(config.taps))})
    return shapes


def read_head_weights(folder: Path, config: HeadConfig, flag: str = "--draft_head") -> dict[str, torch.Tensor]:
    """The head's tensors under speculators' names (the authors' `midlayer.` renamed `layers.0.`), checked."""
    files = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not files:
        raise DraftHeadError(f"{flag} {folder} has no {' or '.join(WEIGHT_FILES)}; download the head's weights too")
    try:
        if files[0].suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(files[0])
        else:
            weights = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip errors alike: the file is cut short or not a checkpoint
        raise DraftHeadError(f"{flag} {files[0]} cannot be read ({type(e).__name__}: {e}); it is corrupt or "
                             "incomplete: download or train the head again") from None
    weights = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
               for k, v in weights.items()}
    for name, shape in expected_shapes(config).items():
        got = tuple(weights[name].shape) if name in weights else None
        if got != shape:
            what = "missing" if got is None else f"{got}"
            fix = ("a head with a smaller draft vocabulary needs its d2t map; download the whole head" if name == "d2t"
                   else "the file does not match its config.json; download or train the head again")
            raise DraftHeadError(f"{flag} {folder}: {name} is {what}, expected {shape}: {fix}")
    embed = weights.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (config.layer.vocab_size, config.layer.dim):
        raise DraftHeadError(f"{flag} {folder}: embed_tokens.weight is {tuple(embed.shape)}, expected "
                             f"{(config.layer.vocab_size, config.layer.dim)}; download the head again")
    if "d2t" in weights:
        ids = torch.arange(config.draft_vocab_size) + weights["d2t"].long()
        if int(ids.min()) < 0 or int(ids.max()) >= config.layer.vocab_size:
            raise DraftHeadError(f"{flag} {folder}: d2t maps draft ids outside the target's vocabulary [0, "
                                 f"{config.layer.vocab_size}): a head for another tokenizer; use this model's head")
    return weights


def read_draft_head(value, target: ModelShape, flag: str = "--draft_head") -> tuple[HeadConfig, dict]:
    folder = resolve_head_folder(value, flag)
    config = read_head_config(folder, target, flag)
    return config, read_head_weights(folder, config, flag)


# our parameter -> the file's tensors (q/k/v and gate/up fused in that order), speculators' names
PARAMETERS = {"fc.weight": ["fc.weight"], "norm.weight": ["norm.weight"], "lm_head.weight": ["lm_head.weight"],
              "layer.input_layernorm.weight": ["layers.0.input_layernorm.weight"],
              "layer.hidden_norm.weight": ["layers.0.hidden_norm.weight"],
              "layer.ffn_norm.weight": ["layers.0.post_attention_layernorm.weight"],
              "layer.attention.wqkv.weight": [f"layers.0.self_attn.{x}_proj.weight" for x in "qkv"],
              "layer.attention.wo.weight": ["layers.0.self_attn.o_proj.weight"],
              "layer.feed_forward.w_gate_up.weight": ["layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"],
              "layer.feed_forward.w_down.weight": ["layers.0.mlp.down_proj.weight"]}


def parameter_names(config: HeadConfig) -> dict[str, list[str]]:
    """PARAMETERS and the options' norms (their names are the same in the file)."""
    extra = [name for name in expected_shapes(config) if name.startswith(("input_norm.", "fc_norm."))]
    return {**PARAMETERS, **{name: [name] for name in extra}}


def write_head(folder: Path, config: HeadConfig, tensors: dict, layout: str = "speculators",
               card: Optional[dict] = None) -> None:
    """A head's files as engines load them, written beside each other and moved into `folder` together: speculators'
    layout (config.json with speculators_config, model.safetensors with `layers.0.*`) or the EAGLE authors'
    (a Llama config.json with LlamaForCausalLMEagle3, pytorch_model.bin with `midlayer.*`); card.json when given
    (how it was trained and measured, with the weights' sha256 and parameter count)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = config.to_json()
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if layout == "eagle":
        layer = cfg.pop("transformer_layer_config")
        cfg.pop("speculators_model_type")
        cfg = {**layer, **cfg, "architectures": [AUTHORS_ARCHITECTURE]}
        weights = tmp / "pytorch_model.bin"
        torch.save({k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}, weights)
    else:
        cfg["speculators_config"] = {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                     "verifier": {"name_or_path": card.get("target") if card else None,
                                                  "architectures": ["LlamaForCausalLM"]}}
        weights = tmp / "model.safetensors"
        save_file(tensors, weights, metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if card is not None:
        card = {**card, "parameters": sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d")),
                "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
        (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def estimated_run_cost(config: HeadConfig, target: ModelShape) -> float:
    """One head run relative to a target decode step: the ratio of the weights each streams (fc, the layer and the
    draft LM head against every target layer and the whole LM head); the drafter measures the real ratio."""
    a = config.layer
    params = (len(config.taps) * config.target_hidden * a.dim + 2 * a.dim * a.head_dim * (a.n_heads + 2 * a.n_kv_heads)
              + a.n_heads * a.head_dim * a.dim + 3 * a.dim * a.hidden_dim + config.draft_vocab_size * a.dim)
    return params / target.weight_bytes_per_token(target.n_layers, 1)


