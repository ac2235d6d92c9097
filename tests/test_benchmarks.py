# SPDX-License-Identifier: Apache-2.0
"""The benchmarks measure what they say: their generators stop at EOS (they once never did, and every figure
included text generated past the end of the answer), each run starts from a fresh drafter, and interleaving the
methods prompt by prompt keeps each one's outputs."""
import argparse
import json
import sys

import pytest
import torch

from .conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import bench_suffix  # noqa: E402
from common import run_interleaved_by_prompt  # noqa: E402

from models.tt_transformers.prompts import eos_token_ids
from models.tt_transformers.prompts import encode


def test_bench_suffix_runs_stop_at_eos(embedded_checkpoint, embedded_tokenizer, embedded_bf16):
    eos = eos_token_ids(embedded_checkpoint, embedded_tokenizer)
    args = argparse.Namespace(n_draft_tokens=16, sa_threshold=1)
    factories = bench_suffix.generator_factories(embedded_bf16, embedded_checkpoint.name, eos, args)
    prompt = encode(embedded_tokenizer, "What is the capital of France? Answer in one sentence.", True)
    methods = ("plain", "suffix", "suffix (request only)", "head", "hybrid")
    runs = run_interleaved_by_prompt({m: factories[m] for m in methods}, [prompt, prompt], 64, 1, stop_at_eos=True)
    for method in methods:
        (run,) = runs[method]
        for output in run["outputs"]:
            assert output[-1] in eos and len(output) < 64, method
        assert run["outputs"] == runs["plain"][0]["outputs"], method  # every method is lossless
    alone = run_interleaved_by_prompt({"suffix": factories["suffix"]}, [prompt, prompt], 64, 1, stop_at_eos=True)
    suffix_steps = [[(it.draft_source, it.drafted, it.accepted) for r in run["results"] for it in r.iterations]
                    for run in (runs["suffix"][0], alone["suffix"][0])]
    assert suffix_steps[0] == suffix_steps[1]  # interleaved with others or alone, the same drafts and steps
    first, second = factories["suffix"]().drafter, factories["suffix"]().drafter
    assert first.memory is not second.memory  # nothing carried between runs: not even the memory of responses


def test_bench_cpu_report_divides_by_the_floor_and_the_fastest_transformers(tmp_path, capsys):
    import json

    import bench_cpu

    ours = {"plain_ms_per_token": 12.0, "speculative_ms_per_token": 8.0, "speedup": 1.5, "tokens_per_step": 1.6,
            "identical_to_baseline": True}
    result = {"cpu_flags": ["avx2", "fma", "sse2"], "prompts": 8, "ours": {"avx2": ours},
              "floor": {"weight_bytes": 269_000_000, "read_gb_s": 26.9, "floor_ms_per_token": 10.0},
              "peers": {"transformers float32": {"ms_per_token": 72.0}, "transformers bfloat16": {"ms_per_token": 48.0},
                        "llama.cpp (native)": {"ms_per_token": 9.0, "same_as_ours": 5, "same_as_its_plain": 8}}}
    bench_cpu.report(result, tmp_path / "cpu.json")
    table = capsys.readouterr().out
    assert "| ours, avx2, plain | 12.0 | 1.20 | 4.00x faster |" in table  # 12 / floor 10; bf16's 48 / 12
    assert "| ours, avx2, speculative | 8.0 | 0.80 | 6.00x faster | 1.50x (1.60 tokens/forward) | True |" in table
    assert "8 of 8 as its plain decoding, 5 as ours" in table
    assert json.loads((tmp_path / "cpu.json").read_text())["ours"]["avx2"] == ours
    assert (tmp_path / "cpu.png").stat().st_size > 0


# Stand-ins for a llama-cpp-python venv's interpreter, each run as `PYTHON llama_cpp_peer.py request answer`.
CRASHES = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"  # as llama.cpp's AMX build on a Sapphire Rapids
RAISES = "raise RuntimeError('failed to load model')"
ANSWERS = ("import json, sys; json.dump({'llama.cpp': {'ms_per_token': 9.0, 'outputs': [[5, 6, 0]]}, "
           "'llama.cpp prompt lookup': {'ms_per_token': 7.0, 'outputs': [[5, 7, 0]]}}, open(sys.argv[3], 'w'))")


