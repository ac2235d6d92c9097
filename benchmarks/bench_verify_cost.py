# SPDX-License-Identifier: Apache-2.0
"""What a verify step costs on this backend by context length: the measurement behind STEP_COSTS (per CPU path).

    make bench-verify-cost   # or: python benchmarks/bench_verify_cost.py --context_lens 128 1024 4096 8000

On the embedded model (bf16, on the CPU kernels' path this CPU or TT_CPU_ISA picks): for each cached context length c,
times target steps of 1 user x 1-17 rows and 4 users x 1-4 rows (the shapes of decoding and verifying a draft), then
fits step ms = W + users x c x R + rows x (T + c x K) by least squares on relative errors (short steps count as much
as long ones). W is the part of a step that does not depend on its rows (streaming the weights), R reading one
user's cached K and V at one position (the kernels read a user's cache once for all of its rows), T a row's work and K
a row's arithmetic per cached position (its scores and its weighing of the values). T / W, K / W and R / W are the
token, key and read costs torch_backend/causal_lm.py keeps per CPU path (STEP_COSTS); the table shows measured and
fitted times side by side. Prints a table and the STEP_COSTS entry, and writes JSON.

The caches come from one prefill of the longest context on user 0, copied to the other users; the contexts are timed
longest first, so the positions a step writes are never read by a later (shorter) context's steps.
"""
import argparse
import time
from pathlib import Path

from common import REPO, machine_info, print_table, quiet_logs

import torch

from models.tt_transformers.records import write_json_atomic
from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

SHAPES = [(1, 1), (1, 2), (1, 5), (1, 9), (1, 17), (4, 1), (4, 2), (4, 4)]  # (users, rows per user)
TERMS = ("weights_ms", "token_ms", "key_ms", "read_ms")  # the fit's W, T, K, R (K and R per cached position)


def time_step(lm: TorchCausalLM, n_users: int, n_rows: int, context_len: int, steps: int) -> float:
    """Median ms of `steps` identical steps writing just past each user's cached context (rollback by position)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        lm.forward_logits([[7] * n_rows] * n_users, [context_len] * n_users, list(range(n_users)))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def fill_caches(lm: TorchCausalLM, n_users: int, length: int) -> None:
    """Users 0 .. n_users - 1 hold the cache of one `length`-token prompt (prefilled once, then copied)."""
    lm.forward_logits([[(31 * i) % 1000 + 100 for i in range(length)]], [0], [0], last_only=True)
    for k, v in zip(lm.cache.k, lm.cache.v):
        k[1:n_users] = k[0]
        v[1:n_users] = v[0]


def measure(lm: TorchCausalLM, context_lens, steps: int, repeats: int) -> dict:
    """{(context_len, users, rows per user): the fastest of `repeats` medians of `steps` steps, in ms}."""
    fill_caches(lm, max(u for u, _ in SHAPES), max(context_lens))
    measured = {}
    for context_len in sorted(set(context_lens), reverse=True):
        time_step(lm, 1, 1, context_len, 3)  # warm-up
        for _ in range(repeats):  # interleaved passes: slow drifts of this shared machine hit every shape
            for users, k in SHAPES:
                ms = time_step(lm, users, k, context_len, steps)
                measured[context_len, users, k] = min(ms, measured.get((context_len, users, k), ms))
    return measured


def features(context_len: float, users: int, k: int) -> list[float]:
    """A step's multipliers of W, T, K and R."""
    return [1.0, users * k, users * k * context_len, users * context_len]


def fit(measured: dict) -> dict:
    """The least-squares W, T, K and R (TERMS) of the measured steps, each step's error relative to its time."""
    keys = list(measured)
    ms = torch.tensor([measured[key] for key in keys], dtype=torch.float64)
    x = torch.tensor([features(*key) for key in keys], dtype=torch.float64)
    solution = torch.linalg.lstsq(x / ms[:, None], torch.ones(len(keys), 1, dtype=torch.float64)).solution[:, 0]
    return dict(zip(TERMS, solution.tolist()))


def costs_of(terms: dict) -> dict:
    """The fit in STEP_COSTS's units (one stream of the weights)."""
    w = terms["weights_ms"]
    return {"token": terms["token_ms"] / w, "key": terms["key_ms"] / w, "read": terms["read_ms"] / w}


def report(measured: dict, terms: dict, path: str, in_use, output_json: Path) -> None:
    """The table of measured and fitted step times, the fit, the STEP_COSTS entry; and the JSON."""
    fitted = {key: sum(f * terms[t] for f, t in zip(features(*key), TERMS)) for key in measured}
    print_table(["cached tokens", "users", "rows per user", "step ms", "fitted ms"],
                [[c, u, k, f"{measured[c, u, k]:.1f}", f"{fitted[c, u, k]:.1f}"] for c, u, k in measured])
    costs = costs_of(terms)
    print(f"\nFit: step = {terms['weights_ms']:.2f} ms + users x {1e3 * terms['read_ms']:.3f} ms per 1,000 cached"
          f" + rows x ({terms['token_ms']:.3f} ms + {1e3 * terms['key_ms']:.3f} ms per 1,000 cached)"
          f"\nSTEP_COSTS entry for {path}: \"{path}\": StepCost({costs['token']:.3f}, {costs['key']:.1e}, "
          f"{costs['read']:.1e})  (torch_backend/causal_lm.py uses {tuple(in_use)})")
    write_json_atomic(output_json, {
        "machine": machine_info(), "cpu_path": path,
        "steps": [{"context_len": c, "users": u, "rows_per_user": k, "ms": measured[c, u, k],
                   "fitted_ms": fitted[c, u, k]} for c, u, k in measured],
        "fit": {**terms, **{f"{name}_cost": value for name, value in costs.items()}},
        "in_use": in_use._asdict()})
    print(f"JSON written to {output_json}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context_lens", type=int, nargs="+", default=[128, 1024, 2048, 4096, 8000],
                    help="cached positions per user (the embedded model holds 8,192 with the rows)")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per shape; the median is kept")
    ap.add_argument("--repeats", type=int, default=3, help="passes over all shapes; each shape's fastest is kept")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_verify_cost.json"))
    args = ap.parse_args()
    if len(set(args.context_lens)) < 2 or min(args.context_lens) < 1:
        ap.error("--context_lens: two or more different lengths >= 1 (the fit tells per-position costs from the rest)")
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats: at least 1")
    quiet_logs()

    model = load_model(resolve_checkpoint(None), torch.bfloat16, max(args.context_lens) + max(k for _, k in SHAPES))
    lm = TorchCausalLM(model, model.args.n_layers, max(u for u, _ in SHAPES))
    measured = measure(lm, args.context_lens, args.steps, args.repeats)
    report(measured, fit(measured), model.kernels.path.name if model.kernels else "torch ops", lm.costs,
           Path(args.output_json))


if __name__ == "__main__":
    main()
