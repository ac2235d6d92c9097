# SPDX-License-Identifier: Apache-2.0
"""The TT-Transformers details the backend relies on (ttnn_backend/tt_surface.py): each variant known from
tt-metal's history is handled, and the probe `make tt-smoke` runs first names what is found and what is missing.
The classes below are TEST DOUBLES of TT-Transformers' signatures (tt/model.py A = 00a9ba8f, B = 5cd1b56c, C = the
2026 version with on_device_logits), not TT-Transformers; eager mode, capture safety and teardown run on the stand-in
(tests/tt_stand_in)."""
import pytest

from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import SuffixDrafter
from models.tt_transformers.ttnn_backend import tt_surface

from ..stand_in_backend import outputs
from ..tt_stand_in import tt_transformers as stand_in_tt
from ..tt_stand_in import ttnn as stand_in_ttnn

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
    from ..tt_stand_in import install

    install(monkeypatch)
    lines = tt_surface.probe()
    assert len(lines) == len(tt_surface.DETAILS) and all(line.found for line in lines), lines
    monkeypatch.delattr(stand_in_tt.Transformer, "prepare_decode_inputs_host")

    class Attention(stand_in_tt.Attention):  # a version whose decode does not reach the update through ttnn.experimental
        use_qk_fused = False

        def forward_decode(self, x, *args, **kwargs):
            return x
    monkeypatch.setattr(stand_in_tt, "Attention", Attention)
    monkeypatch.delattr(stand_in_tt, "tt_all_gather")
    missing = {line.name: line for line in tt_surface.probe() if not line.found}
    assert set(missing) == {"prepare_decode_inputs_host(tokens, current_pos, page_table)",
                            "prepare_decode_inputs_host returns 4 device inputs",
                            "paged_update_cache looked up at call time", "tt_all_gather"}
    called = missing["prepare_decode_inputs_host(tokens, current_pos, page_table)"]
    assert "models/tt_transformers/tt/model.py" in called.text and called.called
    assert not missing["paged_update_cache looked up at call time"].called
    # review 46, finding 3: only the taps (the head stages, --full) call it, so it does not stop the target path
    assert not missing["tt_all_gather"].called and "models/tt_transformers/tt/ccl.py" in missing["tt_all_gather"].text


def test_eager_mode_equals_traced_and_captures_nothing(tt, prompts, plain_outputs, monkeypatch):
    """--trace 0: every step runs its ops one by one (no trace captured or replayed), with the traced run's tokens."""
    lm = tt(4)
    lm.trace = False
    monkeypatch.setattr(stand_in_ttnn, "begin_trace_capture", lambda *a, **k: pytest.fail("captured in eager mode"))
    monkeypatch.setattr(stand_in_ttnn, "execute_trace", lambda *a, **k: pytest.fail("replayed in eager mode"))
    assert outputs(SpeculativeGenerator(lm, SuffixDrafter(1, recycle=4), 4).generate(prompts, 32)) == plain_outputs
    assert lm.compiled and not lm.traces


def test_a_prefill_that_returns_a_pair_gives_the_same_token(tt, prompts):
    """Review 3, F7: every TT-Transformers version read returns a bare tensor from prefill_forward_text; one that
    returned (logits, ...) as its decode forward can stopped the prefill with an AttributeError. It is unwrapped as
    the decode forward's output is (tt_surface.decode_logits)."""
    import functools

    lm = tt(1)
    expected = lm.prefill(0, prompts[0]).ids
    plain = lm.tt.generator.prefill_forward_text

    @functools.wraps(plain)
    def as_pair(*args, **kwargs):
        return plain(*args, **kwargs), None
    lm.tt.generator.prefill_forward_text = as_pair
    assert lm.prefill(0, prompts[0]).ids == expected


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
    from ..tt_baseline import tt_decode_baseline

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
    from .. import tt_baseline

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


class FiveInputs(stand_in_tt.Transformer):
    """tt/model.py@000ec121's decode interface (TEST DOUBLE of its signatures): prepare_decode_inputs_host returns
    rot_mat_idxs_global and rot_mat_idxs_local apart, and ttnn_decode_forward takes them by those names."""

    def prepare_decode_inputs_host(self, tokens, current_pos, page_table=None):
        tokens, current_pos, rope_idxs, page_table = super().prepare_decode_inputs_host(tokens, current_pos, page_table)
        return tokens, current_pos, rope_idxs, rope_idxs, page_table

    def ttnn_decode_forward(self, x, current_pos, rot_mat_idxs_global=None, rot_mat_idxs_local=None, page_table=None,
                            kv_cache=None, argmax_on_device=False):
        return super().ttnn_decode_forward(x, current_pos, rot_mat_idxs_global, page_table, kv_cache)


