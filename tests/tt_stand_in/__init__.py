# SPDX-License-Identifier: Apache-2.0
"""TEST DOUBLE: a stand-in for `ttnn` and the TT-Transformers modules the ttnn backend imports, for running the
backend's host-side logic where no Tenstorrent device exists. It models the device's constraints (ttnn.py) but is
not ttnn and never counts as evidence that the device path works: only the `tt_hardware` tests can show that."""
import sys

from . import generator_vllm, tt_transformers
from . import ttnn as stand_in_ttnn

TT_TRANSFORMERS_MODULES = ("models.tt_transformers.tt", "models.tt_transformers.tt.common",
                           "models.tt_transformers.tt.model", "models.tt_transformers.tt.model_config",
                           "models.tt_transformers.tt.attention", "models.tt_transformers.tt.generator",
                           "models.tt_transformers.tt.ccl", "models.common", "models.common.lightweightmodule")


def install(monkeypatch) -> None:
    """Make `import ttnn` and `models.tt_transformers.tt.*` resolve to the stand-in for one test."""
    monkeypatch.setitem(sys.modules, "ttnn", stand_in_ttnn)
    for name in TT_TRANSFORMERS_MODULES:
        monkeypatch.setitem(sys.modules, name, tt_transformers)
    monkeypatch.setitem(sys.modules, "models.tt_transformers.tt.generator_vllm", generator_vllm)
