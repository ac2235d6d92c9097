# SPDX-License-Identifier: Apache-2.0
# Shared with a tt-metal checkout's folder of the same name: this package's path takes in every such folder on
# sys.path, so models.tt_transformers.tt (tt-metal's) imports beside ours whether tt-metal's folders are regular or
# namespace packages, as long as this repository comes first on the path (the demo puts itself first when run).
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

import os as _os
import sys as _sys

# TT_CPU_ISA (torch_backend/cpu_isa.py) forces a CPU path; set before torch loads, it caps torch's own kernels alike.
_torch_capability = {"avx512": "avx512", "avx2": "avx2", "portable": "default"}.get(_os.environ.get("TT_CPU_ISA", ""))
if _torch_capability and "torch" not in _sys.modules:
    _os.environ.setdefault("ATEN_CPU_CAPABILITY", _torch_capability)
