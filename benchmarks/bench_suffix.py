# SPDX-License-Identifier: Apache-2.0
"""Suffix-automaton and hybrid drafting vs plain decoding and the peers a user would pick instead.

    make bench-suffix        # or: python benchmarks/bench_suffix.py --max_generated_tokens 128 --n_draft_tokens 16

On the embedded model (bf16) and the prompt sets in benchmarks/prompt_sets/ (repetitive: code edits, JSON,
summaries; ordinary: chat, QA, translation), all in this one run:
- ours: plain decoding, `suffix`, `hybrid` (suffix, else the first --draft_layers layers) and Snowflake's
  arctic-inference SuffixDecodingCache as the drafter in our loop (same verifier, same n, same 1.0 match-length
  factor; it sees the prompt and the request's own output, as our automaton does);
- Hugging Face greedy `generate` and `generate(prompt_lookup_num_tokens=10)` on the same weights and dtype;
- the host cost of our automaton's extend + propose, and of arctic's speculate, on a 4,000-token context.
Greedy, stopping at EOS. Prints tables and writes JSON.
"""
import argparse
import random
import statistics
import time
from functools import partial
from pathlib import Path

from common import REPO, hf_ms_per_token, load_hf, machine_info, median_of_interleaved, print_table, quiet_logs, run_ours

import torch

from models.tt_transformers.demo.speculative_decoding.speculative_demo import (
    encode,
    eos_token_ids,
    load_prompts,
    write_json_atomic,
)
from models.tt_transformers.demo.speculative_decoding.speculative_generator import SpeculativeGenerator
from models.tt_transformers.speculative.drafters import DEFAULT_SA_THRESHOLD, Draft, HybridDrafter, ModelDrafter, SuffixDrafter
from models.tt_transformers.speculative.suffix_automaton import SuffixAutomaton
from models.tt_transformers.torch_backend.checkpoint import load_model, load_tokenizer, resolve_checkpoint
from models.tt_transformers.torch_backend.generator import TorchCausalLM

PROMPT_SETS = REPO / "benchmarks" / "prompt_sets"
CATEGORIES = {"code_edit": "repetitive", "json": "repetitive", "summarization": "repetitive",
              "chat": "ordinary", "qa": "ordinary", "translation": "ordinary"}
METHODS = ("plain", "suffix", "hybrid", "arctic")


class ArcticDrafter:
    """arctic-inference's SuffixDecodingCache behind our Drafter interface (a peer, for comparison only)."""

    def __init__(self, max_spec_factor: float = 1.0):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=1)  # its own output, nothing older
        self.max_spec_factor = max_spec_factor
        self.request, self.req_ids, self.seen = 0, {}, {}

    def start(self, users, prompts, sampling):
        for req in self.req_ids.values():
            self.cache.stop_request(req)
        self.req_ids, self.seen = {}, {}
        for u, p in zip(users, prompts):
            self.request += 1
            self.req_ids[u], self.seen[u] = self.request, len(p)
            self.cache.start_request(self.request, list(p))

    def propose(self, users, contexts, max_tokens, extra_cost):
        drafts = []
        for u, ctx, n in zip(users, contexts, max_tokens):
            req = self.req_ids[u]
            self.cache.add_active_response(req, list(ctx[self.seen[u]:]))
            self.seen[u] = len(ctx)
            if n <= 0:
                drafts.append(Draft([], "none"))
                continue
            d = self.cache.speculate(req, ctx[-self.cache.max_tree_depth:], max_spec_tokens=n,
                                     max_spec_factor=self.max_spec_factor)
            drafts.append(Draft(list(d.token_ids), "suffix" if d.token_ids else "none", d.match_len))
        return drafts

    def accept(self, user, new_tokens, n_accepted):
        pass


