# SPDX-License-Identifier: Apache-2.0
"""The one place a drafter is assembled from a SpeculativeConfig: every front end (the command line and pytest form,
the tests, the benchmarks, the tools) builds its drafters here. The default is the demo's: a hybrid of copied drafts
and the draft head shipped for the target's checkpoint (or a published EAGLE-3 head: config.draft_head).

    target = TorchCausalLM(model, model.args.n_layers, max_batch_size=1)
    drafter = make_drafter(SpeculativeConfig(), target)  # or SpeculativeConfig(draft_mode="head", draft_head=folder)
    SpeculativeGenerator(target, drafter, 4).generate([prompt], 64)
"""
from typing import Optional, Sequence

from ..errors import (
    UserError,
    check_implements,
    described,
    check_instance,
    check_number,
    check_token_lists,
)
from .backend import CausalLM
from .config import SpeculativeConfig, default_draft_layers
from .copy_sources.draft_memory import DraftMemory
from .drafters import Drafter, HeadDrafter, HybridDrafter, ModelDrafter, SuffixDrafter, TracedHeadDrafter
from .drafters.eagle3 import DraftHeadModel
from .drafters.eagle3_device import ChainDraftHead
from .generator import MAKE_TARGET


def make_drafter(config: SpeculativeConfig, target: CausalLM, *, draft_lm: Optional[CausalLM] = None,
                 draft_cost: Optional[float] = None, head: Optional[DraftHeadModel] = None,
                 device_head: Optional[ChainDraftHead] = None, documents: Sequence[Sequence[int]] = ()
                 ) -> Optional[Drafter]:
    """The drafter `config.draft_mode` names for `target` (None for plain decoding: n_draft_tokens 0).

    Args:
        config: the settings (checked here).
        target: the model that verifies.
        draft_lm: the draft model for "model" and "hybrid" without a head; default the target's first
            config.draft_layers layers (CausalLM.draft_view: its weights and cache). Given to a hybrid with no
            config.draft_head named, it drafts instead of the shipped head.
        draft_cost: one draft-model token's cost in target forwards, which a hybrid weighs; default draft_lm's layers
            over the target's.
        head: an EAGLE-3 draft head already built, beside the target on its tapped states (a DraftHeadModel), in
            place of config.draft_head's.
        device_head: the same where the target leaves its taps (a ChainDraftHead: a TT device's).
        documents: token ids to draft from beside earlier responses (a corpus), for copied drafts.

    Returns:
        suffix: copied drafts (SuffixDrafter: the request's text, a memory of draft_memory tokens of earlier
        responses and `documents`, recycle_top_k recycled predictions); head: the head's drafter (config.draft_head's,
        built by the target's backend: CausalLM.draft_head); model: the draft model drafting every step; hybrid: the
        copied drafts or the head's (the draft model's without a head), whichever is expected to bring more tokens
        per unit of work.

    Raises:
        UserError: a setting out of range, an argument that does not fit the target (check_drafter_inputs); a draft
            head that cannot be found or does not fit the target (its hidden size, vocabulary or taps), or none for
            head mode; draft_head named beside a built head; a target without draft_head where a head is read.
    """
    documents = check_drafter_inputs(config, target, draft_lm, draft_cost, head, device_head, documents)
    if config.n_draft_tokens == 0:
        return None
    heads = head_drafter(head, device_head)
    if heads is not None and config.draft_head is not None:
        raise UserError(f"draft_head {str(config.draft_head)!r} and a built head (head or device_head) both given; "
                        "leave draft_head None to draft with the built one, or pass no head", "draft_head")
    if heads is None and config.reads_head(draft_lm is not None):
        heads = head_drafter(**target.draft_head(config.draft_head, config.n_draft_tokens,
                                                 required=config.draft_mode == "head"))
    copied = None
    if config.copies:
        memory = DraftMemory(config.draft_memory, documents) if config.draft_memory or documents else None
        copied = SuffixDrafter(config.sa_threshold, memory, config.recycle_top_k)
    if config.draft_mode == "suffix":
        return copied
    if config.draft_mode == "head":
        return heads  # the backend's draft_head refuses head mode without a head
    if heads is not None and config.draft_mode == "hybrid":
        return HybridDrafter(copied, heads)
    if draft_lm is None:
        draft_lm = target.draft_view(draft_layers_of(config, target))
    if config.draft_mode == "model":
        return ModelDrafter(draft_lm)  # every draft has the full n_draft_tokens
    # hybrid: the model drafts only while its acceptance pays for its cost
    return HybridDrafter(copied, ModelDrafter(draft_lm, draft_cost if draft_cost is not None
                                              else draft_lm.n_layers / target.n_layers))


