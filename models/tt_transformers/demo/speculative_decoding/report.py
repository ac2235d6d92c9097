# SPDX-License-Identifier: Apache-2.0
"""The demo's report: TT-Transformers' performance block, the per-prompt table and the --output_json file."""
import json
import os
import platform
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np

from models.tt_transformers.demo.speculative_decoding.inputs import PACKAGE_ROOT, DemoInputError
from models.tt_transformers.demo.speculative_decoding.speculative_generator import UserResult
from models.tt_transformers.speculative.metrics import NUM_DRAFTS, SpecDecodeCounters, summary_lines
from models.tt_transformers.torch_backend.cpu_threads import cpu_seconds


SPEEDUP_SLACK = 1.15  # a speculative step costs at least a plain one: beyond tokens per forward by this, time lied
MIN_TIMED_TOKENS = 16  # a prompt's tokens after the first below which its tok/s is mostly start-up and noise
OTHER_LOAD_CORES = 0.5  # other processes' CPU use (cores) that disturbs a timing


LATENCY_PERCENTILES = (50, 95, 99)


def latencies_ms(users: list[UserResult]) -> dict[str, list[float]]:
    """Per request, as vLLM's serving benchmark measures a streamed request (every request of a batch arrives when
    its generate() starts): TTFT, the first token's time; E2EL, the last token's; TPOT, (E2EL - TTFT) over the
    tokens after the first; and every ITL, the gap between two consecutive chunks (a step's tokens arrive together)."""
    out = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for r in users:
        times = [1e3 * t for t in r.token_times_s]
        if not times:
            continue
        out["ttft"].append(times[0])
        out["e2el"].append(times[-1])
        if len(r.output_tokens) > 1:
            out["tpot"].append((times[-1] - times[0]) / (len(r.output_tokens) - 1))
        out["itl"] += [b - a for a, b in zip(times, times[1:])]
    return out


def latency_summary(users: list[UserResult]) -> dict:
    """mean_<m>_ms and p50/p95/p99_<m>_ms for TTFT, TPOT, ITL and E2EL (vLLM's benchmark keys; None without a
    value)."""
    summary = {}
    for metric, values in latencies_ms(users).items():
        summary[f"mean_{metric}_ms"] = float(np.mean(values)) if values else None
        for p in LATENCY_PERCENTILES:
            summary[f"p{p}_{metric}_ms"] = float(np.percentile(values, p)) if values else None
    return summary


def spec_decode_counters(users: list[UserResult], num_spec_tokens: Optional[int] = None) -> SpecDecodeCounters:
    """vLLM's acceptance counters over every iteration that verified a draft (a tree counts its nodes as draft tokens
    and its accepted path by depth); positions up to num_spec_tokens (default: the longest draft)."""
    drafted = [(it.drafted, it.accepted) for r in users for it in r.iterations if it.drafted]
    counters = SpecDecodeCounters(num_spec_tokens if num_spec_tokens is not None else
                                  max((d for d, _ in drafted), default=0))
    for d, a in drafted:
        counters.observe_draft(d, a)
    return counters


def summarize(batches: list[list[UserResult]], num_spec_tokens: Optional[int] = None) -> dict:
    """Figures over all users (users of one batch share each iteration's time), with TT-Transformers' perf keys:
    prefill_time_to_token (s, mean over users), prefill_t/s (prompt tokens per second of prefill), decode_t/s/u and
    decode_t/s (tokens after the first per second of decoding, per user and over the batch); vLLM's serving keys
    (latency_summary) and its spec-decode counters (spec_decode, for drafts of up to num_spec_tokens)."""
    users = [r for batch in batches for r in batch]
    drafted = sum(it.drafted for r in users for it in r.iterations)
    accepted = sum(it.accepted for r in users for it in r.iterations)
    steps = sum(len(r.iterations) for r in users)
    batch_steps = sum(max(len(r.iterations) for r in batch) for batch in batches)  # target forwards
    produced = sum(len(r.output_tokens) - 1 for r in users)
    decode_s = sum(max(r.decode_s for r in batch) for batch in batches)
    prefill_s = sum(r.ttft_ms for r in users) / 1e3
    tok_s = produced / decode_s if decode_s else 0.0
    tok_s_u = tok_s * len(batches) / len(users)
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_step": produced / steps if steps else 0.0,
        "ms_per_step": 1e3 * decode_s / batch_steps if batch_steps else 0.0,
        "decode_tok_s": tok_s,
        "decode_tok_s_u": tok_s_u,
        "ttft_ms": sum(r.ttft_ms for r in users) / len(users),
        "prefill_time_to_token": prefill_s / len(users),
        "prefill_t/s": sum(len(r.prompt_tokens) for r in users) / prefill_s if prefill_s else 0.0,
        "decode_t/s/u": tok_s_u,
        "decode_t/s": tok_s,
        **latency_summary(users),
        "spec_decode": spec_decode_counters(users, num_spec_tokens).as_dict(),
    }


