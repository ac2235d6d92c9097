# SPDX-License-Identifier: Apache-2.0
"""The demo on the ttnn backend, on the stand-in (tests/tt_stand_in: a TEST DOUBLE for ttnn and TT-Transformers, not
a device): its flags' TT defaults, runs that share models and release their traces, trace regions sized for the runs,
nothing compiled while timed, its options beside tt-metal's demo conftest. The backend's own rules:
tests/ttnn_backend/test_ttnn_tt_metal_rules.py."""
import pytest

from models.tt_transformers.demo.speculative_decoding.build import ModelPool, trace_region_size
from models.tt_transformers.demo.speculative_decoding.inputs import DemoInputError, backend_of, check_flags, dtype_of
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig, add_demo_options
from models.tt_transformers.demo.speculative_decoding.speculative_demo import run_demo
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.ttnn_backend import device as tt_device
from models.tt_transformers.ttnn_backend.trace_plan import pass_ladder

from ..conftest import write_json
from ..stand_in_backend import STAND_IN_TRACE_REGION
from ..ttnn_backend.test_ttnn_tt_metal_rules import build, mesh_of, stand_in  # noqa: F401  (stand_in: a fixture)
from ..tt_stand_in import tt_transformers as stand_in_tt
from ..tt_stand_in import ttnn as stand_in_ttnn


def test_demo_on_the_ttnn_backend(tt, tmp_path, monkeypatch):
    """The demo's ttnn path (MESH_DEVICE set selects it) on the stand-in mesh: TT-Transformers models built with the
    demo's flags, hybrid drafting with the first-layers view, the report identical to plain decoding."""
    monkeypatch.setenv("MESH_DEVICE", "N150")
    config = DemoConfig(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Repeat: a b c d e f g"}])),
                        max_generated_tokens=12, max_seq_len=256, draft_layers=4, batch_size=2)
    assert backend_of(config) == "ttnn" and backend_of(DemoConfig(backend="torch")) == "torch"
    report = run_demo(config, stand_in_ttnn.open_mesh_device(stand_in_ttnn.MeshShape(1, 1),
                                                             trace_region_size=STAND_IN_TRACE_REGION))
    assert report["summary"]["identical_to_baseline"] and report["summary"]["decode_t/s/u"] > 0
    with pytest.raises(ValueError, match="--dtype 'float32' is not supported on the ttnn backend"):
        run_demo(DemoConfig(**{**vars(config), "dtype": "float32"}), None)


def test_tt_text_demo_configuration_by_default(stand_in, embedded_checkpoint):
    """Finding 4: bfloat8_b weights and the performance precision preset unless told otherwise."""
    config = DemoConfig(backend="ttnn")
    assert dtype_of(config) == "bfloat8_b" and dtype_of(DemoConfig(backend="torch")) == "bfloat16"
    assert build(mesh_of((1, 1)), embedded_checkpoint).tt.args.optimizations.__name__ == "performance"
    accurate = build(mesh_of((1, 1)), embedded_checkpoint, optimizations="accuracy")
    assert accurate.tt.args.optimizations.__name__ == "accuracy"
    with pytest.raises(DemoInputError, match="--precision"):
        check_flags(DemoConfig(precision="fast"), "ttnn")
    with pytest.raises(DemoInputError, match="--tap_gather"):  # issue 37 point 7: device or host
        check_flags(DemoConfig(tap_gather="both"), "ttnn")
    with pytest.raises(DemoInputError, match="--trace_region_size must be a positive number of bytes"):
        check_flags(DemoConfig(trace_region_size=0), "ttnn")


def demo_config(tmp_path, **overrides):
    """A run of the embedded model's first 6 layers (what these tests check needs no more; test_demo_on_the_ttnn_backend
    runs all 30)."""
    prompts = write_json(tmp_path / "p.json", [{"prompt": "Repeat: a b c d e f g a b c d e f g"}])
    return DemoConfig(**{**dict(input_prompts=str(prompts), max_generated_tokens=10, max_seq_len=256, target_layers=6,
                                draft_layers=4, backend="ttnn", compare_baseline=1), **overrides})


def test_runs_in_sequence_fit_the_region_sized_for_the_most_demanding(stand_in, tmp_path):
    """Issue 30's review finding 1: the hardware perf test sizes the trace region for a hybrid run, then runs suffix,
    hybrid and model drafting on one pool. Each run replaces what a model plans (a model's earlier runs' traces are
    released when the mesh's traces are next made), so the third run fits; accumulated, the target's plans of all
    three runs outgrew the region at the model run (N150 387 MB opened vs 504 needed)."""
    stand_in.setenv("MESH_DEVICE", "N150")
    config = demo_config(tmp_path, draft_mode="hybrid", max_generated_tokens=6)
    pool = ModelPool()
    with tt_device.open_mesh(trace_region_size=trace_region_size(config, (1, 1))) as mesh:
        try:
            for mode in ("suffix", "hybrid", "model"):
                summary = run_demo(DemoConfig(**{**vars(config), "draft_mode": mode}), mesh, pool)["summary"]
                assert summary["identical_to_baseline"], mode
        finally:
            pool.close()