def test_bench_cpu_records_a_peer_that_fails_or_crashes_with_the_reason_and_measures_the_rest(tmp_path, capsys):
    import json
    import shlex

    import bench_cpu

    builds = []
    for label, code in (("native", CRASHES), ("broken", RAISES), ("avx2", ANSWERS)):
        interpreter = tmp_path / label
        interpreter.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)} \"$@\"\n")
        interpreter.chmod(0o755)
        builds.append(f"{label}={interpreter}")
    peers = bench_cpu.llama_cpp_peers(builds, tmp_path / "model.gguf", [[1, 2]], 3, [0], [[5, 6, 0]], tmp_path)
    assert peers == {
        "llama.cpp (native)": {"failed": "killed by SIGSEGV"},
        "llama.cpp (broken)": {"failed": "exit status 1: RuntimeError: failed to load model"},
        "llama.cpp (avx2)": {"ms_per_token": 9.0, "same_as_ours": 1, "same_as_its_plain": 1},
        "llama.cpp prompt lookup (avx2)": {"ms_per_token": 7.0, "same_as_ours": 0, "same_as_its_plain": 0}}
    ours = {"plain_ms_per_token": 12.0, "speculative_ms_per_token": 8.0, "speedup": 1.5, "tokens_per_step": 1.6,
            "identical_to_baseline": True}
    result = {"cpu_flags": ["avx2"], "prompts": 1, "ours": {"avx512": {"failed": "exit status 1: RuntimeError: x"},
                                                             "avx2": ours},
              "floor": {"weight_bytes": 269_000_000, "read_gb_s": 26.9, "floor_ms_per_token": 10.0},
              "peers": {"transformers float32": {"failed": "OutOfMemoryError: no room"}, **peers}}
    capsys.readouterr()
    bench_cpu.report(result, tmp_path / "cpu.json")
    table = capsys.readouterr().out
    assert "| ours, avx512 | failed: exit status 1: RuntimeError: x | | | | |" in table
    assert "| ours, avx2, plain | 12.0 | 1.20 |  |" in table  # no transformers figure to compare with
    assert "| transformers float32 | failed: OutOfMemoryError: no room | | | | |" in table
    assert "| llama.cpp (native) | failed: killed by SIGSEGV | | | | |" in table
    assert "| llama.cpp (avx2) | 9.0 | 0.90 |  | | 1 of 1 as its plain decoding, 1 as ours |" in table
    written = json.loads((tmp_path / "cpu.json").read_text())
    assert written["peers"]["llama.cpp (native)"] == {"failed": "killed by SIGSEGV"}


def test_bench_cpu_records_a_path_of_ours_the_demo_refuses(tmp_path):
    """A forced path's demo process that stops (here TT_CPU_ISA names no path) is that path's entry, with its line."""
    import bench_cpu

    failed = bench_cpu.attempt(lambda: bench_cpu.cli_figures({"TT_CPU_ISA": "avx3"}, 2, tmp_path / "r.json"))
    assert failed["failed"].startswith("exit status ") and "TT_CPU_ISA='avx3' is not one of" in failed["failed"]


def long_text(paragraphs: int) -> str:
    """A generated document for bench_long's tests: paragraphs of numbered facts, three sentences each."""
    return "\n\n".join(f"On day {i} the river at station {i % 7} rose by {3 * i} centimetres. The ferry ran "
                       f"{i % 4} times; the keeper logged {11 * i} visitors. Rain fell for {i % 5} hours."
                       for i in range(paragraphs))