def environment(device: str) -> dict:
    """Where a report was measured: machine, software and the code's git commit (None outside a git checkout)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PACKAGE_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    return {"machine": platform.machine(), "processor": names[0] if names else platform.processor(),
            "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "device": device, "git_commit": commit}


class LoadMeter:
    """Other processes' CPU use while a phase ran, in cores: what disturbs a timing on a shared machine."""

    def __enter__(self):
        self.start, self.wall = cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        end, wall = cpu_seconds(), time.perf_counter() - self.wall
        self.load = None if end is None or self.start is None or wall <= 0 else {
            "other_processes_cores": max(0.0, (end[0] - self.start[0] - (end[1] - self.start[1])) / wall),
            "own_cores": (end[1] - self.start[1]) / wall, "wall_s": wall}


def timing_warnings(summary: dict, load: dict, env: dict) -> list[str]:
    """What makes this run's figures untrustworthy, each with its likely cause: other processes' load (during a run
    or changing between the speculative and plain runs), and a speedup beyond what tokens per target forward can
    give (a speculative step never costs less than a plain one)."""
    cause = None
    phases = {phase: l["other_processes_cores"] for phase, l in load.items() if l is not None}
    if phases:
        phase, others = max(phases.items(), key=lambda item: item[1])
        cpus, threads = env["cpu_count"], env["torch_threads"]
        if others > OTHER_LOAD_CORES and others + threads > cpus:
            free = max(1, int(cpus - others))
            fix = f"stop them, or set OMP_NUM_THREADS={free}" if threads > free else "stop them"
            cause = (f"other processes used {others:.1f} of {cpus} cores during {phase} decoding while torch ran "
                     f"{threads} thread{'s' * (threads > 1)}: {fix}")
        elif max(phases.values()) - min(phases.values()) > OTHER_LOAD_CORES:
            cause = ("the machine's load changed between the speculative and plain runs (other processes: "
                     + ", ".join(f"{v:.1f} cores during {p}" for p, v in phases.items()) + ")")
    warnings = [f"Timing disturbed: {cause}; rerun on a quiet machine to trust the speedup"] if cause else []
    if "speedup" in summary and summary["speedup"] > SPEEDUP_SLACK * summary["mean_tokens_per_step"]:
        warnings.append(
            f"Speedup {summary['speedup']:.2f}x is more than {summary['mean_tokens_per_step']:.2f} tokens per target "
            f"forward can give (a speculative step, {summary['ms_per_step']:.1f} ms, costs at least a plain one, yet "
            f"plain decoding took {summary['baseline']['ms_per_step']:.1f} ms): the plain run was slowed, by another "
            "process or by OMP_NUM_THREADS above the free cores")
    return warnings


def performance_lines(label: str, s: dict) -> list[str]:
    """TT-Transformers' performance block."""
    ms = 1e3 / s["decode_tok_s_u"] if s["decode_tok_s_u"] else 0.0
    return [f"=== Performance metrics ({label}) ===",
            f"Time to first token: {s['ttft_ms']:.1f}ms",
            f"Average speed: {ms:.1f}ms @ {s['decode_tok_s_u']:.1f} tok/s/user ({s['decode_tok_s']:.1f} tok/s "
            "throughput)",
            f"Acceptance rate: {100 * s['acceptance_rate']:.1f}%, mean tokens per target forward: "
            f"{s['mean_tokens_per_step']:.2f}",
            latency_line(s)] + (summary_lines(s["spec_decode"]) if s["spec_decode"][NUM_DRAFTS] else [])


def latency_line(s: dict) -> str:
    """TPOT, ITL and E2EL in ms: mean / P50 / P95 / P99 (vLLM's benchmark figures)."""
    def figures(metric):
        values = [s[f"{k}_{metric}_ms"] for k in ("mean", *(f"p{p}" for p in LATENCY_PERCENTILES))]
        return "n/a" if None in values else "/".join(f"{v:.1f}" if v < 100 else f"{v:.0f}" for v in values)
    return "Mean/P50/P95/P99 ms: " + ", ".join(f"{m.upper()} {figures(m)}" for m in ("tpot", "itl", "e2el"))


def speedup_line(summary: dict) -> str:
    same = f"; outputs identical: {summary['identical_to_baseline']}" if "identical_to_baseline" in summary else ""
    return f"Speedup over plain decoding: {summary['speedup']:.2f}x{same}"


