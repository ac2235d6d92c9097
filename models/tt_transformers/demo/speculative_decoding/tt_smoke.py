# SPDX-License-Identifier: Apache-2.0
"""The first thing to run on a Tenstorrent machine (`make tt-smoke`): the ttnn backend stage by stage, each logged
with its time, stopping at the first failure with what to send back.

    MESH_DEVICE=N150 HF_MODEL=meta-llama/Llama-3.1-8B-Instruct make tt-smoke

The target path, whose verdict is the run's (the report's "ok", the exit status): ttnn import and version; the
TT-Transformers details the backend relies on, probed without a device (tt_surface.py: one line each); device open
(the fabric on meshes of several devices); model build (weight conversion into the cache folder, logged); a prefill and
a verify step run eagerly (--trace 0: a failure names the op, not a trace); TT-Transformers' own greedy decode of the
prompt (its Generator.decode_forward untraced, a reference); compile and trace capture (TT's prefill warm-up and the
target path's decode traces, no more); prefill of one prompt; one plain traced decode step; one verify step with
drafts; speculative decoding identical to plain decoding through the same verify-shaped step for 32 tokens, the plain
continuation's first 8 ids agreeing with TT's reference in at least 6 places; the TT perf keys of a short demo run.

Then the draft head, with its own verdict (the report's "head") that never changes the target path's: the draft head on
the device (the run's head, else a random EAGLE-3 head: its chain against the torch head fed the same states; its
traces captured in its stage). A head failure leaves exit status 0 when the target path passed: a TT CI job gates on
the path that serves (the target's), and the head's verdict is the last line printed and `jq -e '.head.verdict ==
"passed"' REPORT` for a job that gates on it too.

The second run, --full, adds the tapped hidden states an EAGLE-3 head reads (layers 0, 2, N/2 and N-3: the prompt's
read back from the prefill, a step's left in the tap tile; a head stage), taps in the eager stage, and captures every
trace the stages use (the target's, the taps', the head's target steps) once, up front.

On a Galaxy (8 x 4 mesh) every stage runs on one of TT's data-parallel 1 x 8 submeshes (device.model_mesh), as TT runs
Llama-3.1-8B there; the report's facts give the opened mesh and the model's.

The report (every stage, its seconds, the failure with its traceback, the versions) is written to --report as JSON
before and after every stage, with `"running": <stage>` while one runs, so a hang or a hard crash still leaves it
saying where. Beside it: `<report>.log` (this tool's log), `<report>.ttnn.log` (tt-metal's own log, TT_LOGGER_FILE,
unless already set), and `<report>.tracebacks.txt`: every thread's Python traceback on a hard crash (faulthandler)
and, every --watchdog_s seconds while one stage runs, again (a hang shows where it waits). Send all four back.
"""
import argparse
import faulthandler
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[4]
if __name__ == "__main__":  # `python path/to/tt_smoke.py` from anywhere
    sys.path.insert(0, str(REPO))

from loguru import logger  # noqa: E402

from models.tt_transformers.demo.speculative_decoding.build import (  # noqa: E402
    ModelPool,
    build,
    model_devices,
    trace_region_size,
)
from models.tt_transformers.demo.speculative_decoding.inputs import (  # noqa: E402
    PRECISIONS,
    check_inputs,
    draft_head_folder,
)
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig, OneLineErrorParser  # noqa: E402
from models.tt_transformers.demo.speculative_decoding.speculative_demo import run_demo  # noqa: E402
from models.tt_transformers.prompts import encode  # noqa: E402
from models.tt_transformers.records import environment, write_json_atomic  # noqa: E402
from models.tt_transformers.speculative import SpeculativeConfig, SpeculativeGenerator, make_drafter  # noqa: E402

SMOKE_TOKENS = 32
PROMPT = "Repeat this list exactly: apples, pears, plums, figs, dates, limes, apples, pears, plums, figs, dates, limes."
SEND_BACK = ("send back the report file and the files beside it, `pip show ttnn`, the tt-metal commit "
             "(git -C $TT_METAL_HOME rev-parse HEAD), MESH_DEVICE and HF_MODEL")
WATCHDOG_S = 600  # while one stage runs, every thread's traceback into the tracebacks file this often
# review 46, finding 5: the lossless stage compares speculative with plain decoding through the same step, which a
# consistently wrong step passes; the plain continuation's first REFERENCE_TOKENS ids are also compared in place with
# TT-Transformers' own decode of the prompt, at least MIN_REFERENCE_AGREEMENT agreeing (a bfloat16 near-tie between
# TT's gathered logits and the backend's per-device argmax may flip a late one)
REFERENCE_TOKENS = 8
MIN_REFERENCE_AGREEMENT = 6


