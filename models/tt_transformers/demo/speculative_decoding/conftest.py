# SPDX-License-Identifier: Apache-2.0
"""The demo's pytest options, registered beside the demo as well as at the repository root: in a tt-metal checkout
this folder sits under tt-metal's own demo conftest, which registers the options TT demos share first."""
from models.tt_transformers.demo.speculative_decoding.options import add_demo_options


def pytest_addoption(parser):
    add_demo_options(parser)
