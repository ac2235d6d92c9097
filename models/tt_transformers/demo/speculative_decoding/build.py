# SPDX-License-Identifier: Apache-2.0
"""The demo's models: target, draft source and tokenizer on the torch or ttnn backend, built once the inputs are
checked, and compiled (on a TT device, traced) before anything is timed."""
import dataclasses
import os
from typing import Optional

from loguru import logger

from models.tt_transformers.demo.speculative_decoding.inputs import (
    MAX_CORPUS_TOKENS,
    CheckedInputs,
    DemoInputError,
    draft_head_folder,
    draft_layers_for,
    dtype_of,
    head_taps,
    kv_cache_bytes,
    model_flag,
)
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig, speculative_config
from models.tt_transformers.prompts import encode, eos_token_ids
from models.tt_transformers.speculative.drafters import HybridDrafter
from models.tt_transformers.speculative.factory import make_drafter


def corpus_documents(config: DemoConfig, tokenizer, corpus: Optional[str]) -> list[list[int]]:
    """--draft_corpus's text as token ids, one document (none without a corpus)."""
    if corpus is None:
        return []
    documents = [tokenizer(corpus, add_special_tokens=False).input_ids]
    if len(documents[0]) > MAX_CORPUS_TOKENS:
        raise DemoInputError(f"--draft_corpus {config.draft_corpus} has {len(documents[0]):,} tokens, more than "
                             f"{MAX_CORPUS_TOKENS:,}; pass the part that the requests will repeat")
    return documents


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise DemoInputError(f"draft model {draft_name!r} has a different tokenizer from the target "
                             f"(vocabularies differ); speculative decoding needs one shared vocabulary")


def torch_loader(config: DemoConfig, args):
    """(checkpoint, layers) -> a TorchCausalLM, on the device --device picks for this model."""
    import torch

    from models.tt_transformers.checkpoints.cache import cache_root
    from models.tt_transformers.torch_backend.load import load_model
    from models.tt_transformers.torch_backend.cpu_kernels import kernels_fit, load_cpu_kernels
    from models.tt_transformers.torch_backend.device import choose_device
    from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

    dtype = getattr(torch, dtype_of(config))
    choice = choose_device(config.device, args, dtype,
                           kernels_fit(args, dtype) and load_cpu_kernels(cache_root() / "kernels") is not None,
                           torch.cuda.is_available())
    logger.info(f"Device {choice.device}: {choice.reason}")

    def load(ckpt, n_layers):
        model = load_model(ckpt, dtype, config.max_seq_len, choice.device)
        n_layers = n_layers or model.args.n_layers
        try:
            return TorchCausalLM(model, n_layers, config.batch_size)
        except (RuntimeError, MemoryError):  # free memory allowed it, a limit did not (ulimit -v, a cgroup, CUDA)
            raise DemoInputError(f"--max_seq_len {config.max_seq_len:,} x --batch_size {config.batch_size}: this "
                                 "process could not allocate the KV cache "
                                 f"({kv_cache_bytes(config, model.args, n_layers) / 2**30:.1f} GiB); lower "
                                 "--max_seq_len or --batch_size, or raise the process's memory limit") from None
    return load


def ttnn_loader(config: DemoConfig, mesh_device, mesh_traces):
    """(checkpoint, layers) -> a TtnnCausalLM: TT-Transformers on the mesh device, traced with every other model on
    it (mesh_traces: the mesh's MeshTraces)."""
    from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
    from models.tt_transformers.ttnn_backend.model import build_tt_model
    from models.tt_transformers.ttnn_backend.ttnn_api import ttnn

    def load(ckpt, n_layers):
        tt = build_tt_model(mesh_device, ckpt.folder, ckpt.name, config.batch_size, config.max_seq_len,
                            bool(config.instruct), n_layers, weights_dtype=getattr(ttnn, dtype_of(config)),
                            optimizations=config.precision)
        return TtnnCausalLM(tt, config.batch_size, config.max_seq_len, mesh_traces=mesh_traces,
                            trace=bool(config.enable_trace), tap_gather=config.tap_gather,
                            grouped_attention=bool(config.grouped_verify))
    return load


def model_devices(shape: tuple[int, int]) -> tuple[list[str], int]:
    """TT's device names and the device count of the mesh a model runs on when a mesh of this shape is open
    (device.model_mesh: a Galaxy's 1 x 8 submesh, named as TT names 8 devices, not by MESH_DEVICE)."""
    from models.tt_transformers.ttnn_backend.device import model_mesh_shape
    from models.tt_transformers.ttnn_backend.trace_plan import device_names_for

    model_shape = model_mesh_shape(shape)
    named = os.environ.get("MESH_DEVICE") if model_shape == tuple(shape) else None
    return device_names_for(model_shape, named), model_shape[0] * model_shape[1]


