# SPDX-License-Identifier: Apache-2.0
"""What copied drafts are copied from: a suffix automaton per request (suffix_automaton.py), a memory of earlier
responses and a corpus (draft_memory.py), and the target's recycled predictions with the token trees built from them
(token_tree.py). Each has a Python reference and a C port (suffix_native.c, native.py) built on first use;
`implementations()` gives whichever runs here."""
from typing import Callable, NamedTuple

from . import native
from .suffix_automaton import ReferenceSuffixAutomaton
from .token_tree import ReferenceRecycledTokens, reference_build_tree


class CopySources(NamedTuple):
    SuffixAutomaton: type
    RecycledTokens: type
    build_tree: Callable


def implementations() -> CopySources:
    """The C port's classes and tree builder where the extension builds (the first call builds it), else the Python
    references: the same drafts either way (tests/speculative/test_suffix_native.py)."""
    module = native.suffix_native()
    if module is None:
        return CopySources(ReferenceSuffixAutomaton, ReferenceRecycledTokens, reference_build_tree)
    return CopySources(module.SuffixAutomaton, module.RecycledTokens, module.build_tree)
