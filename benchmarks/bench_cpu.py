# SPDX-License-Identifier: Apache-2.0
"""Every CPU path this machine runs, against the memory floor and what a user would run instead (`make bench-cpu`).

In one run, on the embedded model (SmolLM2-135M-Instruct) and the demo's sample prompts (chat template, greedy, up to
--max_generated_tokens each, stopping at EOS):
- ours, per CPU path (cpu_isa.PATHS that this CPU runs, each forced with TT_CPU_ISA in a fresh demo process, which
  also caps torch's own kernels): plain and speculative decoding (the demo's default hybrid drafting), ms per token
  and whether the outputs were identical;
- the memory floor: the model's weight bytes read once per token, at the read bandwidth measured here (the best of
  several passes of torch.sum over that many bytes, with the package's thread count);
- Hugging Face transformers `generate` in float32 and bfloat16 (decode only, benchmarks/common.py);
- llama.cpp (llama-cpp-python built from source in its own venv, --llama_cpp; `make bench-cpu` builds it as this CPU
  gets it, and on x86-64 also for AVX2 alone) on the very GGUF the embedded model ships as (Q4_1 weights), plain and
  with its prompt-lookup drafting (benchmarks/llama_cpp_peer.py), and how many of its greedy answers equal its own
  plain decoding's and ours.
An entry that fails or whose process crashes (llama.cpp 0.3.36 built natively with AMX segfaults on a Sapphire
Rapids) is recorded with the reason, and the run carries on: there the AVX2 build (no AMX) is llama.cpp's figure.
Writes a table (stdout), the JSON (--output_json) and a chart beside it; docs/results.md carries the table.
"""
import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from common import REPO, cli_figures, hf_ms_per_token, load_hf, machine_info, quiet_logs

from models.tt_transformers.prompts import eos_token_ids
from models.tt_transformers.prompts import encode, load_prompts
from models.tt_transformers.checkpoints.checkpoint import embedded_gguf, load_tokenizer, resolve_checkpoint
from models.tt_transformers.torch_backend.cpu_isa import cpu_flags, runnable_paths
from models.tt_transformers.torch_backend.cpu_threads import fit_threads
from models.tt_transformers.checkpoints.model_shape import ModelShape