def trace_region_size(config: DemoConfig, shape: tuple[int, int], margin: float = None) -> int:
    """The trace region a ttnn run on a mesh of this shape needs (on its model's mesh, model_devices):
    --trace_region_size where given, else every decode trace of the target, of the draft model and of a draft head
    (ttnn_backend/trace_plan.py), for the draft mode's most demanding choice (hybrid: recycling's top k, a head's taps
    and traces and a draft model's traces all counted), with trace_plan's margin (or `margin`)."""
    if config.trace_region_size is not None:
        return config.trace_region_size
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.checkpoints.model_shape import ModelShape
    from models.tt_transformers.ttnn_backend.model import TILE_ROWS
    from models.tt_transformers.ttnn_backend.trace_plan import head_region_bytes, model_trace_bytes, region_bytes

    ckpt = resolve_checkpoint(config.model, model_flag(config))
    args = ModelShape.from_hf_config(ckpt.config)
    device, n_devices = model_devices(shape)
    drafting = config.n_draft_tokens > 0
    top_k = config.recycle_top_k if drafting and config.draft_mode in ("suffix", "hybrid") else 0
    head = draft_head_folder(config, ckpt.name)
    taps = head_taps(head, args) if head is not None else ()
    target_layers = config.target_layers or args.n_layers
    sampled = config.temperature > 0
    traces = model_trace_bytes(ckpt.name, device, n_devices, args.n_layers, target_layers, args.vocab_size,
                               config.n_draft_tokens + 1, top_k, taps, sampled)
    if taps:
        traces += head_region_bytes(ckpt.name, device, args.n_layers, config.n_draft_tokens)
    if drafting and config.draft_mode in ("model", "hybrid"):  # a draft steps up to a whole tile per user
        draft = resolve_checkpoint(config.draft_model, "--draft_model") if config.draft_model else ckpt
        draft_args = ModelShape.from_hf_config(draft.config)
        layers = draft_args.n_layers if config.draft_model else draft_layers_for(config, target_layers)
        traces += model_trace_bytes(draft.name, device, n_devices, draft_args.n_layers, layers, draft_args.vocab_size,
                                    TILE_ROWS, 0, (), sampled)
    return region_bytes(traces, margin)


class ModelPool:
    """The models runs build, kept so that a later run with the same settings reuses them (the perf test runs
    several draft modes on one 8B target: building it again would put a second copy in the device's DRAM) and
    released together when the pool closes (a TT model's traces hold the trace region until released). Its models
    share one mesh, and on a TT device its MeshTraces: every model on the mesh is traced together."""

    def __init__(self):
        self.models: dict = {}
        self.traces = None  # the mesh's MeshTraces, made with the first TT model

    def mesh_traces(self, mesh_device):
        from models.tt_transformers.ttnn_backend.traces import MeshTraces

        if self.traces is None:
            self.traces = MeshTraces(mesh_device)
        if self.traces.mesh is not mesh_device:
            raise ValueError("a model pool holds the models of one mesh: open one pool per mesh")
        return self.traces

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


