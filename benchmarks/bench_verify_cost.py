# SPDX-License-Identifier: Apache-2.0
"""What one more verified token costs on this backend: the measurement behind STEP_COSTS (per CPU path).

    make bench-verify-cost   # or: python benchmarks/bench_verify_cost.py --context_lens 100 1000

On the embedded model (bf16, on the CPU kernels' path this CPU or TT_CPU_ISA picks): for each cached context length,
times target steps of 1 user x 1-17 tokens and 8 users x 1-3 tokens (the shapes of decoding and verifying a draft),
then fits step ms = W + n_tokens (a + b context_len) by least squares, W being the part of a step that does not
depend on how many tokens it computes (streaming the weights). a / W and b / W are the per-token and per-cached-key
costs that torch_backend/causal_lm.py keeps per CPU path (STEP_COSTS); the table shows measured and fitted times side
by side. Prints a table and writes JSON.
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

SHAPES = [(1, 1), (1, 2), (1, 5), (1, 9), (1, 17), (8, 1), (8, 2), (8, 3)]  # (users, tokens per user)


def time_step(lm: TorchCausalLM, n_users: int, n_tokens: int, context_len: int, steps: int) -> float:
    """Median ms of `steps` identical steps writing just past each user's cached context (rollback by position)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        lm.forward_logits([[7] * n_tokens] * n_users, [context_len] * n_users, list(range(n_users)))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context_lens", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per shape; the median is kept")
    ap.add_argument("--repeats", type=int, default=3, help="passes over all shapes; each shape's fastest is kept")
    ap.add_argument("--output_json", default=str(REPO / "bench_results" / "bench_verify_cost.json"))
    args = ap.parse_args()
    quiet_logs()

    max_users = max(u for u, _ in SHAPES)
    max_len = max(args.context_lens) + max(k for _, k in SHAPES)
    model = load_model(resolve_checkpoint(None), torch.bfloat16, max_len)
    lm = TorchCausalLM(model, model.args.n_layers, max_users)
    path = model.kernels.path.name if model.kernels else "torch ops"
    measured = {}
    for context_len in args.context_lens:
        for u in range(max_users):  # a prefill per user fills the cache the timed steps attend to
            lm.forward_logits([[(31 * i + u) % 1000 + 100 for i in range(context_len)]], [0], [u], last_only=True)
        time_step(lm, 1, 1, context_len, 3)  # warm-up
        for _ in range(args.repeats):  # interleaved passes: slow drifts of this shared machine hit every shape
            for users, k in SHAPES:
                ms = time_step(lm, users, k, context_len, args.steps)
                measured[context_len, users, k] = min(ms, measured.get((context_len, users, k), ms))

    keys = list(measured)
    features = torch.tensor([[1.0, u * k, u * k * c] for c, u, k in keys], dtype=torch.float64)
    ms = torch.tensor([measured[key] for key in keys], dtype=torch.float64)
    weights_ms, token_ms, key_ms = torch.linalg.lstsq(features, ms[:, None]).solution[:, 0].tolist()
    fitted = (features @ torch.tensor([weights_ms, token_ms, key_ms], dtype=torch.float64)).tolist()

    print_table(["cached tokens", "users", "tokens per user", "step ms", "fitted ms"],
                [[c, u, k, f"{measured[c, u, k]:.1f}", f"{f:.1f}"] for (c, u, k), f in zip(keys, fitted)])
    token_cost, key_cost = token_ms / weights_ms, key_ms / weights_ms
    print(f"\nFit: step = {weights_ms:.2f} ms + tokens x ({token_ms:.3f} ms + {1e3 * key_ms:.3f} ms per 1,000 cached)"
          f"\ntoken cost {token_cost:.3f}, key cost {key_cost:.1e} on {path} "
          f"(torch_backend/causal_lm.py uses {lm.token_cost}, {lm.key_cost:.0e})")
    write_json_atomic(Path(args.output_json), {
        "machine": machine_info(), "cpu_path": path,
        "steps": [{"context_len": c, "users": u, "tokens_per_user": k, "ms": measured[c, u, k], "fitted_ms": f}
                  for (c, u, k), f in zip(keys, fitted)],
        "fit": {"weights_ms": weights_ms, "token_ms": token_ms, "key_ms": key_ms, "token_cost": token_cost,
                "key_cost": key_cost},
        "in_use": {"token_cost": lm.token_cost, "key_cost": lm.key_cost}})
    print(f"JSON written to {args.output_json}")


if __name__ == "__main__":
    main()
