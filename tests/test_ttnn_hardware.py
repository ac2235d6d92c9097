# SPDX-License-Identifier: Apache-2.0
"""On a Tenstorrent device: what only hardware can confirm about the ttnn backend. Marked `tt_hardware`: collected
everywhere, run where /dev/tenstorrent* exists, reported as skipped with the reason elsewhere.

    MESH_DEVICE=N150 HF_MODEL=meta-llama/Llama-3.1-8B-Instruct pytest tests/test_ttnn_hardware.py -m tt_hardware

HF_MODEL names a checkpoint TT-Transformers runs (a local folder or a hub id in the local Hugging Face cache). The
perf test (`models_performance_bare_metal`) writes bench_results/perf_<device>_<model>.json with the TT perf keys.
"""
import json
import os

import pytest

from models.tt_transformers.demo.speculative_decoding.speculative_demo import DemoConfig, run_demo
from models.tt_transformers.demo.speculative_decoding.speculative_generator import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import HybridDrafter, ModelDrafter, SuffixDrafter
from models.tt_transformers.torch_backend.checkpoint import resolve_checkpoint
from models.tt_transformers.ttnn_backend.device import DEVICE_PARAMS
from models.tt_transformers.ttnn_backend.generator import TtnnCausalLM
from models.tt_transformers.ttnn_backend.model import build_tt_model

from .conftest import REPO_ROOT

pytestmark = [pytest.mark.tt_hardware,
              pytest.mark.parametrize("device_params", [DEVICE_PARAMS], ids=["trace"], indirect=True)]

CODE_EDITS = str(REPO_ROOT / "benchmarks" / "prompt_sets" / "code_edit.json")
# Decode tok/s/user targets per f"{MESH_DEVICE}_{model}" and mode. None measured yet (no device was available where
# this was written): until a run on the device fills them in, each speculative mode's floor is plain decoding's
# tok/s/user on the same device in the same run.
PERF_TARGETS: dict[str, dict[str, float]] = {}


@pytest.fixture
def checkpoint():
    if not os.environ.get("HF_MODEL"):
        pytest.skip("set HF_MODEL to a checkpoint TT-Transformers runs (e.g. meta-llama/Llama-3.1-8B-Instruct)")
    return resolve_checkpoint(None)


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
    target = TtnnCausalLM(build_tt_model(mesh_device, str(checkpoint.folder), batch, 1024, True), batch, 1024)
    plain = [r.output_tokens for r in SpeculativeGenerator(target, None, 0).generate(prompts, 64)]
    view = target.draft_view(max(1, target.n_layers // 4))
    for drafter in (SuffixDrafter(), ModelDrafter(view), HybridDrafter(SuffixDrafter(), ModelDrafter(view, 0.25))):
        assert [r.output_tokens for r in SpeculativeGenerator(target, drafter, 8).generate(prompts, 64)] == plain


@pytest.mark.models_performance_bare_metal
def test_speculative_perf(mesh_device, checkpoint):
    """Plain, suffix, hybrid and model drafting on code edits (batch 1, 128 tokens, bfloat8_b weights): records the
    TT perf keys and checks decode tok/s/user against this device and model's targets (PERF_TARGETS), else against
    plain decoding's in the same run. The model mode's draft is DRAFT_MODEL (a sibling checkpoint) when set; without
    one it is the target's first quarter of layers, which an untrained model rarely agrees with (README: 0.4-0.6x of
    plain on a CPU), so that run is recorded but has no floor."""
    device = os.environ.get("MESH_DEVICE", "N150")
    key = f"{device}_{checkpoint.name}"
    draft_model = os.environ.get("DRAFT_MODEL")
    common = dict(backend="ttnn", input_prompts=CODE_EDITS, max_generated_tokens=128, dtype="bfloat8_b",
                  compare_baseline=1, n_draft_tokens=16, draft_model=draft_model)
    measurements = {}
    for mode in ("suffix", "hybrid", "model"):
        summary = run_demo(DemoConfig(**common, draft_mode=mode), mesh_device)["summary"]
        assert summary["identical_to_baseline"]
        measurements[mode] = {k: summary[k] for k in ("prefill_time_to_token", "prefill_t/s", "decode_t/s/u",
                                                      "decode_t/s", "acceptance_rate", "mean_tokens_per_step")}
        measurements.setdefault("plain", {"decode_t/s/u": summary["baseline_decode_tok_s"]})
    out = REPO_ROOT / "bench_results" / f"perf_{key}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"device": device, "model": checkpoint.name, "draft_model": draft_model,
                               "measurements": measurements}, indent=2))
    targets = PERF_TARGETS.get(key, {})
    for mode in ("suffix", "hybrid") + (("model",) if draft_model else ()):
        floor = targets.get(mode, measurements["plain"]["decode_t/s/u"])
        assert measurements[mode]["decode_t/s/u"] >= floor, (mode, measurements[mode], floor, str(out))
