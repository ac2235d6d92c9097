# SPDX-License-Identifier: Apache-2.0
"""The TT-Transformers details the backend relies on (ttnn_backend/tt_surface.py): each variant known from
tt-metal's history is handled, and the probe `make tt-smoke` runs first names what is found and what is missing.
The classes below are TEST DOUBLES of TT-Transformers' signatures (tt/model.py A = 00a9ba8f, B = 5cd1b56c, C = the
2026 version with on_device_logits), not TT-Transformers; eager mode, capture safety and teardown run on the stand-in
(tests/tt_stand_in)."""
import pytest

from models.tt_transformers.demo.speculative_decoding.speculative_generator import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import SuffixDrafter
from models.tt_transformers.ttnn_backend import tt_surface

from .stand_in_backend import outputs
from .tt_stand_in import tt_transformers as stand_in_tt
from .tt_stand_in import ttnn as stand_in_ttnn

LOGITS, TOKENS = object(), object()


class ModelA:  # tt/model.py@00a9ba8f: a bare tensor on every path
    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            sampling_on_device=False, capture_sampling_trace=False):
        return TOKENS if sampling_on_device and not capture_sampling_trace else LOGITS


class ModelB:  # tt/model.py@5cd1b56c: (logits, None) on the gathered path
    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            sampling_on_device=False, capture_sampling_trace=False):
        if sampling_on_device:
            return LOGITS if capture_sampling_trace else (TOKENS, None)
        return LOGITS, None


class ModelC:  # the 2026 tt/model.py: no sampling keywords; on_device_logits returns the per-device share
    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None,
                            on_device_logits=False, page_tables_per_layer=None):
        return LOGITS if on_device_logits else (LOGITS, None)


class ModelOld:  # a version with neither keyword: only gathered logits
    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs=None, page_table=None, kv_cache=None):
        return LOGITS


@pytest.mark.parametrize("model", [ModelA(), ModelB(), ModelC()], ids=["A", "B", "C"])
@pytest.mark.parametrize("shares", [False, True])
def test_decode_forward_returns_the_logits_in_every_variant(model, shares):
    """Review finding: `out[0]` broke on a bare tensor, and the sampling keywords are gone in C (a TypeError)."""
    out = model.ttnn_decode_forward(None, None, **tt_surface.decode_forward_kwargs(model, shares))
    assert tt_surface.decode_logits(out) is LOGITS
    assert tt_surface.can_keep_shares(model)


def test_a_version_without_per_device_logits_gathers():
    assert not tt_surface.can_keep_shares(ModelOld())
    assert tt_surface.decode_forward_kwargs(ModelOld(), False) == {}
    with pytest.raises(ValueError, match="cannot stay split"):
        tt_surface.decode_forward_kwargs(ModelOld(), True)
    assert tt_surface.decode_logits([(LOGITS, None)]) is LOGITS  # Generator's per-model list


class Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_use_qk_fused_on_the_attention_or_its_args():
    """Review finding: attention.py read `self.use_qk_fused`, which attention.py@5cd1b56c never sets (it reads
    self.args.use_qk_fused)."""
    on_object = Args(use_qk_fused=True, args=Args(use_qk_fused=False))
    assert tt_surface.uses_qk_fused(on_object)
    assert tt_surface.uses_qk_fused(Args(args=Args(use_qk_fused=True)))
    assert not tt_surface.uses_qk_fused(Args(args=Args(use_qk_fused=False)))


def test_layer_counts_and_vocabulary_without_the_newer_attributes():
    """ModelArgs at 17a8a99d sets neither full_model_n_layers nor padded_vocab_size."""
    assert tt_surface.full_layers(Args(n_layers=32)) == 32
    assert tt_surface.full_layers(Args(n_layers=8, full_model_n_layers=32)) == 32
    assert tt_surface.padded_vocab(Args(vocab_size=128256, num_devices=2)) == 128256
    assert tt_surface.padded_vocab(Args(vocab_size=49155, num_devices=2)) == 49216
    assert tt_surface.padded_vocab(Args(vocab_size=49155, num_devices=2, padded_vocab_size=65536)) == 65536


def test_the_probe_names_every_detail(monkeypatch):
    """On the stand-in every detail is found; with a detail taken away the probe names it and the file to read, and
    says whether the backend calls it (a missing call stops make tt-smoke) or reads it (a warning)."""
    from .tt_stand_in import install

    install(monkeypatch)
    lines = tt_surface.probe()
    assert len(lines) == len(tt_surface.DETAILS) and all(line.found for line in lines), lines
    monkeypatch.delattr(stand_in_tt.Transformer, "prepare_decode_inputs_host")

    class Attention(stand_in_tt.Attention):  # a version whose decode does not reach the update through ttnn.experimental
        use_qk_fused = False

        def forward_decode(self, x, *args, **kwargs):
            return x
    monkeypatch.setattr(stand_in_tt, "Attention", Attention)
    missing = {line.name: line for line in tt_surface.probe() if not line.found}
    assert set(missing) == {"prepare_decode_inputs_host(tokens, current_pos, page_table)",
                            "paged_update_cache looked up at call time"}
    called = missing["prepare_decode_inputs_host(tokens, current_pos, page_table)"]
    assert "models/tt_transformers/tt/model.py" in called.text and called.called
    assert not missing["paged_update_cache looked up at call time"].called