def test_the_probe_stops_for_a_decode_interface_the_backend_cannot_drive(monkeypatch, tt):
    """Issue 37's third review, F5: the backend unpacks four inputs from prepare_decode_inputs_host and calls
    ttnn_decode_forward(x, current_pos, rot_mat_idxs=, page_table=, kv_cache=); the version at 000ec121 returns five
    and names the rotary inputs apart, which failed with a TypeError at the first step. The probe names the signature
    as a missing call (make tt-smoke stops at stage 2) and the count, read from TT's source, as a warning (issue 46:
    the step checks it), and a step that gets another count says so in one line."""
    from models.tt_transformers.speculative.backend import UserRows

    lm = tt(1)
    monkeypatch.setattr(stand_in_tt, "Transformer", FiveInputs)
    missing = {line.name: line for line in tt_surface.probe() if not line.found}
    assert {name for name, line in missing.items() if line.called} == {
        "ttnn_decode_forward(x, current_pos, rot_mat_idxs=, page_table=, kv_cache=)"}
    assert "returns 5 values where the backend unpacks 4" in missing["prepare_decode_inputs_host returns 4 device "
                                                                    "inputs"].text
    four = lm.tt.model.prepare_decode_inputs_host  # the built model's: now as 000ec121's returns them
    monkeypatch.setattr(lm.tt.model, "prepare_decode_inputs_host",
                        lambda *args: (lambda t, c, r, p: (t, c, r, r, p))(*four(*args)))
    with pytest.raises(ValueError, match=r"^TT-Transformers' prepare_decode_inputs_host returned 5 inputs where the "
                                         r"backend takes 4 .*"):
        lm.step([UserRows(0, [1], 0)])


def test_a_step_whose_cache_writes_bypass_the_ordered_writer_is_refused(monkeypatch, embedded_checkpoint):
    """F5: the ordered cache writes replace ttnn.experimental.paged_update_cache while TT's forward_decode runs, which
    reaches them only if TT looks the op up there at call time; a version that bound it otherwise (at import, say)
    wrote a verify step's rows in one racing op with no error (the probe's text check only warns). Compiling a step
    now counts the writes that went through the ordered writer (2 per layer, each `passes` ops) and stops with one
    line when they did not."""
    from models.tt_transformers.speculative.backend import UserRows
    from models.tt_transformers.ttnn_backend.trace_plan import TraceKey

    from ..stand_in_backend import backend_builder

    raw = stand_in_ttnn.experimental.paged_update_cache

    class BoundAtImport(stand_in_tt.Attention):  # an Attention that calls the op it bound when its module loaded
        def forward_decode(self, *args, **kwargs):
            looked_up = stand_in_ttnn.experimental.paged_update_cache
            stand_in_ttnn.experimental.paged_update_cache = raw
            try:
                return super().forward_decode(*args, **kwargs)
            finally:
                stand_in_ttnn.experimental.paged_update_cache = looked_up
    build = backend_builder(monkeypatch, embedded_checkpoint)
    lm = build(1)
    assert lm.step([UserRows(0, [1, 2, 3], 0)]).ids  # TT's own Attention: every write ordered
    lm.release_traces()  # (a compile allocates: never under a live trace)
    lm.compile(TraceKey(4, 0, (), False))
    assert (lm.tt.passes.writes, lm.tt.passes.issued) == (2 * 30, 2 * 30 * 4)  # 30 layers, 4 passes
    monkeypatch.setattr(stand_in_tt, "Attention", BoundAtImport)
    with pytest.raises(RuntimeError, match=r"^the ordered cache writes did not reach TT-Transformers' attention: a "
                                           r"30-layer decode step made 0 K/V writes through them \(60 expected\)"):
        build(1).step([UserRows(0, [1, 2, 3], 0)])


