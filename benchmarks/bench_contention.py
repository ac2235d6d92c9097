# SPDX-License-Identifier: Apache-2.0
"""The CPU path on a busy machine (`make bench-contention`): ms per token of plain and speculative decoding (the demo's
default mode, the embedded model), quiet and beside one CPU-bound competitor (a Python busy loop), with the thread
count the package picks (torch_backend/cpu_threads.py: the cores other processes leave free), with every core
whatever the load (OMP_NUM_THREADS = the core count: torch's default, what ran before) and with OMP_NUM_THREADS=1, all
in one run. Each cell is the demo in a fresh process (its thread settings apply from the
start), its figures from the demo's JSON report (the speculative run and its plain baseline, back to back). Writes a
table, bench_results/bench_contention.json and a chart; docs/results.md carries the table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, cli_figures, machine_info

COMPETITOR = "while True: pass"


def demo_cell(threads: str, loaded: bool, n_tokens: int, folder: Path) -> dict:
    """One demo run (speculative, then plain) in its own process; with `loaded`, a busy loop runs beside it."""
    env = {} if threads == "package" else {"OMP_NUM_THREADS": threads}
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if loaded else None
    try:
        return cli_figures(env, n_tokens, folder / f"{threads}-{'loaded' if loaded else 'quiet'}.json")
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = list(cells)
    for i, (what, key) in enumerate((("plain", "plain_ms_per_token"), ("speculative", "speculative_ms_per_token"))):
        ax.bar([x + 0.4 * i for x in range(len(labels))], [cells[c][key] for c in labels], 0.4, label=what)
    ax.set_xticks([x + 0.2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("ms per token")
    ax.set_title("Quiet and beside one CPU-bound process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max_generated_tokens", type=int, default=64)
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_contention.json"))
    args = ap.parse_args()
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in ("package", str(os.cpu_count()), "1"):
            for loaded in (False, True):
                name = f"{'package threads' if threads == 'package' else f'OMP_NUM_THREADS={threads}'}, " \
                       f"{'loaded' if loaded else 'quiet'}"
                cells[name] = demo_cell(threads, loaded, args.max_generated_tokens, Path(tmp))
                print(f"{name}: {cells[name]}", flush=True)
    print(f"\n| threads, load | plain ms/token | speculative ms/token | speedup | loaded / quiet (plain, spec.) |")
    print("|---|---|---|---|---|")
    for name, c in cells.items():
        quiet = cells[name.replace("loaded", "quiet")]
        ratio = f"{c['plain_ms_per_token'] / quiet['plain_ms_per_token']:.2f}x, " \
                f"{c['speculative_ms_per_token'] / quiet['speculative_ms_per_token']:.2f}x"
        print(f"| {name} | {c['plain_ms_per_token']:.1f} | {c['speculative_ms_per_token']:.1f} | {c['speedup']:.2f}x | "
              f"{ratio if 'loaded' in name else ''} |")
    out.write_text(json.dumps({"environment": machine_info(), "max_generated_tokens": args.max_generated_tokens,
                               "competitor": COMPETITOR, "cells": cells}, indent=1))
    plot(cells, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
