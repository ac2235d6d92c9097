# SPDX-License-Identifier: Apache-2.0
"""Opening the mesh device named by MESH_DEVICE the way tt-metal's `mesh_device` fixture does (for the CLI and our
pytest fixture, conftest.py): the mesh shape from tt-metal's name table, the fabric configured before a mesh of
more than one device opens (TT-Transformers' decode runs CCL ops there) and reset after it closes, and a trace
region sized for the traces the run will capture (trace_plan.py)."""
import glob
import os
from contextlib import contextmanager
from typing import Optional

from ..errors import UserError
from .ttnn_api import ttnn

# MESH_DEVICE -> mesh shape, as models/tt_transformers/conftest.py (device_params) and TT's text generation
# parametrize it; P100 is one Blackhole chip (trace_region_config.py, get_mesh_device_name passes it through).
# Unset or unknown: every device, (1, N), as the same table's fallback len(ttnn.get_device_ids()).
MESH_SHAPES = {"N150": (1, 1), "N300": (1, 2), "N150x4": (1, 4), "T3K": (1, 8), "TG": (8, 4),
               "P100": (1, 1), "P150": (1, 1), "P300": (1, 2), "P150x4": (1, 4), "P150x8": (1, 8), "BHGLX": (8, 4)}
NUM_COMMAND_QUEUES = 1  # as tt-metal's text generation
# Trace region sizes already opened, by mesh object: what trace_plan checks a run's traces against.
TRACE_REGIONS: dict[int, int] = {}


def tt_device_present() -> bool:
    return bool(glob.glob("/dev/tenstorrent*"))


# A Galaxy's devices (8 x 4): TT-Transformers' ModelArgs.is_galaxy (tt/model_config.py: num_devices == 32)
GALAXY_DEVICES = 32
# TT's data_parallel for a model of 8 devices on a Galaxy: four 1 x 8 submeshes (tt/generator.py
# _galaxy_data_parallel_submesh_shape: "DP=4 maps to four routeable 1x8 T3K-like submeshes")
GALAXY_DATA_PARALLEL = 4
# Submeshes made of a mesh open_mesh opened, by the mesh's id: kept (and their trace regions known) until it closes
SUBMESHES: dict[int, object] = {}


def check_tensor_parallel(mesh_device) -> None:
    """A model is not built tensor-parallel over a whole Galaxy: at tt-metal 622c6fb9 TT-Transformers' own path there
    (ModelArgs.is_galaxy) fails TT's checks for Llama-3.1-8B on the mock Galaxy, in prefill (tt/attention.py
    forward_prefill hands rotary_embedding_llama the bfloat8_b ccl_dtype output of its QKV all-reduce:
    rotary_embedding_llama_device_operation.cpp "All input tensors must have dtype = bfloat16") and in decode (its
    QKV linear gets a DRAM-sharded program config over DRAM-interleaved wqkv: matmul_device_operation.cpp "Input B
    memory layout must be WIDTH_SHARDED"). TT runs such models on a Galaxy data-parallel, tensor-parallel within a
    submesh (model_mesh). One line, before anything is built."""
    if mesh_device.get_num_devices() == GALAXY_DEVICES:
        raise UserError(f"mesh_device: a {' x '.join(map(str, tuple(mesh_device.shape)))} Galaxy mesh: "
                        "TT-Transformers' tensor parallelism over all 32 devices fails TT's own checks (prefill's "
                        "rotary embedding, decode's QKV matmul); build the model on a submesh of 8 devices, as TT runs "
                        "models on a Galaxy (device.model_mesh: tt/generator.py create_submeshes(mesh_device, 4)[0])",
                        "mesh_device")


