# SPDX-License-Identifier: Apache-2.0
"""Sampling settings, the target distribution they define, and lossless verification by rejection sampling.

Verification follows Leviathan et al. 2023 / Chen et al. 2023: draft token x (drawn from the draft's distribution
q) is accepted with probability min(1, p(x) / q(x)); the first rejection is replaced by a sample from
norm(max(0, p - q)) and ends the iteration; when every draft passes, a bonus token is sampled from the target's
next distribution. A suffix-automaton draft is a point mass (q(x) = 1): accept with probability p(x), else sample
from p with x removed. Either way every appended token is distributed exactly as sampling the target alone.
"""
import math
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SamplingParams:
    """In the spirit of TT-Transformers' SamplingParams. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # nan and inf pass a bare `< 0`
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def streams(self) -> "RandomStreams":
        """Random streams for one run: from the seed, or from fresh OS entropy when there is none."""
        return RandomStreams(self.seed if self.seed is not None else secrets.randbits(63))


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class RandomStreams:
    """One torch.Generator per stream (a user, or a drafter's user), created on the device of the probabilities
    it first samples: a user's draws depend only on the base seed and its stream, never on who else is in the
    batch, and a generator always lives where the probabilities are (CPU or CUDA)."""

    def __init__(self, base_seed: int):
        self.base_seed = base_seed
        self.generators: dict[tuple[int, str], torch.Generator] = {}

    def seed_of(self, stream: int) -> int:
        """A seed in [0, 2^63) for torch's manual_seed, whatever the base (torch.seed() values reach 2^64)."""
        return _mix64(_mix64(self.base_seed) + GOLDEN64 * (stream + 1)) >> 1

    def __call__(self, stream: int, device: Union[str, torch.device] = "cpu") -> torch.Generator:
        device = torch.device(device)
        key = (stream, str(device))
        if key not in self.generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed_of(stream))
            self.generators[key] = g
        return self.generators[key]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities after temperature, top-k and top-p: the distribution to preserve."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, rng: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=rng))


def verify_rejection(draft: Sequence[int], draft_probs: Optional[Sequence[torch.Tensor]], target_probs: torch.Tensor,
                     rng: torch.Generator) -> list[int]:
    """Tokens to append: the accepted draft prefix plus one token from the target (residual or bonus).

    target_probs [len(draft) + 1, V]: the target's distribution after the last accepted token and after each draft.
    draft_probs: the draft model's distribution q for each draft token, or None for a point-mass (suffix) draft.
    """
    assert target_probs.shape[0] == len(draft) + 1, "the target must score the last accepted token and every draft"
    out = []
    for i, x in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else None
        q_x = float(q[x]) if q is not None else 1.0
        if float(torch.rand((), generator=rng, device=rng.device)) * q_x < float(p[x]):  # u < p(x) / q(x), without dividing
            out.append(x)
            continue
        if q is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        out.append(sample(residual / total if total > 0 else p, rng))
        return out
    out.append(sample(target_probs[len(draft)], rng))
    return out


def verify_rejection_tree(tokens: Sequence[int], parents: Sequence[int], target_probs: torch.Tensor,
                          rng: torch.Generator) -> tuple[list[int], list[int]]:
    """Rejection sampling down a tree of point-mass drafts (SpecInfer's multi-candidate verification): at each
    node its children are tried in turn, child x accepted with probability r(x) where r is the target's distribution
    with the children tried before removed and renormalised; an accepted child continues the walk, and when all are
    rejected the next token is sampled from r. Each step's token is distributed exactly as sampling the target:
    P(x) = p(x) for a child tried first, and (1 - p(tried)) * p(x) / (1 - p(tried)) = p(x) for the rest.

    target_probs [len(tokens) + 1, V]: after the context's last token, then after each node. Returns the tokens to
    append and the accepted path (draft indices)."""
    from .verification import children_of

    children = children_of(parents)
    out, path, node = [], [], -1
    while True:
        residual = target_probs[node + 1].clone()
        for child in children.get(node, ()):
            x = tokens[child]
            total = float(residual.sum())
            if total > 0 and float(torch.rand((), generator=rng, device=rng.device)) * total < float(residual[x]):
                out.append(x)
                path.append(child)
                node = child
                break
            residual[x] = 0.0
        else:
            total = float(residual.sum())
            out.append(sample(residual / total if total > 0 else target_probs[node + 1], rng))
            return out, path
