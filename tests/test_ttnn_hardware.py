# SPDX-License-Identifier: Apache-2.0
"""On a Tenstorrent device: what only hardware can confirm about the ttnn backend. Marked `tt_hardware`: collected
everywhere, run where /dev/tenstorrent* exists, reported as skipped with the reason elsewhere.

    MESH_DEVICE=N150 HF_MODEL=meta-llama/Llama-3.1-8B-Instruct pytest tests/test_ttnn_hardware.py -m tt_hardware

HF_MODEL names a checkpoint TT-Transformers runs (a local folder or a hub id in the local Hugging Face cache). Run
`make tt-smoke` first (test_smoke here): it stops at the first stage that fails. The perf test
(`models_performance_bare_metal`) writes bench_results/perf_<device>_<model>.json with the TT perf keys and the
measured time of every traced step shape (what the cost model's constants in ttnn_backend/generator.py estimate).
"""
import json
import os
import sys

import pytest

from models.tt_transformers.demo.speculative_decoding.speculative_demo import (
    DemoConfig,
    ModelPool,
    run_demo,
    trace_region_size,
)
from models.tt_transformers.demo.speculative_decoding.speculative_generator import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import HybridDrafter, ModelDrafter, SuffixDrafter
from models.tt_transformers.torch_backend.checkpoint import resolve_checkpoint
from models.tt_transformers.ttnn_backend.device import mesh_shape
from models.tt_transformers.ttnn_backend.generator import TtnnCausalLM
from models.tt_transformers.ttnn_backend.model import build_tt_model

from .conftest import REPO_ROOT

pytestmark = pytest.mark.tt_hardware

CODE_EDITS = str(REPO_ROOT / "benchmarks" / "prompt_sets" / "code_edit.json")
# Decode tok/s/user targets per f"{MESH_DEVICE}_{model}" and mode. None measured yet (no device was available where
# this was written): until a run on the device fills them in, each speculative mode's floor is plain decoding's
# tok/s/user on the same device in the same run.
PERF_TARGETS: dict[str, dict[str, float]] = {}


PERF = dict(backend="ttnn", input_prompts=CODE_EDITS, max_generated_tokens=128, compare_baseline=1,
            n_draft_tokens=16, draft_model=os.environ.get("DRAFT_MODEL"), draft_mode="hybrid")


@pytest.fixture
def device_params():
    """A trace region for the largest run here (the perf test's 16 drafts, hybrid: every trace kind)."""
    return {"trace_region_size": trace_region_size(DemoConfig(**PERF), mesh_shape())}


@pytest.fixture
def checkpoint():
    if not os.environ.get("HF_MODEL"):
        pytest.skip("set HF_MODEL to a checkpoint TT-Transformers runs (e.g. meta-llama/Llama-3.1-8B-Instruct)")
    return resolve_checkpoint(None)


def test_smoke(checkpoint, tmp_path):
    """`make tt-smoke`: every stage passes (it opens the mesh itself)."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import tt_smoke

    report = tt_smoke.run(DemoConfig(backend="ttnn", draft_mode="suffix", max_generated_tokens=tt_smoke.SMOKE_TOKENS),
                          tmp_path / "report.json")
    assert report["ok"], report["stages"][-1]


def test_demo_on_device(mesh_device, checkpoint):
    report = run_demo(DemoConfig(backend="ttnn", max_generated_tokens=64), mesh_device)
    assert report["summary"]["identical_to_baseline"]


@pytest.mark.parametrize("batch", [1, 4])
def test_lossless_on_device(mesh_device, checkpoint, batch):
    """Every draft mode equals plain greedy decoding through the same traced 32-row step on the device."""
    from models.tt_transformers.demo.speculative_decoding.speculative_demo import encode, load_prompts
    from models.tt_transformers.torch_backend.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    prompts = [encode(tokenizer, p, True) for p in load_prompts(CODE_EDITS)][:batch]
    target = TtnnCausalLM(build_tt_model(mesh_device, checkpoint.folder, checkpoint.name, batch, 1024, True), batch,
                          1024)
    plain = [r.output_tokens for r in SpeculativeGenerator(target, None, 0).generate(prompts, 64)]
    view = target.draft_view(max(1, target.n_layers // 4))
    for drafter in (SuffixDrafter(), ModelDrafter(view), HybridDrafter(SuffixDrafter(), ModelDrafter(view, 0.25))):
        assert [r.output_tokens for r in SpeculativeGenerator(target, drafter, 8).generate(prompts, 64)] == plain


@pytest.mark.models_performance_bare_metal
def test_speculative_perf(mesh_device, checkpoint):
    """Plain, suffix, hybrid and model drafting on code edits (batch 1, 128 tokens, bfloat8_b weights, performance
    precision), on one target built once: records the TT perf keys and the time of every traced step shape, and checks
    decode tok/s/user against this device and model's targets (PERF_TARGETS), else against plain decoding's in the
    same run. The model mode's draft is DRAFT_MODEL (a sibling checkpoint) when set; without one it is the target's
    first quarter of layers, which an untrained model rarely agrees with (README: 0.4-0.6x of plain on a CPU), so that
    run is recorded but has no floor."""
    device = os.environ.get("MESH_DEVICE", "N150")
    key = f"{device}_{checkpoint.name}"
    measurements, step_ms = {}, {}
    pool = ModelPool()
    try:
        for mode in ("suffix", "hybrid", "model"):
            summary = run_demo(DemoConfig(**{**PERF, "draft_mode": mode}), mesh_device, pool)["summary"]
            assert summary["identical_to_baseline"]
            measurements[mode] = {k: summary[k] for k in ("compile_prefill", "compile_decode", "prefill_time_to_token",
                                                          "prefill_t/s", "decode_t/s/u", "decode_t/s",
                                                          "acceptance_rate", "mean_tokens_per_step")}
            measurements.setdefault("plain", {"decode_t/s/u": summary["baseline_decode_tok_s"]})
        for lm in pool.models.values():
            step_ms[f"{lm.n_layers} layers"] = {f"passes={p} top_k={k} taps={list(taps)}": 1e3 * sum(t) / len(t)
                                                for (p, k, taps), t in lm.step_times.items() if t}
    finally:
        pool.close()
    out = REPO_ROOT / "bench_results" / f"perf_{key}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"device": device, "model": checkpoint.name, "draft_model": PERF["draft_model"],
                               "measurements": measurements, "step_ms": step_ms}, indent=2))
    targets = PERF_TARGETS.get(key, {})
    for mode in ("suffix", "hybrid") + (("model",) if PERF["draft_model"] else ()):
        floor = targets.get(mode, measurements["plain"]["decode_t/s/u"])
        assert measurements[mode]["decode_t/s/u"] >= floor, (mode, measurements[mode], floor, str(out))
