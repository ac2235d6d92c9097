# SPDX-License-Identifier: Apache-2.0
"""On a Tenstorrent device: what only hardware can confirm about the ttnn backend. Marked `tt_hardware`: collected
everywhere, run where /dev/tenstorrent* exists, reported as skipped with the reason elsewhere.

    MESH_DEVICE=N150 HF_MODEL=meta-llama/Llama-3.1-8B-Instruct pytest tests/demo/test_ttnn_hardware.py -m tt_hardware

HF_MODEL names a checkpoint TT-Transformers runs (a local folder or a hub id in the local Hugging Face cache);
DRAFT_HEAD an EAGLE-3 head for it (a folder or hub id: the EAGLE authors' or speculators' layout), for the draft head
on the device. Run `make tt-smoke` first (test_smoke here): it stops at the first stage that fails. The perf tests
(`models_performance_bare_metal`) write bench_results/perf_<device>_<model>.json (and perf_head_...) with the TT perf
keys and the measured time of every traced step shape (what the cost model's constants in ttnn_backend/causal_lm.py
estimate).
"""
import json
import os
import sys

import pytest

from models.tt_transformers.demo.speculative_decoding.build import ModelPool, trace_region_size
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig
from models.tt_transformers.demo.speculative_decoding.speculative_demo import run_demo
from models.tt_transformers.speculative import SpeculativeConfig, SpeculativeGenerator, make_drafter
from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.ttnn_backend.device import mesh_shape
from models.tt_transformers.ttnn_backend.eagle3_head import TtnnDraftHead
from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM
from models.tt_transformers.ttnn_backend.traces import MeshTraces
from models.tt_transformers.ttnn_backend.model import build_tt_model

from ..conftest import REPO_ROOT

pytestmark = pytest.mark.tt_hardware

CODE_EDITS = str(REPO_ROOT / "benchmarks" / "prompt_sets" / "code_edit.json")
CHAT = str(REPO_ROOT / "benchmarks" / "prompt_sets" / "chat.json")
# Decode tok/s/user targets per f"{MESH_DEVICE}_{model}" and mode. None measured yet (no device was available where
# this was written): until a run on the device fills them in, each speculative mode's floor is plain decoding's
# tok/s/user on the same device in the same run.
PERF_TARGETS: dict[str, dict[str, float]] = {}


PERF = dict(backend="ttnn", input_prompts=CODE_EDITS, max_generated_tokens=128, compare_baseline=1,
            n_draft_tokens=16, draft_model=os.environ.get("DRAFT_MODEL"), draft_mode="hybrid")


HEAD_PERF = dict(backend="ttnn", input_prompts=CHAT, max_generated_tokens=128, compare_baseline=1, n_draft_tokens=4,
                 draft_head=os.environ.get("DRAFT_HEAD"), draft_mode="hybrid")


@pytest.fixture
def device_params():
    """A trace region for the largest run here (the perf test's 16 drafts, hybrid: every trace kind; a draft head's
    traces beside it)."""
    return {"trace_region_size": trace_region_size(DemoConfig(**PERF), mesh_shape())
            + (trace_region_size(DemoConfig(**HEAD_PERF), mesh_shape()) if HEAD_PERF["draft_head"] else 0)}


@pytest.fixture
def checkpoint():
    if not os.environ.get("HF_MODEL"):
        pytest.skip("set HF_MODEL to a checkpoint TT-Transformers runs (e.g. meta-llama/Llama-3.1-8B-Instruct)")
    return resolve_checkpoint(None)


def test_smoke(checkpoint, tmp_path):
    """`make tt-smoke`: every stage passes (it opens the mesh itself)."""
    from models.tt_transformers.demo.speculative_decoding import tt_smoke

    report = tt_smoke.run(DemoConfig(backend="ttnn", draft_mode="suffix", max_generated_tokens=tt_smoke.SMOKE_TOKENS),
                          tmp_path / "report.json")
    assert report["ok"], report["stages"][-1]


def test_demo_on_device(mesh_device, checkpoint):
    report = run_demo(DemoConfig(backend="ttnn", max_generated_tokens=64), mesh_device)
    assert report["summary"]["identical_to_baseline"]