def host_cost_us(context: list[int], n_draft: int, n_iterations: int = 400) -> dict:
    """Median µs per iteration of (extend by the accepted tokens + propose) on a context of len(context), for our
    automaton and for arctic's (add_active_response + speculate). Accepted runs of 1-4 tokens, as in decoding."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    rng = random.Random(0)
    steps = [rng.randint(1, 4) for _ in range(n_iterations)]
    prefix_len = len(context) - sum(steps)
    sam = SuffixAutomaton(context[:prefix_len])
    arctic = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=1)
    arctic.start_request(0, context[:prefix_len])
    ours, theirs, pos = [], [], prefix_len
    for k in steps:
        new = context[pos : pos + k]
        start = time.perf_counter()
        for t in new:
            sam.extend(t)
        sam.propose(n_draft, 4)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        arctic.add_active_response(0, new)
        arctic.speculate(0, context[max(0, pos + k - 64): pos + k], max_spec_tokens=n_draft)
        theirs.append(time.perf_counter() - start)
        pos += k
    return {"context_tokens": len(context), "ours_median_us": 1e6 * statistics.median(ours),
            "arctic_median_us": 1e6 * statistics.median(theirs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max_generated_tokens", type=int, default=128)
    ap.add_argument("--n_draft_tokens", type=int, default=16)
    ap.add_argument("--sa_threshold", type=int, default=DEFAULT_SA_THRESHOLD)
    ap.add_argument("--draft_layers", type=int, default=8)
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES))
    ap.add_argument("--repeats", type=int, default=3, help="runs of each of our methods; the median is reported")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_suffix.json"))
    args = ap.parse_args()
    quiet_logs()

    ckpt = resolve_checkpoint(None)
    tok = load_tokenizer(ckpt)
    model = load_model(ckpt, torch.bfloat16, 2048)
    target = TorchCausalLM(model, model.args.n_layers, 1)
    n, k = args.max_generated_tokens, args.n_draft_tokens
    draft_lm = target.draft_view(args.draft_layers)  # as the demo builds it
    draft_cost = model.args.weight_bytes_per_token(args.draft_layers, 2) / model.args.weight_bytes_per_token(30, 2)
    eos = eos_token_ids(ckpt, tok)  # so that stopping at EOS stops, as in the demo
    generators = {
        "plain": SpeculativeGenerator(target, None, 0, eos),
        "suffix": SpeculativeGenerator(target, SuffixDrafter(args.sa_threshold), k, eos),
        "hybrid": SpeculativeGenerator(target, HybridDrafter(
            SuffixDrafter(args.sa_threshold), ModelDrafter(draft_lm, draft_cost)), k, eos),
        "arctic": SpeculativeGenerator(target, ArcticDrafter(), k, eos),
    }
    hf = load_hf(ckpt.folder, torch.bfloat16)
    report = {"machine": machine_info(), "model": ckpt.name, "dtype": "bfloat16", "max_generated_tokens": n,
              "n_draft_tokens": k, "sa_threshold": args.sa_threshold, "draft_layers": args.draft_layers,
              "categories": {}}

    for category in args.categories:
        prompts = [encode(tok, p, True) for p in load_prompts(str(PROMPT_SETS / f"{category}.json"))]
        ours = median_of_interleaved({m: partial(run_ours, g, prompts, n, stop_at_eos=True)
                                      for m, g in generators.items()}, args.repeats)
        row = {m: {key: r[key] for key in ("ms_per_token", "acceptance_rate", "tokens_per_step")}
               for m, r in ours.items()}
        for m in METHODS[1:]:
            row[m]["speedup"] = ours["plain"]["ms_per_token"] / ours[m]["ms_per_token"]
            row[m]["identical_to_plain"] = ours[m]["outputs"] == ours["plain"]["outputs"]
        row["hf_generate_ms_per_token"] = hf_ms_per_token(hf, prompts, n, stop_at_eos=True)
        row["hf_prompt_lookup_ms_per_token"] = hf_ms_per_token(hf, prompts, n, stop_at_eos=True,
                                                               prompt_lookup_num_tokens=10)
        report["categories"][category] = row
        print(f"{category}: done", flush=True)

    sample = [t for f in sorted(PROMPT_SETS.glob("*.json")) for p in load_prompts(str(f)) for t in encode(tok, p, False)]
    context = (sample * (4000 // len(sample) + 1))[:4000]
    report["host_cost"] = host_cost_us(context, k)

    print(f"\nGreedy, {ckpt.name} bf16, up to {n} tokens per prompt, n_draft_tokens={k}, sa_threshold="
          f"{args.sa_threshold}, hybrid draft = first {args.draft_layers} layers; {machine_info()}")
    table = []
    for category, row in report["categories"].items():
        plain_ms = row["plain"]["ms_per_token"]
        for m in METHODS:
            r = row[m]
            speed = f"{r['speedup']:.2f}x" if m != "plain" else "1.00x"
            table.append([category, CATEGORIES[category], m, f"{r['tokens_per_step']:.2f}",
                          f"{100 * r['acceptance_rate']:.0f}%", f"{r['ms_per_token']:.1f}", speed,
                          r.get("identical_to_plain", True)])
        for m, key in (("HF generate", "hf_generate_ms_per_token"), ("HF prompt lookup 10", "hf_prompt_lookup_ms_per_token")):
            table.append([category, CATEGORIES[category], m, "", "", f"{row[key]:.1f}", f"{plain_ms / row[key]:.2f}x", ""])
    print_table(["category", "kind", "method", "tokens/target forward", "acceptance", "ms/token", "speedup vs our plain",
                 "identical"], table)
    h = report["host_cost"]
    print(f"\nHost cost per iteration on a {h['context_tokens']}-token context (median): ours extend + propose "
          f"{h['ours_median_us']:.1f} µs; arctic add_active_response + speculate {h['arctic_median_us']:.1f} µs")
    write_json_atomic(Path(args.output_json), report)
    print(f"JSON: {args.output_json}")


if __name__ == "__main__":
    main()
