# SPDX-License-Identifier: Apache-2.0
"""The demo's input checks: every flag, the prompts file and what the model allows, checked before anything loads, each
failure one DemoInputError line naming the flag or file and the fix."""
import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from models.tt_transformers.demo.speculative_decoding.options import (
    DEFAULT_DRAFT_LAYERS,
    DEFAULT_PROMPTS,
    DEMO_OPTIONS,
    SWITCHES,
    DemoConfig,
    speculative_config,
)
from models.tt_transformers.errors import UserError
from models.tt_transformers.prompts import load_prompts as read_prompts
from models.tt_transformers.prompts import split_batches as fill_batches
from models.tt_transformers.records import PACKAGE_ROOT
from models.tt_transformers.speculative.config import NO_DRAFT_HEAD, default_draft_layers
from models.tt_transformers.speculative.sampling import SamplingParams, check_sampling_only
from models.tt_transformers.checkpoints.checkpoint import Checkpoint, resolve_checkpoint
from models.tt_transformers.torch_backend.cpu_isa import check_cpu_isa
from models.tt_transformers.torch_backend.device import DEVICES
from models.tt_transformers.checkpoints.eagle3_format import (
    HeadChoice,
    choose_draft_head,
    head_folder,
    read_head_config,
)
from models.tt_transformers.checkpoints.model_shape import ModelShape

SUPPORTED_BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # as TT-Transformers demos
BACKENDS = ("auto", "torch", "ttnn")
MAX_CORPUS_TOKENS = 1_000_000  # about 600 MB of suffix automaton
# The weights' dtype per backend, the default first: on ttnn bfloat8_b, what tt-metal's text demo runs
# (simple_text_demo.py -> create_tt_model(dtype=ttnn.bfloat8_b)): an 8B model's LM head alone is ~1 GB in bf16.
DTYPES = {"torch": ("bfloat16", "float32"), "ttnn": ("bfloat8_b", "bfloat16")}
# TT-Transformers' decoder precision presets (tt/model_config.py, DecodersPrecision.performance / .accuracy);
# tt-metal's text demo runs performance unless told otherwise. (Its demo conftest's own --optimizations takes a
# decoder-config string, so ours has another name.)
PRECISIONS = ("performance", "accuracy")
TAP_GATHERS = ("device", "host")  # where a mesh's tapped states are gathered (ttnn_backend/taps.py, write_taps)


DemoInputError = UserError  # bad demo input: the message names the flag or file and the fix
# The library's parameters whose flag has another name (every other parameter is its flag without the dashes).
FLAGS = {"trees": "--draft_trees", "max_batch_size": "--batch_size", "chain_len": "--n_draft_tokens",
         "draft_lm": "--draft_model", "prompts": "--input_prompts"}


@contextmanager
def flags_named():
    """The library's input errors, which name its parameters, re-worded with the demo's flags."""
    try:
        yield
    except UserError as e:
        if e.parameter is None:
            raise
        raise e.named_with(lambda parameter: FLAGS.get(parameter, f"--{parameter}")) from None


def find_prompts_file(path: str) -> Path:
    """The documented `--input_prompts models/tt_transformers/demo/...` works from the working directory (the
    repository or a tt-metal checkout) and, failing that, from the folder that holds our models/ package."""
    p = Path(path).expanduser()
    if not p.is_file() and not p.is_absolute() and (PACKAGE_ROOT / p).is_file():
        return PACKAGE_ROOT / p
    if not p.exists():
        raise DemoInputError(f"--input_prompts {path!r} does not exist; pass a JSON or JSON Lines prompts file "
                             f"(default: {DEFAULT_PROMPTS})")
    return p


def load_prompts(path: str) -> list[str]:
    """--input_prompts's prompts (prompts.load_prompts: TT format or JSON Lines)."""
    return read_prompts(find_prompts_file(path), "--input_prompts")


