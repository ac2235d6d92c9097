# SPDX-License-Identifier: Apache-2.0
"""What the demo shows and reports: a first screen that leads to the result (Iteration lines bounded per batch with
a count of the rest, every iteration in the report), --help with its defaults, the pytest form's result without -s,
and figures that can be trusted: a warning naming the likely cause where other processes' load or an impossible
speedup says the timing lied, and per-prompt speedups from too few tokens, or beyond their tokens per forward,
marked."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loguru import logger

from models.tt_transformers.demo.speculative_decoding.options import DEMO_OPTIONS
from models.tt_transformers.demo.speculative_decoding.report import (
    MIN_TIMED_TOKENS,
    LoadMeter,
    performance_lines,
    prompt_entries,
    prompt_table_lines,
    speedup_lines,
    timing_warnings,
)
from models.tt_transformers.demo.speculative_decoding.speculative_demo import main, run_demo
from models.tt_transformers.speculative.results import (
    IterationStats,
    UserResult,
    latency_summary,
    spec_decode_counters,
    summarize,
)

from ..conftest import REPO_ROOT, write_json
from .test_inputs_and_cache import DEMO_SCRIPT, demo


def logged_lines():
    lines = []
    return lines, logger.add(lambda m: lines.extend(m.record["message"].split("\n")), level="INFO")


@pytest.mark.parametrize("log_iterations", [2, -1])
def test_iteration_lines_are_bounded_and_every_iteration_is_reported(tmp_path, embedded_checkpoint, log_iterations):
    """--log_iterations 2: two Iteration lines per batch (speculative and plain alike), then one line counting the
    rest; -1: every one. The report holds every iteration either way."""
    prompts = write_json(tmp_path / "two.json", [{"prompt": "Hi"}, {"prompt": "Count from one to twenty in words."}])
    lines, sink = logged_lines()
    try:
        report = run_demo(demo(tmp_path, input_prompts=str(prompts), log_iterations=log_iterations, stop_at_eos=0,
                               max_generated_tokens=24, compare_baseline=1, draft_mode="suffix"))
    finally:
        logger.remove(sink)
    per_batch = [len(p["iterations"]) for p in report["prompts"]] + [23, 23]  # plain: one token per forward
    iteration_lines = [line for line in lines if line.startswith("Iteration ")]
    counted = [int(re.match(r"\.\.\. (\d+) more iterations?, accepted \d+/\d+ \(--log_iterations -1 logs each\)$",
                            line).group(1)) for line in lines if line.startswith("... ")]
    if log_iterations == -1:
        assert len(iteration_lines) == sum(per_batch) and counted == []
    else:
        assert len(iteration_lines) == 2 * len(per_batch) and counted == [n - 2 for n in per_batch]
    assert sum(p["tokens_per_step"] * len(p["iterations"]) for p in report["prompts"]) == pytest.approx(2 * 23)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps long paths at their hyphens
    assert exit_.value.code == 0
    missing = [name for name, _, default, _ in DEMO_OPTIONS
               if default is not None and "".join(f"(default: {default})".split()) not in text]
    assert not missing, missing


def test_pytest_form_shows_the_result_without_s(tmp_path, embedded_checkpoint):
    """`pytest speculative_demo.py::test_speculative_demo` (no -s) ends with the result, not `1 passed` alone."""
    prompts = write_json(tmp_path / "p.json", [{"prompt": "Hi"}])
    out = subprocess.run([sys.executable, "-m", "pytest", f"{DEMO_SCRIPT}::test_speculative_demo", "-q", "-p",
                          "no:cacheprovider", "--input_prompts", str(prompts), "--max_generated_tokens", "4"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = out.stdout[out.stdout.index("speculative decoding demo"):]
    for expected in ("=== Performance metrics (speculative) ===", "=== Performance metrics (plain decoding) ===",
                     "Speedup over plain decoding: ", "Per prompt:", "\nHi "):
        assert expected in summary, summary


QUIET = {"speculative": {"other_processes_cores": 0.05}, "plain": {"other_processes_cores": 0.1}}
TWO_CORES = {"cpu_count": 2, "torch_threads": 2}


def figures(speedup, tokens_per_step, ms=10.0):
    """A batch-1 run's summary: plain decoding's ms per forward is what the speedup and tokens per forward imply."""
    return {"speedup": speedup, "mean_tokens_per_step": tokens_per_step, "ms_per_step": ms,
            "baseline": {"ms_per_step": speedup * ms / tokens_per_step}}


@pytest.mark.parametrize("summary,load,env,expected", [
    (figures(1.2, 1.4), QUIET, TWO_CORES, []),
    # issue 36's figures: 11.08x at 1.07 tokens per target forward, 1.53x at 0 % acceptance; issue 45's 3.82x at
    # 3.75, under the 15 % slack there was
    (figures(11.08, 1.07, 9.0), QUIET, TWO_CORES,
     ["Speedup 11.08x is more than 1.07 tokens per target forward can give (a speculative step, 9.0 ms, costs at "
      "least a plain one, yet plain decoding took 93.2 ms): the plain run was slowed, by another process or by "
      "OMP_NUM_THREADS above the free cores"]),
    (figures(1.53, 1.0), QUIET, TWO_CORES, ["Speedup 1.53x is more than 1.00 tokens per target forward can give"]),
    (figures(3.82, 3.75), QUIET, TWO_CORES, ["Speedup 3.82x is more than 3.75 tokens per target forward can give"]),
    (figures(1.2, 1.4), {**QUIET, "plain": {"other_processes_cores": 1.4}}, TWO_CORES,
     ["Timing disturbed: other processes used 1.4 of 2 cores during plain decoding while torch ran 2 threads: stop "
      "them, or set OMP_NUM_THREADS=1; rerun on a quiet machine to trust the speedup"]),
    (figures(1.2, 1.4), {**QUIET, "plain": {"other_processes_cores": 1.5}}, {"cpu_count": 2, "torch_threads": 1},
     ["Timing disturbed: other processes used 1.5 of 2 cores during plain decoding while torch ran 1 thread: stop "
      "them; rerun"]),
    (figures(1.2, 1.4), {**QUIET, "plain": {"other_processes_cores": 2.0}}, {"cpu_count": 16, "torch_threads": 4},
     ["Timing disturbed: the machine's load changed between the speculative and plain runs (other processes: 0.1 "
      "cores during speculative, 2.0 cores during plain)"]),
])
def test_timing_warnings_name_the_likely_cause(summary, load, env, expected):
    warnings = timing_warnings(summary, load, env)
    assert len(warnings) == len(expected) and all(w.startswith(e) for w, e in zip(warnings, expected)), warnings


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs /proc/stat")
def test_load_meter_sees_another_process():
    """A process spinning beside a phase shows as other processes' load (other sessions here can only add to it)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter's start is not the phase
        with LoadMeter() as meter:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert meter.load["other_processes_cores"] >= 0.5 and meter.load["own_cores"] < 0.5, meter.load


