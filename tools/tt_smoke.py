# SPDX-License-Identifier: Apache-2.0
"""The first thing to run on a Tenstorrent machine (`make tt-smoke`): the ttnn backend stage by stage, each logged
with its time, stopping at the first failure with what to send back.

    MESH_DEVICE=N150 HF_MODEL=meta-llama/Llama-3.1-8B-Instruct make tt-smoke

Stages: ttnn import and version; the TT-Transformers details the backend relies on, probed without a device
(tt_surface.py: one line each); device open (the fabric on meshes of several devices); model build (weight
conversion into the cache folder, logged); a prefill and a verify step run eagerly (--trace 0: a failure names the
op, not a trace); compile and trace capture (TT's prefill warm-up and every decode trace
the run uses); prefill of one prompt; one plain traced decode step; one verify step with
drafts; the tapped hidden states an EAGLE-3 head reads (layers 0, 2, N/2 and N-3: the prompt's read back from the
prefill, a step's left in the tap tile); the draft head on the device (the run's head, else a random EAGLE-3 head:
its chain against the torch head fed the same states); speculative decoding identical to plain decoding through the
same verify-shaped step for 32 tokens; the TT perf keys of a short demo run. The report (every stage, its seconds, the failure with its traceback, the
versions) is written to --report as JSON.
"""
import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loguru import logger  # noqa: E402

from models.tt_transformers.demo.speculative_decoding.build import (  # noqa: E402
    ModelPool,
    build,
    draft_head,
    trace_region_size,
)
from models.tt_transformers.demo.speculative_decoding.inputs import (  # noqa: E402
    PRECISIONS,
    check_inputs,
    draft_head_folder,
)
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig  # noqa: E402
from models.tt_transformers.demo.speculative_decoding.speculative_demo import run_demo  # noqa: E402
from models.tt_transformers.prompts import encode  # noqa: E402
from models.tt_transformers.records import environment, write_json_atomic  # noqa: E402
from models.tt_transformers.speculative import SpeculativeConfig, SpeculativeGenerator, make_drafter  # noqa: E402

SMOKE_TOKENS = 32
PROMPT = "Repeat this list exactly: apples, pears, plums, figs, dates, limes, apples, pears, plums, figs, dates, limes."
SEND_BACK = ("send back the report file, `pip show ttnn`, the tt-metal commit (git -C $TT_METAL_HOME rev-parse HEAD), "
             "MESH_DEVICE and HF_MODEL")


class Smoke:
    """What the stages build on one another: the mesh, the model, the prompt's tokens."""

    def __init__(self, config: DemoConfig, exits: ExitStack, draft_head=None):
        self.config, self.exits, self.draft_head = config, exits, draft_head  # draft_head: --draft_head (else None)
        self.mesh = self.lm = self.drafter = self.tokens = None
        self.pool = ModelPool()  # the demo run of the last stage reuses the model built here
        self.facts: dict = {}


def tt_transformers_surface(s: Smoke) -> None:
    """Every TT-Transformers detail the backend relies on, probed against the installed tt-metal without opening a
    device (ttnn_backend/tt_surface.py): one line each, found with its variant or missing with the file to look at."""
    from models.tt_transformers.ttnn_backend.tt_surface import probe

    lines = probe()
    for name, found, variant in lines:
        (logger.info if found else logger.error)(f"  {'found' if found else 'MISSING'}: {name}: {variant}")
    s.facts["tt_transformers_surface"] = {name: variant for name, _, variant in lines}
    missing = [name for name, found, _ in lines if not found]
    if missing:
        raise LookupError(f"{len(missing)} TT-Transformers detail(s) the backend relies on are missing: "
                          f"{'; '.join(missing)}")


def import_ttnn(s: Smoke) -> None:
    import ttnn  # noqa: F401

    model = importlib.import_module("models.tt_transformers.tt.model")  # TT-Transformers, from the tt-metal checkout

    try:
        version = importlib.metadata.version("ttnn")
    except importlib.metadata.PackageNotFoundError:  # a tt-metal build on PYTHONPATH, not a pip install
        version = "not installed as a package"
    s.facts.update(ttnn=version, tt_transformers=str(Path(model.__file__).parent))