def read_corpus(path: str) -> str:
    """--draft_corpus's text: a text file, refused (as a binary prompts file is) when it is not UTF-8 or holds NUL
    bytes, which no text the requests repeat contains."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise DemoInputError(f"--draft_corpus {path!r} is a directory; pass a text file (documents to draft from, "
                             "concatenated)")
    if not p.is_file():
        raise DemoInputError(f"--draft_corpus {path!r} does not exist; pass a text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DemoInputError(f"--draft_corpus {path}: not UTF-8 text (byte {e.start}); pass a text file") from None
    if "\0" in text:
        raise DemoInputError(f"--draft_corpus {path}: holds NUL bytes, so it is not text; pass a text file")
    return text


def split_batches(n_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices per batch (prompts.split_batches), for a batch size TT demos run."""
    if batch_size not in SUPPORTED_BATCH_SIZES:
        raise DemoInputError(f"--batch_size {batch_size} is not supported; use one of {SUPPORTED_BATCH_SIZES}")
    return fill_batches(n_prompts, batch_size)


def model_flag(config: DemoConfig) -> str:
    """What chose the target checkpoint, as its errors name it."""
    return "--model" if config.model else "HF_MODEL"


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


def check_flags(config: DemoConfig, backend: str) -> None:
    """Every flag that can be checked before anything loads."""
    if backend == "ttnn" and importlib.util.find_spec("ttnn") is None:
        raise DemoInputError("the ttnn backend (--backend ttnn, or MESH_DEVICE set) needs tt-metal v0.81.1's Python "
                             "environment (ttnn 0.81.1) and a Tenstorrent device: see README.md, 'On a Tenstorrent "
                             "machine'; on this machine use --backend torch (and unset MESH_DEVICE)")
    for name, type_, default, _ in DEMO_OPTIONS:  # '' would be read as the working directory, or as nothing
        if type_ is str and getattr(config, name) is not None and not getattr(config, name).strip():
            raise DemoInputError(f"--{name} is empty; give it a value or leave it out (default: {default})")
    for name in SWITCHES:
        if getattr(config, name) not in (0, 1):
            raise DemoInputError(f"--{name} must be 0 or 1, got {getattr(config, name)}")
    if config.grouped_verify and (config.temperature or config.draft_mode not in ("suffix", "model")):
        raise DemoInputError("--grouped_verify 1 runs greedy verify steps without taps (--temperature 0, --draft_mode "
                             "suffix or model): its grouped programs return no sampling logits and no tapped states; "
                             f"got --temperature {config.temperature} --draft_mode {config.draft_mode}")
    if config.precision not in PRECISIONS:
        raise DemoInputError(f"--precision {config.precision!r} is not one of {', '.join(PRECISIONS)}")
    if config.tap_gather not in TAP_GATHERS:
        raise DemoInputError(f"--tap_gather {config.tap_gather!r} is not one of {', '.join(TAP_GATHERS)}")
    if config.trace_region_size is not None and config.trace_region_size < 1:
        raise DemoInputError(f"--trace_region_size must be a positive number of bytes, got {config.trace_region_size}; "
                             "leave it out to size the region for the run")
    if config.dtype is not None and config.dtype not in DTYPES[backend]:
        raise DemoInputError(f"--dtype {config.dtype!r} is not supported on the {backend} backend; use "
                             f"{' or '.join(DTYPES[backend])}")
    with flags_named():
        speculative_config(config).check()
    sampling_params(config)
    if config.log_iterations < -1:
        raise DemoInputError(f"--log_iterations must be >= 0, or -1 for every iteration, got {config.log_iterations}")
    if config.max_generated_tokens < 1:
        raise DemoInputError(f"--max_generated_tokens must be >= 1, got {config.max_generated_tokens}")
    if config.target_layers is not None and config.target_layers < 1:
        raise DemoInputError(f"--target_layers must be >= 1, got {config.target_layers}")
    if config.max_seq_len < 2:
        raise DemoInputError(f"--max_seq_len must be >= 2, got {config.max_seq_len}")
    if config.device not in DEVICES:
        raise DemoInputError(f"--device {config.device!r} is not one of {', '.join(DEVICES)}")


def sampling_params(config: DemoConfig) -> SamplingParams:
    """The sampling flags, refused in one line where they are out of range or where greedy decoding (--temperature 0)
    would ignore them: the library refuses --top_k and --top_p then; --seed, which it takes (a script may always
    pass one), is refused here, where a user typed it."""
    with flags_named():
        params = SamplingParams(config.temperature, config.top_k, config.top_p, config.seed)
        check_sampling_only("seed", config.seed, None, config.temperature)
    return params


