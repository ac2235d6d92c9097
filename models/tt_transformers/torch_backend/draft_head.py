# SPDX-License-Identifier: Apache-2.0
"""A trained draft head (EAGLE, arXiv 2401.15077): one decoder layer on the target's own final hidden states.

At position t the head reads [the target's final hidden state at t ; the embedding of token t+1], projects it to
the model's width, runs one decoder layer of the target's shape (with a KV cache of its own over the positions
before) and a norm, and predicts the target's final hidden state at t+1; the target's LM head, restricted to the
draft vocabulary (the most frequent response tokens: FR-Spec, arXiv 2502.14856), turns that into the next token.
Drafting k tokens runs the head k times on its own predictions. The head stores only its projection, layer, norm
and vocabulary; the embedding, rotary tables and LM-head rows are the target's (no copy of the LM head: its rows
are gathered once at load, a 6x smaller matrix than the whole head).

Files: head.safetensors (fc.weight, block.*, norm.weight, vocab) and card.json (how it was trained, measured).
"""
import hashlib
import json
import os
import shutil
from itertools import accumulate
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import ExactToken
from .model import KernelLinear, RMSNorm, Transformer, TransformerBlock
from .model_config import ModelArgs


class DraftHeadError(ValueError):
    """A draft head file cannot be used with this target; the message says why and what to do."""