def smoke_taps(n_layers: int) -> tuple[int, ...]:
    """Layer 0 (the embedding, checked exactly) and an EAGLE-3 head's default taps (2, N // 2, N - 3)."""
    return tuple(dict.fromkeys(min(max(i, 0), n_layers - 1) for i in (0, 2, n_layers // 2, n_layers - 3)))


RANDOM_DRAFT_VOCAB = 32000  # a random head's draft vocabulary, as published EAGLE-3 heads for Llama-3 have


def smoke_head_folder(config: DemoConfig, ckpt, draft_head=None):
    """The head the draft-head stage runs: --draft_head (a folder or a hub id in the local cache, as the demo's), else
    the one shipped for the model, else None (a random EAGLE-3 head of the target's shape, seeded)."""
    return draft_head_folder(DemoConfig(**{**vars(config), "draft_mode": "hybrid", "draft_head": draft_head}),
                                  ckpt.name)


# The device head's drafts must agree with the host bf16 head's on at least this share of first drafts. Rounding the
# weights to bfloat8_b alone left 96.9 % of first drafts the same (shipped head, real states) and 92.9 % (8B-shaped
# random head; tools/head_precision.py, docs/head_precision.json); the device's compute fidelity adds to that: below
# 80 % the device head computes something else.
MIN_FIRST_DRAFT_AGREEMENT = 0.8
MIN_CHAIN_STEPS = 32  # chain steps compared, over as many prompt prefixes as that takes


def stages_region(config: DemoConfig, shape, draft_head=None) -> int:
    """Trace region for the traces the stages add to the run's: the taps stage's (1 write pass, smoke_taps), and the
    head stage's (the target's steps with the head's taps and the head's own traces), with the margin."""
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.checkpoints.model_shape import ModelShape
    from models.tt_transformers.ttnn_backend.trace_plan import (
        device_names_for,
        head_region_bytes,
        model_trace_bytes,
        region_bytes,
    )

    ckpt = resolve_checkpoint(config.model, "--model" if config.model else "HF_MODEL")
    args = ModelShape.from_hf_config(ckpt.config)
    devices, n = device_names_for(shape, os.environ.get("MESH_DEVICE")), shape[0] * shape[1]
    from models.tt_transformers.checkpoints.eagle3_format import default_taps, read_head_config

    k = max(1, config.n_draft_tokens)
    folder = smoke_head_folder(config, ckpt, draft_head)
    head_taps = read_head_config(folder, args).taps if folder is not None else default_taps(args.n_layers)
    traces = model_trace_bytes(ckpt.name, devices, n, args.n_layers, args.n_layers, args.vocab_size, 1, 0,
                               smoke_taps(args.n_layers))
    traces += model_trace_bytes(ckpt.name, devices, n, args.n_layers, args.n_layers, args.vocab_size, k + 1, 0,
                                head_taps)
    return region_bytes(traces + head_region_bytes(ckpt.name, devices, args.n_layers, k))


def open_device(s: Smoke) -> None:
    from models.tt_transformers.ttnn_backend.device import fabric_config_for, mesh_shape, open_mesh

    shape = mesh_shape()
    region = trace_region_size(s.config, shape) + stages_region(s.config, shape, s.draft_head)
    s.mesh = s.exits.enter_context(open_mesh(trace_region_size=region))
    s.exits.callback(s.pool.close)  # traces released before the mesh closes
    s.facts.update(mesh=list(shape), fabric=str(fabric_config_for(shape)), trace_region_size=region)


def build_model(s: Smoke) -> None:
    tokenizer, s.lm, s.drafter, *_ = build(s.config, check_inputs(s.config), s.mesh, s.pool)
    s.tokens = encode(tokenizer, PROMPT, bool(s.config.instruct))
    args = s.lm.tt.args
    s.facts.update(model=args.model_name, device=args.device_name, weight_cache=str(args.model_cache_path))


def eager_steps(s: Smoke) -> None:
    """A prefill with taps and a verify step with the top k and taps, run op by op (--trace 0) before anything is
    captured: a failure here is an op's, not a trace's."""
    from models.tt_transformers.speculative.backend import UserRows

    s.lm.trace = False
    try:
        taps = smoke_taps(s.lm.n_layers)
        first = s.lm.prefill(0, s.tokens, taps=taps).ids[0][0]
        rows = [first, *s.tokens[-4:]]
        s.facts["eager_verify_ids"] = s.lm.step([UserRows(0, rows, len(s.tokens))], top_k=s.drafter.top_k,
                                                taps=taps).ids[0]
    finally:
        s.lm.trace = True


def compile_and_capture(s: Smoke) -> None:
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
    the same states (bfloat16, on the host) drafts beside it. Reported: both chains, the head's probabilities and the
    first draft's logits' difference (bfloat8_b weights on the device); the run fails on non-finite logits or a first
    draft that is not among the torch head's top 5."""
    import torch

    from models.tt_transformers.speculative.drafters.eagle3_device import HeadFeed
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.torch_backend.load import load_model
    from models.tt_transformers.checkpoints.eagle3_format import random_head, read_draft_head
    from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, build_draft_head
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    ckpt = resolve_checkpoint(s.config.model, "--model" if s.config.model else "HF_MODEL")
    args = ModelShape.from_hf_config(ckpt.config)
    folder = smoke_head_folder(s.config, ckpt, s.draft_head)
    head = read_draft_head(folder, args) if folder is not None else \
        random_head(args, draft_vocab=min(RANDOM_DRAFT_VOCAB, args.vocab_size))
    k = max(1, s.config.n_draft_tokens)
    config = DemoConfig(**{**vars(s.config), "n_draft_tokens": k})
    dev = draft_head(head, s.lm, ckpt, args, config, lambda make: s.pool.get(("smoke head",), make))["device_head"]
    drafter = make_drafter(SpeculativeConfig(draft_mode="head", n_draft_tokens=k), s.lm, device_head=dev)
    SpeculativeGenerator(s.lm, drafter, k).warm_up()
    out = s.lm.prefill(0, s.tokens, taps=head[0].taps)
    context = s.tokens + out.ids[0]
    ids, probs = dev.draft([HeadFeed(0, 0, context[1:], states=out.hidden[0])], [0], k)[0]
    host = load_model(ckpt, torch.bfloat16, s.config.max_seq_len, "cpu", cpu_kernels=False, n_layers=0)
    runner = HeadRunner(build_draft_head(*head, host), 1, s.config.max_seq_len, args)
    state, first_ref = runner.run([0], [0], [out.hidden[0]], [context[1:]])[0]
    reference, logits = [], first_ref
    for j in range(k):
        reference.append(int(runner.vocab[logits.argmax()]))
        state, logits = runner.run([0], [len(s.tokens) + j], [state[-1:]], [[reference[-1]]])[0]
    device_logits = dev.read_logits(0)[dev.last_rows[0]]
    if not torch.isfinite(device_logits).all():
        raise AssertionError("the device head's logits hold non-finite values")
    top5 = runner.vocab[first_ref.topk(5).indices].tolist()
    s.facts["draft_head"] = {"head": str(folder or "random"), "device_chain": ids, "torch_chain": reference,
                             "probs": [round(p, 3) for p in probs], "first_logits_max_rel_diff": round(
                                 ((device_logits - first_ref).abs().max() / first_ref.abs().max()).item(), 4)}
    if ids[0] not in top5:
        raise AssertionError(f"the device head's first draft {ids[0]} is not among the torch head's top 5 {top5}")
    agreement = chain_agreement(dev, runner, out.hidden[0], context, k)
    s.facts["draft_head"]["agreement"] = agreement
    if agreement["first_draft_same"] < MIN_FIRST_DRAFT_AGREEMENT:
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
    spec = SpeculativeGenerator(s.lm, s.drafter, s.config.n_draft_tokens).generate([s.tokens], SMOKE_TOKENS, False)[0]
    s.facts["tokens_per_step"] = round(len(spec.output_tokens) / max(1, len(spec.iterations) + 1), 2)
    if spec.output_tokens != plain.output_tokens:
        raise AssertionError(f"speculative output differs from plain decoding through the same step: "
                             f"{spec.output_tokens} vs {plain.output_tokens}")


def perf_keys(s: Smoke) -> None:
    report = run_demo(s.config, s.mesh, s.pool)
    keys = ("compile_prefill", "compile_decode", "prefill_time_to_token", "prefill_t/s", "decode_t/s/u", "decode_t/s",
            "mean_tokens_per_step", "speedup", "identical_to_baseline")
    s.facts["perf"] = {k: report["summary"].get(k) for k in keys}


STAGES: list[tuple[str, Callable[[Smoke], None]]] = [
    ("ttnn import", import_ttnn), ("TT-Transformers surface", tt_transformers_surface), ("device open", open_device),
    ("model build", build_model), ("eager prefill and verify step", eager_steps),
    ("compile and trace capture", compile_and_capture), ("prefill", prefill), ("plain decode step", decode_step), ("verify step", verify_step),
    ("tapped states", tapped_states), ("draft head on the device", device_head),
    (f"lossless over {SMOKE_TOKENS} tokens", lossless), ("perf keys", perf_keys)]


def run_stages(smoke: Smoke, stages, report: dict, report_path: Path) -> None:
    """Every stage in order until one fails, each recorded in the report."""
    for i, (name, stage) in enumerate(stages, 1):
        start = time.perf_counter()
        try:
            stage(smoke)
        except Exception as e:  # noqa: BLE001: any failure is the finding this tool reports
            seconds = time.perf_counter() - start
            report["stages"].append({"stage": name, "seconds": seconds, "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()})
            report["ok"] = False
            logger.error(f"stage {i} ({name}) FAILED after {seconds:.1f}s: {type(e).__name__}: {e}")
            logger.error(f"stopped there; {SEND_BACK}: {report_path}")
            return
        seconds = time.perf_counter() - start
        report["stages"].append({"stage": name, "seconds": seconds})
        logger.info(f"stage {i} ({name}) passed in {seconds:.1f}s")


def write_report(report: dict, smoke: Smoke, report_path: Path) -> None:
    report["facts"] = smoke.facts
    report["environment"] = {"MESH_DEVICE": os.environ.get("MESH_DEVICE"), "HF_MODEL": os.environ.get("HF_MODEL"),
                             "TT_CACHE_PATH": os.environ.get("TT_CACHE_PATH"),
                             **environment(smoke.facts.get("device", "not opened"))}
    write_json_atomic(report_path, report)


def run(config: DemoConfig, report_path: Path, stages=None, draft_head=None) -> dict:
    """Every stage in order until one fails; the report, also written to report_path: before the teardown (the models
    released, the mesh closed), so that a teardown that crashes or hangs after a failed capture cannot lose it, and
    again after it, with the teardown's own failure if it had one."""
    report = {"stages": [], "ok": True}
    smoke = Smoke(config, None, draft_head)
    try:
        with ExitStack() as exits:
            smoke.exits = exits
            run_stages(smoke, stages or STAGES, report, report_path)
            write_report(report, smoke, report_path)
    except Exception as e:  # noqa: BLE001: the teardown's failure is reported beside the stages'
        report["ok"] = False
        report["teardown"] = f"{type(e).__name__}: {e}"
        logger.error(f"teardown FAILED: {type(e).__name__}: {e}; {SEND_BACK}: {report_path}")
    finally:
        write_report(report, smoke, report_path)
    if report["ok"]:
        logger.info(f"all {len(report['stages'])} stages passed: {json.dumps(smoke.facts.get('perf'))}; report "
                    f"{report_path}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", default="tt_smoke_report.json", help="where the JSON report goes")
    parser.add_argument("--max_seq_len", type=int, default=1024)
    parser.add_argument("--precision", default="performance", choices=PRECISIONS)
    parser.add_argument("--draft_head", help="the EAGLE-3 head the draft-head stage runs (a folder or a hub id in the "
                                             "local cache, as the demo's); default: the one shipped for the model, "
                                             "else a random one")
    args = parser.parse_args(argv)
    config = DemoConfig(backend="ttnn", max_seq_len=args.max_seq_len, precision=args.precision,
                             draft_mode="suffix", max_generated_tokens=SMOKE_TOKENS)
    return 0 if run(config, Path(args.report), draft_head=args.draft_head)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