def test_bench_long_prompts_fill_their_length_with_a_prefix_and_carry_their_task(embedded_tokenizer):
    import bench_long

    text = long_text(60)
    for task, instruction in bench_long.TASKS.items():
        prompt = bench_long.build_prompt(embedded_tokenizer, text, task, 256)
        assert 256 - 40 < len(prompt) <= 256  # within a sentence of the length
        assert prompt == bench_long.build_prompt(embedded_tokenizer, text, task, 256)  # deterministic
        decoded = embedded_tokenizer.decode(prompt)
        assert decoded.count(instruction) == 1 and decoded.count(bench_long.NEEDLE) == (task == "qa")
        document = "On day 0" + decoded.split("On day 0", 1)[1].split("\n\n" + instruction)[0]
        if task == "qa":  # the needle is a paragraph of its own near the middle, the rest the text's start
            before, after = document.split(bench_long.NEEDLE)
            assert before.endswith("\n\n") and after.startswith("\n\n") and abs(len(before) - len(after)) < 200
            document = before[:-2] + after
        assert text.startswith(document) and document.endswith(".")  # a prefix of the text, cut at a sentence end


def test_bench_long_refuses_lengths_and_documents_it_cannot_fill(embedded_tokenizer, tmp_path):
    import pytest

    import bench_long
    from models.tt_transformers.errors import UserError

    with pytest.raises(UserError, match=r"^--lengths 30: too short for the copy task's prompt"):
        bench_long.build_prompt(embedded_tokenizer, long_text(60), "copy", 30)
    with pytest.raises(UserError, match=r"^--documents hold \d+ tokens of summarize prompt, not more than --lengths 2,000"):
        bench_long.build_prompt(embedded_tokenizer, long_text(20), "summarize", 2000)
    with pytest.raises(UserError, match=r"^--documents .*missing.txt does not exist"):
        bench_long.read_documents([tmp_path / "missing.txt"])
    assert bench_long.split_lengths([1000, 8100, 16000], 128, 8192, "M") == (
        [1000], {8100: "8,100 prompt tokens + 128 generated exceed M's 8,192 positions (max_position_embeddings)",
                 16000: "16,000 prompt tokens + 128 generated exceed M's 8,192 positions (max_position_embeddings)"})


def run_bench_long(monkeypatch, tmp_path, *flags):
    import bench_long

    (tmp_path / "doc.txt").write_text(long_text(60))
    monkeypatch.setattr(sys, "argv", ["bench_long.py", "--documents", str(tmp_path / "doc.txt"), "--output_json",
                                      str(tmp_path / "long.json"), "--max_generated_tokens", "12", *flags])
    bench_long.main()
    return json.loads((tmp_path / "long.json").read_text())


def test_bench_long_measures_every_row_against_plain_decoding_and_skips_lengths_beyond_the_model(
        monkeypatch, tmp_path, capsys):
    report = run_bench_long(monkeypatch, tmp_path, "--lengths", "300", "9000", "--tasks", "copy", "qa")
    skipped, *rows = sorted(report["rows"], key=lambda r: -r["length"])
    assert skipped == {"length": 9000, "skipped": "9,000 prompt tokens + 12 generated exceed SmolLM2-135M-Instruct's "
                                                  "8,192 positions (max_position_embeddings)"}
    assert [(r["length"], r["task"], r["draft_mode"]) for r in rows] == [(300, "copy", "hybrid"), (300, "qa", "hybrid")]
    for r in rows:
        assert r["identical_to_plain"] and 280 < r["prompt_tokens"] <= 300 and r["tokens_per_forward"] >= 1.0
        assert r["hf_ttft_s"] > 0 and r["plain_ttft_s"] > 0 and r["speedup"] > 0
    table = capsys.readouterr().out
    assert "| 9,000 |  | all |  | skipped: 9,000 prompt tokens" in table
    assert (tmp_path / "long.png").stat().st_size > 0


