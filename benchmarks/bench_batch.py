# SPDX-License-Identifier: Apache-2.0
"""Batched speculative decoding, greedy and sampled, vs plain decoding on the same backend in one run.

    make bench-batch         # or: python benchmarks/bench_batch.py --batch_sizes 1 4 8 --temperatures 0 0.7

On the embedded model (bf16): 8 prompts from benchmarks/prompt_sets (code edits, summaries, chat), split into
batches as the demo does, decoded with the suffix-automaton drafter and plainly, for each batch size and
temperature. Reports tokens per target forward, acceptance and throughput (tokens/s over all users), and for
greedy whether every user's output equals its batch-1 plain output. Prints a table and writes JSON.
"""
import argparse
from functools import partial
from pathlib import Path

from common import REPO, machine_info, median_of_interleaved, print_table, quiet_logs

import torch

from models.tt_transformers.prompts import eos_token_ids
from models.tt_transformers.prompts import encode, load_prompts, split_batches
from models.tt_transformers.records import write_json_atomic
from models.tt_transformers.speculative.results import summarize
from models.tt_transformers.speculative import SamplingParams, SpeculativeConfig, SpeculativeGenerator, make_drafter
from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

PROMPT_SETS = REPO / "benchmarks" / "prompt_sets"
PROMPTS = [("code_edit", 3), ("summarization", 3), ("chat", 2)]


def suffix_drafter(target):
    """`--draft_mode suffix` at the library's defaults, as the demo builds it (memory of earlier responses,
    recycling; trees where the target verifies them), fresh for each run so that no run learns from an earlier one."""
    return make_drafter(SpeculativeConfig(draft_mode="suffix"), target)


def run_batched(target, new_drafter, n_draft, prompts, batch_size, n_tokens, sampling, eos):
    SpeculativeGenerator(target, None, 0, eos, sampling).generate(prompts[:1], 4)  # warm-up, plain
    gen = SpeculativeGenerator(target, new_drafter(target) if new_drafter else None, n_draft, eos, sampling)
    batches = split_batches(len(prompts), batch_size)
    results = [gen.generate([prompts[i] for i in b], n_tokens) for b in batches]
    return summarize(results), [r.output_tokens for rb in results for r in rb]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--max_generated_tokens", type=int, default=64)
    ap.add_argument("--n_draft_tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="runs of plain and speculative; the median is reported")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_batch.json"))
    args = ap.parse_args()
    quiet_logs()

    ckpt = resolve_checkpoint(None)
    tok = load_tokenizer(ckpt)
    prompts = [encode(tok, p, True) for name, k in PROMPTS for p in load_prompts(str(PROMPT_SETS / f"{name}.json"))[:k]]
    eos = eos_token_ids(ckpt, tok)
    model = load_model(ckpt, torch.bfloat16, 1024)
    n = args.max_generated_tokens
    rows, batch1_plain = [], None
    for temperature in args.temperatures:
        for b in args.batch_sizes:
            target = TorchCausalLM(model, model.args.n_layers, b)
            sampling = SamplingParams(temperature, seed=0)
            runs = median_of_interleaved(
                {"plain": partial(run_batched, target, None, 0, prompts, b, n, sampling, eos),
                 "suffix": partial(run_batched, target, suffix_drafter, args.n_draft_tokens, prompts, b, n, sampling,
                                   eos)}, args.repeats, key=lambda run: -run[0]["decode_tok_s"])
            (plain, plain_out), (spec, spec_out) = runs["plain"], runs["suffix"]
            if temperature == 0 and batch1_plain is None:
                batch1_plain = run_batched(TorchCausalLM(model, model.args.n_layers, 1), None, 0, prompts, 1, n,
                                           sampling, eos)[1]
            rows.append({"batch_size": b, "temperature": temperature,
                         "tokens_per_step": spec["mean_tokens_per_step"], "acceptance_rate": spec["acceptance_rate"],
                         "plain_tok_s": plain["decode_tok_s"], "speculative_tok_s": spec["decode_tok_s"],
                         "speedup": spec["decode_tok_s"] / plain["decode_tok_s"],
                         "identical_to_batch1_plain": (spec_out == batch1_plain == plain_out) if temperature == 0 else None})
            print(f"batch {b}, temperature {temperature}: done", flush=True)

    print(f"\nSuffix drafting (n_draft_tokens={args.n_draft_tokens}) vs plain decoding, {ckpt.name} bf16, "
          f"{len(prompts)} prompts x up to {n} tokens; {machine_info()}")
    print_table(["batch", "temperature", "tokens/target forward", "acceptance", "plain tok/s", "speculative tok/s",
                 "speedup", "greedy = batch-1 plain"],
                [[r["batch_size"], r["temperature"], f"{r['tokens_per_step']:.2f}", f"{100 * r['acceptance_rate']:.0f}%",
                  f"{r['plain_tok_s']:.1f}", f"{r['speculative_tok_s']:.1f}", f"{r['speedup']:.2f}x",
                  "" if r["identical_to_batch1_plain"] is None else r["identical_to_batch1_plain"]] for r in rows])
    write_json_atomic(Path(args.output_json), {"machine": machine_info(), "model": ckpt.name, "rows": rows,
                                               "n_draft_tokens": args.n_draft_tokens, "max_generated_tokens": n})
    print(f"Plot: {plot(rows, Path(args.output_json).with_suffix('.png'))}")
    print(f"JSON: {args.output_json}")


def plot(rows: list[dict], path: Path) -> Path:
    """Throughput speedup over plain decoding by batch size, one line per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for temperature in sorted({r["temperature"] for r in rows}):
        these = [r for r in rows if r["temperature"] == temperature]
        ax.plot([r["batch_size"] for r in these], [r["speedup"] for r in these], marker="o",
                label="greedy" if temperature == 0 else f"temperature {temperature}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput vs plain decoding")
    ax.set_title("Model-free drafts at batch, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