def available_memory_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    meminfo = Path("/proc/meminfo")
    for line in meminfo.read_text().splitlines() if meminfo.is_file() else []:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def kv_cache_bytes(config: DemoConfig, args: ModelShape, layers: int) -> int:
    """The torch backend's KV cache: K and V for every layer, user and position, plus one scratch position."""
    element_bytes = 4 if dtype_of(config) == "float32" else 2
    return 2 * layers * config.batch_size * args.n_kv_heads * (config.max_seq_len + 1) * args.head_dim * element_bytes


def check_cache_fits(config: DemoConfig, args, target_layers: int, backend: str) -> None:
    """--max_seq_len within the model's context length, and (torch) its KV cache within this machine's free memory,
    checked before anything is allocated."""
    if config.max_seq_len > args.max_position_embeddings:
        raise DemoInputError(f"--max_seq_len {config.max_seq_len:,} is longer than the model's context "
                             f"({args.max_position_embeddings:,} positions); use at most that")
    if backend != "torch":
        return  # the device's cache is paged in its own DRAM
    per_position = kv_cache_bytes(config, args, target_layers) // (config.max_seq_len + 1)
    free = available_memory_bytes()
    if free is not None and per_position * config.max_seq_len > free:
        raise DemoInputError(f"--max_seq_len {config.max_seq_len:,}: its KV cache ({per_position * config.max_seq_len / 2**30:.1f} "
                             f"GiB for batch {config.batch_size}) does not fit this machine's "
                             f"{free / 2**30:.1f} GiB of free memory; use at most {free // per_position:,}")


def head_flags(config: DemoConfig) -> dict:
    """The library's draft-head choice (eagle3_format.choose_draft_head), in the demo's flags: whether a head is
    required (--draft_mode head) and how its errors name the flags."""
    return dict(required=config.draft_mode == "head", flag="--draft_head", mode_flag="--draft_mode")


def reads_head(config: DemoConfig) -> bool:
    """Whether the run drafts with a head (SpeculativeConfig.reads_head: --draft_model keeps the shipped head out)."""
    return speculative_config(config).reads_head(config.draft_model is not None)


def draft_head_folder(config: DemoConfig, model_name: str) -> Optional[Path]:
    """The draft head the run uses (before the target's layers are counted): --draft_head (a folder or a hub id in
    the local cache), else the one shipped for the target, else None (--draft_mode head then fails with the fix)."""
    return head_folder(config.draft_head, model_name, **head_flags(config)) if reads_head(config) else None


def head_taps(folder: Path, args) -> tuple[int, ...]:
    """The target layers a draft head reads (its config.json), or the flag's one-line error."""
    return read_head_config(folder, args).taps


def draft_layers_for(config: DemoConfig, target_layers: int) -> int:
    """--draft_layers, or the default fitted to the target: a default the user did not choose never stops a run."""
    return config.draft_layers if config.draft_layers is not None else default_draft_layers(target_layers)


@dataclass
class CheckedInputs:
    """What the checks established, so that building repeats none of them."""
    backend: str
    prompts: list[str]
    batches: list[list[int]]  # prompt indices per batch
    corpus: Optional[str]  # --draft_corpus's text
    ckpt: Checkpoint  # the target's
    args: ModelShape  # the target's
    target_layers: int
    head_folder: Optional[Path]  # the draft head the run drafts with, if any
    draft_ckpt: Optional[Checkpoint]  # --draft_model's, where the run drafts with it
    draft_layers: Optional[int]  # the target's first layers as the draft model, where the run drafts with them
    notes: list[str] = field(default_factory=list)  # what the run chose for the user, one line each
    unused: list[str] = field(default_factory=list)  # flags given that the run does not read, each with why