@pytest.mark.parametrize("batch", [1, 4])
def test_lossless_on_device(mesh_device, checkpoint, batch):
    """Every draft mode equals plain greedy decoding through the same traced 32-row step on the device."""
    from models.tt_transformers.prompts import encode, load_prompts
    from models.tt_transformers.checkpoints.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    prompts = [encode(tokenizer, p, True) for p in load_prompts(CODE_EDITS)][:batch]
    target = TtnnCausalLM(build_tt_model(mesh_device, checkpoint.folder, checkpoint.name, batch, 1024, True), batch,
                          1024, mesh_traces=MeshTraces(mesh_device))
    plain = [r.output_tokens for r in SpeculativeGenerator(target, None, 0).generate(prompts, 64)]
    view = target.draft_view(max(1, target.n_layers // 4))
    for mode in ("suffix", "model", "hybrid"):  # copies from the request alone; the first quarter of the layers
        config = SpeculativeConfig(draft_mode=mode, draft_memory=0, recycle_top_k=0)
        drafter = make_drafter(config, target, draft_lm=view, draft_cost=0.25)
        assert [r.output_tokens for r in SpeculativeGenerator(target, drafter, 8).generate(prompts, 64)] == plain


def device_head_drafter(target, checkpoint, n_draft_tokens: int):
    """DRAFT_HEAD, else the head shipped for the model, else a random EAGLE-3 head of its shape (lossless all the
    same: its drafts fail), on the device beside `target` (TtnnCausalLM.build_head, make_drafter), traced with it."""
    from models.tt_transformers.demo.speculative_decoding.inputs import draft_head_folder
    from models.tt_transformers.checkpoints.eagle3_format import random_head, read_draft_head
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    config = DemoConfig(backend="ttnn", n_draft_tokens=n_draft_tokens, draft_head=os.environ.get("DRAFT_HEAD"))
    args = ModelShape.from_hf_config(checkpoint.config)
    folder = draft_head_folder(DemoConfig(**{**vars(config), "draft_mode": "hybrid"}), checkpoint.name)
    head = read_draft_head(folder, args) if folder is not None else random_head(args)
    drafter = make_drafter(SpeculativeConfig(draft_mode="head", n_draft_tokens=n_draft_tokens), target,
                           device_head=target.build_head(*head, n_draft_tokens))
    SpeculativeGenerator(target, drafter, n_draft_tokens).warm_up()
    return drafter


@pytest.mark.parametrize("batch", [1, 4])
def test_device_head_lossless_on_device(mesh_device, checkpoint, batch):
    """The draft head on the device (DRAFT_HEAD, the shipped one, or a random one), in head and hybrid modes, equals
    plain greedy decoding through the same traced 32-row step."""
    from models.tt_transformers.prompts import encode, load_prompts
    from models.tt_transformers.checkpoints.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    prompts = [encode(tokenizer, p, True) for p in load_prompts(CHAT)][:batch]
    target = TtnnCausalLM(build_tt_model(mesh_device, checkpoint.folder, checkpoint.name, batch, 1024, True), batch,
                          1024, mesh_traces=MeshTraces(mesh_device))
    plain = [r.output_tokens for r in SpeculativeGenerator(target, None, 0).generate(prompts, 64)]
    head = device_head_drafter(target, checkpoint, 4)
    hybrid = make_drafter(SpeculativeConfig(draft_memory=0, recycle_top_k=0), target, device_head=head.head)
    for drafter in (head, hybrid):
        assert [r.output_tokens for r in SpeculativeGenerator(target, drafter, 4).generate(prompts, 64)] == plain


def mean_ms(times: dict, name: str) -> dict:
    """Each traced shape's mean replay time in ms, keyed by `name` formatted with the shape's key."""
    return {name.format(*(list(k) if isinstance(k, tuple) else k for k in key)): 1e3 * sum(t) / len(t)
            for key, t in times.items() if t}


def write_perf(name: str, report: dict):
    out = REPO_ROOT / "bench_results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return out


def per_position(report: dict, bucket: int = 32) -> dict:
    """Decode tok/s/user per span of `bucket` generated positions (0-31, 32-63, ...), over every prompt's iterations
    (batch 1): how the speed holds as the context grows."""
    tokens, seconds = {}, {}
    for prompt in report["prompts"]:
        position = 1  # the first token comes from the prefill
        for it in prompt["iterations"]:
            span = position // bucket * bucket
            tokens[span] = tokens.get(span, 0) + it["accepted"] + 1
            seconds[span] = seconds.get(span, 0.0) + it["ms"] / 1e3
            position += it["accepted"] + 1
    return {f"{span}-{span + bucket - 1}": tokens[span] / seconds[span] for span in sorted(tokens)}


@pytest.mark.models_performance_bare_metal
def test_device_head_perf(mesh_device, checkpoint):
    """Head and hybrid modes with a published head (DRAFT_HEAD) on chat prompts (batch 1, 128 tokens, 4 drafts):
    records tokens per forward, decode tok/s/user overall and per position, the TT perf keys and the measured time of
    every head trace (feed passes, chain length), beside plain decoding in the same run; hybrid's floor is plain's
    tok/s/user (PERF_TARGETS when set)."""
    if not HEAD_PERF["draft_head"]:
        pytest.skip("set DRAFT_HEAD to a published EAGLE-3 head for HF_MODEL (a folder or a hub id in the local cache)")
    device = os.environ.get("MESH_DEVICE", "N150")
    key = f"{device}_{checkpoint.name}"
    measurements, head_ms = {}, {}
    pool = ModelPool()
    try:
        for mode in ("head", "hybrid"):
            report = run_demo(DemoConfig(**{**HEAD_PERF, "draft_mode": mode}), mesh_device, pool)
            summary = report["summary"]
            assert summary["identical_to_baseline"]
            measurements[mode] = {**{k: summary[k] for k in ("compile_prefill", "compile_decode",
                                                             "prefill_time_to_token", "decode_t/s/u", "decode_t/s",
                                                             "acceptance_rate", "mean_tokens_per_step",
                                                             "draft_head_run_cost")},
                                  "decode_t/s/u_per_position": per_position(report)}
            measurements.setdefault("plain", {"decode_t/s/u": summary["baseline_decode_tok_s"]})
        for model in pool.models.values():
            if isinstance(model, TtnnDraftHead):
                head_ms.update(mean_ms(model.step_times, "passes={} k={}"))
    finally:
        pool.close()
    out = write_perf(f"perf_head_{key}", {"device": device, "model": checkpoint.name,
                                          "draft_head": HEAD_PERF["draft_head"], "measurements": measurements,
                                          "head_trace_ms": head_ms})
    floor = PERF_TARGETS.get(key, {}).get("head_hybrid", measurements["plain"]["decode_t/s/u"])
    assert measurements["hybrid"]["decode_t/s/u"] >= floor, (measurements["hybrid"], floor, str(out))


@pytest.mark.models_performance_bare_metal
def tt_baseline(mesh_device, checkpoint, config: DemoConfig) -> dict:
    """TT-Transformers' own traced decode (tt_baseline.py) on the perf prompts' first batch, built and dropped before
    our models are built (two 8B models do not fit an N150 together): what a TT user runs without us."""
    from models.tt_transformers.prompts import encode, load_prompts
    from models.tt_transformers.checkpoints.checkpoint import load_tokenizer
    from ..tt_baseline import tt_decode_baseline

    tokenizer = load_tokenizer(checkpoint)
    prompts = [encode(tokenizer, p, bool(config.instruct)) for p in load_prompts(config.input_prompts)]
    report = tt_decode_baseline(mesh_device, checkpoint.folder, checkpoint.name, prompts[: config.batch_size],
                                config.max_generated_tokens, config.max_seq_len, bool(config.instruct))
    report.pop("tokens")
    return report


def test_speculative_perf(mesh_device, checkpoint):
    """Plain, suffix, hybrid and model drafting on code edits (batch 1, 128 tokens, bfloat8_b weights, performance
    precision), on one target built once: records the TT perf keys and the time of every traced step shape, and checks
    decode tok/s/user against this device and model's targets (PERF_TARGETS), else against plain decoding's in the
    same run. The model mode's draft is DRAFT_MODEL (a sibling checkpoint) when set; without one it is the target's
    first quarter of layers, which an untrained model rarely agrees with (README: 0.4-0.6x of plain on a CPU), so that
    run is recorded but has no floor."""
    device = os.environ.get("MESH_DEVICE", "N150")
    key = f"{device}_{checkpoint.name}"
    measurements, step_ms = {"tt_decode": tt_baseline(mesh_device, checkpoint, DemoConfig(**PERF))}, {}
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
            if isinstance(lm, TtnnCausalLM):
                step_ms[f"{lm.n_layers} layers"] = mean_ms(lm.step_times, "passes={} top_k={} taps={}")
    finally:
        pool.close()
    for mode in ("suffix", "hybrid", "model"):  # against both baselines: our plain decoding and TT's own decode
        measurements[mode]["speedup_vs_plain"] = measurements[mode]["decode_t/s/u"] / measurements["plain"]["decode_t/s/u"]
        measurements[mode]["speedup_vs_tt_decode"] = (measurements[mode]["decode_t/s/u"]
                                                      / measurements["tt_decode"]["decode_t/s/u"])
    out = write_perf(f"perf_{key}", {"device": device, "model": checkpoint.name, "draft_model": PERF["draft_model"],
                                     "measurements": measurements, "step_ms": step_ms})
    targets = PERF_TARGETS.get(key, {})
    for mode in ("suffix", "hybrid") + (("model",) if PERF["draft_model"] else ()):
        floor = targets.get(mode, measurements["plain"]["decode_t/s/u"])
        assert measurements[mode]["decode_t/s/u"] >= floor, (mode, measurements[mode], floor, str(out))