def test_eager_mode_equals_traced_and_captures_nothing(tt, prompts, plain_outputs, monkeypatch):
    """--trace 0: every step runs its ops one by one (no trace captured or replayed), with the traced run's tokens."""
    lm = tt(4)
    lm.trace = False
    monkeypatch.setattr(stand_in_ttnn, "begin_trace_capture", lambda *a, **k: pytest.fail("captured in eager mode"))
    monkeypatch.setattr(stand_in_ttnn, "execute_trace", lambda *a, **k: pytest.fail("replayed in eager mode"))
    assert outputs(SpeculativeGenerator(lm, SuffixDrafter(1, recycle=4), 4).generate(prompts, 32)) == plain_outputs
    assert lm.compiled and not lm.traces


def test_a_failed_capture_is_ended_and_released(tt, prompts, monkeypatch):
    """A failure between begin and end of a capture ends and releases it before it is raised: the mesh is left with
    no open capture, and the next capture works."""
    lm = tt(2)
    mesh, forward = lm.tt.mesh_device, lm._forward

    def failing(*args, **kwargs):
        if mesh.capturing is not None:
            raise RuntimeError("TT_FATAL: out of trace region")
        return forward(*args, **kwargs)
    monkeypatch.setattr(lm, "_forward", failing)
    with pytest.raises(RuntimeError, match="out of trace region"):
        SpeculativeGenerator(lm, None, 0).generate(prompts[:1], 4)
    assert mesh.capturing is None and not mesh.traces
    monkeypatch.setattr(lm, "_forward", forward)
    SpeculativeGenerator(lm, None, 0).generate(prompts[:1], 4)
    assert lm.traces


def test_teardown_goes_on_past_a_trace_that_will_not_release(tt, prompts, monkeypatch):
    lm = tt(1)
    SpeculativeGenerator(lm, None, 0).generate(prompts[:1], 4)
    assert lm.traces

    def refuse(mesh, trace_id):
        raise RuntimeError("TT_THROW: trace in use")
    monkeypatch.setattr(stand_in_ttnn, "release_trace", refuse)
    lm.release()
    assert not lm.traces and not lm.planned


def test_eager_models_need_no_trace_region(tt):
    """An eager model captures nothing: its programs count for nothing against the trace region."""
    from models.tt_transformers.ttnn_backend.device import TRACE_REGIONS

    lm = tt(1)
    lm.trace = False
    TRACE_REGIONS[id(lm.tt.mesh_device)] = 1
    try:
        lm.warm_up(5, 4, ())
    finally:
        TRACE_REGIONS.pop(id(lm.tt.mesh_device))
    assert lm.planned  # planned, and not refused for a region of 1 byte


def test_tt_decode_baseline_runs_the_same_model(tt, prompts, plain_outputs, embedded_checkpoint):
    """Issue 30's review finding 2: the perf test's second baseline is TT-Transformers' own decode (create_tt_model with
    TT's defaults, Generator.decode_forward with on-device greedy sampling where supported): on the stand-in it
    produces plain decoding's tokens (the same model), with its t/s/u measured over the steps after the first."""
    from models.tt_transformers.ttnn_backend.tt_baseline import tt_decode_baseline

    lm = tt(4)  # the stand-in installed; the baseline builds its own model on the same mesh
    # 32 users (the stand-in's decode step is the 32-row tile whatever the batch; TT's keeps [B] positions)
    report = tt_decode_baseline(lm.tt.mesh_device, embedded_checkpoint.folder, embedded_checkpoint.name,
                                prompts[:2] * 16, 12, 192, True)
    assert report["on_device_sampling"] and report["batch"] == 32 and report["decode_t/s/u"] > 0
    assert report["tokens"][:2] == [p[:12] for p in plain_outputs[:2]]


def test_tt_decode_baseline_releases_every_trace_it_made(tt, prompts, embedded_checkpoint, monkeypatch):
    """Issue 37 point 6: with on-device sampling TT's Generator captures a second trace inside its sampling module
    (SamplingGenerator.capture_trace), which neither our baseline nor TT's Generator.__del__ released: it stayed in the
    trace region sized for our traces. Now the baseline leaves no trace, and a version that keeps one stops the run
    with the trace region it left."""
    from models.tt_transformers.ttnn_backend import tt_baseline

    lm = tt(4)
    mesh = lm.tt.mesh_device

    def baseline():
        return tt_baseline.tt_decode_baseline(mesh, embedded_checkpoint.folder, embedded_checkpoint.name,
                                              prompts[:2] * 16, 4, 192, True)
    # the stand-in keeps no kernel binaries: all its DRAM must be back
    monkeypatch.setattr(tt_baseline, "DRAM_LEFT_BYTES", 0, raising=False)
    assert baseline()["on_device_sampling"]
    assert mesh.traces == {}
    monkeypatch.setattr(stand_in_tt.SamplingGenerator, "reset_trace", lambda self: None)
    with pytest.raises(RuntimeError, match="left 0.0 MB of trace region|MB of trace region"):
        baseline()