class Smoke:
    """What the stages build on one another: the mesh, the model, the prompt's tokens."""

    def __init__(self, config: DemoConfig, exits: ExitStack, draft_head=None, full: bool = False):
        self.config, self.exits, self.draft_head = config, exits, draft_head  # draft_head: --draft_head (else None)
        self.full = full  # --full: the second run (taps, every trace captured up front)
        self.mesh = self.lm = self.drafter = self.tokens = None  # mesh: the model's (device.model_mesh)
        self.pool = ModelPool()  # the perf stage's demo run and the head stage reuse the model built here
        self.facts: dict = {}


def tt_transformers_surface(s: Smoke) -> None:
    """Every TT-Transformers detail the backend relies on, probed against the installed tt-metal without opening a
    device (ttnn_backend/tt_surface.py): one line each, found with its variant or missing with the file to look at.
    The stage stops the run only for a signature the target path calls; a detail read from TT's source text or
    attributes (a property, a rename or a refactor can hide it while the run works) or called only by the stages after
    the target path (tt_all_gather: the taps) is a warning, and the later stages tell."""
    from models.tt_transformers.ttnn_backend.tt_surface import probe

    lines = probe()
    for line in lines:
        if line.found:
            logger.info(f"  found: {line.name}: {line.text}")
        else:
            status = "MISSING" if line.called else "not found (not called by the target path: going on)"
            (logger.error if line.called else logger.warning)(f"  {status}: {line.name}: {line.text}")
    s.facts["tt_transformers_surface"] = {line.name: line.text for line in lines}
    missing = [line.name for line in lines if line.called and not line.found]
    if missing:
        raise LookupError(f"{len(missing)} TT-Transformers signature(s) the backend calls are missing: "
                          f"{'; '.join(missing)}")


def import_ttnn(s: Smoke) -> None:
    import ttnn  # noqa: F401

    model = importlib.import_module("models.tt_transformers.tt.model")  # TT-Transformers, from the tt-metal checkout

    try:
        version = importlib.metadata.version("ttnn")
    except importlib.metadata.PackageNotFoundError:  # a tt-metal build on PYTHONPATH, not a pip install
        version = "not installed as a package"
    s.facts.update(ttnn=version, tt_transformers=str(Path(model.__file__).parent))
    checkout = tt_metal_version(Path(model.__file__).resolve().parents[3])
    s.facts["tt_metal"] = checkout
    if not re.match(rf"{re.escape(TT_METAL_PIN)}(-|$)", checkout):  # v0.81.1 or v0.81.1-<n>-g<sha>, not v0.81.10
        logger.warning(f"tt-metal checkout {checkout}, not {TT_METAL_PIN} (the backend is pinned to it): a failure in "
                       "a later stage may be TT-Transformers' drift; send this line with the report")


TT_METAL_PIN = "v0.81.1"  # the tt-metal release of the ttnn 0.81.1 wheel (README, "On a Tenstorrent machine")


def tt_metal_version(root: Path) -> str:
    """`git describe --tags` of the tt-metal checkout TT-Transformers is imported from, or why it is not known."""
    try:
        done = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(root), "describe", "--tags"],
                              capture_output=True, text=True, timeout=30)  # a checkout another user owns included
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    if done.returncode == 0:
        return done.stdout.strip()
    why = (done.stderr.strip().splitlines() or [f"git exit {done.returncode}"])[0]
    return f"unknown ({root}: {why})"