def test_the_galaxy_probe_is_called_on_a_galaxy_only(monkeypatch):
    """F1: on a Galaxy the backend keeps a step's rows in mesh column 0's users, which is right when TT's Attention
    groups the decode users per mesh column (batch_size_per_device_group) and fills column 0's caches in a prefill;
    the probe reads that from tt/attention.py where MESH_DEVICE names a Galaxy (a warning when it cannot, issue 46:
    the lossless stage checks it), and is not needed elsewhere."""
    from ..tt_stand_in import install

    install(monkeypatch)
    name = "Galaxy: decode users grouped per mesh column"
    monkeypatch.setenv("MESH_DEVICE", "N300")
    line = next(line for line in tt_surface.probe() if line.name == name)
    assert line.found and not line.called and "not needed" in line.text
    monkeypatch.setenv("MESH_DEVICE", "TG")
    line = next(line for line in tt_surface.probe() if line.name == name)  # the stand-in has no Galaxy path
    assert not line.found and not line.called and "models/tt_transformers/tt/attention.py" in line.text

    class OlderGalaxyAttention(stand_in_tt.Attention):  # the one-column fill, tt/attention.py@00b769dd
        def forward_prefill(self, x, *args, **kwargs):
            if self.TG:
                x = self.prefill_prepare_tensor_for_kv_cache(x, self.batch_size_per_device_group)
            return super().forward_prefill(x, *args, **kwargs)

        def prefill_prepare_tensor_for_kv_cache(self, key_or_value_layer, user_id):
            return key_or_value_layer

    class NewerGalaxyAttention(stand_in_tt.Attention):  # every column filled with a page table
        def forward_prefill(self, x, *args, page_table=None, **kwargs):
            if self.TG and not page_table:
                x = self.prefill_prepare_tensor_for_kv_cache(x, self.batch_size_per_device_group)
            return super().forward_prefill(x, *args, page_table=page_table, **kwargs)
    for attention, fills in ((OlderGalaxyAttention, "fills the column of user_id"), (NewerGalaxyAttention,
                                                                                     "fills every column")):
        monkeypatch.setattr(stand_in_tt, "Attention", attention)
        line = next(line for line in tt_surface.probe() if line.name == name)
        assert line.found and fills in line.text, line


def test_tt_decode_baseline_leaves_no_trace_id_for_a_destructor(tt, prompts, embedded_checkpoint, monkeypatch):
    """F6: TT-Transformers' Generator.__del__ releases no trace (tt/generator.py: it closes data-parallel submeshes),
    but a Generator whose destructor releases what its trace_id* attributes hold (the Galaxy demo's,
    models/demos/llama3_70b_galaxy/tt/generator.py) would release the baseline's traces a second time after the
    baseline released them. The baseline empties those attributes once it has released their traces."""
    import gc

    from .. import tt_baseline

    lm = tt(4)
    mesh = lm.tt.mesh_device
    released, release = [], stand_in_ttnn.release_trace
    monkeypatch.setattr(stand_in_ttnn, "release_trace", lambda m, trace_id: released.append(trace_id) or release(m, trace_id))

    def releases_its_traces(self):  # a destructor as the Galaxy demo's Generator has
        for trace_id in tt_baseline.generator_traces(self):
            stand_in_ttnn.release_trace(self.mesh_device, trace_id)
    monkeypatch.setattr(stand_in_tt.Generator, "__del__", releases_its_traces, raising=False)
    tt_baseline.tt_decode_baseline(mesh, embedded_checkpoint.folder, embedded_checkpoint.name, prompts[:2] * 16, 4,
                                   192, True)
    gc.collect()
    assert released and len(released) == len(set(released)), released


def test_a_machine_without_ttnn_gets_one_line_naming_the_fix(monkeypatch):
    """The backend imports ttnn in one place (ttnn_api.py): without it, the first op the backend touches raises one
    line saying where ttnn comes from, not an ImportError from whichever module ran first."""
    import sys

    from models.tt_transformers.ttnn_backend.ttnn_api import TtnnMissing, ttnn

    monkeypatch.setitem(sys.modules, "ttnn", None)  # as `import ttnn` fails on a machine without it
    with pytest.raises(TtnnMissing, match=r"^tt-metal's ttnn is not importable in this Python \(.*\): run in "
                                          r"tt-metal's python_env .* use the torch backend$") as e:
        ttnn.from_torch
    assert "\n" not in str(e.value)
