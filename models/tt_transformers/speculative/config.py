# SPDX-License-Identifier: Apache-2.0
"""Every setting of speculative decoding and its default, in one place: what `make_drafter` builds and what
`SpeculativeGenerator` verifies. The command line's flags take their defaults from here.

    config = SpeculativeConfig(draft_mode="suffix", n_draft_tokens=16)
    config.check()  # UserError naming the parameter and the fix
"""
import os
from dataclasses import dataclass
from typing import Optional, Union

from ..errors import UserError, check_bool, check_choice, check_int
from .backend import MAX_DRAFT_TOKENS
DRAFT_MODES = ("model", "suffix", "head", "hybrid")
DEFAULT_SA_THRESHOLD = 1  # shortest match a copied draft may start from; its score decides whether it drafts
DEFAULT_DRAFT_LAYERS = 8  # the draft model's depth when draft_layers is not given, on targets deeper than that
MAX_RECYCLE_TOP_K = 32  # ttnn.topk's default k; more is never worth a tree row
MAX_TREE_NODES = 32  # nodes of a token tree verified per user and step (copied drafts' trees and a head's)
DEFAULT_DRAFT_MEMORY = 65536  # tokens of earlier responses copied drafts may draw on
NO_DRAFT_HEAD = "none"  # draft_head: draft without a head (hybrid: the draft model instead)


@dataclass
class SpeculativeConfig:
    """How to draft (make_drafter) and verify (SpeculativeGenerator):

    n_draft_tokens: most draft tokens verified per user and target forward; 0 = plain decoding.
    draft_mode: "suffix" (copied drafts only, no model), "head" (a trained EAGLE-3 draft head), "model" (a draft
        model, every draft of n_draft_tokens) or "hybrid" (per step and user, the copied draft or the head's, the draft
        model's where there is no head, whichever is expected to bring more tokens per unit of work).
    draft_head: the EAGLE-3 head of "head" and "hybrid": a folder or a hub id in the local Hugging Face cache (the
        EAGLE authors' layout or speculators'); None = the head shipped for the target's checkpoint
        (models/tt_transformers/draft_heads/<name>), as the demo drafts by default, where one ships and, in a hybrid,
        no draft model is given; "none" = no head (a hybrid then drafts with the draft model).
    sa_threshold: the shortest match (tokens) a copied draft may start from.
    draft_memory: tokens of earlier responses kept to draft from (cross-request memory); 0 = off.
    recycle_top_k: the target's top next tokens kept per token to draft from (token recycling); 0 = off.
    trees: verify token trees (several candidates at once) where the backend can (CausalLM.supports_trees).
    draft_layers: the draft model is the target's first draft_layers layers (sharing its weights and cache) when no
        separate draft model is given; None = default_draft_layers(the target's layers).
    """

    n_draft_tokens: int = 4
    draft_mode: str = "hybrid"
    sa_threshold: int = DEFAULT_SA_THRESHOLD
    draft_memory: int = DEFAULT_DRAFT_MEMORY
    recycle_top_k: int = 4
    trees: bool = True
    draft_layers: Optional[int] = None
    draft_head: Union[str, os.PathLike, None] = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raises UserError, naming the parameter and the fix, for a setting of the wrong type or out of range (at
        construction, and again where the config is used: its fields can be changed in between)."""
        check_n_draft_tokens(self.n_draft_tokens)
        check_choice("draft_mode", self.draft_mode, DRAFT_MODES)
        check_int("sa_threshold", self.sa_threshold, 1, fix="tokens of matched suffix")
        check_int("draft_memory", self.draft_memory, 0, fix="0 turns it off")
        check_int("recycle_top_k", self.recycle_top_k, 0, MAX_RECYCLE_TOP_K, fix="0 turns it off")
        check_bool("trees", self.trees)
        if self.draft_layers is not None:
            check_int("draft_layers", self.draft_layers, 1, fix="leave it out for the default")
        self._check_draft_head()

    def _check_draft_head(self) -> None:
        """draft_head's type and its agreement with draft_mode; the folder itself is read by make_drafter."""
        head = self.draft_head
        if not (head is None or isinstance(head, os.PathLike) or isinstance(head, str) and head.strip()):
            raise UserError(f"draft_head {head!r} is not a head: give a folder or a cached hub id (a str or a path), "
                            f"None for the head shipped for the target, or {NO_DRAFT_HEAD!r} for no head", "draft_head")
        if head == NO_DRAFT_HEAD and self.draft_mode == "head" and self.n_draft_tokens > 0:
            raise UserError(f"draft_head {NO_DRAFT_HEAD!r} with draft_mode 'head', which drafts with a head only: give "
                            "draft_head a folder (or None: the shipped head), or use draft_mode hybrid or suffix",
                            "draft_head")

    @property
    def copies(self) -> bool:
        """Whether copied drafts (SuffixDrafter) take part."""
        return self.n_draft_tokens > 0 and self.draft_mode in ("suffix", "hybrid")

    def reads_head(self, draft_model: bool = False) -> bool:
        """Whether a draft head drafts: in head mode, and in a hybrid but where draft_head is "none" or, with no
        draft_head named, where a draft model is given (the shipped head does not displace a chosen model)."""
        if self.n_draft_tokens == 0 or self.draft_head == NO_DRAFT_HEAD:
            return False
        return self.draft_mode == "head" or self.draft_mode == "hybrid" and (self.draft_head is not None
                                                                             or not draft_model)


def check_n_draft_tokens(n_draft_tokens) -> int:
    return check_int("n_draft_tokens", n_draft_tokens, 0, MAX_DRAFT_TOKENS, fix="0 = plain decoding")


def default_draft_layers(target_layers: int) -> int:
    """The draft model's depth when none is given, fitted to the target: a default nobody chose never stops a run."""
    return DEFAULT_DRAFT_LAYERS if DEFAULT_DRAFT_LAYERS < target_layers else max(1, target_layers // 2)