def build(config: DemoConfig, checked: CheckedInputs, mesh_device=None, pool: Optional[ModelPool] = None):
    """Target, draft and tokenizer on the torch or ttnn backend (ttnn: on `mesh_device`), as check_inputs settled
    them, the drafter assembled by the library's make_drafter; models come from `pool` when an earlier run built them
    with the same settings. Returns the tokenizer, target, drafter, draft model (None without one), the prompts' tokens
    and the EOS ids."""
    from models.tt_transformers.checkpoints.checkpoint import load_tokenizer
    from models.tt_transformers.checkpoints.eagle3_format import read_draft_head
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    for note in checked.notes:
        logger.info(note)
    if checked.unused:
        logger.warning(f"Not used by this run: {', '.join(checked.unused)}")
    ckpt, args, target_layers, head_folder = checked.ckpt, checked.args, checked.target_layers, checked.head_folder
    head_weights = read_draft_head(head_folder, args) if head_folder is not None else None  # (config, tensors)
    tokenizer = load_tokenizer(ckpt, model_flag(config))
    if checked.draft_ckpt is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(checked.draft_ckpt, "--draft_model"), config.draft_model)
    spec = speculative_config(config)
    documents = corpus_documents(config, tokenizer, checked.corpus) if spec.copies else []

    pool = pool if pool is not None else ModelPool()
    loader = (ttnn_loader(config, mesh_device, pool.mesh_traces(mesh_device)) if checked.backend == "ttnn"
              else torch_loader(config, args))
    built_with = (checked.backend, dtype_of(config), config.precision, config.device, config.batch_size,
                  config.max_seq_len, config.instruct, config.tap_gather)

    def load(ckpt, n_layers):
        return pool.get(("model", str(ckpt.folder), n_layers, built_with), lambda: loader(ckpt, n_layers))

    target = load(ckpt, target_layers)
    draft_lm, draft_cost, heads = None, None, {}
    if head_weights is not None:  # the backend's head (CausalLM.draft_head's); on a TT device pooled, traces and all
        def make_head():
            return target.build_head(*head_weights, config.n_draft_tokens)
        heads = ({"device_head": pool.get(("head", str(head_folder), target_layers, config.n_draft_tokens,
                                           built_with), make_head)}
                 if checked.backend == "ttnn" else {"head": make_head()})
    elif spec.n_draft_tokens > 0 and spec.draft_mode in ("model", "hybrid"):
        if checked.draft_ckpt is not None:
            draft_lm, draft_args = load(checked.draft_ckpt, None), ModelShape.from_hf_config(checked.draft_ckpt.config)
        else:  # the target's first layers, reading and writing the target's cache for them
            draft_lm = pool.get(("view", str(ckpt.folder), target_layers, checked.draft_layers, built_with),
                                lambda: target.draft_view(checked.draft_layers))
            draft_args = args
        # a hybrid's draft model drafts only while its acceptance pays for its cost: the weights it reads per token
        draft_cost = (draft_args.weight_bytes_per_token(draft_lm.n_layers, 2)
                      / args.weight_bytes_per_token(target_layers, 2))
    # the head chosen by check_inputs, built above: make_drafter builds no other
    spec = dataclasses.replace(spec, draft_head=None) if heads else spec
    drafter = make_drafter(spec, target, draft_lm=draft_lm, draft_cost=draft_cost, documents=documents, **heads)
    if heads:
        head = drafter.fallback if isinstance(drafter, HybridDrafter) else drafter
        logger.info(f"Draft head {head_folder.name} ({head_weights[0].layout}): taps {list(head.taps)}, "
                    f"{len(head.vocab):,} draft tokens, a run ~{head.draft_cost:.2f} step")
    tokens = [encode(tokenizer, p, bool(config.instruct)) for p in checked.prompts]
    longest = max(len(t) for t in tokens)
    if longest + config.max_generated_tokens > config.max_seq_len:  # the loop stops a user at the end of its cache
        logger.warning(f"--max_generated_tokens {config.max_generated_tokens}: the longest prompt ({longest} tokens) "
                       f"leaves room for {config.max_seq_len - longest} within --max_seq_len {config.max_seq_len}; "
                       f"answers that reach it stop there (--max_seq_len {longest + config.max_generated_tokens} "
                       "holds them all)")
    return tokenizer, target, drafter, draft_lm, tokens, eos_token_ids(ckpt, tokenizer)


def describe_drafter(config: DemoConfig, checked: CheckedInputs) -> str:
    """The header's `Drafting:` line: what drafts in this run, as the checks settled it."""
    if config.n_draft_tokens == 0:
        return "plain decoding"
    sources = [f"the request's text (matches of {config.sa_threshold}+ tokens)"]
    sources += [f"earlier responses (up to {config.draft_memory:,} tokens)"] * (config.draft_memory > 0)
    sources += [f"corpus {config.draft_corpus}"] * (config.draft_corpus is not None)
    sources += [f"the target's top-{config.recycle_top_k} recycled"] * (config.recycle_top_k > 0)
    trees = config.draft_trees and checked.backend == "torch"  # the ttnn backend verifies chains
    copied = f"copied drafts from {', '.join(sources)}{', as token trees' if trees else ''}"
    if checked.head_folder is not None:
        other = f"draft head {checked.head_folder}"
    else:
        other = f"draft model {config.draft_model or f'first {checked.draft_layers} layers'}"
    return {"model": other, "suffix": copied, "head": other,
            "hybrid": f"hybrid: {copied}, or the {other}, whichever is expected to bring more tokens per "
                      "unit of work"}[config.draft_mode]