class WordTokenizer:
    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


def user(tokens: int, forwards: int, decode_s: float, finish_reason: str = "length") -> UserResult:
    iterations = [IterationStats("suffix", 2, 1, 1.0)] * forwards
    return UserResult([1, 2], list(range(tokens)), iterations, ttft_ms=1.0, decode_s=decode_s,
                      finish_reason=finish_reason)


def test_prompt_table_marks_figures_it_cannot_vouch_for():
    """A speedup from too few tokens (*) or beyond what its tokens per forward can give (!, impossible: at once,
    issue 45's 3.82x at 3.75 tokens per forward among them), and an answer cut by the end of the KV cache (^), are
    marked, with a line saying why; the report's entries say the same."""
    few, sound, beyond = MIN_TIMED_TOKENS - 1, 41, 41
    results = [[user(few + 1, few, 0.1)], [user(sound, 20, 1.0, "cache_end")], [user(beyond, 40, 1.0)],
               [user(76, 20, 1.0, "stop")]]
    baseline = [[user(few + 1, few, 0.1)], [user(sound, 40, 2.0)], [user(beyond, 40, 3.0)], [user(76, 75, 3.82)]]
    entries = prompt_entries(["a short answer", "a sound figure", "a slowed plain run", "just beyond"],
                             [[0], [1], [2], [3]], results, baseline, WordTokenizer())
    assert [(e["too_few_tokens_to_time"], e["speedup_beyond_tokens_per_step"], e["finish_reason"])
            for e in entries] == [(True, False, "length"), (False, False, "cache_end"), (False, True, "length"),
                                  (False, True, "stop")]
    lines = prompt_table_lines(entries)
    assert re.search(r"1\.00x\* +suffix", lines[1]) and re.search(r"2\.00x\^ +suffix", lines[2])
    assert re.search(r"3\.00x! +suffix", lines[3]) and re.search(r" 3\.75 +3\.82x! +suffix", lines[4])
    assert lines[5:] == [f"* fewer than {MIN_TIMED_TOKENS} tokens after the first: too few to time",
                         "! impossible: beyond its tokens per forward (a speculative forward costs at least a plain "
                         "one): timing disturbed",
                         "^ cut by the end of the KV cache (--max_seq_len) before an EOS or --max_generated_tokens: "
                         "raise --max_seq_len"]