PROMPT_ECHO = 100  # characters of a prompt the log repeats (a code edit's prompt runs to pages)


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def prompt_entries(prompts: list[str], batches: list[list[int]], results: list[list[UserResult]],
                   baseline: Optional[list[list[UserResult]]], tokenizer) -> list[dict]:
    """The report's entry per prompt, in prompt order (a repeat that only filled the last batch is left out)."""
    entries, seen = [], set()
    for b, batch in enumerate(batches):
        for u, i in enumerate(batch):
            if i in seen:
                continue
            seen.add(i)
            r = results[b][u]
            produced = len(r.output_tokens) - 1
            entry = {"prompt": prompts[i], "output_text": tokenizer.decode(r.output_tokens, skip_special_tokens=True),
                     "output_tokens": r.output_tokens, "iterations": [vars(it) for it in r.iterations],
                     "ttft_ms": r.ttft_ms, "token_times_ms": [1e3 * t for t in r.token_times_s],
                     "decode_tok_s": r.decode_tok_s,
                     "tokens_per_step": produced / len(r.iterations) if r.iterations else 0.0,
                     "draft_sources": dict(Counter(it.draft_source for it in r.iterations if it.drafted)),
                     "too_few_tokens_to_time": produced < MIN_TIMED_TOKENS}
            if baseline is not None:
                entry["baseline_output_tokens"] = baseline[b][u].output_tokens
                entry["baseline_decode_tok_s"] = baseline[b][u].decode_tok_s
                entry["speedup"] = r.decode_tok_s / entry["baseline_decode_tok_s"]
                entry["speedup_beyond_tokens_per_step"] = entry["speedup"] > SPEEDUP_SLACK * entry["tokens_per_step"]
            entries.append(entry)
    return entries


def prompt_table_lines(entries: list[dict]) -> list[str]:
    """Per prompt: tokens per target forward, speedup over plain decoding, which sources drafted: where it pays. A
    speedup from too few tokens (*) or beyond what its tokens per forward can give (!) is marked, with why."""
    lines = [f"{'prompt':<44} {'tokens/forward':>14} {'speedup':>8}   drafted by"]
    for e in entries:
        speedup, marks = "-", ""
        if "speedup" in e:
            speedup = f"{e['speedup']:.2f}x"
            marks = "*" * e["too_few_tokens_to_time"] + "!" * e["speedup_beyond_tokens_per_step"]
        sources = ", ".join(f"{source} {n}" for source, n in sorted(e["draft_sources"].items())) or "nothing"
        lines.append(f"{shorten(e['prompt'], 44):<44} {e['tokens_per_step']:>14.2f} {speedup:>8}{marks:<2} {sources}")
    if any(e.get("speedup") is not None and e["too_few_tokens_to_time"] for e in entries):
        lines.append(f"* fewer than {MIN_TIMED_TOKENS} tokens after the first: too few to time")
    if any(e.get("speedup_beyond_tokens_per_step") for e in entries):
        lines.append("! more than its tokens per forward can give: its plain run was slowed (another process?)")
    return lines


def result_lines(report: dict) -> list[str]:
    """The run's result, as the screen ends with it: performance, speedup, warnings, the per-prompt table."""
    summary = report["summary"]
    lines = performance_lines("speculative", summary)
    if "baseline" in summary:
        lines += performance_lines("plain decoding", summary["baseline"]) + [speedup_line(summary)]
    return lines + summary["warnings"] + ["Per prompt:"] + prompt_table_lines(report["prompts"])


class ReportFile:
    """A JSON report file reserved before the run: its temporary file is created in the report's folder at once, so a
    path that cannot be written (a read-only folder, /proc) stops the run before it starts, whatever permission bits
    say; the report is written into that same file and renamed over the path only when whole. A run that fails or is
    interrupted calls discard(): nothing of it is left, not even the folders made for it."""

    def __init__(self, path, flag: str = "--output_json"):
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise DemoInputError(f"{flag} {str(path)!r} is a directory; give a file path")
        self.made: list[Path] = []  # folders created for the report, innermost last
        missing = [folder for folder in self.path.parents if not folder.exists()]
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self.made.append(folder)
            os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as e:
            self.discard()
            raise DemoInputError(f"{flag} {str(path)!r} cannot be written (creating a file in {self.path.parent} "
                                 f"failed: {e.strerror}); pass a path in a folder you can write in") from None

    def write(self, data) -> None:
        try:
            self.tmp.write_text(json.dumps(data, indent=2))
            os.replace(self.tmp, self.path)
        except BaseException:  # a full disk: no half-written report either
            self.discard()
            raise

    def discard(self) -> None:
        if self.tmp.exists():  # not when creating it failed
            self.tmp.unlink()
        for folder in reversed(self.made):
            folder.rmdir()


def write_json_atomic(path: Path, data, flag: str = "--output_json") -> None:
    """JSON written whole or not at all (a reader never sees half a file)."""
    ReportFile(path, flag).write(data)
