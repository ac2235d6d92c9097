# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding demo, in the shape of TT-Transformers' simple_text_demo.

    pytest models/tt_transformers/demo/speculative_decoding/speculative_demo.py::test_speculative_demo \
        --n_draft_tokens 4 --draft_layers 8
    python models/tt_transformers/demo/speculative_decoding/speculative_demo.py --n_draft_tokens 4 --draft_layers 8

With no flags it runs the embedded default model (SmolLM2-135M-Instruct) on the sample_prompts.json beside this
file; HF_MODEL (or --model) points at a local Llama/Mistral checkpoint folder, a GGUF file, or a hub id already in
the local Hugging Face cache.
"""
import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # `python path/to/speculative_demo.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from loguru import logger

from models.tt_transformers.demo.speculative_decoding.speculative_generator import (
    SpeculativeGenerator,
    UserResult,
    check_n_draft_tokens,
)
from models.tt_transformers.speculative.drafters import DEFAULT_SA_THRESHOLD
from models.tt_transformers.speculative.sampling import SamplingParams
from models.tt_transformers.torch_backend.device import DEVICES

PACKAGE_ROOT = Path(__file__).resolve().parents[4]  # the folder holding models/: the repository, or site-packages
DEFAULT_PROMPTS = Path(__file__).resolve().with_name("sample_prompts.json")  # beside the demo, as TT demos keep them
SUPPORTED_BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # as TT-Transformers demos
DRAFT_MODES = ("model", "suffix", "head", "hybrid")
DRAFT_HEADS = Path(__file__).resolve().parents[2] / "draft_heads"  # shipped heads, one folder per target name
BACKENDS = ("auto", "torch", "ttnn")
MAX_RECYCLE_TOP_K = 32  # ttnn.topk's default k; more is never worth a tree row
MAX_CORPUS_TOKENS = 1_000_000  # about 600 MB of suffix automaton
# The weights' dtype per backend, the default first: on ttnn bfloat8_b, what tt-metal's text demo runs
# (simple_text_demo.py -> create_tt_model(dtype=ttnn.bfloat8_b)): an 8B model's LM head alone is ~1 GB in bf16.
DTYPES = {"torch": ("bfloat16", "float32"), "ttnn": ("bfloat8_b", "bfloat16")}
# TT-Transformers' decoder precision presets (tt/model_config.py, DecodersPrecision.performance / .accuracy);
# tt-metal's text demo runs performance unless told otherwise. (Its demo conftest's own --optimizations takes a
# decoder-config string, so ours has another name.)
PRECISIONS = ("performance", "accuracy")

# (name, type, default, help): the pytest options (root conftest.py) and the CLI flags come from this one table.
DEMO_OPTIONS = [
    ("input_prompts", str, str(DEFAULT_PROMPTS), "prompts file: JSON list of {\"prompt\": ...} or JSON Lines (a "
                                                 "relative path is tried from the working directory, then from the "
                                                 "folder holding models/)"),
    ("instruct", int, 1, "1: wrap prompts in the tokenizer's chat template"),
    ("max_seq_len", int, 1024, "maximum context (prompt + generated tokens) per user"),
    ("batch_size", int, 1, "users decoded together (1, 2, 4, 8, 16, 32)"),
    ("max_generated_tokens", int, 128, "tokens to generate per user"),
    ("stop_at_eos", int, 1, "1: stop a user at the end-of-sequence token"),
    ("n_draft_tokens", int, 4, "draft tokens verified per target forward; 0 = plain decoding"),
    ("draft_mode", str, "hybrid", "model: draft model only; suffix: copied drafts only (no model); head: the "
                                  "trained draft head only; hybrid: per step, the copied draft or the head's (the "
                                  "draft model's where no head is given or shipped), whichever is expected to bring "
                                  "more accepted tokens"),
    ("sa_threshold", int, DEFAULT_SA_THRESHOLD, "minimum match length (tokens) a copied draft may start from"),
    ("draft_memory", int, 65536, "tokens of earlier responses kept to draft from (cross-request memory); 0 = off"),
    ("draft_corpus", str, None, "a text file to draft from as well (logs, a code base): a static corpus"),
    ("recycle_top_k", int, 4, "the target's top next tokens kept per token to draft from (token recycling); 0 = off"),
    ("draft_trees", int, 1, "1: verify token trees (several candidates at once) where the backend can"),
    ("draft_head", str, None, "EAGLE-3 draft head: a folder or hub id (the EAGLE authors' or speculators' layout); "
                              "default: the one shipped for the target in models/tt_transformers/draft_heads/<model>"),
    ("draft_layers", int, 8, "layers of the target used as the draft model (weights shared)"),
    ("target_layers", int, None, "truncate the target to its first N layers (default: all)"),
    ("draft_model", str, None, "separate draft checkpoint (folder or .gguf) with the same tokenizer"),
    ("temperature", float, 0.0, "sampling temperature; 0 = greedy (output identical to plain greedy decoding)"),
    ("top_k", int, 0, "sample from the k most likely tokens only; 0 = off"),
    ("top_p", float, 1.0, "sample from the smallest set of tokens with this much probability; 1 = off"),
    ("seed", int, None, "random seed for sampling: a seeded run is reproducible"),
    ("compare_baseline", int, 1, "1: also run plain decoding, check identical tokens and report the speedup"),
    ("output_json", str, None, "write a JSON report here"),
    ("model", str, None, "target checkpoint folder or .gguf file (default: HF_MODEL, else the embedded model)"),
    ("dtype", str, None, "weights: torch bfloat16 (default) or float32; ttnn bfloat8_b (default, as tt-metal's "
                         "text demo) or bfloat16"),
    ("precision", str, "performance", "ttnn: TT-Transformers' decoder precision preset, performance (bfp4 MLP, LoFi; "
                                      "tt-metal's text demo default) or accuracy"),
    ("device", str, "auto", "torch device: auto (the faster of cpu and cuda for this model, logged), cpu or cuda"),
    ("backend", str, "auto", "torch, ttnn (a Tenstorrent mesh through TT-Transformers) or auto: ttnn when "
                             "MESH_DEVICE is set"),
    ("enable_trace", int, 1, "ttnn: 1 traces every decode step and draft-head replay (as TT's demos' enable_trace); 0 "
                             "runs them op by op (slower; a failure names the op, not the trace). The CLI also takes "
                             "--trace (pytest's own --trace is its debugger)"),
]


def add_demo_options(parser) -> None:
    """Register the demo's pytest options (read as getoption(...) or default). Inside a tt-metal checkout, tt-metal's
    models/tt_transformers/demo/conftest.py has already registered the ones TT demos share (--input_prompts,
    --max_seq_len, --batch_size, ...), and pytest refuses a second registration ("option names ... already
    added"): theirs are kept, read the same way."""
    for name, type_, _, help_ in DEMO_OPTIONS:
        try:
            parser.addoption(f"--{name}", action="store", type=type_, default=None, help=help_)
        except ValueError as e:
            if "already added" not in str(e):
                raise


class DemoInputError(ValueError):
    """Bad demo input; the message names the problem and the fix."""


# The demo's settings, one field per option, with the same defaults.
DemoConfig = make_dataclass("DemoConfig", [(name, Optional[type_], field(default=default))
                                           for name, type_, default, _ in DEMO_OPTIONS])


def find_prompts_file(path: str) -> Path:
    """The documented `--input_prompts models/tt_transformers/demo/...` works from the working directory (the
    repository or a tt-metal checkout) and, failing that, from the folder that holds our models/ package."""
    p = Path(path).expanduser()
    if not p.is_file() and not p.is_absolute() and (PACKAGE_ROOT / p).is_file():
        return PACKAGE_ROOT / p
    if p.is_dir():
        raise DemoInputError(f"--input_prompts {path!r} is a directory; pass a JSON or JSON Lines prompts file in it")
    if not p.is_file():
        raise DemoInputError(f"--input_prompts {path!r} does not exist; pass a JSON or JSON Lines prompts file "
                             f"(default: {DEFAULT_PROMPTS})")
    return p


def load_prompts(path: str) -> list[str]:
    """TT format (a JSON list of {"prompt": ...}) or JSON Lines with a "prompt" field (one line is one object)."""
    p = find_prompts_file(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DemoInputError(f"--input_prompts {path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    example = '[{"prompt": "..."}] or one {"prompt": "..."} per line'
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DemoInputError(f"--input_prompts {path}: neither JSON nor JSON Lines (line {number}: {e.msg} at "
                                     f"column {e.colno}); expected {example}") from None
    if isinstance(entries, dict):
        entries = [entries]  # JSON Lines with a single line
    if not isinstance(entries, list) or not entries:
        raise DemoInputError(f"--input_prompts {path}: holds no prompts; expected a non-empty {example}")
    prompts = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("prompt"), str):
            raise DemoInputError(f"--input_prompts {path}: entry {i} has no string \"prompt\" field; expected "
                                 f"{example}")
        if not e["prompt"].strip():
            raise DemoInputError(f"--input_prompts {path}: entry {i} has an empty prompt; give it some text or "
                                 "remove it")
        prompts.append(e["prompt"])
    return prompts


def split_batches(n_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices per batch; the last batch is filled by repeating prompts, as TT demos do."""
    if batch_size not in SUPPORTED_BATCH_SIZES:
        raise DemoInputError(f"--batch_size {batch_size} is not supported; use one of {SUPPORTED_BATCH_SIZES}")
    n_batches = -(-n_prompts // batch_size)
    return [[(b * batch_size + i) % n_prompts for i in range(batch_size)] for b in range(n_batches)]


def encode(tokenizer, prompt: str, instruct: bool) -> list[int]:
    if instruct and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"])
    return tokenizer(prompt).input_ids


def draft_memory(config: DemoConfig, tokenizer):
    """--draft_memory and --draft_corpus as a DraftMemory (None when both are off)."""
    from models.tt_transformers.speculative.draft_memory import DraftMemory

    corpus = []
    if config.draft_corpus is not None:
        corpus = [tokenizer(Path(config.draft_corpus).read_text(errors="replace"), add_special_tokens=False).input_ids]
        if len(corpus[0]) > MAX_CORPUS_TOKENS:
            raise DemoInputError(f"--draft_corpus {config.draft_corpus} has {len(corpus[0]):,} tokens, more than "
                                 f"{MAX_CORPUS_TOKENS:,}; pass the part that the requests will repeat")
    if config.draft_memory == 0 and not corpus:
        return None
    return DraftMemory(config.draft_memory, corpus)


def eos_token_ids(ckpt, tokenizer) -> list[int]:
    """Every id that ends a response: config.json's and generation_config.json's, and the tokenizer's."""
    return sorted(set(ckpt.eos_token_ids) | {tokenizer.eos_token_id} - {None})


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise DemoInputError(f"draft model {draft_name!r} has a different tokenizer from the target "
                             f"(vocabularies differ); speculative decoding needs one shared vocabulary")


def backend_of(config: DemoConfig) -> str:
    """--backend, where auto means ttnn when MESH_DEVICE names a Tenstorrent mesh (as TT users set it)."""
    if config.backend not in BACKENDS:
        raise DemoInputError(f"--backend {config.backend!r} is not one of {', '.join(BACKENDS)}")
    if config.backend == "auto":
        return "ttnn" if os.environ.get("MESH_DEVICE") else "torch"
    return config.backend


def dtype_of(config: DemoConfig) -> str:
    """--dtype, or the backend's default."""
    return config.dtype or DTYPES[backend_of(config)][0]


def check_writable(flag: str, path: str) -> None:
    """A file the run will write, checked before anything runs (so a long run does not end in a traceback)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DemoInputError(f"--{flag} {path!r} is a directory; give a file path")
    folder = p.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise DemoInputError(f"--{flag} {path!r} cannot be written ({folder} is not a folder you can write in); "
                             "pass a path in one")


def check_flags(config: DemoConfig, backend: str) -> None:
    """Every flag that can be checked before anything loads."""
    if backend == "ttnn" and importlib.util.find_spec("ttnn") is None:
        raise DemoInputError("the ttnn backend (--backend ttnn, or MESH_DEVICE set) needs tt-metal v0.81.1's Python "
                             "environment (ttnn 0.81.1) and a Tenstorrent device: see README.md, 'On a Tenstorrent "
                             "machine'; on this machine use --backend torch (and unset MESH_DEVICE)")
    if config.output_json is not None:
        check_writable("output_json", config.output_json)
    if config.precision not in PRECISIONS:
        raise DemoInputError(f"--precision {config.precision!r} is not one of {', '.join(PRECISIONS)}")
    if config.dtype is not None and config.dtype not in DTYPES[backend]:
        raise DemoInputError(f"--dtype {config.dtype!r} is not supported on the {backend} backend; use "
                             f"{' or '.join(DTYPES[backend])}")
    check_n_draft_tokens(config.n_draft_tokens)
    sampling_params(config)
    if config.draft_mode not in DRAFT_MODES:
        raise DemoInputError(f"--draft_mode {config.draft_mode!r} is not one of {', '.join(DRAFT_MODES)}")
    if config.sa_threshold < 1:
        raise DemoInputError(f"--sa_threshold must be >= 1 (tokens of matched suffix), got {config.sa_threshold}")
    for flag, value in (("draft_memory", config.draft_memory), ("recycle_top_k", config.recycle_top_k)):
        if value < 0:
            raise DemoInputError(f"--{flag} must be >= 0 (0 turns it off), got {value}")
    if config.recycle_top_k > MAX_RECYCLE_TOP_K:
        raise DemoInputError(f"--recycle_top_k {config.recycle_top_k} is more than {MAX_RECYCLE_TOP_K}; lower it")
    if config.draft_head is not None and config.draft_mode not in ("head", "hybrid"):
        raise DemoInputError(f"--draft_head is read only by --draft_mode head or hybrid, not {config.draft_mode!r}; "
                             "drop --draft_head or pick one of those modes")
    if config.draft_corpus is not None and not Path(config.draft_corpus).is_file():
        raise DemoInputError(f"--draft_corpus {config.draft_corpus!r} does not exist; pass a text file")
    if config.max_generated_tokens < 1:
        raise DemoInputError(f"--max_generated_tokens must be >= 1, got {config.max_generated_tokens}")
    if config.target_layers is not None and config.target_layers < 1:
        raise DemoInputError(f"--target_layers must be >= 1, got {config.target_layers}")
    if config.max_seq_len < 2:
        raise DemoInputError(f"--max_seq_len must be >= 2, got {config.max_seq_len}")
    if config.device not in DEVICES:
        raise DemoInputError(f"--device {config.device!r} is not one of {', '.join(DEVICES)}")
    if config.enable_trace not in (0, 1):
        raise DemoInputError(f"--enable_trace {config.enable_trace} is not 0 or 1 (1: traced steps, 0: eager)")


def available_memory_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    meminfo = Path("/proc/meminfo")
    for line in meminfo.read_text().splitlines() if meminfo.is_file() else []:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_cache_fits(config: DemoConfig, args, target_layers: int, backend: str) -> None:
    """--max_seq_len within the model's context length, and (torch) its KV cache within this machine's free memory,
    checked before anything is allocated."""
    if config.max_seq_len > args.max_position_embeddings:
        raise DemoInputError(f"--max_seq_len {config.max_seq_len:,} is longer than the model's context "
                             f"({args.max_position_embeddings:,} positions); use at most that")
    if backend != "torch":
        return  # the device's cache is paged in its own DRAM
    element_bytes = 4 if dtype_of(config) == "float32" else 2
    per_position = 2 * target_layers * args.n_kv_heads * args.head_dim * config.batch_size * element_bytes  # K and V
    free = available_memory_bytes()
    if free is not None and per_position * config.max_seq_len > free:
        raise DemoInputError(f"--max_seq_len {config.max_seq_len:,}: its KV cache ({per_position * config.max_seq_len / 2**30:.1f} "
                             f"GiB for batch {config.batch_size}) does not fit this machine's "
                             f"{free / 2**30:.1f} GiB of free memory; use at most {free // per_position:,}")


def draft_head_folder(config: DemoConfig, model_name: str) -> Optional[Path]:
    """The draft head the run uses: --draft_head (a folder or a hub id in the local cache), else the one shipped for
    the target, else None (--draft_mode head then fails with the fix)."""
    from models.tt_transformers.torch_backend.draft_head import DraftHeadError, resolve_head_folder

    if config.n_draft_tokens == 0 or config.draft_mode not in ("head", "hybrid"):
        return None
    if config.draft_head is not None:
        try:
            return resolve_head_folder(config.draft_head)
        except DraftHeadError as e:
            raise DemoInputError(str(e)) from None
    shipped = DRAFT_HEADS / model_name
    if (shipped / "config.json").is_file() and config.draft_model is None:
        return shipped
    if config.draft_mode == "head":
        raise DemoInputError(f"--draft_mode head: no draft head ships for {model_name}; pass --draft_head FOLDER "
                             "(train one with `make train-draft-head ARGS='--model <checkpoint> --out FOLDER'`) or "
                             "use --draft_mode suffix or hybrid")
    return None


def torch_loader(config: DemoConfig, args):
    """(checkpoint, layers) -> a TorchCausalLM, on the device --device picks for this model."""
    import torch

    from models.tt_transformers.torch_backend.checkpoint import cache_root, load_model
    from models.tt_transformers.torch_backend.cpu_kernels import kernels_fit, load_cpu_kernels
    from models.tt_transformers.torch_backend.device import choose_device
    from models.tt_transformers.torch_backend.generator import TorchCausalLM

    dtype = getattr(torch, dtype_of(config))
    choice = choose_device(config.device, args, dtype,
                           kernels_fit(args, dtype) and load_cpu_kernels(cache_root() / "kernels") is not None,
                           torch.cuda.is_available())
    logger.info(f"Device {choice.device}: {choice.reason}")

    def load(ckpt, n_layers):
        model = load_model(ckpt, dtype, config.max_seq_len, choice.device)
        return TorchCausalLM(model, n_layers or model.args.n_layers, config.batch_size)
    return load


def ttnn_loader(config: DemoConfig, mesh_device):
    """(checkpoint, layers) -> a TtnnCausalLM: TT-Transformers on the mesh device."""
    import ttnn

    from models.tt_transformers.ttnn_backend.generator import TtnnCausalLM
    from models.tt_transformers.ttnn_backend.model import build_tt_model

    def load(ckpt, n_layers):
        tt = build_tt_model(mesh_device, ckpt.folder, ckpt.name, config.batch_size, config.max_seq_len,
                            bool(config.instruct), n_layers, weights_dtype=getattr(ttnn, dtype_of(config)),
                            optimizations=config.precision)
        return TtnnCausalLM(tt, config.batch_size, config.max_seq_len, trace=bool(config.enable_trace))
    return load


def head_taps(folder: Path, args) -> tuple[int, ...]:
    """The target layers a draft head reads (its config.json), or the flag's one-line error."""
    from models.tt_transformers.torch_backend.draft_head import DraftHeadError, read_head_config

    try:
        return read_head_config(folder, args).taps
    except DraftHeadError as e:
        raise DemoInputError(str(e)) from None


def trace_region_size(config: DemoConfig, shape: tuple[int, int]) -> int:
    """The trace region a ttnn run on a mesh of this shape needs: every decode trace of the target, of the draft model
    and of a draft head (ttnn_backend/trace_plan.py), for the draft mode's most demanding choice (hybrid: recycling's
    top k, a head's taps and traces and a draft model's traces all counted)."""
    from models.tt_transformers.torch_backend.checkpoint import resolve_checkpoint
    from models.tt_transformers.torch_backend.model_config import ModelArgs
    from models.tt_transformers.ttnn_backend.model import TILE_ROWS
    from models.tt_transformers.ttnn_backend.trace_plan import (
        device_names_for,
        head_region_bytes,
        model_trace_bytes,
        region_bytes,
    )

    ckpt = resolve_checkpoint(config.model, "--model" if config.model else "HF_MODEL")
    args = ModelArgs.from_hf_config(ckpt.config)
    device, n_devices = device_names_for(shape, os.environ.get("MESH_DEVICE")), shape[0] * shape[1]
    drafting = config.n_draft_tokens > 0
    top_k = config.recycle_top_k if drafting and config.draft_mode in ("suffix", "hybrid") else 0
    head = draft_head_folder(config, ckpt.name)
    taps = head_taps(head, args) if head is not None else ()
    target_layers = config.target_layers or args.n_layers
    traces = model_trace_bytes(ckpt.name, device, n_devices, args.n_layers, target_layers, args.vocab_size,
                               config.n_draft_tokens + 1, top_k, taps)
    if taps:
        traces += head_region_bytes(ckpt.name, device, args.n_layers, config.n_draft_tokens)
    if drafting and config.draft_mode in ("model", "hybrid"):  # a draft steps up to a whole tile per user
        draft = resolve_checkpoint(config.draft_model, "--draft_model") if config.draft_model else ckpt
        draft_args = ModelArgs.from_hf_config(draft.config)
        layers = draft_args.n_layers if config.draft_model else min(config.draft_layers, target_layers)
        traces += model_trace_bytes(draft.name, device, n_devices, draft_args.n_layers, layers, draft_args.vocab_size,
                                    TILE_ROWS, 0, ())
    return region_bytes(traces)


class ModelPool:
    """The models runs build, kept so that a later run with the same settings reuses them (the perf test runs
    several draft modes on one 8B target: building it again would put a second copy in the device's DRAM) and
    released together when the pool closes (a TT model's traces hold the trace region until released)."""

    def __init__(self):
        self.models: dict = {}

    def get(self, key: tuple, make):
        if key not in self.models:
            self.models[key] = make()
        return self.models[key]

    def close(self) -> None:
        import gc

        for lm in self.models.values():
            lm.release()
        self.models.clear()
        gc.collect()  # device tensors are freed when their last reference goes


def build(config: DemoConfig, mesh_device=None, pool: Optional[ModelPool] = None):
    """Validate every flag first, then load target, draft and tokenizer on the torch or ttnn backend (ttnn: on
    `mesh_device`); models come from `pool` when an earlier run built them with the same settings. Returns the
    checkpoint, tokenizer, target, drafter, draft model (None without one), prompts, their tokens and the EOS ids."""
    from models.tt_transformers.speculative.drafters import HybridDrafter, ModelDrafter, SuffixDrafter
    from models.tt_transformers.torch_backend.checkpoint import load_tokenizer, resolve_checkpoint
    from models.tt_transformers.torch_backend.draft_head import DraftHeadError, read_draft_head
    from models.tt_transformers.torch_backend.model_config import ModelArgs

    backend = backend_of(config)
    check_flags(config, backend)
    prompts = load_prompts(config.input_prompts)
    split_batches(len(prompts), config.batch_size)  # validates --batch_size before any loading

    ckpt = resolve_checkpoint(config.model, "--model" if config.model else "HF_MODEL")
    args = ModelArgs.from_hf_config(ckpt.config)
    target_layers = config.target_layers or args.n_layers
    if not 1 <= target_layers <= args.n_layers:
        raise DemoInputError(f"--target_layers {target_layers} is out of range: {ckpt.name} has {args.n_layers} "
                             f"layers; use 1 to {args.n_layers}, or leave it unset for all of them")
    head_folder = draft_head_folder(config, ckpt.name)
    try:
        head_weights = read_draft_head(head_folder, args) if head_folder is not None else None  # (config, tensors)
    except DraftHeadError as e:
        raise DemoInputError(str(e)) from None
    taps = head_weights[0].taps if head_weights is not None else ()
    unusable = taps and (max(taps) > target_layers or backend == "ttnn" and max(taps) == target_layers)
    if unusable and config.draft_head is None and config.draft_mode == "hybrid":
        # the shipped head is for the whole model: a truncated target's hybrid drafts with the draft model instead
        logger.info(f"The shipped draft head reads layers {list(taps)}, which this target does not run: hybrid "
                    "drafts with the draft model")
        head_weights, taps = None, ()
    if taps and max(taps) > target_layers:
        raise DemoInputError(f"--draft_head {head_folder}: it reads layers {list(taps)}, but --target_layers keeps "
                             f"{target_layers}; leave --target_layers unset or use a head for that many layers")
    if taps and backend == "ttnn" and max(taps) == target_layers:  # the backend captures layers' inputs only
        raise DemoInputError(f"--draft_head {head_folder}: it reads the last layer's output (tap {target_layers}), "
                             f"which the ttnn backend does not capture; use a head whose taps are layers 0 to "
                             f"{target_layers - 1}, or --backend torch")
    uses_draft_model = config.n_draft_tokens > 0 and (config.draft_mode == "model" or
                                                      config.draft_mode == "hybrid" and head_weights is None)
    check_cache_fits(config, args, target_layers, backend)
    if not config.draft_model and not 1 <= config.draft_layers < target_layers:  # checked in every mode
        fix = "raise it to at least 1" if config.draft_layers < 1 else f"lower it to at most {target_layers - 1}"
        raise DemoInputError(f"--draft_layers {config.draft_layers} must be between 1 and {target_layers - 1} (the "
                             f"draft is the first layers of the {target_layers}-layer target): {fix}, or use "
                             "--draft_mode suffix for no draft model")
    tokenizer = load_tokenizer(ckpt)
    draft_ckpt = resolve_checkpoint(config.draft_model, "--draft_model") if uses_draft_model and config.draft_model else None
    if draft_ckpt is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_ckpt), config.draft_model)

    copied = None
    if config.n_draft_tokens > 0 and config.draft_mode in ("suffix", "hybrid"):  # head and model modes copy nothing
        copied = SuffixDrafter(config.sa_threshold, draft_memory(config, tokenizer), config.recycle_top_k)

    pool = pool if pool is not None else ModelPool()
    loader = ttnn_loader(config, mesh_device) if backend == "ttnn" else torch_loader(config, args)
    built_with = (backend, dtype_of(config), config.precision, config.device, config.batch_size,
                  config.max_seq_len, config.instruct, config.draft_trees)

    def load(ckpt, n_layers):
        return pool.get(("model", str(ckpt.folder), n_layers, built_with), lambda: loader(ckpt, n_layers))

    target = load(ckpt, target_layers)
    if not config.draft_trees:
        target.supports_trees = False
    drafter = draft_lm = None
    if head_weights is not None:
        head = draft_head(head_weights, target, ckpt, args, config,
                          lambda make: pool.get(("head", str(head_folder), target_layers, config.n_draft_tokens,
                                                 built_with), make))
        drafter = head if config.draft_mode == "head" else HybridDrafter(copied, head)
        logger.info(f"Draft head {head_folder.name} ({head_weights[0].layout}): taps {list(head.taps)}, "
                    f"{len(head.vocab):,} draft tokens, a run ~{head.draft_cost:.2f} step")
    elif config.n_draft_tokens > 0 and config.draft_mode == "suffix":
        drafter = copied  # no draft model at all
    elif config.n_draft_tokens > 0:
        if draft_ckpt is not None:
            draft_lm, draft_args = load(draft_ckpt, None), ModelArgs.from_hf_config(draft_ckpt.config)
        else:  # the target's first layers, reading and writing the target's cache for them
            draft_lm = pool.get(("view", str(ckpt.folder), target_layers, config.draft_layers, built_with),
                                lambda: target.draft_view(config.draft_layers))
            draft_args = args
        if config.draft_mode == "model":
            drafter = ModelDrafter(draft_lm)  # every draft has the full n_draft_tokens
        else:  # hybrid: the model drafts only while its acceptance pays for its cost (weights read per token)
            draft_cost = (draft_args.weight_bytes_per_token(draft_lm.n_layers, 2)
                          / args.weight_bytes_per_token(target_layers, 2))
            drafter = HybridDrafter(copied, ModelDrafter(draft_lm, draft_cost))
    tokens = [encode(tokenizer, p, bool(config.instruct)) for p in prompts]
    return ckpt, tokenizer, target, drafter, draft_lm, prompts, tokens, eos_token_ids(ckpt, tokenizer)


def draft_head(head: tuple, target, ckpt, args, config: DemoConfig, pooled=lambda make: make()):
    """The draft head's drafter beside the target: on a TT device the head runs on the device (TtnnDraftHead: chains of
    --n_draft_tokens, one traced replay each, fed the taps the target's steps leave there; the tokens it is fed are
    looked up on the host in the checkpoint's embedding, or the head's own; built through `pooled`, so runs share it
    and the pool releases its traces); on torch a HeadRunner beside the target, on its embedding."""
    from models.tt_transformers.speculative.head_drafter import HeadDrafter, TracedHeadDrafter
    from models.tt_transformers.torch_backend.checkpoint import read_embedding
    from models.tt_transformers.torch_backend.draft_head import HeadRunner, build_draft_head

    if backend_of(config) == "ttnn":
        import ttnn

        from models.tt_transformers.ttnn_backend.draft_head import TtnnDraftHead

        config_, weights = head
        embedding = weights.get("embed_tokens.weight")
        embedding = read_embedding(ckpt) if embedding is None else embedding
        return TracedHeadDrafter(pooled(lambda: TtnnDraftHead(target, config_, weights, embedding,
                                                              config.n_draft_tokens, args,
                                                              weights_dtype=getattr(ttnn, dtype_of(config)))))
    return HeadDrafter(HeadRunner(build_draft_head(*head, target.model), config.batch_size, config.max_seq_len, args))


def sampling_params(config: DemoConfig) -> SamplingParams:
    try:
        return SamplingParams(config.temperature, config.top_k, config.top_p, config.seed)
    except ValueError as e:
        raise DemoInputError(f"bad sampling flags: {e}") from None


def describe_drafter(config: DemoConfig, model_name: str) -> str:
    if config.n_draft_tokens == 0:
        return "plain decoding"
    model = config.draft_model or f"first {config.draft_layers} layers"
    sources = [f"the request's text (matches of {config.sa_threshold}+ tokens)"]
    sources += [f"earlier responses (up to {config.draft_memory:,} tokens)"] * (config.draft_memory > 0)
    sources += [f"corpus {config.draft_corpus}"] * (config.draft_corpus is not None)
    sources += [f"the target's top-{config.recycle_top_k} recycled"] * (config.recycle_top_k > 0)
    trees = config.draft_trees and backend_of(config) == "torch"  # the ttnn backend verifies chains
    copied = f"copied drafts from {', '.join(sources)}{', as token trees' if trees else ''}"
    head = draft_head_folder(config, model_name)
    other = f"draft head {head}" if head else f"draft model {model}"
    return {"model": f"draft model {model}", "suffix": copied, "head": other,
            "hybrid": f"hybrid: {copied}, or the {other}, whichever is expected to bring more tokens per "
                      "unit of work"}[config.draft_mode]


def summarize(batches: list[list[UserResult]]) -> dict:
    """Figures over all users (users of one batch share each iteration's time), with TT-Transformers' perf keys:
    prefill_time_to_token (s, mean over users), prefill_t/s (prompt tokens per second of prefill), decode_t/s/u and
    decode_t/s (tokens after the first per second of decoding, per user and over the batch)."""
    users = [r for batch in batches for r in batch]
    drafted = sum(it.drafted for r in users for it in r.iterations)
    accepted = sum(it.accepted for r in users for it in r.iterations)
    steps = sum(len(r.iterations) for r in users)
    produced = sum(len(r.output_tokens) - 1 for r in users)
    decode_s = sum(max(r.decode_s for r in batch) for batch in batches)
    prefill_s = sum(r.ttft_ms for r in users) / 1e3
    tok_s = produced / decode_s if decode_s else 0.0
    tok_s_u = tok_s * len(batches) / len(users)
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_step": produced / steps if steps else 0.0,
        "decode_tok_s": tok_s,
        "decode_tok_s_u": tok_s_u,
        "ttft_ms": sum(r.ttft_ms for r in users) / len(users),
        "prefill_time_to_token": prefill_s / len(users),
        "prefill_t/s": sum(len(r.prompt_tokens) for r in users) / prefill_s if prefill_s else 0.0,
        "decode_t/s/u": tok_s_u,
        "decode_t/s": tok_s,
    }


