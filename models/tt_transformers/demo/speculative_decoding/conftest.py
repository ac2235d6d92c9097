# SPDX-License-Identifier: Apache-2.0
"""The demo's pytest options, registered beside the demo as well as at the repository root: in a tt-metal checkout
this folder sits under tt-metal's own demo conftest, which registers the options TT demos share first."""
import pytest

from models.tt_transformers.demo.speculative_decoding.inputs import check_inputs
from models.tt_transformers.demo.speculative_decoding.options import add_demo_options, config_from_pytest


def pytest_addoption(parser):
    add_demo_options(parser)


def pytest_collection_modifyitems(config, items):
    """A bad option stops the demo's test before anything runs, as pytest's own usage errors do: one line, no
    source listing (the checks need no weights)."""
    if any(item.originalname == "test_speculative_demo" for item in items):
        try:
            check_inputs(config_from_pytest(config))
        except ValueError as e:  # DemoInputError, CheckpointError, ModelConfigError: the message names the fix
            raise pytest.UsageError(str(e)) from None
