# SPDX-License-Identifier: Apache-2.0
# Shared with a tt-metal checkout's folder of the same name: this package's path takes in every such folder on
# sys.path, so models.tt_transformers.tt (tt-metal's) imports beside ours whether tt-metal's folders are regular or
# namespace packages, as long as this package is found first (README, "Next to tt-metal").
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

import os as _os
import platform as _platform

from .cpu_caps import cap_libraries as _cap_libraries

# TT_CPU_ISA (torch_backend/cpu_isa.py) forces a CPU path; set here, before torch loads, its caps reach torch's own
# kernels, oneDNN and MKL alike (cpu_caps.py).
_cap_libraries(_os.environ.get("TT_CPU_ISA", ""), _platform.machine())
