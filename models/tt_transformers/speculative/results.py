# SPDX-License-Identifier: Apache-2.0
"""What `SpeculativeGenerator.generate` returns per user, and the figures over a run's users (TT-Transformers' perf
keys among them)."""
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .metrics import SpecDecodeCounters


@dataclass
class IterationStats:
    """One iteration of one user: the draft's source and size, and how many of its tokens were accepted and kept (an
    EOS ends the count: drafts verified past it are not)."""

    draft_source: str
    drafted: int
    accepted: int
    ms: float
    match_len: int = 0


FINISH_REASONS = ("stop", "length", "cache_end")


@dataclass
class UserResult:
    """One prompt's answer. finish_reason, why it ended (None while it runs), as vLLM's where vLLM has one: "stop", an
    end-of-sequence token (kept last); "length", max_generated_tokens reached; "cache_end", the KV cache's end
    (max_seq_len: prompt and answer together) came first, so the answer has fewer tokens than asked for and no EOS
    (vLLM folds this into "length", as max_model_len; here it is told apart because its fix is another: a longer
    max_seq_len)."""

    prompt_tokens: list[int]
    output_tokens: list[int] = field(default_factory=list)
    iterations: list[IterationStats] = field(default_factory=list)
    ttft_ms: float = 0.0
    decode_s: float = 0.0  # time after the first token
    token_times_s: list[float] = field(default_factory=list)  # when each step's tokens were ready, from the start of
    # generate() (the batch's arrival): its first token's, then one per iteration (a chunk, as a server streams it)
    finish_reason: Optional[str] = None  # one of FINISH_REASONS once done

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, per second of decoding."""
        return (len(self.output_tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


LATENCY_PERCENTILES = (50, 95, 99)


def latencies_ms(users: list[UserResult]) -> dict[str, list[float]]:
    """Per request, as vLLM's serving benchmark measures a streamed request (every request of a batch arrives when
    its generate() starts): TTFT, the first token's time; E2EL, the last token's; TPOT, (E2EL - TTFT) over the
    tokens after the first; and every ITL, the gap between two consecutive chunks (a step's tokens arrive together)."""
    out = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for r in users:
        times = [1e3 * t for t in r.token_times_s]
        if not times:
            continue
        out["ttft"].append(times[0])
        out["e2el"].append(times[-1])
        if len(r.output_tokens) > 1:
            out["tpot"].append((times[-1] - times[0]) / (len(r.output_tokens) - 1))
        out["itl"] += [b - a for a, b in zip(times, times[1:])]
    return out


def latency_summary(users: list[UserResult]) -> dict:
    """mean_<m>_ms and p50/p95/p99_<m>_ms for TTFT, TPOT, ITL and E2EL (vLLM's benchmark keys; None without a
    value)."""
    summary = {}
    for metric, values in latencies_ms(users).items():
        summary[f"mean_{metric}_ms"] = float(np.mean(values)) if values else None
        for p in LATENCY_PERCENTILES:
            summary[f"p{p}_{metric}_ms"] = float(np.percentile(values, p)) if values else None
    return summary


def spec_decode_counters(users: list[UserResult], num_spec_tokens: Optional[int] = None) -> SpecDecodeCounters:
    """vLLM's acceptance counters over every iteration that verified a draft (a tree counts its nodes as draft tokens
    and its accepted path by depth); positions up to num_spec_tokens (default: the longest draft)."""
    drafted = [(it.drafted, it.accepted) for r in users for it in r.iterations if it.drafted]
    counters = SpecDecodeCounters(num_spec_tokens if num_spec_tokens is not None else
                                  max((d for d, _ in drafted), default=0))
    for d, a in drafted:
        counters.observe_draft(d, a)
    return counters


def summarize(batches: list[list[UserResult]], num_spec_tokens: Optional[int] = None) -> dict:
    """Figures over all users (users of one batch share each iteration's time), with TT-Transformers' perf keys:
    prefill_time_to_token (s, mean over users), prefill_t/s (prompt tokens per second of prefill), decode_t/s/u and
    decode_t/s (tokens after the first per second of decoding, per user and over the batch); vLLM's serving keys
    (latency_summary) and its spec-decode counters (spec_decode, for drafts of up to num_spec_tokens)."""
    users = [r for batch in batches for r in batch]
    drafted = sum(it.drafted for r in users for it in r.iterations)
    accepted = sum(it.accepted for r in users for it in r.iterations)
    steps = sum(len(r.iterations) for r in users)
    batch_steps = sum(max(len(r.iterations) for r in batch) for batch in batches)  # target forwards
    produced = sum(len(r.output_tokens) - 1 for r in users)
    decode_s = sum(max(r.decode_s for r in batch) for batch in batches)
    prefill_s = sum(r.ttft_ms for r in users) / 1e3
    tok_s = produced / decode_s if decode_s else 0.0
    tok_s_u = tok_s * len(batches) / len(users)
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_step": produced / steps if steps else 0.0,
        "ms_per_step": 1e3 * decode_s / batch_steps if batch_steps else 0.0,
        "decode_tok_s": tok_s,
        "decode_tok_s_u": tok_s_u,
        "ttft_ms": sum(r.ttft_ms for r in users) / len(users),
        "prefill_time_to_token": prefill_s / len(users),
        "prefill_t/s": sum(len(r.prompt_tokens) for r in users) / prefill_s if prefill_s else 0.0,
        "decode_t/s/u": tok_s_u,
        "decode_t/s": tok_s,
        **latency_summary(users),
        "spec_decode": spec_decode_counters(users, num_spec_tokens).as_dict(),
    }