@pytest.mark.parametrize("speedup,tokens_per_step,marked", [(3.82, 3.75, True), (3.70, 3.75, False)])
def test_a_speedup_beyond_tokens_per_forward_is_marked_impossible(speedup, tokens_per_step, marked):
    """The run's speedup line carries the mark and a line saying it is impossible, not only a warning elsewhere."""
    lines = speedup_lines({**figures(speedup, tokens_per_step), "identical_to_baseline": True})
    assert lines[0] == f"Speedup over plain decoding: {speedup:.2f}x{'!' * marked}; outputs identical: True"
    assert lines[1:] == ([f"! impossible: more than its {tokens_per_step:.2f} tokens per target forward can give; "
                          "the timing was disturbed (see the warning)"] if marked else [])


def test_latency_figures_are_vllms_benchmark_figures():
    """TTFT / E2EL: a request's first / last chunk from its batch's arrival; TPOT: the time after the first token
    per later token; ITL: every gap between chunks (a step's tokens arrive together); P50/P95/P99 by linear
    interpolation, as numpy.percentile and vLLM's benchmark compute them. Written out for three requests."""
    five_in_three = UserResult([1], [5, 6, 7, 8, 9], token_times_s=[0.1, 0.2, 0.5])
    two = UserResult([1], [5, 6], token_times_s=[0.3, 0.35])
    one = UserResult([1], [5], token_times_s=[0.2])  # no TPOT, no ITL
    s = latency_summary([five_in_three, two, one])
    expected = {"ttft": (200, 200, 290, 298), "tpot": (75, 75, 97.5, 99.5), "itl": (150, 100, 280, 296),
                "e2el": (350, 350, 485, 497)}
    for metric, (mean, p50, p95, p99) in expected.items():
        got = [s[f"{k}_{metric}_ms"] for k in ("mean", "p50", "p95", "p99")]
        assert got == pytest.approx([mean, p50, p95, p99]), metric
    alone = latency_summary([one])
    assert alone["p99_tpot_ms"] is None and alone["mean_itl_ms"] is None and alone["p50_e2el_ms"] == pytest.approx(200)


def test_spec_decode_counters_and_performance_block():
    """Iterations that verified a draft count as vLLM's drafts (positions up to n_draft_tokens); the performance
    block shows the latency figures and, when something was drafted, the acceptance by position."""
    its = [IterationStats("suffix", 4, 4, 1.0), IterationStats("suffix", 4, 0, 1.0), IterationStats("none", 0, 0, 1.0),
           IterationStats("tree", 3, 2, 1.0)]
    r = UserResult([1], list(range(9)), its, ttft_ms=1.0, decode_s=0.01, token_times_s=[0.001 * i for i in range(5)])
    assert spec_decode_counters([r], 4).as_dict() == {
        "vllm:spec_decode_num_drafts_total": 3, "vllm:spec_decode_num_draft_tokens_total": 11,
        "vllm:spec_decode_num_accepted_tokens_total": 6,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": {"0": 2, "1": 2, "2": 1, "3": 1}}
    lines = performance_lines("speculative", summarize([[r]], 4))
    assert lines[-3] == "Mean/P50/P95/P99 ms: TPOT 0.5/0.5/0.5/0.5, ITL 1.0/1.0/1.0/1.0, E2EL 4.0/4.0/4.0/4.0"
    assert lines[-2:] == ["Drafts: 3, 11 tokens, 6 accepted (mean acceptance length 3.00)",
                          "Accepted by draft position: 0.67 0.67 0.33 0.33"]
    plain = UserResult([1], [1, 2], [IterationStats("none", 0, 0, 1.0)], token_times_s=[0.1, 0.2])
    assert performance_lines("plain decoding", summarize([[plain]], 0))[-1] == (
        "Mean/P50/P95/P99 ms: TPOT 100/100/100/100, ITL 100/100/100/100, E2EL 200/200/200/200")
