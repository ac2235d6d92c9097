# SPDX-License-Identifier: Apache-2.0
"""What the benchmarks share: the embedded model, our loop's figures, Hugging Face `generate` timing."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEMO = REPO / "models/tt_transformers/demo/speculative_decoding/speculative_demo.py"

import torch  # noqa: E402
from loguru import logger  # noqa: E402

from models.tt_transformers.records import environment  # noqa: E402
from models.tt_transformers.speculative.results import summarize  # noqa: E402
from models.tt_transformers.speculative.generator import SpeculativeGenerator  # noqa: E402


def quiet_logs() -> None:
    logger.remove()
    logger.add(sys.stderr, level="WARNING")


def machine_info() -> dict:
    """The demo report's environment record (machine, CPU, threads, torch, git commit)."""
    return environment("cpu")


def cli_figures(env: dict, n_tokens: int, report: Path, *flags: str) -> dict:
    """The demo (speculative, then plain decoding, on the embedded model) in its own process with `env` over this
    one's (OMP_NUM_THREADS unset unless given: the package's thread count), its figures from the JSON report."""
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, **env}
    subprocess.run([sys.executable, str(DEMO), "--max_generated_tokens", str(n_tokens), "--output_json", str(report),
                    "--log_iterations", "0", *flags], env=env, check=True, capture_output=True, text=True)
    data = json.loads(report.read_text())
    s = data["summary"]
    return {"speculative_ms_per_token": 1e3 / s["decode_tok_s_u"],
            "plain_ms_per_token": 1e3 / s["baseline"]["decode_tok_s_u"], "speedup": s["speedup"],
            "tokens_per_step": s["mean_tokens_per_step"],
            "other_processes_cores": {phase: (l or {}).get("other_processes_cores") for phase, l in s["load"].items()},
            "identical_to_baseline": s.get("identical_to_baseline"),
            "plain_outputs": [p.get("baseline_output_tokens") for p in data["prompts"]]}


def run_ours(make_generator, prompts, n_tokens: int, stop_at_eos: bool = False) -> dict:
    """A fresh generator (and drafter: nothing learned from an earlier run) over the prompts in order, each its own
    batch of one, after a plain warm-up; figures from the demo's summarize()."""
    generator = warmed_up(make_generator)
    return figures([generator.generate([p], n_tokens, stop_at_eos=stop_at_eos)[0] for p in prompts])


def run_interleaved_by_prompt(factories: dict, prompts, n_tokens: int, repeats: int, stop_at_eos: bool = False) -> dict:
    """Every method over the same prompts, `repeats` times: each repeat builds a fresh generator per method, then runs
    the prompts in order, each prompt through every method in turn (a, b, c, a, b, c, ...). A method still sees the
    prompts in order through one generator, as one server would, while this shared machine's drifts (its speed
    wanders by 10-40% over minutes) reach every method within the same few seconds, so the per-repeat ratios between
    methods are paired. Returns each method's figures, one per repeat."""
    out = {name: [] for name in factories}
    for _ in range(repeats):
        generators = {name: warmed_up(make) for name, make in factories.items()}
        results = {name: [] for name in factories}
        for p in prompts:
            for name, generator in generators.items():
                results[name].append(generator.generate([p], n_tokens, stop_at_eos=stop_at_eos)[0])
        for name, rs in results.items():
            out[name].append(figures(rs))
    return out


def warmed_up(make_generator) -> SpeculativeGenerator:
    generator = make_generator()
    SpeculativeGenerator(generator.target, None, 0).generate([[1, 2, 3, 4]], 4, stop_at_eos=False)
    return generator


def figures(results) -> dict:
    """One run's figures (one result per prompt) from the demo's summarize()."""
    s = summarize([[r] for r in results])
    return {"ms_per_token": 1e3 / s["decode_tok_s"], "tok_s": s["decode_tok_s"],
            "acceptance_rate": s["acceptance_rate"], "tokens_per_step": s["mean_tokens_per_step"],
            "outputs": [r.output_tokens for r in results], "results": results}


def median_of_interleaved(runs: dict, repeats: int, key=lambda r: r["ms_per_token"]) -> dict:
    """Call every run `repeats` times, interleaved (a, b, c, a, b, c, ...) so that this shared machine's slow
    drifts hit every method alike, and keep each method's median run by `key`, with every run's key in "spread"."""
    results = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return {name: {**sorted(rs, key=key)[len(rs) // 2], "spread": sorted(key(r) for r in rs)}
            for name, rs in results.items()}


def print_table(header: list[str], rows: list[list]) -> None:
    """A Markdown table, as pasted into README.md."""
    for cells in [header, ["---"] * len(header), *rows]:
        print("| " + " | ".join(str(c) for c in cells) + " |")


def load_hf(folder, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_ms_per_token(hf, prompts, n_tokens: int, stop_at_eos: bool = False, **generate_kwargs) -> float:
    """Decode-only ms/token of greedy `generate`: (time for the whole output - time for its first token) over the
    tokens after the first one, summed over prompts."""
    def timed(p, n, exact):
        ids = torch.tensor([p])
        kwargs = dict(max_new_tokens=n, do_sample=False, **generate_kwargs)
        if exact:
            kwargs["min_new_tokens"] = n
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        return time.perf_counter() - start, out.shape[1] - len(p)

    timed(prompts[0], 4, True)
    total_s = total_tokens = 0
    for p in prompts:
        full_s, n = timed(p, n_tokens, not stop_at_eos)
        first_s, _ = timed(p, 1, True)
        total_s += full_s - first_s
        total_tokens += n - 1
    return 1e3 * total_s / total_tokens