class DraftHead(nn.Module):
    def __init__(self, target: Transformer, vocab: torch.Tensor):
        super().__init__()
        args, dtype = target.args, target.dtype
        self.args = args
        self.__dict__["target"] = target  # borrowed, not a submodule: never moved, cast or trained with the head
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=False, dtype=dtype)
        self.block = TransformerBlock(args, dtype)
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.register_buffer("vocab", vocab.to(torch.int64), persistent=False)
        self.head: Optional[nn.Module] = None  # the target's LM-head rows of `vocab`: set by attach_lm_head

    def lm_head_rows(self) -> torch.Tensor:
        """The target's LM-head rows for the draft vocabulary [V', dim] (gathered from a packed head if need be)."""
        out = self.target.output
        if isinstance(out, KernelLinear):
            return out.kernels.packed_rows(out.packed, self.vocab)
        return out.weight.detach()[self.vocab]

    def attach_lm_head(self) -> None:
        """Gather the LM-head rows once; on the CPU kernels they become a packed linear layer like the target's."""
        rows = self.lm_head_rows()
        kernels = self.target.kernels
        if kernels is not None:
            self.head = KernelLinear(kernels.pack_weight(rows), rows.shape[0], kernels, torch.float32)
            self.fc = KernelLinear.from_linear(self.fc, kernels)
            self.block.use_cpu_kernels(kernels)
        else:
            linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
            linear.weight = nn.Parameter(rows, requires_grad=False)
            self.head = linear

    def features(self, hidden: torch.Tensor, next_tokens: torch.Tensor, step, k_cache, v_cache) -> torch.Tensor:
        """[B, T, dim] target hidden states and [B, T] next tokens -> the predicted next hidden states [B, T, dim]."""
        x = self.fc(torch.cat([hidden, self.target.tok_embeddings(next_tokens)], dim=-1))
        return self.norm(self.block(x, step, k_cache, v_cache))

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Predicted hidden states -> float32 logits over the draft vocabulary."""
        if self.head is not None:
            return self.head(predicted).float()
        return F.linear(predicted, self.lm_head_rows()).float()


def head_weights(head: DraftHead) -> dict:
    """What a head file holds (bf16 weights, int32 vocabulary), from a head not yet attached to the CPU kernels."""
    return {"fc.weight": head.fc.weight.detach().to("cpu", torch.bfloat16).contiguous(),
            "norm.weight": head.norm.weight.detach().to("cpu", torch.bfloat16).contiguous(),
            "vocab": head.vocab.to("cpu", torch.int32).contiguous(),
            **{f"block.{k}": v.detach().to("cpu", torch.bfloat16).contiguous()
               for k, v in head.block.state_dict().items()}}


def save_draft_head(weights: dict, folder: Path, card: dict) -> None:
    """head.safetensors (head_weights) and card.json (with the weights' sha256 and parameter count, so a copy can
    be checked against its card), written beside each other and moved into `folder` together."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(weights, tmp / "head.safetensors", metadata={"format": "pt"})
    card = {**card, "parameters": sum(t.numel() for name, t in weights.items() if name != "vocab"),
            "weights_sha256": hashlib.sha256((tmp / "head.safetensors").read_bytes()).hexdigest()}
    (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def read_draft_head(folder, args: ModelArgs, flag: str = "--draft_head") -> dict:
    """The weights in `folder` (head.safetensors, card.json), checked against the target's ModelArgs before any
    model loads: a clear error naming the flag and the fix when they do not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    path = folder / "head.safetensors"
    if not path.is_file():
        raise DraftHeadError(f"{flag} {str(folder)!r} has no head.safetensors; point {flag} at a folder written by "
                             "`make train-draft-head` (head.safetensors + card.json)")
    try:
        weights = load_file(path)
    except (SafetensorError, OSError) as e:
        raise DraftHeadError(f"{flag} {path} cannot be read as safetensors ({e}); train or copy the head again") from None
    try:
        card = json.loads((folder / "card.json").read_text()) if (folder / "card.json").is_file() else {}
    except json.JSONDecodeError:
        card = {}
    trained_for = f"a head trained for {card.get('target', 'another model')}"
    with torch.device("meta"):
        block = TransformerBlock(args, torch.bfloat16).state_dict()
    expected = {"fc.weight": (args.dim, 2 * args.dim), "norm.weight": (args.dim,),
                **{f"block.{k}": tuple(v.shape) for k, v in block.items()}}
    for name, shape in expected.items():
        if name not in weights or tuple(weights[name].shape) != shape:
            got = tuple(weights[name].shape) if name in weights else "missing"
            raise DraftHeadError(f"{flag} {folder}: {name} is {got}, but this target needs {shape} ({trained_for}); "
                                 "train one for this target with `make train-draft-head ARGS='--model ...'`")
    vocab = weights.get("vocab")
    if vocab is None or vocab.dim() != 1 or vocab.numel() == 0:
        raise DraftHeadError(f"{flag} {folder}: no draft vocabulary (vocab); train the head again")
    if int(vocab.max()) >= args.vocab_size or int(vocab.min()) < 0:
        raise DraftHeadError(f"{flag} {folder}: its draft vocabulary holds ids outside the target's [0, "
                             f"{args.vocab_size}) ({trained_for}, another tokenizer); train one for this target")
    return weights


def build_draft_head(weights: dict, target: Transformer) -> DraftHead:
    """A DraftHead on `target` (its embedding, rotary tables and LM-head rows) from read_draft_head's weights."""
    head = DraftHead(target, weights["vocab"].to(torch.int64))
    head.block.load_state_dict({k.removeprefix("block."): v.to(target.dtype) for k, v in weights.items()
                                if k.startswith("block.")})
    head.fc.weight.data = weights["fc.weight"].to(target.dtype)
    head.norm.weight.data = weights["norm.weight"].to(target.dtype)
    head.to(target.device)
    head.attach_lm_head()
    return head.eval()


def load_draft_head(folder, target: Transformer, flag: str = "--draft_head") -> DraftHead:
    return build_draft_head(read_draft_head(folder, target.args, flag), target)


class HeadRunner:
    """The head with a KV cache of its own per user (one layer), run in packed steps like the target's (each row
    attends through its own call, so its results do not depend on what else shares the run): the torch
    `DraftHeadModel` of speculative/head_drafter.py. `draft_cost`: one run of one row relative to a target decode
    step, as the ratio of the weights each streams (the projection, layer and LM-head rows against every layer and
    the whole LM head)."""

    max_rows = 256  # catch-up rows per user and run (a prompt goes in chunks)

    def __init__(self, head: DraftHead, max_batch_size: int):
        self.head, self.target = head, head.target
        self.cache = self.target.new_cache(1, max_batch_size)
        self.vocab, self.vocab_size = head.vocab, head.args.vocab_size
        args = head.args
        layer = args.weight_bytes_per_token(1, 1) - args.weight_bytes_per_token(0, 1)
        head_weights = 2 * args.dim * args.dim + layer + len(head.vocab) * args.dim
        self.draft_cost = head_weights / args.weight_bytes_per_token(args.n_layers, 1)

    @torch.inference_mode()
    def run(self, users: Sequence[int], start_pos: Sequence[int], hidden: Sequence[torch.Tensor],
            next_tokens: Sequence[Sequence[int]], every_row: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per user: the predicted next hidden states [n, dim] and the draft-vocabulary logits after its last row
        [V'] (after every row [n, V'] with every_row)."""
        window = self.head.args.sliding_window or self.target.max_seq_len
        exact, rows, slots = [], [], []
        for u, start, toks in zip(users, start_pos, next_tokens):
            for i in range(len(toks)):
                pos = start + i
                exact.append(ExactToken(len(exact), u, pos, pos, max(0, pos + 1 - window), pos + 1))
                rows.append(u)
                slots.append(pos)
        x = torch.cat(list(hidden)).to(device=self.target.device, dtype=self.target.dtype)
        flat = [t for toks in next_tokens for t in toks]
        if len(flat) == 1 and self.target.kernels is None:  # a padding partner, as TorchCausalLM._packed_step
            x, flat = torch.cat([x, x]), flat + flat
            rows, slots = rows + rows, slots + [self.cache.scratch_slot]
        dev = self.target.device
        step = self.target.step_inputs(positions=torch.tensor([slots], device=dev), query_pos=None,
                                       rows=torch.tensor([rows], device=dev), kv_len=0, all_rows=False,
                                       exact_tokens=exact)
        predicted = self.head.features(x.unsqueeze(0), torch.tensor([flat], device=dev), step, self.cache.k[0],
                                       self.cache.v[0])[0, : len(exact)]
        ends = list(accumulate(len(toks) for toks in next_tokens))
        logits = self.head.logits(predicted if every_row else predicted[[end - 1 for end in ends]])
        return [(predicted[end - len(toks) : end], logits[end - len(toks) : end] if every_row else logits[i])
                for i, (toks, end) in enumerate(zip(next_tokens, ends))]
