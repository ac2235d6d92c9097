# SPDX-License-Identifier: Apache-2.0
"""Speculative vs plain decoding at long context, with Hugging Face's prefill of the same prompts, in one run.

    make bench-long        # or: python benchmarks/bench_long.py --lengths 1000 4000 --tasks copy qa

On the embedded model (bf16, the CPU path this CPU picks), one prompt per context length and task: a long document
cut to fill the length, then an instruction, in the chat template as the demo encodes it (prompts.encode):
- copy: "copy its last paragraph exactly" (the answer is a copy of the document's end);
- summarize: "summarize it in five sentences, reusing its wording";
- qa: a question on a fictional archive note placed as a paragraph in the document's middle (a needle: the answer is
  in no model's memory).
The document (--documents, joined in order) defaults to the FSF's GPL-3 and GFDL-1.3 texts as Debian and Ubuntu ship
them (/usr/share/common-licenses; verbatim copies are free to make): public, natural text, and not this project's.
Each prompt is its longest prefix, cut at a sentence or paragraph end, whose encoded prompt has at most --lengths
tokens (deterministic: the same tokenizer gives the same prompt). A length whose prompt and answer exceed the model's
positions (max_position_embeddings: 8,192 for SmolLM2-135M-Instruct, so 16,000 here) is a row marked skipped, with
that reason.

Per row, --repeats times: plain decoding, then speculative decoding in each --draft_modes (default the demo's
hybrid; --n_draft_tokens 8), each from a fresh generator and drafter (nothing learned from an earlier row), greedy,
up to --max_generated_tokens (128) stopping at EOS; then Hugging Face transformers' time to first token on the same
prompt (bf16 `generate(max_new_tokens=1)`: its prefill). Reported: decode tokens/s plain and speculative, the speedup
(the median over repeats of each repeat's paired ratio), tokens per target forward, time to first token of each and
Hugging Face's. Every speculative output is checked against plain decoding's: a row that differs is marked and the
run exits with status 1 once the table, JSON and chart (beside the JSON) are written.
"""
import argparse
import re
import statistics
import sys
import time
from pathlib import Path

from common import REPO, load_hf, machine_info, print_table, quiet_logs, warmed_up

import torch

from models.tt_transformers.errors import UserError, check_int
from models.tt_transformers.prompts import encode, eos_token_ids
from models.tt_transformers.records import write_json_atomic
from models.tt_transformers.speculative import SpeculativeConfig, SpeculativeGenerator, make_drafter
from models.tt_transformers.speculative.config import DRAFT_MODES
from models.tt_transformers.speculative.results import summarize
from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.checkpoints.model_shape import ModelShape

