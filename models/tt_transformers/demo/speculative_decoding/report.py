# SPDX-License-Identifier: Apache-2.0
"""The demo's report: TT-Transformers' performance block, the per-prompt table and the --output_json file."""
import time
from collections import Counter
from typing import Optional

from models.tt_transformers import records
from models.tt_transformers.speculative.metrics import NUM_DRAFTS, summary_lines
from models.tt_transformers.speculative.results import LATENCY_PERCENTILES, UserResult
from models.tt_transformers.torch_backend.cpu_threads import cpu_seconds


MIN_TIMED_TOKENS = 16  # a prompt's tokens after the first below which its tok/s is mostly start-up and noise
OTHER_LOAD_CORES = 0.5  # other processes' CPU use (cores) that disturbs a timing


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
    if speedup_impossible(summary):
        warnings.append(
            f"Speedup {summary['speedup']:.2f}x is more than {speedup_bound(summary):.2f} tokens per target forward "
            f"can give (a speculative step, {summary['ms_per_step']:.1f} ms, costs at least a plain one, yet plain "
            f"decoding took {summary['baseline']['ms_per_step']:.1f} ms): the plain run was slowed, by another "
            "process or by OMP_NUM_THREADS above the free cores")
    return warnings


def speedup_bound(summary: dict) -> float:
    """The most the run's speedup can be: its tokens per target forward over plain decoding's, each batch's
    forwards counted once (at batch 1, its mean tokens per target forward), since a speculative forward costs at
    least a plain one. (speedup = that ratio x plain ms per forward / speculative ms per forward.)"""
    return summary["speedup"] * summary["ms_per_step"] / summary["baseline"]["ms_per_step"]


def speedup_impossible(summary: dict) -> bool:
    """A speedup above speedup_bound: a speculative forward measured faster than a plain one, so the timing lied."""
    return "speedup" in summary and summary["ms_per_step"] < summary["baseline"]["ms_per_step"]


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


IMPOSSIBLE_MARK = "!"  # a speedup beyond what its tokens per target forward can give


def speedup_lines(summary: dict) -> list[str]:
    """The speedup over plain decoding, marked (IMPOSSIBLE_MARK and a line saying why) where it is beyond its tokens
    per target forward."""
    same = f"; outputs identical: {summary['identical_to_baseline']}" if "identical_to_baseline" in summary else ""
    impossible = speedup_impossible(summary)
    lines = [f"Speedup over plain decoding: {summary['speedup']:.2f}x{IMPOSSIBLE_MARK * impossible}{same}"]
    if impossible:
        lines.append(f"{IMPOSSIBLE_MARK} impossible: more than its {speedup_bound(summary):.2f} tokens per target "
                     "forward can give; the timing was disturbed (see the warning)")
    return lines


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
                     "too_few_tokens_to_time": produced < MIN_TIMED_TOKENS, "finish_reason": r.finish_reason}
            if baseline is not None:
                entry["baseline_output_tokens"] = baseline[b][u].output_tokens
                entry["baseline_decode_tok_s"] = baseline[b][u].decode_tok_s
                entry["speedup"] = r.decode_tok_s / entry["baseline_decode_tok_s"]
                # a plain forward gives one token and costs at most a speculative one
                entry["speedup_beyond_tokens_per_step"] = entry["speedup"] > entry["tokens_per_step"]
            entries.append(entry)
    return entries


CACHE_END_MARK = "^"  # an answer cut by the end of its KV cache


def prompt_table_lines(entries: list[dict]) -> list[str]:
    """Per prompt: tokens per target forward, speedup over plain decoding, which sources drafted: where it pays. A
    speedup from too few tokens (*) or beyond what its tokens per forward can give (!, impossible), and an answer
    cut by the end of the KV cache (^), are marked, with why."""
    lines = [f"{'prompt':<44} {'tokens/forward':>14} {'speedup':>8}   drafted by"]
    for e in entries:
        speedup, marks = "-", ""
        if "speedup" in e:
            speedup = f"{e['speedup']:.2f}x"
            marks = "*" * e["too_few_tokens_to_time"] + IMPOSSIBLE_MARK * e["speedup_beyond_tokens_per_step"]
        marks += CACHE_END_MARK * (e["finish_reason"] == "cache_end")
        sources = ", ".join(f"{source} {n}" for source, n in sorted(e["draft_sources"].items())) or "nothing"
        lines.append(f"{shorten(e['prompt'], 44):<44} {e['tokens_per_step']:>14.2f} {speedup:>8}{marks:<3} {sources}")
    if any(e.get("speedup") is not None and e["too_few_tokens_to_time"] for e in entries):
        lines.append(f"* fewer than {MIN_TIMED_TOKENS} tokens after the first: too few to time")
    if any(e.get("speedup_beyond_tokens_per_step") for e in entries):
        lines.append(f"{IMPOSSIBLE_MARK} impossible: beyond its tokens per forward (a speculative forward costs at "
                     "least a plain one): timing disturbed")
    if any(e["finish_reason"] == "cache_end" for e in entries):
        lines.append(f"{CACHE_END_MARK} cut by the end of the KV cache (--max_seq_len) before an EOS or "
                     "--max_generated_tokens: raise --max_seq_len")
    return lines


def result_lines(report: dict) -> list[str]:
    """The run's result, as the screen ends with it: performance, speedup, warnings, the per-prompt table."""
    summary = report["summary"]
    lines = performance_lines("speculative", summary)
    if "baseline" in summary:
        lines += performance_lines("plain decoding", summary["baseline"]) + speedup_lines(summary)
    return lines + summary["warnings"] + ["Per prompt:"] + prompt_table_lines(report["prompts"])


class ReportFile(records.ReportFile):
    """--output_json's file (records.ReportFile: reserved before the run, written whole or not at all)."""

    def __init__(self, path):
        super().__init__(path, "--output_json")