def check_inputs(config: DemoConfig) -> CheckedInputs:
    """Every check that needs no weights: the flags, the prompts file, the checkpoints' and the draft head's configs,
    and what the model allows. Run before anything loads (on the pytest path, at collection: a usage error)."""
    backend = backend_of(config)
    check_flags(config, backend)
    if backend == "torch":
        check_cpu_isa()  # TT_CPU_ISA names a path this CPU runs
    prompts = load_prompts(config.input_prompts)
    batches = split_batches(len(prompts), config.batch_size)
    corpus = read_corpus(config.draft_corpus) if config.draft_corpus is not None else None
    ckpt = resolve_checkpoint(config.model, model_flag(config))
    args = ModelShape.from_hf_config(ckpt.config)
    target_layers = config.target_layers or args.n_layers
    if not 1 <= target_layers <= args.n_layers:
        raise DemoInputError(f"--target_layers {target_layers} is out of range: {ckpt.name} has {args.n_layers} "
                             f"layers; use 1 to {args.n_layers}, or leave it unset for all of them")
    # an explicit value, any mode (below 1 check_flags refused: SpeculativeConfig.check)
    if config.draft_layers is not None and config.draft_layers >= target_layers:
        raise DemoInputError(f"--draft_layers {config.draft_layers} must be between 1 and {target_layers - 1} (the "
                             f"draft is the first layers of the {target_layers}-layer target): lower it to at most "
                             f"{target_layers - 1}, or leave it out")
    check_cache_fits(config, args, target_layers, backend)
    # the library's choice, as make_drafter's (a truncated target's hybrid passes the shipped head over, with a note)
    head = (choose_draft_head(config.draft_head, ckpt.name, args, target_layers, backend == "torch",
                              layers_flag="--target_layers", **head_flags(config))
            if reads_head(config) else HeadChoice(None, None))
    checked = CheckedInputs(backend, prompts, batches, corpus, ckpt, args, target_layers, head.folder, None, None)
    checked.notes += [head.note] if head.note else []
    uses_draft_model = config.n_draft_tokens > 0 and (config.draft_mode == "model" or
                                                      config.draft_mode == "hybrid" and checked.head_folder is None)
    if uses_draft_model and config.draft_model:
        checked.draft_ckpt = resolve_checkpoint(config.draft_model, "--draft_model")
        draft_vocab = ModelShape.from_hf_config(checked.draft_ckpt.config).vocab_size
        if draft_vocab != args.vocab_size:  # its tokens would index past the other's embedding at the first step
            raise DemoInputError(f"--draft_model {config.draft_model}: its vocabulary has {draft_vocab:,} tokens, "
                                 f"{ckpt.name}'s {args.vocab_size:,}; pass a draft model of the target's family (its "
                                 "tokenizer), or use --draft_mode suffix")
    elif uses_draft_model:
        checked.draft_layers = draft_layers_for(config, target_layers)
        if checked.draft_layers >= target_layers:
            raise DemoInputError(f"--draft_mode {config.draft_mode} drafts with the target's first layers, and the "
                                 f"{target_layers}-layer target has none to spare; pass --draft_model CHECKPOINT or "
                                 "use --draft_mode suffix")
        if config.draft_layers is None and checked.draft_layers != DEFAULT_DRAFT_LAYERS:
            checked.notes.append(f"--draft_layers not given: the draft model is the first {checked.draft_layers} of "
                                 f"the target's {target_layers} layers (the default {DEFAULT_DRAFT_LAYERS} needs a "
                                 "deeper target)")
    checked.unused = unused_flags(config, checked)
    return checked


def unused_flags(config: DemoConfig, checked: CheckedInputs) -> list[str]:
    """The draft flags given that this run does not read, each with why: a flag the draft mode ignores is no error
    (the default mode ignores --draft_layers when a head ships), but it is never ignored silently."""
    if config.n_draft_tokens == 0:
        why_no_model = why_no_head = "plain decoding (--n_draft_tokens 0) drafts nothing"
    else:
        why_no_model = ("hybrid drafts with the draft head" if config.draft_mode == "hybrid" else
                       f"--draft_mode {config.draft_mode} builds no draft model")
        why_no_head = f"read by --draft_mode head or hybrid, not {config.draft_mode}"
    unused = []
    if config.draft_head not in (None, NO_DRAFT_HEAD) and checked.head_folder is None:
        unused.append(f"--draft_head ({why_no_head})")
    if config.draft_model is not None and checked.draft_ckpt is None:
        unused.append(f"--draft_model ({why_no_model})")
    if config.draft_layers is not None and checked.draft_layers is None:
        unused.append(f"--draft_layers ({'the draft model is --draft_model' if checked.draft_ckpt else why_no_model})")
    if config.draft_corpus is not None and (config.n_draft_tokens == 0 or config.draft_mode in ("head", "model")):
        why_not_copied = f"copied drafts are made by --draft_mode suffix or hybrid, not {config.draft_mode}"
        unused.append(f"--draft_corpus ({why_no_head if config.n_draft_tokens == 0 else why_not_copied})")
    return unused