def test_runs_share_one_model_and_release_their_traces(stand_in, tmp_path):
    """Finding 5: runs given one pool build the target once; every trace is released when the pool closes, and a
    run without a pool releases its own."""
    built = []
    transformer = stand_in_tt.Transformer
    stand_in.setattr(stand_in_tt, "Transformer", lambda *a, **k: built.append(1) or transformer(*a, **k))
    mesh = mesh_of((1, 1))
    pool = ModelPool()
    for mode in ("suffix", "hybrid", "model"):
        assert run_demo(demo_config(tmp_path, draft_mode=mode), mesh, pool)["summary"]["identical_to_baseline"]
    assert len(built) == 1 and mesh.traces
    pool.close()
    assert mesh.traces == {}
    run_demo(demo_config(tmp_path), mesh)
    assert mesh.traces == {}


def test_traces_are_planned_and_fit_the_region(stand_in, tmp_path):
    """Finding 6: a run captures the pass counts it can use (n_draft_tokens 4: 1, 2, 4 and 5 passes), the trace
    region grows with the draft length and follows TT's per-model sizes, and traces that would not fit the region the
    mesh was opened with stop the run first with an error that names the fix."""
    assert pass_ladder(5) == [1, 2, 4, 5] and pass_ladder(17) == [1, 2, 4, 8, 16, 17] and pass_ladder(1) == [1]
    stand_in.setenv("MESH_DEVICE", "N150")
    mesh = mesh_of((1, 1))
    pool = ModelPool()
    run_demo(demo_config(tmp_path, draft_mode="suffix", recycle_top_k=0, compare_baseline=0), mesh, pool)
    target = next(iter(pool.models.values()))
    assert {key.passes for key in target.traces} == {1, 2, 4, 5}
    pool.close()
    small, large = (trace_region_size(demo_config(tmp_path, n_draft_tokens=n), (1, 1)) for n in (1, 16))
    assert 0 < small < large
    truncated = demo_config(tmp_path, target_layers=10, draft_layers=4, draft_mode="hybrid", compare_baseline=0)
    with tt_device.open_mesh(trace_region_size=trace_region_size(truncated, (1, 1))) as sized:
        run_demo(truncated, sized)  # the plan and the model agree on a truncated target's traces
    with tt_device.open_mesh(trace_region_size=small) as narrow:
        with pytest.raises(ValueError, match="rerun with --trace_region_size [0-9]+ .*lower --n_draft_tokens"):
            run_demo(demo_config(tmp_path, n_draft_tokens=16), narrow)


def test_nothing_compiles_while_timed(stand_in, tmp_path, embedded_checkpoint):
    """Findings 7 and 12: every trace of the target and of the draft (a first-layers view, and a separate draft
    checkpoint with its prefill warm-up) is compiled and captured before timing; the report carries TT's compile keys
    apart from decode."""
    events = []
    generate = SpeculativeGenerator.generate
    capture = stand_in_ttnn.begin_trace_capture
    warmup = stand_in_tt.Generator.warmup_model_prefill

    def timed(self, *args, **kwargs):
        events.append("timed")
        return generate(self, *args, **kwargs)
    stand_in.setattr(SpeculativeGenerator, "generate", timed)
    stand_in.setattr(stand_in_ttnn, "begin_trace_capture", lambda *a, **k: events.append("capture") or capture(*a, **k))
    release = stand_in_ttnn.release_trace
    stand_in.setattr(stand_in_ttnn, "release_trace", lambda *a: events.append("release") or release(*a))
    stand_in.setattr(stand_in_tt.Generator, "warmup_model_prefill",
                     lambda self, *a, **k: (events.append("prefill warm-up") if not self.already_warmed_up_prefill
                                            else None) or warmup(self, *a, **k))
    mesh = mesh_of((1, 1))
    for overrides, models in (({"draft_mode": "model"}, 1), ({"draft_mode": "hybrid", "recycle_top_k": 4}, 1),
                              ({"draft_mode": "model", "draft_model": str(embedded_checkpoint.folder)}, 2)):
        events.clear()
        summary = run_demo(demo_config(tmp_path, **overrides), mesh)["summary"]
        first_timed = events.index("timed")
        # review finding 4: every model is planned first, then each trace captured once: none released to be made again
        assert "release" not in events[:first_timed], (overrides, events)
        assert "capture" in events[:first_timed] and "capture" not in events[first_timed:], overrides
        assert events[:first_timed].count("prefill warm-up") == models  # the target's, and a separate draft's
        assert "prefill warm-up" not in events[first_timed:], overrides
        assert summary["compile_decode"] > 0 and summary["compile_prefill"] > 0


def test_options_beside_tt_metal_demo_conftest(stand_in, tmp_path):
    """Finding 16: inside a tt-metal checkout its demo conftest registers the options TT demos share before ours;
    ours registers the rest and reads theirs. The report names the TT device, not the host."""
    from _pytest.config.argparsing import Parser

    parser = Parser()
    for name in ("input_prompts", "instruct", "max_seq_len", "batch_size", "max_generated_tokens", "stop_at_eos",
                 "optimizations"):  # models/tt_transformers/demo/conftest.py (tt-metal)
        parser.addoption(f"--{name}", action="store", default=None)
    add_demo_options(parser)
    names = {name for option in parser._anonymous.options for name in option.names()}
    assert {"--n_draft_tokens", "--draft_mode", "--max_seq_len"} <= names
    stand_in.setenv("MESH_DEVICE", "N150")
    report = run_demo(demo_config(tmp_path, draft_mode="suffix"), mesh_of((1, 1)))
    assert report["environment"]["device"] == "N150 (1 x 1 mesh)"
