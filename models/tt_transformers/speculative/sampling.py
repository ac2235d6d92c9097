# SPDX-License-Identifier: Apache-2.0
"""Sampling settings, the target distribution they define, and keyed draws: the token at a position of a request is
drawn from noise keyed on (seed, request, position) alone.

A draw is an exponential race (Gumbel-max): with E_i ~ Exp(1) from a generator seeded by the key, token i wins
argmax_i p_i / E_i with probability p_i / sum(p). Verification compares each draft token with the target's own keyed
draw at its position: accepted iff equal, else that draw is appended and ends the iteration. Every appended token is
then the target's draw at its position whatever drafted (drafter-invariant speculative decoding, Daliri et al. 2024,
arXiv 2408.07978): lossless, and token-identical to plain sampling with the same seed wherever the target's
probabilities for a position do not depend on how many rows its step carried. Drafters that sample (a draft model,
a head's chains) draw from q with the same key, so a draft equals the target's draw whenever the same noise picks
the same token from q as from p: always when q = p, otherwise a little less often than rejection sampling's
1 - TV(p, q) (docs/draft_sources.md). Copied, recycled and tree drafts are accepted with
probability p(x), as under rejection sampling.
"""
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import UserError, check_int, check_number

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
        """Each setting checked and stored as a plain int or float (a numpy or torch scalar would leak into the keyed
        draws' arithmetic)."""
        checked = {"temperature": check_number("temperature", self.temperature, 0, fix="0 = greedy"),
                   "top_k": check_int("top_k", self.top_k, 0, fix="0 = off"),
                   "top_p": check_number("top_p", self.top_p, 0, 1, lo_open=True, fix="1 = off"),
                   "seed": None if self.seed is None else check_int("seed", self.seed, 0,
                                                                    fix="None: fresh randomness each run")}
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: set once, here
        check_sampling_only("top_k", self.top_k, 0, self.temperature)
        check_sampling_only("top_p", self.top_p, 1.0, self.temperature)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling_only(name: str, value, off, temperature: float) -> None:
    """A setting only sampling reads (top_k, top_p), given with temperature 0 (greedy), is refused: it would be ignored
    without a word. (A seed is not: it is harmless under greedy, and a script may pass one always.)"""
    if temperature == 0 and value != off:
        raise UserError(f"{name} {value} only applies when sampling, and temperature 0 is greedy; set temperature "
                        f"above 0 to sample, or leave {name} out", name, ("temperature",))


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class KeyedSampler:
    """The settings of one run and its keyed draws. requests[user]: the request id of each user (cache row), so a
    prompt's draws do not depend on which row or batch it runs in (default: the user's own index); the seed, or fresh
    OS entropy when there is none."""

    def __init__(self, params: SamplingParams, requests: Optional[Sequence[int]] = None):
        self.params, self.requests = params, requests
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)

    def key(self, user: int, position: int) -> int:
        """A seed in [0, 2^63) for torch's manual_seed, from (seed, request, position) alone."""
        request = self.requests[user] if self.requests is not None else user
        return _mix64(_mix64(_mix64(self.seed) + GOLDEN64 * (request + 1)) + GOLDEN64 * (position + 1)) >> 1

    def sample(self, probs: torch.Tensor, user: int, position: int) -> int:
        """The token at `position` of the user's request under probabilities `probs` [V]. The noise is drawn on the
        CPU (so the token does not depend on the device); -log(0) = inf only takes a token out of the race."""
        noise = torch.rand(probs.numel(), generator=torch.Generator().manual_seed(self.key(user, position)))
        return int((probs.cpu() / noise.log_().neg_()).argmax())


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


class TargetSamples:
    """The target's keyed draw after each row of a step (rows: [last token, drafts...], or a tree's nodes), each
    computed when first read: verification reads rows only up to the first rejection. positions[r]: the position of
    the token row r predicts."""

    def __init__(self, sampler: KeyedSampler, user: int, logits: torch.Tensor, positions: Sequence[int]):
        self.sampler, self.user, self.logits, self.positions = sampler, user, logits, positions
        self.drawn: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, r: int) -> int:
        if r not in self.drawn:
            probs = probabilities(self.logits[r], self.sampler.params)
            self.drawn[r] = self.sampler.sample(probs, self.user, self.positions[r])
        return self.drawn[r]