def model_mesh_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """The shape of the mesh model_mesh builds a model on, for a mesh of this shape: a Galaxy's 1 x 8 submesh."""
    return (1, GALAXY_DEVICES // GALAXY_DATA_PARALLEL) if shape[0] * shape[1] == GALAXY_DEVICES else tuple(shape)


def model_mesh(mesh_device):
    """The mesh a model is built on, as TT runs a model of 8 devices on this machine: on a Galaxy, the first of TT's
    data-parallel submeshes (tt/generator.py create_submeshes(mesh_device, 4): the mesh reshaped to 4 x 8, four
    1 x 8 rows, as simple_text_demo.py's prepare_generator_args makes them for its data_parallel 4 cases and
    models/demos/qwen25_vl/conftest.py's qwen25_vl_mesh_device takes the first), tensor-parallel within it; any
    other mesh, itself. One model runs, not four: the speculative loop steps one model (docs/ttnn_backend.md,
    "Galaxy"). Made once per mesh open_mesh opened, whose trace region (each chip's) it shares and which closes it
    before itself."""
    if mesh_device.get_num_devices() != GALAXY_DEVICES:
        return mesh_device
    if id(mesh_device) in SUBMESHES:
        return SUBMESHES[id(mesh_device)]
    from models.tt_transformers.tt.generator import create_submeshes

    submesh = create_submeshes(mesh_device, GALAXY_DATA_PARALLEL)[0]
    if id(mesh_device) in TRACE_REGIONS:
        SUBMESHES[id(mesh_device)] = submesh
        TRACE_REGIONS[id(submesh)] = TRACE_REGIONS[id(mesh_device)]
    return submesh


def mesh_shape(name: Optional[str] = None) -> tuple[int, int]:
    """The shape tt-metal opens for MESH_DEVICE=name; unset: all devices in one row (needs ttnn and a device)."""
    name = name if name is not None else os.environ.get("MESH_DEVICE")
    if name in MESH_SHAPES:
        return MESH_SHAPES[name]
    if name:
        raise ValueError(f"MESH_DEVICE={name!r} is not one of {', '.join(MESH_SHAPES)}; set it to the machine's "
                         "mesh, or unset it to open every device")
    return (1, len(ttnn.get_device_ids()))


def fabric_config_for(shape: tuple[int, int]):
    """The fabric TT-Transformers' CCL ops need on a mesh of more than one device (None for one device: the fabric
    needs at least two chips), as models/tt_transformers/conftest.py's device_params turns `fabric_config: True` into
    one: FABRIC_2D_TORUS_XY on a Blackhole Galaxy, FABRIC_1D_RING on a 6U Galaxy (conftest.py is_6u: cluster type
    GALAXY), FABRIC_1D otherwise."""
    if shape[0] * shape[1] == 1:
        return None
    cluster = ttnn.cluster.get_cluster_type()
    if cluster == ttnn.cluster.ClusterType.BLACKHOLE_GALAXY:
        return ttnn.FabricConfig.FABRIC_2D_TORUS_XY
    if cluster == ttnn.cluster.ClusterType.GALAXY:
        return ttnn.FabricConfig.FABRIC_1D_RING
    return ttnn.FabricConfig.FABRIC_1D


def dispatch_params(device_params: dict, fabric) -> tuple[dict, object]:
    """device_params as tt-metal's get_updated_device_params (tests/scripts/common.py, the 2026 form the root
    conftest imports) turns them into open_mesh_device's: dispatch_core_axis and dispatch_core_type become one
    ttnn.DispatchCoreConfig(type, axis, fabric_tensix_config); on Blackhole ROW dispatch needs both a fabric and a
    fabric tensix config, else it falls back to COL ("ROW dispatch requires both fabric and tensix config, using
    DispatchCoreAxis.COL instead"). The tensix config is the caller's (device_params' fabric_tensix_config, e.g. MUX),
    else the root conftest's get_default_fabric_tensix_config(): DISABLED on every architecture (one downstream copy
    defaults Blackhole to MUX with ROW dispatch: not followed). Returns the parameters and the tensix config set_fabric
    passes on."""
    params = dict(device_params)
    axis, kind = params.pop("dispatch_core_axis", None), params.pop("dispatch_core_type", None)
    tensix = params.pop("fabric_tensix_config", None)
    if ttnn.device.is_blackhole() and not (fabric is not None and tensix is not None) and \
            axis == ttnn.DispatchCoreAxis.ROW:
        axis = ttnn.DispatchCoreAxis.COL
    params.setdefault("dispatch_core_config", ttnn.DispatchCoreConfig(kind, axis, tensix))
    return params, tensix if tensix is not None else ttnn.FabricTensixConfig.DISABLED


@contextmanager
def open_mesh(name: Optional[str] = None, trace_region_size: int = 0, fabric_config=True,
              num_command_queues: int = NUM_COMMAND_QUEUES, reliability_mode=None, **device_params):
    """The mesh device for MESH_DEVICE, closed on exit. Takes device_params as tt-metal's models parametrize them:
    like tt-metal's root conftest.py `mesh_device` fixture it pops fabric_config (True: the mesh's own, as
    fabric_config_for; None or False: none; else that FabricConfig) and reliability_mode, resolves the dispatch
    config (dispatch_params), runs set_fabric before open_mesh_device (which takes no fabric keyword), and after
    closing reset_fabric (the fabric config cannot change while a mesh is open). With MESH_DEVICE unset (and no name)
    it opens the system mesh's own shape, as open_mesh_device does without one (8 x 4 on a Galaxy)."""
    if not tt_device_present():
        raise ValueError("the ttnn backend needs a Tenstorrent device (no /dev/tenstorrent* here); use --backend torch")
    named = name if name is not None else os.environ.get("MESH_DEVICE")
    shape = mesh_shape(name)
    fabric = fabric_config_for(shape) if fabric_config is True else (fabric_config or None)
    if shape == (1, 1):
        fabric = None  # models/tt_transformers/conftest.py: no fabric on a single device
    device_params, tensix = dispatch_params(device_params, fabric)
    if fabric is not None:  # set_fabric: set_fabric_config(config, reliability_mode, num_planes, fabric_tensix_config)
        ttnn.set_fabric_config(fabric, reliability_mode or ttnn.FabricReliabilityMode.STRICT_INIT, None, tensix)
    try:
        mesh = ttnn.open_mesh_device(mesh_shape=ttnn.MeshShape(*shape) if named else None,
                                     trace_region_size=trace_region_size, num_command_queues=num_command_queues,
                                     **device_params)
        TRACE_REGIONS[id(mesh)] = trace_region_size
        try:
            yield mesh
        finally:
            TRACE_REGIONS.pop(id(mesh), None)
            if id(mesh) in SUBMESHES:  # a submesh shares its parent's command queue, and ttnn 0.81.1 refuses to
                # close a mesh while its submesh's is in use ("cq ID 0 is in use by child submesh", mesh_device.cpp
                # close_impl): the submesh closes first, as tt/generator.py Generator.__del__ closes its submeshes
                # ("Workaround for issue #19052"). Nothing runs on the Galaxy itself, whose queue would then refuse
                # the submesh's close ("in use by parent mesh"); quiesce_devices, which resets both, crashes the mock
                submesh = SUBMESHES.pop(id(mesh))
                TRACE_REGIONS.pop(id(submesh), None)
                ttnn.close_mesh_device(submesh)
            ttnn.close_mesh_device(mesh)
    finally:
        if fabric is not None:
            ttnn.set_fabric_config(ttnn.FabricConfig.DISABLED)