def environment(device: str) -> dict:
    """Where a report was measured: machine, software and the code's git commit (None outside a git checkout)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    return {"machine": platform.machine(), "processor": names[0] if names else platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "device": device, "git_commit": commit}


def log_performance(label: str, s: dict) -> None:
    logger.info(f"=== Performance metrics ({label}) ===")
    logger.info(f"Time to first token: {s['ttft_ms']:.1f}ms")
    ms = 1e3 / s["decode_tok_s_u"] if s["decode_tok_s_u"] else 0.0
    logger.info(f"Average speed: {ms:.1f}ms @ {s['decode_tok_s_u']:.1f} tok/s/user ({s['decode_tok_s']:.1f} tok/s throughput)")
    logger.info(f"Acceptance rate: {100 * s['acceptance_rate']:.1f}%, mean tokens per target forward: "
                f"{s['mean_tokens_per_step']:.2f}")


def generate_all(generator: SpeculativeGenerator, tokens: list[list[int]], batches: list[list[int]],
                 config: DemoConfig) -> list[list[UserResult]]:
    return [generator.generate([tokens[i] for i in batch], config.max_generated_tokens, bool(config.stop_at_eos),
                               requests=batch) for batch in batches]


def warm_up(target, drafter, draft_lm, config: DemoConfig) -> dict:
    """Compile (and on a TT device trace) every program the run can use, on the target and the draft model, before
    anything is timed; TT's compile_prefill / compile_decode keys, in seconds. No drafter learns anything here (the
    memory of earlier responses would otherwise hold part of the first answer)."""
    times = {"compile_prefill": 0.0, "compile_decode": 0.0}
    top_k = drafter.top_k if drafter is not None else 0
    taps = drafter.taps if drafter is not None else ()
    work = [(target, config.n_draft_tokens + 1, top_k, taps)]
    if draft_lm is not None:  # a draft model catches up on accepted text in steps of up to its whole row budget
        work.append((draft_lm, draft_lm.max_step_rows, 0, ()))
    for lm, rows, k, h in work:
        for key, seconds in lm.warm_up(min(rows, lm.max_step_rows), k, h).items():
            times[key] += seconds
    head = getattr(getattr(drafter, "fallback", drafter), "head", None)
    if hasattr(head, "warm_up"):  # a head on the device: its traces, made with the target's
        times["compile_decode"] += head.warm_up()
    if hasattr(target, "prepare_traces"):  # on a TT mesh: every model planned above, compiled and captured once
        times["compile_decode"] += target.prepare_traces()
    return times


def run_demo(config: DemoConfig, mesh_device=None, pool: Optional[ModelPool] = None) -> dict:
    """The demo on the backend --backend picks (ttnn: on `mesh_device`); returns the report. Models come from
    `pool` (reused across runs, released by its owner); without one the run builds its own and releases them."""
    own_pool = pool is None
    pool = ModelPool() if own_pool else pool
    try:
        return run_on(config, mesh_device, pool)
    finally:
        if own_pool:
            pool.close()


def run_on(config: DemoConfig, mesh_device, pool: ModelPool) -> dict:
    from models.tt_transformers.speculative.head_drafter import HeadDrafter

    ckpt, tokenizer, target, drafter, draft_lm, prompts, tokens, eos = build(config, mesh_device, pool)
    sampling = sampling_params(config)
    spec = SpeculativeGenerator(target, drafter, config.n_draft_tokens, eos, sampling)
    batches = split_batches(len(prompts), config.batch_size)
    for batch in batches:  # every prompt fits before anything runs
        spec.check_prompts([tokens[i] for i in batch])
    compile_times = warm_up(target, drafter, draft_lm, config)
    logger.info(f"Compile and warm-up (not timed): prefill {compile_times['compile_prefill']:.1f}s, decode "
                f"{compile_times['compile_decode']:.1f}s")

    logger.info(f"Speculative decoding: {ckpt.name}, {target.n_layers} target layers, batch {config.batch_size}, "
                f"n_draft_tokens={config.n_draft_tokens}, {'greedy' if sampling.greedy else f'sampling {sampling}'}")
    logger.info(textwrap.fill(f"Drafting: {describe_drafter(config, ckpt.name)}", width=100, subsequent_indent="  "))
    results = generate_all(spec, tokens, batches, config)
    summary = {**summarize(results), **compile_times}
    head = getattr(drafter, "fallback", drafter)
    if isinstance(head, HeadDrafter):  # what a head run cost on this machine, as its length policy priced it
        summary["draft_head_run_cost"] = head.draft_cost
        logger.info(f"Draft head: a run measured at {head.draft_cost:.3f} of a target step")
    log_performance("speculative", summary)

    baseline = None
    if config.compare_baseline and config.n_draft_tokens > 0:
        logger.info("Plain decoding on the same backend (baseline)")
        baseline = generate_all(SpeculativeGenerator(target, None, 0, eos, sampling), tokens, batches, config)
        base_summary = summarize(baseline)
        log_performance("plain decoding", base_summary)
        summary["baseline_decode_tok_s"] = base_summary["decode_tok_s"]
        summary["speedup"] = summary["decode_tok_s"] / base_summary["decode_tok_s"]
        same = ""
        if sampling.greedy or sampling.seed is not None:  # a seeded draw depends on (seed, prompt, position) alone
            summary["identical_to_baseline"] = all(
                r.output_tokens == b.output_tokens for rb, bb in zip(results, baseline) for r, b in zip(rb, bb))
            same = f"; outputs identical: {summary['identical_to_baseline']}"
        logger.info(f"Speedup over plain decoding: {summary['speedup']:.2f}x{same}")

    report = {"config": {**vars(config), "model_name": ckpt.name, "target_layers": target.n_layers},
              "environment": environment(target.device_name), "prompts": [], "summary": summary}
    seen = set()
    for b, batch in enumerate(batches):
        for u, i in enumerate(batch):
            if i in seen:  # a repeat that only filled the last batch
                continue
            seen.add(i)
            r = results[b][u]
            text = tokenizer.decode(r.output_tokens, skip_special_tokens=True)
            logger.info(f"User {i} prompt: {shorten(prompts[i], PROMPT_ECHO)!r}\nOutput: {text}")
            entry = {"prompt": prompts[i], "output_text": text, "output_tokens": r.output_tokens,
                     "iterations": [vars(it) for it in r.iterations], "ttft_ms": r.ttft_ms,
                     "decode_tok_s": r.decode_tok_s,
                     "tokens_per_step": (len(r.output_tokens) - 1) / len(r.iterations) if r.iterations else 0.0,
                     "draft_sources": dict(Counter(it.draft_source for it in r.iterations if it.drafted))}
            if baseline is not None:
                entry["baseline_output_tokens"] = baseline[b][u].output_tokens
                entry["baseline_decode_tok_s"] = baseline[b][u].decode_tok_s
                entry["speedup"] = r.decode_tok_s / entry["baseline_decode_tok_s"]
            report["prompts"].append(entry)
    log_prompt_table(report["prompts"])
    if config.output_json:
        write_json_atomic(Path(config.output_json), report)
        logger.info(f"Report written to {config.output_json}")
    return report


PROMPT_ECHO = 100  # characters of a prompt the log repeats (a code edit's prompt runs to pages)


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def log_prompt_table(entries: list[dict]) -> None:
    """Per prompt: tokens per target forward, speedup over plain decoding, which sources drafted: where it pays."""
    lines = [f"{'prompt':<44} {'tokens/forward':>14} {'speedup':>8}  drafted by"]
    for e in entries:
        speedup = f"{e['speedup']:.2f}x" if "speedup" in e else "-"
        sources = ", ".join(f"{source} {n}" for source, n in sorted(e["draft_sources"].items())) or "nothing"
        lines.append(f"{shorten(e['prompt'], 44):<44} {e['tokens_per_step']:>14.2f} {speedup:>8}  {sources}")
    logger.info("Per prompt:\n" + "\n".join(lines))


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def config_from_pytest(request) -> DemoConfig:
    """Options are read as getoption(...) or default, as TT-Transformers demos do."""
    values = {}
    for name, _, default, _ in DEMO_OPTIONS:
        value = request.config.getoption(f"--{name}")
        values[name] = default if value is None else value
    return DemoConfig(**values)


def test_speculative_demo(request):
    """The demo as a pytest test; on the ttnn backend (MESH_DEVICE set, or --backend ttnn) it runs on the
    `mesh_device` fixture (conftest.py: the fabric and a trace region sized for these options, as tt-metal's
    fixture opens a mesh for its text demo)."""
    config = config_from_pytest(request)
    mesh_device = request.getfixturevalue("mesh_device") if backend_of(config) == "ttnn" else None
    report = run_demo(config, mesh_device)
    assert all(p["output_tokens"] for p in report["prompts"])
    if "identical_to_baseline" in report["summary"]:
        assert report["summary"]["identical_to_baseline"], "speculative output differs from plain decoding"


LOG_FORMAT = "<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}"  # fits a 120-column terminal


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, type_, default, help_ in DEMO_OPTIONS:
        parser.add_argument(f"--{name}", *(["--trace"] if name == "enable_trace" else []), type=type_,
                            default=default, help=help_)
    config = DemoConfig(**vars(parser.parse_args(argv)))
    try:
        if backend_of(config) == "ttnn":
            from models.tt_transformers.ttnn_backend.device import mesh_shape, open_mesh

            check_flags(config, "ttnn")
            with open_mesh(trace_region_size=trace_region_size(config, mesh_shape())) as mesh_device:
                report = run_demo(config, mesh_device)
        else:
            report = run_demo(config)
    except ValueError as e:  # DemoInputError, CheckpointError, ModelConfigError: clear messages, no traceback
        logger.error(str(e))
        return 2
    except KeyboardInterrupt:  # nothing half-written is left: reports are written whole or not at all
        logger.error("interrupted (Ctrl-C): stopped, no report written")
        return 130
    return 0 if report["summary"].get("identical_to_baseline", True) else 1


if __name__ == "__main__":
    logger.remove()  # the CLI's own log format; as a library or under pytest the caller's handlers stay
    logger.add(sys.stderr, format=LOG_FORMAT)
    sys.exit(main())
