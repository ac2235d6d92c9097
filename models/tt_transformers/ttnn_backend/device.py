# SPDX-License-Identifier: Apache-2.0
"""Opening the mesh device named by MESH_DEVICE, as tt-metal's text demo does (for the CLI; pytest uses the
`mesh_device` fixture, conftest.py)."""
import glob
import os
from contextlib import contextmanager

MESH_SHAPES = {"N150": (1, 1), "N300": (1, 2), "T3K": (1, 8), "TG": (8, 4)}
DEVICE_PARAMS = {"trace_region_size": 50_000_000, "num_command_queues": 1}  # tt-metal's text demo uses the same


def mesh_shape(name: str = None) -> tuple[int, int]:
    name = name or os.environ.get("MESH_DEVICE")
    if name not in MESH_SHAPES:
        raise ValueError(f"MESH_DEVICE={name!r} is not one of {', '.join(MESH_SHAPES)}; set it to the machine's mesh")
    return MESH_SHAPES[name]


def tt_device_present() -> bool:
    return bool(glob.glob("/dev/tenstorrent*"))


@contextmanager
def open_mesh(name: str = None, **device_params):
    """The mesh device for MESH_DEVICE, closed on exit."""
    import ttnn

    if not tt_device_present():
        raise ValueError("the ttnn backend needs a Tenstorrent device (no /dev/tenstorrent* here); use --backend torch")
    mesh = ttnn.open_mesh_device(mesh_shape=ttnn.MeshShape(*mesh_shape(name)), **{**DEVICE_PARAMS, **device_params})
    try:
        yield mesh
    finally:
        ttnn.close_mesh_device(mesh)
