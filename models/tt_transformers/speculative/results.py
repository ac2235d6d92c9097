# SPDX-License-Identifier: Apache-2.0
"""What `SpeculativeGenerator.generate` returns per user, and the figures over a run's users (TT-Transformers' perf
keys among them)."""
from dataclasses import dataclass, field


@dataclass
class IterationStats:
    draft_source: str
    drafted: int
    accepted: int
    ms: float
    match_len: int = 0


@dataclass
class UserResult:
    prompt_tokens: list[int]
    output_tokens: list[int] = field(default_factory=list)
    iterations: list[IterationStats] = field(default_factory=list)
    ttft_ms: float = 0.0
    decode_s: float = 0.0  # time after the first token

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, per second of decoding."""
        return (len(self.output_tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


def summarize(batches: list[list[UserResult]]) -> dict:
    """Figures over all users (users of one batch share each iteration's time), with TT-Transformers' perf keys:
    prefill_time_to_token (s, mean over users), prefill_t/s (prompt tokens per second of prefill), decode_t/s/u and
    decode_t/s (tokens after the first per second of decoding, per user and over the batch)."""
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
    }
