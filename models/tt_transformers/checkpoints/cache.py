# SPDX-License-Identifier: Apache-2.0
"""The cache root: TT_CACHE_PATH, else ~/.cache/tt_speculative. Converted GGUF checkpoints, TT-Transformers' weight
caches and HF-name links, converted draft heads, the bf16 CPU kernels and the drafting extension all live under it."""
import os
from pathlib import Path


def cache_root() -> Path:
    """Where every cache of this package lives (TT_CACHE_PATH)."""
    return Path(os.environ.get("TT_CACHE_PATH") or Path.home() / ".cache" / "tt_speculative")
