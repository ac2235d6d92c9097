# SPDX-License-Identifier: Apache-2.0
"""The demo's pytest options, registered beside the demo as well as at the repository root: in a tt-metal checkout
this folder sits under tt-metal's own demo conftest, which registers the options TT demos share first."""
import pytest

from models.tt_transformers.demo.speculative_decoding.inputs import check_inputs
from models.tt_transformers.demo.speculative_decoding.options import add_demo_options, config_from_pytest
from models.tt_transformers.demo.speculative_decoding.speculative_demo import RESULT_LINES
from models.tt_transformers.errors import UserError


def pytest_addoption(parser):
    add_demo_options(parser)


def pytest_collection_modifyitems(config, items):
    """A bad option stops the demo's test before anything runs, as pytest's own usage errors do: one line, no
    source listing (the checks need no weights)."""
    if any(item.originalname == "test_speculative_demo" for item in items):
        try:
            check_inputs(config_from_pytest(config))
        except UserError as e:  # a flag, a file, a checkpoint: the message names the fix
            raise pytest.UsageError(str(e)) from None


def pytest_terminal_summary(terminalreporter, config):
    """The demo's result (performance, speedup, warnings, the per-prompt table) in pytest's summary: captured
    output is shown only for failures, and `1 passed` alone says nothing of what ran."""
    if RESULT_LINES in config.stash:
        terminalreporter.write_sep("=", "speculative decoding demo")
        for line in config.stash[RESULT_LINES]:
            terminalreporter.write_line(line)