DOCUMENTS = [Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/GFDL-1.3")]
LENGTHS = [1000, 4000, 8000, 16000]
NEEDLE = ("Archive note: this copy of the text was checked by Marta Lindqvist at the Tromsø office on 14 March 2019, "
          "and its reference number is 4172-B.")
TASKS = {
    "copy": "Copy the last paragraph of the text above exactly, word for word.",
    "summarize": "Summarize the text above in five sentences, reusing its wording.",
    "qa": "According to the archive note in the text above, who checked this copy of the text, at which office, on "
          "what date, and what is its reference number? Answer in one sentence.",
}
# Where a document may be cut: after a sentence's (or clause's) closing mark, not a section number's ("0."), or at a
# paragraph's last character.
CUT = re.compile(r"(?<![\d\s])[.;:!?](?=\s)|\S(?=[ \t]*\n[ \t]*\n)")
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def read_documents(paths: list[Path]) -> str:
    """The documents' texts joined by a blank line (UserError naming --documents for one that cannot be read)."""
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8").strip("\n"))
        except FileNotFoundError:
            raise UserError(f"--documents {path} does not exist (Debian and Ubuntu ship the default ones); pass "
                            "plain-text files, together long enough for the longest --lengths") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--documents {path} cannot be read as UTF-8 text ({e}); pass plain-text files") from None
    return "\n\n".join(texts)


def prompt_text(document: str, task: str) -> str:
    """The user turn: the document, then the task's instruction; qa's document carries NEEDLE as its own paragraph at
    the paragraph break nearest its middle (its end where it has none)."""
    if task == "qa":
        breaks = [m.start() for m in PARAGRAPH_BREAK.finditer(document)] + [len(document)]
        at = min(breaks, key=lambda b: abs(b - len(document) / 2))
        document = f"{document[:at]}\n\n{NEEDLE}{document[at:]}"
    return f"{document}\n\n{TASKS[task]}"


def build_prompt(tokenizer, text: str, task: str, n_tokens: int) -> list[int]:
    """The longest prompt of at most n_tokens tokens (chat template included) whose document is a prefix of `text`
    cut at a CUT point: found by bisection over the cut points, as token counts grow with the prefix."""
    cuts = sorted({m.end() for m in CUT.finditer(text)} | {len(text)})

    def tokens(k: int) -> list[int]:
        return encode(tokenizer, prompt_text(text[:cuts[k]], task), True)

    if len(tokens(0)) > n_tokens:
        raise UserError(f"--lengths {n_tokens}: too short for the {task} task's prompt (its instruction, chat template "
                        "and a first sentence of the documents); give a longer length")
    if len(tokens(len(cuts) - 1)) <= n_tokens:
        raise UserError(f"--documents hold {len(tokens(len(cuts) - 1)):,} tokens of {task} prompt, not more than "
                        f"--lengths {n_tokens:,}: add documents or give shorter lengths")
    lo, hi = 0, len(cuts) - 1  # tokens(lo) fits, tokens(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(tokens(mid)) <= n_tokens else (lo, mid)
    return tokens(lo)


def split_lengths(lengths: list[int], n_generated: int, limit: int, model_name: str) -> tuple[list[int], dict]:
    """The lengths whose prompt and answer fit the model's positions, and each other one with why it is skipped."""
    fits = [n for n in lengths if n + n_generated <= limit]
    skipped = {n: f"{n:,} prompt tokens + {n_generated} generated exceed {model_name}'s {limit:,} positions "
                  f"(max_position_embeddings)" for n in lengths if n not in fits}
    return fits, skipped


def hf_ttft_s(hf, prompt: list[int]) -> float:
    """Seconds for Hugging Face `generate` to give the prompt's first token (greedy): its prefill."""
    start = time.perf_counter()
    hf.generate(torch.tensor([prompt]), max_new_tokens=1, min_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def decode(model, eos: list[int], config: SpeculativeConfig, prompt: list[int], n_tokens: int):
    """One prompt through a fresh, warmed-up generator (its own cache and drafter) as the demo builds it: its
    result, and what a run of its draft head cost at the end, in plain target steps, as the drafter measured it (None
    without a head, or where it never ran)."""
    drafters = []

    def make():
        target = TorchCausalLM(model, model.args.n_layers, 1)
        drafters.append(make_drafter(config, target))
        return SpeculativeGenerator(target, drafters[-1], config.n_draft_tokens, eos)
    result = warmed_up(make).generate([prompt], n_tokens, stop_at_eos=True)[0]
    head = getattr(drafters[-1], "fallback", drafters[-1])
    cost = getattr(head, "cost", None)
    return result, (cost.value if cost is not None and cost.run_s is not None and cost.step_s is not None else None)


def measure(model, eos: list[int], prompt: list[int], configs: dict, args, hf) -> dict:
    """One row per speculative config for `prompt`: --repeats runs of plain decoding (configs["plain"]), each
    speculative config and (hf given) Hugging Face's first token, interleaved so that this machine's drifts reach all
    of them alike; medians over the repeats, and the median of the per-repeat (paired) speedups."""
    runs = {mode: [] for mode in configs}
    hf_s = []
    for _ in range(args.repeats):
        for mode, config in configs.items():
            r, head_run = decode(model, eos, config, prompt, args.max_generated_tokens)
            runs[mode].append({**summarize([[r]]), "output": r.output_tokens, "finish_reason": r.finish_reason,
                               "head_run_step": head_run})
        if hf is not None:
            hf_s.append(hf_ttft_s(hf, prompt))
    plain = runs["plain"]
    rows = {}
    for mode in args.draft_modes:
        spec = runs[mode]
        speedups = [s["decode_tok_s"] / p["decode_tok_s"] for p, s in zip(plain, spec) if p["decode_tok_s"]]
        rows[mode] = {
            "prompt_tokens": len(prompt), "generated_tokens": len(plain[0]["output"]),
            "finish_reason": plain[0]["finish_reason"],
            "plain_tok_s": statistics.median(r["decode_tok_s"] for r in plain),
            "speculative_tok_s": statistics.median(r["decode_tok_s"] for r in spec),
            "speedup": statistics.median(speedups) if speedups else None,  # none where plain made a single token
            "speedup_spread": [min(speedups), max(speedups)] if speedups else None,
            "tokens_per_forward": statistics.median(r["mean_tokens_per_step"] for r in spec),
            "acceptance_rate": statistics.median(r["acceptance_rate"] for r in spec),
            "plain_ttft_s": statistics.median(r["ttft_ms"] / 1e3 for r in plain),
            "speculative_ttft_s": statistics.median(r["ttft_ms"] / 1e3 for r in spec),
            "hf_ttft_s": statistics.median(hf_s) if hf_s else None,
            "head_run_step": max((r["head_run_step"] for r in spec if r["head_run_step"] is not None), default=None),
            "identical_to_plain": all(s["output"] == p["output"] for p, s in zip(plain, spec)),
        }
    return rows


def cell(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def table(report: dict) -> None:
    print(f"\n{report['model']} bf16 ({report['cpu_path']}), greedy, up to {report['max_generated_tokens']} tokens "
          f"stopping at EOS, n_draft_tokens={report['n_draft_tokens']}, {report['repeats']} repeat(s): "
          f"{machine_info()}")
    rows = []
    for r in report["rows"]:
        if "skipped" in r:
            rows.append([f"{r['length']:,}", "", "all", "", f"skipped: {r['skipped']}", *[""] * 9])
            continue
        spread = (f" ({r['speedup_spread'][0]:.2f}-{r['speedup_spread'][1]:.2f})"
                  if r["speedup_spread"] and report["repeats"] > 1 else "")
        rows.append([f"{r['length']:,}", f"{r['prompt_tokens']:,}", r["task"], r["draft_mode"],
                     cell(r["plain_tok_s"], ".1f"), cell(r["speculative_tok_s"], ".1f"),
                     cell(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else "") + spread,
                     cell(r["tokens_per_forward"], ".2f"), cell(r["plain_ttft_s"], ".2f"),
                     cell(r["speculative_ttft_s"], ".2f"), cell(r["hf_ttft_s"], ".2f"), r["generated_tokens"],
                     cell(r.get("head_run_step"), ".3f"), r["identical_to_plain"]])
    print_table(["context", "prompt tokens", "task", "draft", "plain tok/s", "speculative tok/s", "speedup",
                 "tokens/target forward", "TTFT plain s", "TTFT speculative s", "HF bf16 TTFT s", "tokens out",
                 "head run (steps)", "identical"], rows)


def plot(report: dict, path: Path) -> None:
    """Speedup by prompt tokens per task and draft mode (left); time to first token, ours (plain) and Hugging
    Face's, by prompt tokens per task (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in report["rows"] if "skipped" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, task in enumerate(report["tasks"]):
        color = f"C{i}"
        for style, mode in zip(("-o", "--s", ":^", "-.v"), report["draft_modes"]):
            rows = [r for r in measured if r["task"] == task and r["draft_mode"] == mode and r["speedup"] is not None]
            left.plot([r["prompt_tokens"] for r in rows], [r["speedup"] for r in rows], style, color=color,
                      label=f"{task} ({mode})")
        rows = [r for r in measured if r["task"] == task and r["draft_mode"] == report["draft_modes"][0]]
        right.plot([r["prompt_tokens"] for r in rows], [r["plain_ttft_s"] for r in rows], "-o", color=color,
                   label=f"{task}: ours")
        with_hf = [r for r in rows if r["hf_ttft_s"] is not None]
        right.plot([r["prompt_tokens"] for r in with_hf], [r["hf_ttft_s"] for r in with_hf], "--x", color=color,
                   label=f"{task}: Hugging Face bf16")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xlabel("prompt tokens")
    left.set_ylabel("speedup vs plain decoding (decode tok/s)")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("time to first token (s)")
    for ax in (left, right):
        ax.legend(fontsize=7)
    skipped = [f"{r['length']:,}" for r in report["rows"] if "skipped" in r]
    fig.suptitle(f"{report['model']} bf16, n_draft_tokens={report['n_draft_tokens']}"
                 + (f" (skipped, beyond the model's positions: {', '.join(skipped)})" if skipped else ""), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(report: dict) -> dict:
    """Issue 47's checks this bench can make: speculative decoding never slower than plain; where the longest
    length makes 2 or more tokens per target forward, its speedup per token per forward at least 80 % of the shortest
    length's (same task and mode: the speedup "at the same tokens per forward", which the two rows do not share); a
    head run at most 0.2 of a target step wherever it ran; time to first token at the longest length at most Hugging
    Face's."""
    measured = [r for r in report["rows"] if "skipped" not in r]
    name = lambda r: f"{r['length']} {r['task']} {r['draft_mode']}"  # noqa: E731
    out = {"never_slower": {name(r): r["speedup"] for r in measured}}
    out["never_slower"]["met"] = all(r["speedup"] is None or r["speedup"] >= 1.0 for r in measured)
    longest, shortest = max(r["length"] for r in measured), min(r["length"] for r in measured)
    per_forward = {(r["length"], r["task"], r["draft_mode"]): r["speedup"] / r["tokens_per_forward"]
                   for r in measured if r["speedup"] is not None}
    held = {name(r): per_forward[longest, r["task"], r["draft_mode"]] / per_forward[shortest, r["task"], r["draft_mode"]]
            for r in measured if r["length"] == longest > shortest and r["tokens_per_forward"] >= 2
            and (shortest, r["task"], r["draft_mode"]) in per_forward and r["speedup"] is not None}
    out["speedup_per_token_per_forward_vs_shortest"] = {**held, "met": all(v >= 0.8 for v in held.values())}
    runs = {name(r): r["head_run_step"] for r in measured if r.get("head_run_step") is not None}
    out["head_run_at_most_0.2_step"] = {**runs, "met": all(v <= 0.2 for v in runs.values())}
    at_longest = [r for r in measured if r["length"] == longest and r["hf_ttft_s"] is not None]
    if at_longest:
        out["ttft_at_most_hf_at_longest"] = {
            **{r["task"]: [r["plain_ttft_s"], r["hf_ttft_s"]] for r in at_longest},
            "met": all(r["plain_ttft_s"] <= r["hf_ttft_s"] for r in at_longest)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="prompt tokens per row (at most)")
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    ap.add_argument("--documents", type=Path, nargs="+", default=DOCUMENTS,
                    help="plain-text files, joined in order, that the prompts cut (default: GPL-3 and GFDL-1.3)")
    ap.add_argument("--draft_modes", nargs="+", choices=DRAFT_MODES, default=[SpeculativeConfig().draft_mode],
                    help="a row set per mode (default the demo's); e.g. hybrid head")
    ap.add_argument("--n_draft_tokens", type=int, default=8)
    ap.add_argument("--max_generated_tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each row; medians and the median paired speedup")
    ap.add_argument("--skip_hf", action="store_true", help="leave out Hugging Face's time to first token")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_long.json"))
    args = ap.parse_args()
    quiet_logs()
    try:
        differ = run(args)
    except UserError as e:
        sys.exit(f"bench_long.py: {e.named_with(lambda parameter: '--' + parameter)}")
    if differ:
        sys.exit(f"bench_long.py: speculative outputs differ from plain decoding's in {', '.join(differ)}")


def run(args) -> list[str]:
    """The whole bench (main's flags); returns the rows whose speculative outputs differ from plain decoding's."""
    check_int("--repeats", args.repeats, 1)
    check_int("--max_generated_tokens", args.max_generated_tokens, 1)
    configs = {"plain": SpeculativeConfig(n_draft_tokens=0),
               **{mode: SpeculativeConfig(n_draft_tokens=args.n_draft_tokens, draft_mode=mode)
                  for mode in args.draft_modes}}
    ckpt = resolve_checkpoint(None)
    tokenizer = load_tokenizer(ckpt)
    text = read_documents(args.documents)
    limit = ModelShape.from_hf_config(ckpt.config).max_position_embeddings
    fits, skipped = split_lengths(args.lengths, args.max_generated_tokens, limit, ckpt.name)
    if not fits:
        raise UserError(f"--lengths: none leaves room for --max_generated_tokens {args.max_generated_tokens} within "
                        f"{ckpt.name}'s {limit:,} positions; give one up to {limit - args.max_generated_tokens:,}")
    prompts = {(n, task): build_prompt(tokenizer, text, task, n) for n in fits for task in args.tasks}
    model = load_model(ckpt, torch.bfloat16, max(fits) + args.max_generated_tokens)
    hf = None if args.skip_hf else load_hf(ckpt.folder, torch.bfloat16)
    eos = eos_token_ids(ckpt, tokenizer)
    # A warm-up row, discarded: a process's first prefill of a real prompt costs several times a later one (after
    # warmed_up's 4-token one too), which would land on the first row's plain time to first token.
    measure(model, eos, prompts[min(prompts)], configs, args, hf)
    report = {"machine": machine_info(), "model": ckpt.name, "dtype": "bfloat16",
              "cpu_path": model.kernels.path.name if model.kernels else "torch ops",
              "documents": [str(p) for p in args.documents], "tasks": args.tasks, "draft_modes": args.draft_modes,
              "n_draft_tokens": args.n_draft_tokens, "max_generated_tokens": args.max_generated_tokens,
              "repeats": args.repeats, "rows": []}
    for n in sorted(args.lengths):
        if n in skipped:
            report["rows"].append({"length": n, "skipped": skipped[n]})
            print(f"{n:,} tokens: skipped, {skipped[n]}", flush=True)
            continue
        for task in args.tasks:
            for mode, row in measure(model, eos, prompts[n, task], configs, args, hf).items():
                report["rows"].append({"length": n, "task": task, "draft_mode": mode, **row})
            print(f"{n:,} tokens, {task}: done", flush=True)
    report["goals"] = goals(report)
    table(report)
    print(f"\nGoals (issue 47): {report['goals']}")
    out = Path(args.output_json)
    write_json_atomic(out, report)
    plot(report, out.with_suffix(".png"))
    print(f"JSON: {out}\nChart: {out.with_suffix('.png')}")
    return [f"{r['length']} {r['task']} {r['draft_mode']}" for r in report["rows"]
            if not r.get("identical_to_plain", True)]


if __name__ == "__main__":
    main()