def read_floor(weight_bytes: int, passes: int = 7) -> dict:
    """ms to read `weight_bytes` once: the fastest of several torch.sum passes over a float32 buffer that large."""
    fit_threads()
    buffer = torch.ones(weight_bytes // 4)
    buffer.sum()
    best = min(timed(buffer.sum) for _ in range(passes))
    return {"weight_bytes": weight_bytes, "read_gb_s": weight_bytes / best / 1e9, "floor_ms_per_token": 1e3 * best}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def attempt(measure) -> dict:
    """`measure()`'s figures, or {"failed": the reason} where it fails or its process crashes, so that one entry this
    machine cannot run leaves the others' figures standing."""
    try:
        return measure()
    except subprocess.CalledProcessError as e:
        reason = process_failure(e)
    except Exception as e:  # noqa: BLE001 - whatever stops one entry is that entry's result
        reason = f"{type(e).__name__}: {e}"
    return {"failed": reason}


def process_failure(e: subprocess.CalledProcessError) -> str:
    """How a process ended (the signal that killed it, or its exit status) and the last line it wrote to stderr."""
    if e.returncode >= 0:
        how = f"exit status {e.returncode}"
    else:
        how = "killed by " + (signal.Signals(-e.returncode).name if -e.returncode in signal.valid_signals()
                              else f"signal {-e.returncode}")
    last = next((line.strip() for line in reversed((e.stderr or "").splitlines()) if line.strip()), "")
    return f"{how}: {last}" if last else how


def llama_cpp(python: str, gguf: Path, prompts: list[list[int]], n_tokens: int, eos: list[int], folder: Path) -> dict:
    """llama.cpp's figures from benchmarks/llama_cpp_peer.py, run by the llama-cpp-python venv's interpreter."""
    request, answer = folder / "llama_request.json", folder / "llama_answer.json"
    request.write_text(json.dumps({"gguf": str(gguf), "prompts": prompts, "n_tokens": n_tokens, "eos": eos,
                                   "threads": torch.get_num_threads()}))
    subprocess.run([python, str(REPO / "benchmarks" / "llama_cpp_peer.py"), str(request), str(answer)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return json.loads(answer.read_text())


def llama_cpp_peers(builds: list[str], gguf: Path, prompts: list[list[int]], n_tokens: int, eos: list[int],
                    ours: Optional[list], folder: Path) -> dict:
    """Each build's entries (`LABEL=PYTHON`: plain, prompt lookup), with how many answers equal its plain decoding's
    and `ours` (None: no path of ours ran); a build that fails or crashes is one entry with the reason."""
    peers = {}
    for build in builds:
        label, python = build.split("=", 1)
        runs = attempt(lambda: llama_cpp(python, gguf, prompts, n_tokens, eos, folder))
        if "failed" in runs:
            peers[f"llama.cpp ({label})"] = runs
            print(f"llama.cpp ({label}): {runs}", flush=True)
            continue
        plain = runs["llama.cpp"]["outputs"]
        for name, figures in runs.items():
            outputs = figures.pop("outputs")
            if ours is not None:
                figures["same_as_ours"] = sum(a == b for a, b in zip(outputs, ours))
            figures["same_as_its_plain"] = sum(a == b for a, b in zip(outputs, plain))
            peers[f"{name} ({label})"] = figures
            print(f"{name} ({label}): {figures}", flush=True)
    return peers


def plot(rows: list[tuple[str, float]], floor_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.2))
    labels, values = [r[0] for r in rows], [r[1] for r in rows]
    ax.barh(range(len(rows)), values, color=["tab:blue" if lab.startswith("ours") else "tab:gray" for lab in labels])
    ax.axvline(floor_ms, color="tab:red", linestyle="--", label=f"memory floor {floor_ms:.1f} ms")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per token (decode, lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max_generated_tokens", type=int, default=128)
    ap.add_argument("--paths", default="", help="comma-separated CPU paths (default: every one this CPU runs)")
    ap.add_argument("--llama_cpp", action="append", default=[], metavar="LABEL=PYTHON",
                    help="a build of llama.cpp: the interpreter of a venv with llama-cpp-python, and what to call it "
                         "(repeatable; none: llama.cpp is left out)")
    ap.add_argument("--skip_hf", action="store_true", help="leave Hugging Face transformers out")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_cpu.json"))
    args = ap.parse_args()
    quiet_logs()
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = args.paths.split(",") if args.paths else [p.name for p in runnable_paths()]
    ckpt = resolve_checkpoint(None)
    tokenizer = load_tokenizer(ckpt)
    prompts = [encode(tokenizer, p, True) for p in load_prompts(REPO / "sample_prompts.json")]
    n = args.max_generated_tokens
    result = {"environment": machine_info(), "cpu_flags": sorted(cpu_flags()), "max_generated_tokens": n,
              "prompts": len(prompts), "ours": {}, "peers": {}}
    result["floor"] = read_floor(ModelShape.from_hf_config(ckpt.config).weight_bytes_per_token(
        ModelShape.from_hf_config(ckpt.config).n_layers, 2))
    print(f"memory floor: {result['floor']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:  # each in a fresh process, whose package caps torch, oneDNN and MKL to the path
            result["ours"][path] = attempt(lambda: cli_figures({"TT_CPU_ISA": path}, n, Path(tmp) / f"{path}.json"))
            print(f"ours, {path}: {result['ours'][path]}", flush=True)
        if not args.skip_hf:
            for dtype in (torch.float32, torch.bfloat16):
                name = f"transformers {str(dtype).removeprefix('torch.')}"
                result["peers"][name] = attempt(lambda: {"ms_per_token": hf_ms_per_token(
                    load_hf(ckpt.folder, dtype), prompts, n, stop_at_eos=True)})
                print(f"{name}: {result['peers'][name]}", flush=True)
        ours = next((r["plain_outputs"] for r in result["ours"].values() if "failed" not in r), None)
        result["peers"].update(llama_cpp_peers(args.llama_cpp, embedded_gguf(), prompts, n,
                                               eos_token_ids(ckpt, tokenizer), ours, Path(tmp)))
    report(result, out)


def report(result: dict, out: Path) -> None:
    floor = result["floor"]["floor_ms_per_token"]
    fastest_hf = min((p["ms_per_token"] for name, p in result["peers"].items()
                      if name.startswith("transformers") and "failed" not in p), default=None)
    print(f"\nCPU flags: {' '.join(f for f in result['cpu_flags'] if f.startswith(('avx', 'fma', 'f16c', 'asimd', 'bf16')))}")
    print(f"memory floor: {result['floor']['weight_bytes'] / 1e6:.0f} MB of weights at {result['floor']['read_gb_s']:.1f} "
          f"GB/s = {floor:.1f} ms/token\n")
    print("| what | ms/token | x floor | vs fastest transformers | speculative speedup | outputs identical |")
    print("|---|---|---|---|---|---|")
    rows = []
    for path, r in result["ours"].items():
        if "failed" in r:
            print(f"| ours, {path} | failed: {r['failed']} | | | | |")
            continue
        for what, key in (("plain", "plain_ms_per_token"), ("speculative", "speculative_ms_per_token")):
            ms = r[key]
            rows.append((f"ours {path} {what}", ms))
            vs_hf = f"{fastest_hf / ms:.2f}x faster" if fastest_hf else ""
            spec = f"{r['speedup']:.2f}x ({r['tokens_per_step']:.2f} tokens/forward)" if what == "speculative" else ""
            same = str(r["identical_to_baseline"]) if what == "speculative" else ""
            print(f"| ours, {path}, {what} | {ms:.1f} | {ms / floor:.2f} | {vs_hf} | {spec} | {same} |")
    for name, p in result["peers"].items():
        if "failed" in p:
            print(f"| {name} | failed: {p['failed']} | | | | |")
            continue
        rows.append((name, p["ms_per_token"]))
        vs_hf = f"{fastest_hf / p['ms_per_token']:.2f}x faster" if fastest_hf else ""
        same = (f"{p['same_as_its_plain']} of {result['prompts']} as its plain decoding"
                + (f", {p['same_as_ours']} as ours" if "same_as_ours" in p else "") if "same_as_its_plain" in p else "")
        print(f"| {name} | {p['ms_per_token']:.1f} | {p['ms_per_token'] / floor:.2f} | {vs_hf} | | {same} |")
    out.write_text(json.dumps(result, indent=1))
    plot(rows, floor, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