def smoke_taps(n_layers: int) -> tuple[int, ...]:
    """Layer 0 (the embedding, checked exactly) and an EAGLE-3 head's default taps (2, N // 2, N - 3)."""
    return tuple(dict.fromkeys(min(max(i, 0), n_layers - 1) for i in (0, 2, n_layers // 2, n_layers - 3)))


RANDOM_DRAFT_VOCAB = 32000  # a random head's draft vocabulary, as published EAGLE-3 heads for Llama-3 have


def smoke_head_folder(config: DemoConfig, ckpt, draft_head=None):
    """The head the draft-head stage runs: --draft_head (a folder or a hub id in the local cache, as the demo's), else
    the one shipped for the model, else None (a random EAGLE-3 head of the target's shape, seeded)."""
    return draft_head_folder(DemoConfig(**{**vars(config), "draft_mode": "hybrid", "draft_head": draft_head}),
                                  ckpt.name)


# The gates on the device head's drafts, against a host head whose matmul weights are rounded as the device stores them
# (bfloat8_b: draft_head.stored_weights), so that what differs is the device's compute alone. A real head (shipped, or
# --draft_head): its first drafts agree with the host's on at least MIN_FIRST_DRAFT_AGREEMENT of the prefixes (the
# weights' rounding alone, if left out of the reference, moved 3-5 % of first drafts, the shipped head's and an
# 8B-shaped random one's: tools/head_precision.py, docs/head_precision.json; below 80 % the device head computes
# something else).
# A random head has near-tied top drafts, which any rounding of the compute reorders (with the old unrounded reference
# a third of runs failed the 80 % gate with nothing wrong): its first draft must be among the host's RANDOM_HEAD_TOP
# and its first logits within FIRST_LOGITS_TOLERANCE of the host's (the largest difference over the largest host
# logit: a wrong program is off by the logits' own size); its agreement is reported. The tolerance is measured: the
# host reference keeps a bf16 KV cache and exact matmuls where the device head's cache is bfloat8_b and its matmuls
# HiFi2, and tools/head_precision.py found those two alone move the first logits by up to 3.07 % (the shipped SmolLM2
# head on real tapped states; 1.64 % with the cache alone) and 1.20 % (an 8B-shaped random head on random states; 0.78
# %), in docs/head_precision.json; 1.37 % (0.78 %) with 8B-like massive-activation channels in those states
# (head_precision.py with_outlier_channels: the smoke feeds Llama-3.1-8B's real taps, which the head's fc takes
# un-normed). The gate allows FIRST_LOGITS_MARGIN times the larger: as much again for what the host does not model
# (the device's norms, softmax and SDPA in bf16 with approximate exponentials), 6.14 % in all.
MIN_FIRST_DRAFT_AGREEMENT = 0.8
RANDOM_HEAD_TOP = 3
FIRST_LOGITS_MEASURED = 0.03068  # docs/head_precision.json: the largest "KV cache bfloat8_b, HiFi2 matmuls" figure
FIRST_LOGITS_MARGIN = 2
FIRST_LOGITS_TOLERANCE = round(FIRST_LOGITS_MEASURED * FIRST_LOGITS_MARGIN, 4)
MIN_CHAIN_STEPS = 32  # chain steps compared, over as many prompt prefixes as that takes


# The smoke opens the mesh with the traces' estimate (trace_plan.py: TT's per-model region scaled by op counts, never
# measured on a device) x 2.5, where the demo uses x 1.25: a first run on a device is the one that finds out how far
# off the estimate is, and the extra costs DRAM the smoke does not use (Llama-3.1-8B on N150: docs/ttnn_backend.md).
# Traces that still outgrow it stop the run with the size to pass (--trace_region_size).
SMOKE_REGION_MARGIN = 2.5


def smoke_head_taps(config: DemoConfig, draft_head=None) -> tuple[int, ...]:
    """The taps of the head the draft-head stage runs (smoke_head_folder's, or a random head's: the default taps)."""
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.checkpoints.eagle3_format import default_taps, read_head_config
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    ckpt = resolve_checkpoint(config.model, "--model" if config.model else "HF_MODEL")
    args = ModelShape.from_hf_config(ckpt.config)
    folder = smoke_head_folder(config, ckpt, draft_head)
    return tuple(read_head_config(folder, args).taps if folder is not None else default_taps(args.n_layers))


def stages_region(config: DemoConfig, shape, draft_head=None, margin: float = SMOKE_REGION_MARGIN,
                  full: bool = False) -> int:
    """Trace region for the traces the stages add to the run's: the head stage's (the target's steps with the head's
    taps and the head's own traces), and with `full` the taps stage's (1 write pass, smoke_taps), with the margin."""
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.checkpoints.model_shape import ModelShape
    from models.tt_transformers.ttnn_backend.trace_plan import head_region_bytes, model_trace_bytes, region_bytes

    ckpt = resolve_checkpoint(config.model, "--model" if config.model else "HF_MODEL")
    args = ModelShape.from_hf_config(ckpt.config)
    devices, n = model_devices(shape)
    k = max(1, config.n_draft_tokens)
    head_taps = smoke_head_taps(config, draft_head)
    traces = model_trace_bytes(ckpt.name, devices, n, args.n_layers, args.n_layers, args.vocab_size, k + 1, 0,
                               head_taps)
    if full:
        traces += model_trace_bytes(ckpt.name, devices, n, args.n_layers, args.n_layers, args.vocab_size, 1, 0,
                                    smoke_taps(args.n_layers))
    return region_bytes(traces + head_region_bytes(ckpt.name, devices, args.n_layers, k), margin)


def open_device(s: Smoke) -> None:
    """The mesh, its trace region --trace_region_size where given, else the run's and the stages' traces x
    SMOKE_REGION_MARGIN; the stages run on the model's mesh (device.model_mesh: on a Galaxy one of TT's 1 x 8
    submeshes)."""
    from models.tt_transformers.ttnn_backend.device import fabric_config_for, mesh_shape, model_mesh, open_mesh

    shape = mesh_shape()
    region = s.config.trace_region_size or (trace_region_size(s.config, shape, SMOKE_REGION_MARGIN)
                                            + stages_region(s.config, shape, s.draft_head, full=s.full))
    s.mesh = model_mesh(s.exits.enter_context(open_mesh(trace_region_size=region)))
    s.exits.callback(s.pool.close)  # traces released before the mesh closes
    s.facts.update(mesh=list(shape), model_mesh=list(s.mesh.shape), fabric=str(fabric_config_for(shape)),
                   trace_region_size=region)


def build_model(s: Smoke) -> None:
    tokenizer, s.lm, s.drafter, *_ = build(s.config, check_inputs(s.config), s.mesh, s.pool)
    s.tokens = encode(tokenizer, PROMPT, bool(s.config.instruct))
    args = s.lm.tt.args
    s.facts.update(model=args.model_name, device=args.device_name, weight_cache=str(args.model_cache_path))


def eager_steps(s: Smoke) -> None:
    """A prefill and a verify step with the top k (and with --full taps), run op by op (--trace 0) before anything is
    captured: a failure here is an op's, not a trace's."""
    from models.tt_transformers.speculative.backend import UserRows

    s.lm.trace = False
    try:
        taps = smoke_taps(s.lm.n_layers) if s.full else ()
        first = s.lm.prefill(0, s.tokens, taps=taps).ids[0][0]
        rows = [first, *s.tokens[-4:]]
        s.facts["eager_verify_ids"] = s.lm.step([UserRows(0, rows, len(s.tokens))], top_k=s.drafter.top_k,
                                                taps=taps).ids[0]
    finally:
        s.lm.trace = True


def tt_reference(s: Smoke) -> None:
    """TT-Transformers' own greedy decode of the prompt (TtnnCausalLM.tt_greedy: TT's Generator.decode_forward
    untraced, host argmax), run before any trace is captured so that its eager programs compile outside every trace;
    the lossless stage compares the plain continuation with it."""
    s.facts["tt_reference"] = {"ids": s.lm.tt_greedy(0, s.tokens, REFERENCE_TOKENS)}


def compile_and_capture(s: Smoke) -> None:
    """The target path's programs (the run's, kept planned through the lossless and perf stages' warm-ups:
    TtnnCausalLM.keep_planned) compiled and captured here, no more: a first run captures what its verdict needs, and
    the head stage plans its own shapes after it. With --full every shape the later stages step is kept planned too
    (the tapped states' step, the draft head's target steps) and captured once here: no later stage releases and
    captures the target's traces again, but the head stage, whose head is built (its weights allocated) with the
    traces live. The trace region is sized for all of them (stages_region)."""
    k = max(1, s.config.n_draft_tokens)
    s.lm.keep_planned(k + 1, s.drafter.top_k, ())
    if s.full:
        s.lm.keep_planned(1, 0, smoke_taps(s.lm.n_layers))
        s.lm.keep_planned(k + 1, 0, smoke_head_taps(s.config, s.draft_head))
    s.facts.update(SpeculativeGenerator(s.lm, s.drafter, s.config.n_draft_tokens).warm_up())


def prefill(s: Smoke) -> None:
    s.facts["first_token"] = s.lm.prefill(0, s.tokens).ids[0][0]


def decode_step(s: Smoke) -> None:
    from models.tt_transformers.speculative.backend import UserRows

    step = s.lm.step([UserRows(0, [s.facts["first_token"]], len(s.tokens))], top_k=s.drafter.top_k)
    s.facts["decode_ids"] = step.ids[0]


def verify_step(s: Smoke) -> None:
    from models.tt_transformers.speculative.backend import UserRows

    rows = [s.facts["first_token"], *s.tokens[-4:]]  # a draft of 4 copied tokens
    s.facts["verify_ids"] = s.lm.step([UserRows(0, rows, len(s.tokens))], top_k=s.drafter.top_k).ids[0]


def tapped_states(s: Smoke) -> None:
    """The residual stream entering the tapped layers: for the prompt, read back from TT's prefill as it runs the
    layers, and for a step of the prompt's last token at its own position, left in the tap tile by the traced step
    (all-gathered on N300/T3K) and read here. Tap 0 (the embedding) must be the same in both; the other taps are
    reported (prefill's and decode's numerics differ)."""
    import torch

    from models.tt_transformers.speculative.backend import UserRows

    taps, dim = smoke_taps(s.lm.n_layers), s.lm.tt.args.dim
    prompt = s.lm.prefill(0, s.tokens, taps=taps).hidden[0]
    s.lm.step([UserRows(0, [s.tokens[-1]], len(s.tokens) - 1)], taps=taps)
    step = s.lm.read_taps(taps)[:1]
    if prompt.shape != (len(s.tokens), len(taps) * dim) or step.shape != (1, len(taps) * dim):
        raise AssertionError(f"tapped states of shape {tuple(prompt.shape)} and {tuple(step.shape)}, expected "
                             f"({len(s.tokens)}, {len(taps) * dim}) and (1, {len(taps) * dim})")
    if not (prompt.isfinite().all() and step.isfinite().all()):
        raise AssertionError("tapped states hold non-finite values")
    last = prompt[-1:].float()
    if not torch.equal(last[:, :dim], step[:, :dim].float()):
        raise AssertionError("tap 0 (the embedding) differs between the prefill and the step")
    blocks = list(zip(last.split(dim, dim=1), step.float().split(dim, dim=1)))
    s.facts["taps"] = {"layers": list(taps), "norms": [round(b.norm().item(), 3) for _, b in blocks],
                       "step_vs_prefill_max_rel_diff": [round(((a - b).abs().max() / b.abs().max()).item(), 4)
                                                        for a, b in blocks]}


def device_head(s: Smoke) -> None:
    """The run's draft head (or a random EAGLE-3 head of this target's shape, seeded, where none ships) on the device,
    traced with the target's traces: fed the prompt's taps, it drafts a chain of --n_draft_tokens; the torch head fed
    the same states, its matmul weights rounded as the device stores them (bfloat16 compute, on the host), drafts beside
    it. Reported: both chains, the head's probabilities, the first draft's logits' difference and the agreement over
    prompt prefixes; gated as the constants above say (a real head's agreement, a random head's top and logits)."""
    import torch
    import ttnn

    from models.tt_transformers.speculative.drafters.eagle3_device import HeadFeed
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.torch_backend.load import load_model
    from models.tt_transformers.checkpoints.eagle3_format import random_head, read_draft_head
    from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, build_draft_head
    from models.tt_transformers.checkpoints.model_shape import ModelShape
    from models.tt_transformers.ttnn_backend.eagle3_head import stored_weights

    ckpt = resolve_checkpoint(s.config.model, "--model" if s.config.model else "HF_MODEL")
    args = ModelShape.from_hf_config(ckpt.config)
    folder = smoke_head_folder(s.config, ckpt, s.draft_head)
    head = read_draft_head(folder, args) if folder is not None else \
        random_head(args, draft_vocab=min(RANDOM_DRAFT_VOCAB, args.vocab_size))
    k = max(1, s.config.n_draft_tokens)
    dev = s.pool.get(("smoke head",), lambda: s.lm.build_head(*head, k))  # as the demo's, pooled
    drafter = make_drafter(SpeculativeConfig(draft_mode="head", n_draft_tokens=k), s.lm, device_head=dev)
    SpeculativeGenerator(s.lm, drafter, k).warm_up()
    out = s.lm.prefill(0, s.tokens, taps=head[0].taps)
    context = s.tokens + out.ids[0]
    ids, probs = dev.draft([HeadFeed(0, 0, context[1:], states=out.hidden[0])], [0], k)[0]
    host = load_model(ckpt, torch.bfloat16, s.config.max_seq_len, "cpu", cpu_kernels=False, n_layers=0)
    weights = stored_weights(*head) if dev.dtype == ttnn.bfloat8_b else head[1]
    runner = HeadRunner(build_draft_head(head[0], weights, host), 1, s.config.max_seq_len, args,
                        window=None)  # as the device head: its whole cache (up to its layer's sliding window)
    state, first_ref = runner.run([0], [0], [out.hidden[0]], [context[1:]])[0]
    reference, logits = [], first_ref
    for j in range(k):
        reference.append(int(runner.vocab[logits.argmax()]))
        state, logits = runner.run([0], [len(s.tokens) + j], [state[-1:]], [[reference[-1]]])[0]
    device_logits = dev.read_logits(0)[dev.last_rows[0]]
    if not torch.isfinite(device_logits).all():
        raise AssertionError("the device head's logits hold non-finite values")
    difference = ((device_logits - first_ref).abs().max() / first_ref.abs().max()).item()
    agreement = chain_agreement(dev, runner, out.hidden[0], context, k)
    s.facts["draft_head"] = {"head": str(folder or "random"), "device_chain": ids, "torch_chain": reference,
                             "probs": [round(p, 3) for p in probs], "first_logits_max_rel_diff": round(difference, 4),
                             "agreement": agreement}
    top = runner.vocab[first_ref.topk(RANDOM_HEAD_TOP if folder is None else 5).indices].tolist()
    if ids[0] not in top:
        raise AssertionError(f"the device head's first draft {ids[0]} is not among the host head's top {len(top)} "
                             f"{top}")
    if folder is None and difference > FIRST_LOGITS_TOLERANCE:
        raise AssertionError(f"the device head's first logits differ from the host head's by {difference:.1%} of the "
                             f"largest, above {FIRST_LOGITS_TOLERANCE:.2%}")
    if folder is not None and agreement["first_draft_same"] < MIN_FIRST_DRAFT_AGREEMENT:
        raise AssertionError(f"the device head's first drafts agree with the host head's on "
                             f"{agreement['first_draft_same']:.0%} of {agreement['chains']} prefixes, below "
                             f"{MIN_FIRST_DRAFT_AGREEMENT:.0%}")


def chain_agreement(dev, runner, states, context: list[int], k: int) -> dict:
    """The device head and the host head fed the same prompt prefixes (evenly spaced, enough for MIN_CHAIN_STEPS
    chain steps), each drafting a chain of k from there: the share of first drafts and whole chains that agree and
    the mean agreed prefix."""
    from models.tt_transformers.speculative.drafters.eagle3_device import HeadFeed

    n = len(states)
    count = min(n, -(-MIN_CHAIN_STEPS // k))
    starts = sorted({max(1, n - i * max(1, n // count)) for i in range(count)})
    prefixes = []
    for p in starts:
        device = dev.draft([HeadFeed(0, 0, context[1 : p + 1], states=states[:p])], [0], k)[0][0]
        state, logits = runner.run([0], [0], [states[:p]], [context[1 : p + 1]])[0]
        host = []
        for j in range(k):
            host.append(int(runner.vocab[logits.argmax()]))
            state, logits = runner.run([0], [p + j], [state[-1:]], [[host[-1]]])[0]
        agreed = 0
        while agreed < k and device[agreed] == host[agreed]:
            agreed += 1
        prefixes.append(agreed)
    return {"chains": len(prefixes), "chain_steps": len(prefixes) * k,
            "first_draft_same": round(sum(a > 0 for a in prefixes) / len(prefixes), 4),
            "identical": round(sum(a == k for a in prefixes) / len(prefixes), 4),
            "mean_agreed_prefix": round(sum(prefixes) / len(prefixes), 3)}


def lossless(s: Smoke) -> None:
    from models.tt_transformers.speculative.generator import SpeculativeGenerator

    plain = SpeculativeGenerator(s.lm, None, 0).generate([s.tokens], SMOKE_TOKENS, False)[0]
    reference, ours = s.facts["tt_reference"]["ids"], plain.output_tokens[:REFERENCE_TOKENS]
    agreed = sum(a == b for a, b in zip(ours, reference))
    s.facts["tt_reference"].update(plain_ids=ours, agreed=agreed)  # reported whatever follows
    spec = SpeculativeGenerator(s.lm, s.drafter, s.config.n_draft_tokens).generate([s.tokens], SMOKE_TOKENS, False)[0]
    s.facts["tokens_per_step"] = round(len(spec.output_tokens) / max(1, len(spec.iterations) + 1), 2)
    if spec.output_tokens != plain.output_tokens:
        raise AssertionError(f"speculative output differs from plain decoding through the same step: "
                             f"{spec.output_tokens} vs {plain.output_tokens}")
    if agreed < MIN_REFERENCE_AGREEMENT:
        raise AssertionError(f"plain decoding's first {len(ours)} ids agree in place with TT-Transformers' own decode "
                             f"of the prompt on {agreed} (at least {MIN_REFERENCE_AGREEMENT} needed): {ours} vs TT's "
                             f"{reference}")


def perf_keys(s: Smoke) -> None:
    report = run_demo(s.config, s.mesh, s.pool)
    keys = ("compile_prefill", "compile_decode", "prefill_time_to_token", "prefill_t/s", "decode_t/s/u", "decode_t/s",
            "mean_tokens_per_step", "speedup", "identical_to_baseline")
    s.facts["perf"] = {k: report["summary"].get(k) for k in keys}


TARGET_STAGES: list[tuple[str, Callable[[Smoke], None]]] = [
    ("ttnn import", import_ttnn), ("TT-Transformers surface", tt_transformers_surface), ("device open", open_device),
    ("model build", build_model), ("eager prefill and verify step", eager_steps),
    ("TT-Transformers' own decode (reference)", tt_reference), ("compile and trace capture", compile_and_capture),
    ("prefill", prefill), ("plain decode step", decode_step),
    ("verify step", verify_step), (f"lossless over {SMOKE_TOKENS} tokens", lossless), ("perf keys", perf_keys)]
# The head's stages run after the target path: the draft head's builds the most code never run on silicon (a custom
# decoder layer), so its failure is its own verdict (report["head"]) and never hides a passing target path.
HEAD_STAGES = (tapped_states, device_head)
STAGES = [*TARGET_STAGES, ("draft head on the device", device_head)]  # the first run (the default)
FULL_STAGES = [*TARGET_STAGES, ("tapped states", tapped_states), ("draft head on the device", device_head)]  # --full


def side_files(report_path: Path) -> dict[str, Path]:
    """What a run leaves beside its report (module docstring)."""
    return {kind: report_path.with_name(report_path.name + suffix)
            for kind, suffix in (("log", ".log"), ("ttnn_log", ".ttnn.log"), ("tracebacks", ".tracebacks.txt"))}


def run_stages(smoke: Smoke, stages, report: dict, report_path: Path, tracebacks, watchdog_s: float) -> None:
    """Every stage in order, each recorded in the report, which is written before it starts (naming it as running: a
    hang or a hard crash leaves that) and after it ends. A target-path stage that fails stops the run (report "ok"
    False); a head stage (HEAD_STAGES) that fails sets the head's verdict (report "head") and the head's later stages
    are not run, the target path's verdict unchanged. While a stage runs, every thread's traceback goes to
    `tracebacks` every watchdog_s seconds."""
    head = report["head"]
    for i, (name, stage) in enumerate(stages, 1):
        if stage in HEAD_STAGES and head["verdict"] == "failed":
            skip = "not run: the draft head failed at an earlier stage"
            report["stages"].append({"stage": name, "skipped": skip})
            logger.warning(f"stage {i} ({name}) {skip}")
            continue
        report["running"] = name
        write_report(report, smoke, report_path)
        print(f"tt-smoke: stage {i}/{len(stages)} ({name}) running", flush=True)
        tracebacks.write(f"\n--- stage {i} ({name}) started {time.strftime('%Y-%m-%d %H:%M:%S')}; every thread's "
                         f"traceback follows every {watchdog_s:g}s while it runs ---\n")
        tracebacks.flush()
        faulthandler.dump_traceback_later(watchdog_s, repeat=True, file=tracebacks)
        start = time.perf_counter()
        try:
            stage(smoke)
        except Exception as e:  # noqa: BLE001: any failure is the finding this tool reports
            seconds, error = time.perf_counter() - start, f"{type(e).__name__}: {e}"
            report["stages"].append({"stage": name, "seconds": seconds, "error": error,
                                     "traceback": traceback.format_exc()})
            logger.error(f"stage {i} ({name}) FAILED after {seconds:.1f}s: {error}")
            if stage in HEAD_STAGES:
                head.update(verdict="failed", stage=name, error=error)
                logger.error(f"the draft head failed; the target path's verdict stands; {SEND_BACK}: {report_path}")
                write_report(report, smoke, report_path)
                continue
            report["ok"] = False
            logger.error(f"stopped there; {SEND_BACK}: {report_path}")
            return
        finally:
            faulthandler.cancel_dump_traceback_later()
            report["running"] = None
        seconds = time.perf_counter() - start
        report["stages"].append({"stage": name, "seconds": seconds})
        if stage in HEAD_STAGES and head["verdict"] != "failed":
            head["verdict"] = "passed"
        write_report(report, smoke, report_path)
        logger.info(f"stage {i} ({name}) passed in {seconds:.1f}s")


def smoke_settings(config: DemoConfig, draft_head=None, full: bool = False) -> dict:
    """What this run was asked for, in the report: the settings that change which programs run (--tap_gather: whether
    the tapped traces hold our all-gather; --full), so a report says which form hung or passed."""
    return {"tap_gather": config.tap_gather, "max_seq_len": config.max_seq_len, "precision": config.precision,
            "n_draft_tokens": config.n_draft_tokens, "draft_head": draft_head,
            "trace_region_size": config.trace_region_size, "grouped_verify": config.grouped_verify, "full": full}


def write_report(report: dict, smoke: Smoke, report_path: Path) -> None:
    report["facts"] = smoke.facts
    report["environment"] = {"MESH_DEVICE": os.environ.get("MESH_DEVICE"), "HF_MODEL": os.environ.get("HF_MODEL"),
                             "TT_CACHE_PATH": os.environ.get("TT_CACHE_PATH"),
                             **environment(smoke.facts.get("device", "not opened"))}
    write_json_atomic(report_path, report)


def run(config: DemoConfig, report_path: Path, stages=None, draft_head=None, watchdog_s: float = WATCHDOG_S,
        full: bool = False) -> dict:
    """Every stage in order (STAGES, or FULL_STAGES with `full`) until a target-path stage fails, the head's stages
    with their own verdict (run_stages); the report, also written to report_path before and after every stage
    (run_stages), before the teardown (the models released, the mesh closed), so that a teardown that crashes or hangs
    after a failed capture cannot lose it, and again after it, with the teardown's own failure if it had one. The
    files beside it (side_files) are set up first: this tool's log, tt-metal's (TT_LOGGER_FILE, read when ttnn loads:
    not when it is loaded already, or set by the caller), and the tracebacks of a crash or a stage that runs long."""
    files = side_files(report_path)
    report = {"stages": [], "ok": True, "head": {"verdict": "not run"}, "running": None,
              "files": {kind: str(path) for kind, path in files.items()},
              "settings": smoke_settings(config, draft_head, full)}
    sets_ttnn_log = "ttnn" not in sys.modules and "TT_LOGGER_FILE" not in os.environ
    if sets_ttnn_log:
        os.environ["TT_LOGGER_FILE"] = str(files["ttnn_log"])
    else:
        report["files"]["ttnn_log"] = os.environ.get("TT_LOGGER_FILE", "stdout (ttnn was loaded before the smoke)")
    print(f"tt-smoke: report {report_path}; beside it {', '.join(str(p) for p in files.values())}", flush=True)
    smoke = Smoke(config, None, draft_head, full)
    sink = logger.add(files["log"], level="DEBUG")
    crash_handler_was_on = faulthandler.is_enabled()
    with open(files["tracebacks"], "a") as tracebacks:
        faulthandler.enable(file=tracebacks, all_threads=True)  # a hard crash's tracebacks, beside the report
        try:
            with ExitStack() as exits:
                smoke.exits = exits
                run_stages(smoke, stages or (FULL_STAGES if full else STAGES), report, report_path, tracebacks,
                           watchdog_s)
                write_report(report, smoke, report_path)
        except Exception as e:  # noqa: BLE001: the teardown's failure is reported beside the stages'
            report["ok"] = False
            report["teardown"] = f"{type(e).__name__}: {e}"
            logger.error(f"teardown FAILED: {type(e).__name__}: {e}; {SEND_BACK}: {report_path}")
        finally:
            write_report(report, smoke, report_path)
            faulthandler.disable()
            if crash_handler_was_on:  # as it was (pytest's, for one)
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
            logger.remove(sink)
            if sets_ttnn_log:  # read once, when ttnn loads: this process's later imports are not ours to redirect
                os.environ.pop("TT_LOGGER_FILE", None)
    for line in verdict_lines(report):
        print(line, flush=True)
    if report["ok"]:
        logger.info(f"target path passed: {json.dumps(smoke.facts.get('perf'))}; report {report_path}")
    return report


def verdict_lines(report: dict) -> list[str]:
    """The run's two verdicts, the last lines it prints: the target path's (the exit status) and the draft head's."""
    failed = next((s["stage"] for s in report["stages"] if "error" in s and s["stage"] != report["head"].get("stage")),
                  None)
    target = ("passed" if report["ok"] else f"FAILED at stage {failed!r}" if failed else
              f"FAILED in the teardown ({report.get('teardown')})")
    head = report["head"]
    verdict = f"FAILED at stage {head['stage']!r} ({head['error']})" if head["verdict"] == "failed" else head["verdict"]
    return [f"tt-smoke verdict: target path {target} (exit status {0 if report['ok'] else 1})",
            f"tt-smoke draft head: {verdict}"]


def main(argv=None) -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", default="tt_smoke_report.json", help="where the JSON report goes")
    parser.add_argument("--max_seq_len", type=int, default=1024)
    parser.add_argument("--precision", default="performance", choices=PRECISIONS)
    parser.add_argument("--draft_head", help="the EAGLE-3 head the draft-head stage runs (a folder or a hub id in the "
                                             "local cache, as the demo's); default: the one shipped for the model, "
                                             "else a random one")
    parser.add_argument("--watchdog_s", type=float, default=WATCHDOG_S,
                        help="seconds: while one stage runs, every thread's traceback goes to <report>.tracebacks.txt "
                             "this often")
    parser.add_argument("--tap_gather", default="host", choices=("device", "host"),
                        help="N300/T3K: where the tapped states a draft head reads are gathered: host (the smoke's "
                             "default: read back and written to the tap tile after each replay, so no trace holds a "
                             "collective of ours) or device (one all-gather inside each tapped trace, the demo's "
                             "default: run it once host passes); the same on one device")
    parser.add_argument("--full", action="store_true",
                        help="the second run: also the tapped-states stage and taps in the eager stage, every trace "
                             "the stages use (the taps' and the head's target steps too) captured once up front; the "
                             "default (the first run) captures only the target path's traces before its verdict")
    parser.add_argument("--grouped_verify", action="store_true",
                        help="verify steps' attention as one cache scan per user (the demo's --grouped_verify 1): "
                             "the lossless stage then shows whether it stays bit-identical to plain decoding here")
    parser.add_argument("--trace_region_size", type=int, help="bytes of trace region to open the mesh with (default: "
                                                                "the traces' estimate x 2.5; a run whose traces outgrow "
                                                                "the region names the size to pass here)")
    args = parser.parse_args(argv)
    config = DemoConfig(backend="ttnn", max_seq_len=args.max_seq_len, precision=args.precision,
                        draft_mode="suffix", max_generated_tokens=SMOKE_TOKENS, tap_gather=args.tap_gather,
                        trace_region_size=args.trace_region_size, grouped_verify=int(args.grouped_verify))
    report = run(config, Path(args.report), draft_head=args.draft_head, watchdog_s=args.watchdog_s, full=args.full)
    return 0 if report["ok"] else 1  # the target path's verdict; the head's is in the report (module docstring)


if __name__ == "__main__":
    sys.exit(main())
