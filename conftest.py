# SPDX-License-Identifier: Apache-2.0
"""Demo options (read as `request.config.getoption(...) or default`, as TT-Transformers demos do) and markers.

Tests that need what a machine may lack are collected everywhere and skipped with the reason where it is missing,
never deselected silently: `tt_hardware` runs where /dev/tenstorrent* exists, `cuda` where torch sees a CUDA
device, and `slow` (long end-to-end runs) with --run_slow (`make test-slow`).
"""
import glob

import pytest

from models.tt_transformers.demo.speculative_decoding.options import add_demo_options


def pytest_addoption(parser):
    add_demo_options(parser)
    parser.addoption("--run_slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end runs; run with --run_slow (make test-slow)")
    config.addinivalue_line("markers", "tt_hardware: needs a Tenstorrent device (/dev/tenstorrent*)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device visible to torch")
    config.addinivalue_line("markers", "models_performance_bare_metal: TT CI perf test")


@pytest.fixture
def device_params(request):
    """Device settings, parametrized indirectly as in tt-metal's demos."""
    return dict(getattr(request, "param", {}))


@pytest.fixture
def mesh_device(request, device_params):
    """The Tenstorrent mesh named by MESH_DEVICE (every device when unset), opened as tt-metal's `mesh_device`
    fixture opens it (ttnn_backend/device.py: the fabric on meshes of several devices), and the mesh a model runs on
    (device.model_mesh: on a Galaxy one of TT's 1 x 8 submeshes); its trace region is device_params'
    trace_region_size, else sized for the demo options this run was given. Skipped with the reason on machines
    without a device (the ttnn backend then cannot run)."""
    from models.tt_transformers.demo.speculative_decoding.build import trace_region_size
    from models.tt_transformers.demo.speculative_decoding.options import config_from_pytest
    from models.tt_transformers.ttnn_backend.device import mesh_shape, model_mesh, open_mesh, tt_device_present

    if not tt_device_present():
        pytest.skip("needs a Tenstorrent device: no /dev/tenstorrent* here")
    params = dict(device_params)
    region = params.pop("trace_region_size", None) or trace_region_size(config_from_pytest(request.config), mesh_shape())
    with open_mesh(trace_region_size=region, **params) as mesh:
        yield model_mesh(mesh)


def missing_resources(config) -> dict:
    import torch

    return {
        "slow": None if config.getoption("--run_slow") else "slow end-to-end case: run with --run_slow (make test-slow)",
        "tt_hardware": None if glob.glob("/dev/tenstorrent*") else "needs a Tenstorrent device: no /dev/tenstorrent* here",
        "cuda": None if torch.cuda.is_available() else "needs CUDA: torch sees no CUDA device here",
    }


def pytest_collection_modifyitems(config, items):
    reasons = {marker: reason for marker, reason in missing_resources(config).items() if reason}
    for item in items:
        for marker, reason in reasons.items():
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
