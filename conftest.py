# SPDX-License-Identifier: Apache-2.0
"""Demo options (read as `request.config.getoption(...) or default`, as TT-Transformers demos do) and markers."""
import pytest

from models.tt_transformers.demo.speculative_decoding.speculative_demo import DEMO_OPTIONS


def pytest_addoption(parser):
    for name, type_, _, help_ in DEMO_OPTIONS:
        parser.addoption(f"--{name}", action="store", type=type_, default=None, help=help_)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end runs; selected with -m slow")
    config.addinivalue_line("markers", "tt_hardware: needs a Tenstorrent device; selected with -m tt_hardware")
    config.addinivalue_line("markers", "models_performance_bare_metal: TT CI perf test")
