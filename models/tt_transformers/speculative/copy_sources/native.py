# SPDX-License-Identifier: Apache-2.0
"""The drafting extension (suffix_native.c: the suffix automaton, the recycled-token table and the token-tree builder in
C, so drafting's host time per iteration stays small beside a device step; `make bench-suffix` measures it), built with
the system C compiler on first use (not at import) and cached under TT_CACHE_PATH. Without a compiler, or with
TT_NATIVE_DRAFTING=0, the Python references in suffix_automaton.py and token_tree.py run instead: the same drafts,
slower."""
import functools
import importlib.machinery
import importlib.util
import os
import sysconfig
from pathlib import Path

from loguru import logger

from ...checkpoints.cache import cache_root
from ...native_build import build_library
from ..draft_length import LENGTH_BUCKETS

SOURCE = Path(__file__).with_name("suffix_native.c")
FALLBACK = "drafting runs its Python reference (slower, same drafts)"


def load_suffix_native():
    """The extension module, or None where it cannot be built (or TT_NATIVE_DRAFTING=0)."""
    if os.environ.get("TT_NATIVE_DRAFTING", "1") == "0":
        return None
    include, suffix = sysconfig.get_paths()["include"], importlib.machinery.EXTENSION_SUFFIXES[0]
    if not (Path(include) / "Python.h").is_file():
        logger.warning(f"no Python.h in {include} (install your Python's development headers) to build {SOURCE.name}: "
                       f"{FALLBACK}")
        return None
    path = build_library(SOURCE, cache_root() / "native", ["-O2", f"-I{include}"], depends_on=suffix, suffix=suffix,
                         fallback=FALLBACK)
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("suffix_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.set_length_buckets(LENGTH_BUCKETS)
    return module



@functools.cache
def suffix_native():
    """The extension, built (or loaded from the cache) on the first call; None where it cannot be."""
    return load_suffix_native()
