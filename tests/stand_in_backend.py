# SPDX-License-Identifier: Apache-2.0
"""The ttnn backend built on the stand-in (tests/tt_stand_in, a TEST DOUBLE for ttnn and TT-Transformers), and the
prompts and plain outputs the ttnn tests compare against (fixtures registered by conftest.py)."""
import pytest
import torch

from models.tt_transformers.prompts import encode
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
from models.tt_transformers.ttnn_backend.traces import MeshTraces
from models.tt_transformers.ttnn_backend.model import build_tt_model

from .tt_stand_in import install
from .tt_stand_in import tt_transformers as stand_in_tt
from .tt_stand_in import ttnn as stand_in_ttnn

MAX_SEQ_LEN = 192
STAND_IN_TRACE_REGION = 10**9  # bytes of the stand-in's own trace accounting (ttnn.TRACE_OP_BYTES per op)


def backend_builder(monkeypatch, checkpoint, shape=(1, 1)):
    install(monkeypatch)
    mesh = stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(*shape), trace_region_size=STAND_IN_TRACE_REGION)

    def build(max_users, max_seq_len=MAX_SEQ_LEN, float32=False, grouped=False):
        """The demo's default bfloat8_b weights, which the stand-in computes in torch bfloat16; float32: the
        stand-in computes them in float32 instead (TT has no float32 weights: a way to compare with the torch
        backend's float32 numerics, not a device setting)."""
        if float32:
            monkeypatch.setitem(stand_in_tt.COMPUTE_DTYPES, stand_in_ttnn.bfloat8_b, torch.float32)
        model = build_tt_model(mesh, checkpoint.folder, checkpoint.name, max_users, max_seq_len, True)
        # grouped: the verify attention of --grouped_verify 1 (bit-identical to per row in the stand-in's float64)
        return TtnnCausalLM(model, max_users, max_seq_len, mesh_traces=mesh_traces(mesh), grouped_attention=grouped)
    return build


def mesh_traces(mesh) -> MeshTraces:
    """The one MeshTraces of a stand-in mesh (kept on the mesh object), as a caller keeps one per mesh."""
    if not hasattr(mesh, "mesh_traces"):
        mesh.mesh_traces = MeshTraces(mesh)
    return mesh.mesh_traces


@pytest.fixture
def tt(monkeypatch, embedded_checkpoint):
    """Build a backend on the stand-in: tt(max_users, max_seq_len=MAX_SEQ_LEN, float32=False)."""
    return backend_builder(monkeypatch, embedded_checkpoint)


@pytest.fixture(scope="session")
def prompts(embedded_tokenizer, sample_prompt_tokens):
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    copy = encode(embedded_tokenizer, f"Rename w to width and h to height in this code:\n{code}", True)
    return [copy, sample_prompt_tokens[1], sample_prompt_tokens[2], sample_prompt_tokens[4]]


@pytest.fixture(scope="session")
def plain_outputs(embedded_checkpoint, prompts):
    """Plain greedy decoding of the four prompts through the stand-in's 32-row step (each row is computed on its
    own, so a user's output does not depend on the batch it shares the tile with)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        lm = backend_builder(monkeypatch, embedded_checkpoint)(4)
        return outputs(SpeculativeGenerator(lm, None, 0).generate(prompts, 32))


def outputs(results):
    return [r.output_tokens for r in results]