def test_bench_long_goals_compare_the_longest_length_with_the_shortest_per_token_per_forward():
    import bench_long

    def row(length, task, speedup, per_forward, head_run=None, hf=None, ttft=1.0):
        return {"length": length, "task": task, "draft_mode": "hybrid", "speedup": speedup,
                "tokens_per_forward": per_forward, "head_run_step": head_run, "hf_ttft_s": hf, "plain_ttft_s": ttft}

    report = {"rows": [row(1000, "copy", 2.0, 2.5, 0.1), row(1000, "qa", 1.2, 1.5), row(8000, "copy", 1.5, 2.4, 0.25, 2.0),
                       row(8000, "qa", 0.98, 1.9, None, 0.5), {"length": 16000, "skipped": "beyond"}]}
    goals = bench_long.goals(report)
    assert goals["never_slower"]["met"] is False and goals["never_slower"]["8000 qa hybrid"] == 0.98
    held = goals["speedup_per_token_per_forward_vs_shortest"]  # qa at 8k makes < 2 tokens per forward: not compared
    assert held == {"8000 copy hybrid": pytest.approx((1.5 / 2.4) / (2.0 / 2.5)), "met": False}
    assert goals["head_run_at_most_0.2_step"] == {"1000 copy hybrid": 0.1, "8000 copy hybrid": 0.25, "met": False}
    assert goals["ttft_at_most_hf_at_longest"] == {"copy": [1.0, 2.0], "qa": [1.0, 0.5], "met": False}


def test_bench_long_fails_a_run_whose_speculative_outputs_differ(monkeypatch, tmp_path):
    """Its table, JSON and chart are written first; then it exits with the rows named."""
    import pytest

    import bench_long

    measured = bench_long.measure
    monkeypatch.setattr(bench_long, "measure", lambda *a: {mode: {**row, "identical_to_plain": False}
                                                           for mode, row in measured(*a).items()})
    with pytest.raises(SystemExit, match="differ from plain decoding's in 300 copy hybrid$"):
        run_bench_long(monkeypatch, tmp_path, "--lengths", "300", "--tasks", "copy", "--skip_hf")
    assert json.loads((tmp_path / "long.json").read_text())["rows"][0]["identical_to_plain"] is False


def test_bench_verify_cost_fit_recovers_the_step_model():
    """Steps timed exactly as W + users x c x R + rows x (T + c x K) give back W, T, K and R, and the STEP_COSTS
    entry divides each by W."""
    import bench_verify_cost

    truth = {"weights_ms": 9.0, "token_ms": 0.8, "key_ms": 4e-4, "read_ms": 1.2e-3}
    measured = {(c, u, k): sum(f * truth[t] for f, t in zip(bench_verify_cost.features(c, u, k),
                                                             bench_verify_cost.TERMS))
                for c in (128, 1024, 8000) for u, k in bench_verify_cost.SHAPES}
    fitted = bench_verify_cost.fit(measured)
    assert fitted == pytest.approx(truth, rel=1e-6)
    assert bench_verify_cost.costs_of(fitted) == pytest.approx({"token": 0.8 / 9, "key": 4e-4 / 9, "read": 1.2e-3 / 9})


def test_bench_verify_cost_runs_every_shape_at_every_context(tmp_path, capsys, monkeypatch):
    """The bench end to end at tiny settings: every shape at every context, the fit and the STEP_COSTS entry printed,
    the JSON written; the other users' caches are user 0's prefill."""
    import json

    import bench_verify_cost

    caches = []
    measure = bench_verify_cost.measure

    def measure_and_keep(lm, *args):
        out = measure(lm, *args)
        caches.append(lm.cache)
        return out

    monkeypatch.setattr(bench_verify_cost, "measure", measure_and_keep)
    out = tmp_path / "verify_cost.json"
    monkeypatch.setattr(sys, "argv", ["bench_verify_cost.py", "--context_lens", "8", "24", "--steps", "1",
                                      "--repeats", "1", "--output_json", str(out)])
    bench_verify_cost.main()
    data = json.loads(out.read_text())
    shapes = {(s["context_len"], s["users"], s["rows_per_user"]) for s in data["steps"]}
    assert shapes == {(c, u, k) for c in (8, 24) for u, k in bench_verify_cost.SHAPES}
    assert all(s["ms"] > 0 for s in data["steps"])
    assert set(data["fit"]) == {*bench_verify_cost.TERMS, "token_cost", "key_cost", "read_cost"}
    assert f'"{data["cpu_path"]}": StepCost(' in capsys.readouterr().out
    (cache,) = caches
    for k in cache.k:
        assert all(torch.equal(k[u, :, :8], k[0, :, :8]) for u in range(1, 4))
    assert cache.k[0][0, :, :8].abs().sum() > 0
