# SPDX-License-Identifier: Apache-2.0
"""Benchmark on the embedded default model: plain decoding vs speculative decoding, vs HF, vs the bandwidth floor.

    make bench                       # or: python benchmarks/bench_speculative.py --max_generated_tokens 64

Everything is measured in this one run on this machine: our plain decode (bf16 and float32), Hugging Face
greedy `generate` on the same weights, the memory-bandwidth floor (weight bytes read per token / measured read
bandwidth), and speculative decoding with layer-truncated drafts (acceptance, tokens per target forward,
speedup over our plain path). Prints a table and writes JSON.
"""
import argparse
import time
from functools import partial
from pathlib import Path

from common import REPO, hf_ms_per_token, load_hf, machine_info, median_of_interleaved, print_table, quiet_logs, run_ours

import torch

from models.tt_transformers.prompts import encode, load_prompts
from models.tt_transformers.records import write_json_atomic
from models.tt_transformers.speculative import SpeculativeConfig, SpeculativeGenerator, make_drafter
from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM


def read_bandwidth_gb_s() -> float:
    """Median of 7 sums over 256 MiB, far beyond the caches."""
    x = torch.ones(256 * 1024 * 1024 // 4)
    x.sum()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / sorted(times)[3] / 1e9


def layer_draft_generator(model, n_draft, draft_layers):
    target = TorchCausalLM(model, model.args.n_layers, 1)
    config = SpeculativeConfig(draft_mode="model", n_draft_tokens=n_draft, draft_layers=draft_layers)
    drafter = make_drafter(config, target)  # the first draft_layers layers, as the demo builds them (None: plain)
    return SpeculativeGenerator(target, drafter, n_draft)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input_prompts", default=str(REPO / "sample_prompts.json"))
    ap.add_argument("--max_generated_tokens", type=int, default=64)
    ap.add_argument("--draft_layers", type=int, nargs="+", default=[8, 20, 25])
    ap.add_argument("--n_draft_tokens", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each plain decoder; the median is reported")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_speculative.json"))
    args = ap.parse_args()
    quiet_logs()

    ckpt = resolve_checkpoint(None)
    tok = load_tokenizer(ckpt)
    prompts = [encode(tok, p, True) for p in load_prompts(args.input_prompts)]
    n = args.max_generated_tokens
    report = {"machine": machine_info(), "model": ckpt.name, "prompts": len(prompts), "max_generated_tokens": n}

    bw = read_bandwidth_gb_s()
    bf16 = load_model(ckpt, torch.bfloat16, 1024)
    floor_ms = bf16.args.weight_bytes_per_token(bf16.args.n_layers, 2) / (bw * 1e9) * 1e3
    report["cpu_kernels"] = bf16.kernels is not None
    models = {"bfloat16": bf16, "bfloat16_torch_ops": load_model(ckpt, torch.bfloat16, 1024, cpu_kernels=False),
              "float32": load_model(ckpt, torch.float32, 1024)}
    plain = median_of_interleaved({k: partial(run_ours, partial(layer_draft_generator, m, 0, 0), prompts, n)
                                   for k, m in models.items()}, args.repeats)
    hf = {name: hf_ms_per_token(load_hf(ckpt.folder, dt), prompts, n) for name, dt in
          [("bfloat16", torch.bfloat16), ("float32", torch.float32)]}
    report["plain"] = {"read_bandwidth_gb_s": bw, "floor_ms_per_token_bf16": floor_ms,
                       **{f"ours_{k}_ms_per_token": v["ms_per_token"] for k, v in plain.items()},
                       **{f"hf_{k}_ms_per_token": v for k, v in hf.items()}}

    print(f"\nPlain greedy decode, {ckpt.name}, {len(prompts)} prompts x {n} tokens, {torch.get_num_threads()} threads")
    table = []
    for k, name in (("bfloat16", f"ours bfloat16 ({'CPU kernels' if bf16.kernels else 'torch ops'})"),
                    ("bfloat16_torch_ops", "ours bfloat16 (torch ops)"), ("float32", "ours float32")):
        ours, dt = plain[k]["ms_per_token"], k.split("_")[0]
        table.append([name, f"{ours:.1f}", f"{hf[dt] / ours:.2f}x", f"{ours / floor_ms:.2f}x floor"])
    for k in ("bfloat16", "float32"):
        table.append([f"HF generate {k}", f"{hf[k]:.1f}", "1.00x", f"{hf[k] / floor_ms:.2f}x floor"])
    table.append([f"floor (bf16 weights {bf16.args.weight_bytes_per_token(bf16.args.n_layers, 2) / 1e6:.0f} MB / "
                  f"{bw:.1f} GB/s)", f"{floor_ms:.1f}", "", "1.00x"])
    print_table(["decoder", "ms/token", "speed vs HF same dtype", "vs bandwidth floor"], table)

    rows = []
    base = plain["bfloat16"]
    for layers in args.draft_layers:
        for k in args.n_draft_tokens:
            r = run_ours(partial(layer_draft_generator, bf16, k, layers), prompts, n)
            rows.append({"draft_layers": layers, "n_draft_tokens": k, "acceptance_rate": r["acceptance_rate"],
                         "tokens_per_step": r["tokens_per_step"], "ms_per_token": r["ms_per_token"],
                         "speedup": base["ms_per_token"] / r["ms_per_token"],
                         "identical_to_plain": r["outputs"] == base["outputs"]})
    report["speculative_layer_draft"] = rows
    print(f"\nSpeculative decoding with the target's first N layers as draft (bf16, plain = "
          f"{base['ms_per_token']:.1f} ms/token)")
    print_table(["draft_layers", "n_draft", "acceptance", "tokens/target forward", "ms/token", "speedup vs plain",
                 "identical"],
                [[r["draft_layers"], r["n_draft_tokens"], f"{100 * r['acceptance_rate']:.1f}%",
                  f"{r['tokens_per_step']:.2f}", f"{r['ms_per_token']:.1f}", f"{r['speedup']:.2f}x",
                  r["identical_to_plain"]] for r in rows])
    write_json_atomic(Path(args.output_json), report)
    print(f"\nJSON: {args.output_json}")


if __name__ == "__main__":
    main()