def draft_layers_of(config: SpeculativeConfig, target: CausalLM) -> int:
    """The target's first layers the draft model is made of: config.draft_layers (0 is refused, not the default), or
    the default fitted to the target."""
    return config.draft_layers if config.draft_layers is not None else default_draft_layers(target.n_layers)


def check_drafter_inputs(config: SpeculativeConfig, target: CausalLM, draft_lm: Optional[CausalLM],
                         draft_cost: Optional[float], head, device_head, documents) -> list[list[int]]:
    """make_drafter's arguments, checked before anything is built: each of the right kind, and every model or head
    given fitting the target (its vocabulary, its batch, its context, its layers). Returns the documents as lists of
    token ids."""
    check_instance("config", config, SpeculativeConfig, "pass SpeculativeConfig(draft_mode=..., n_draft_tokens=...)")
    config.check()
    check_implements("target", target, CausalLM, ("n_layers", "vocab_size", "max_batch_size", "max_seq_len",
                                                  "draft_view"), MAKE_TARGET)
    if draft_cost is not None:
        check_number("draft_cost", draft_cost, 0, lo_open=True, fix="one draft token's cost in target forwards")
    if head is not None and device_head is not None:
        raise UserError("give a draft head beside the target (head) or one on the device (device_head), not both",
                        "device_head")
    if head is None and device_head is None and config.reads_head(draft_lm is not None) \
            and not hasattr(target, "draft_head"):  # a CausalLM of its own, written before heads were built by it
        other = "" if config.draft_mode == "head" else ", or draft_head='none' to draft without a head"
        raise UserError(f"target ({described(target)}) has no draft_head, so it cannot build the draft head draft_mode "
                        f"{config.draft_mode!r} reads; pass a built head (head or device_head){other}", "target")
    for name, given in (("head", head), ("device_head", device_head)):
        if given is not None and given.vocab_size != target.vocab_size:
            raise UserError(f"{name} drafts over a vocabulary of {given.vocab_size:,} tokens, the target's has "
                            f"{target.vocab_size:,}; pass a head trained for this target", name)
        if given is not None and max(given.taps, default=0) > target.n_layers:
            raise UserError(f"{name} reads the target's layers {list(given.taps)}, but the target has "
                            f"{target.n_layers}; pass a head trained for this target", name)
    if draft_lm is not None:
        check_implements("draft_lm", draft_lm, CausalLM, ("n_layers", "vocab_size", "max_batch_size", "max_seq_len",
                                                          "prefill", "step"), MAKE_TARGET)
        if draft_lm.vocab_size != target.vocab_size:
            raise UserError(f"draft_lm has a vocabulary of {draft_lm.vocab_size:,} tokens, the target "
                            f"{target.vocab_size:,}; pass a draft model of the target's family, with its tokenizer",
                            "draft_lm")
        for name in ("max_batch_size", "max_seq_len"):  # the draft drafts for every user, to the end of the context
            if getattr(draft_lm, name) < getattr(target, name):
                raise UserError(f"draft_lm was built for {name} {getattr(draft_lm, name)}, the target for "
                                f"{getattr(target, name)}; build it with the target's {name}", "draft_lm")
    elif config.n_draft_tokens and (config.draft_mode == "model" or config.draft_mode == "hybrid" and head is None
                                    and device_head is None):
        layers = draft_layers_of(config, target)
        if layers >= target.n_layers:
            raise UserError(f"draft_layers {layers}: the draft model is the target's first layers, and the "
                            f"{target.n_layers}-layer target has {target.n_layers - 1 or 'none'} to spare; lower "
                            "draft_layers, pass draft_lm, or use draft_mode 'suffix'", "draft_layers")
    return check_token_lists("documents", documents, target.vocab_size, "pass a list of token id lists")


def head_drafter(head: Optional[DraftHeadModel] = None, device_head: Optional[ChainDraftHead] = None):
    """The drafter of whichever head is given: HeadDrafter beside the target, TracedHeadDrafter on the device."""
    if device_head is not None:
        return TracedHeadDrafter(device_head)
    return HeadDrafter(head) if head is not None else None
