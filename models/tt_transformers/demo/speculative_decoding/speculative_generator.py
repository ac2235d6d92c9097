# SPDX-License-Identifier: Apache-2.0
"""The speculative decoding loop: draft, verify all drafts in one target forward, accept, repeat.

It speaks only to the `CausalLM` backend interface and the `Drafter` interface: the same loop runs the
torch backend here and a ttnn backend on a Tenstorrent device. With no drafter (or n_draft_tokens 0) it is
plain autoregressive decoding on the same backend, which is what speed is compared against. Greedy settings
verify by exact match on the target's argmax (what a device sends back); sampling settings verify by rejection
sampling on the target's logits, so both paths are lossless.
"""
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from loguru import logger

from models.tt_transformers.speculative.backend import MAX_DRAFT_TOKENS, CausalLM
from models.tt_transformers.speculative.drafters import Draft, Drafter
from models.tt_transformers.speculative.sampling import SamplingParams, probabilities, verify_rejection
from models.tt_transformers.speculative.verification import verify_greedy


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


def check_n_draft_tokens(n_draft_tokens: int) -> None:
    if not 0 <= n_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--n_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {n_draft_tokens}")


def describe_sources(drafts: Sequence[Draft]) -> str:
    """Which source drafted: ', draft: suffix (match 12)' for one user, ', drafts: suffix 3, model 1' for a batch."""
    if len(drafts) == 1:
        d = drafts[0]
        return f", draft: {d.source}" + (f" (match {d.match_len})" if d.source == "suffix" else "")
    counts = Counter(d.source for d in drafts)
    return ", drafts: " + ", ".join(f"{source} {n}" for source, n in sorted(counts.items()))


class SpeculativeGenerator:
    def __init__(self, target: CausalLM, drafter: Optional[Drafter], n_draft_tokens: int,
                 eos_token_ids: Sequence[int] = (), sampling_params: Optional[SamplingParams] = None):
        check_n_draft_tokens(n_draft_tokens)
        if n_draft_tokens > 0 and drafter is None:
            raise ValueError("n_draft_tokens > 0 needs a drafter")
        self.target, self.n_draft_tokens = target, n_draft_tokens
        self.drafter = drafter if n_draft_tokens > 0 else None
        self.eos_token_ids = set(eos_token_ids)
        self.sampling = sampling_params or SamplingParams()
        self.streams = None

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        if not prompts:
            raise ValueError("no prompts to generate from")
        if len(prompts) > self.target.max_batch_size:
            raise ValueError(f"{len(prompts)} prompts but the backend was built for batch size "
                             f"{self.target.max_batch_size}; raise --batch_size or pass fewer prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if not all(0 <= t < self.target.vocab_size for t in p):
                raise ValueError(f"prompt {i} has token ids outside the model's vocabulary [0, {self.target.vocab_size})"
                                 "; encode it with the target's own tokenizer")
            if len(p) >= self.target.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, which leaves no room to generate within "
                                 f"max_seq_len={self.target.max_seq_len}; raise --max_seq_len or shorten the prompt")

    def generate(self, prompts: Sequence[Sequence[int]], max_generated_tokens: int,
                 stop_at_eos: bool = True) -> list[UserResult]:
        self.check_prompts(prompts)
        if max_generated_tokens < 1:
            raise ValueError(f"max_generated_tokens must be >= 1, got {max_generated_tokens}")
        users = list(range(len(prompts)))
        results = [UserResult(list(p)) for p in prompts]
        contexts = [list(p) for p in prompts]

        self.streams = None if self.sampling.greedy else self.sampling.streams()
        # Prefill one user at a time, as TT-Transformers does; the first token comes from the prefill.
        for u in users:
            start = time.perf_counter()
            first = self._verify([u], [Draft([], "none")], [contexts[u]], prefill=True)[0][0]
            results[u].ttft_ms = (time.perf_counter() - start) * 1e3
            contexts[u].append(first)
            results[u].output_tokens.append(first)
        if self.drafter is not None:
            # The draft model's prefill (or the automaton's build) happens after the first token and before the
            # second, so it is decode time: every user waits for it, as for an iteration.
            start = time.perf_counter()
            self.drafter.start(users, prompts, self.sampling)
            draft_prefill_s = time.perf_counter() - start
            for r in results:
                r.decode_s += draft_prefill_s
        active = [u for u in users if not self._finished(results[u], contexts[u], max_generated_tokens, stop_at_eos)]

        iteration = 0
        while active:
            start = time.perf_counter()
            caps = [self._draft_cap(results[u], contexts[u], max_generated_tokens) for u in active]
            if self.drafter is not None:
                context_len = sum(len(contexts[u]) for u in active) / len(active)
                drafts = self.drafter.propose(active, [contexts[u] for u in active], caps,
                                              self.target.verify_cost(len(active), context_len))
            else:
                drafts = [Draft([], "none") for _ in active]
            appended = self._verify(active, drafts, [contexts[u] for u in active])
            ms = (time.perf_counter() - start) * 1e3
            produced = accepted = 0
            for u, draft, new in zip(active, drafts, appended):
                n_accepted = len(new) - 1
                if self.drafter is not None:
                    self.drafter.accept(u, new, n_accepted)
                new = self._keep(new, results[u], max_generated_tokens, stop_at_eos)
                contexts[u].extend(new)
                results[u].output_tokens.extend(new)
                results[u].decode_s += ms / 1e3
                results[u].iterations.append(
                    IterationStats(draft.source, len(draft.tokens), n_accepted, ms, draft.match_len))
                produced += len(new)
                accepted += n_accepted
            drafted = sum(len(d.tokens) for d in drafts)
            tok_s = produced / (ms / 1e3)
            logger.info(f"Iteration {iteration}: {ms:.0f}ms @ {tok_s / len(active):.1f} tok/s/user "
                        f"({tok_s:.1f} tok/s throughput), accepted {accepted}/{drafted} draft tokens"
                        f"{describe_sources(drafts)}")
            iteration += 1
            active = [u for u in active if not self._finished(results[u], contexts[u], max_generated_tokens, stop_at_eos)]
        return results

    def _verify(self, users: list[int], drafts: list[Draft], contexts: list[list[int]],
                prefill: bool = False) -> list[list[int]]:
        """One target forward over [last token, drafts...] per user (the whole prompt at prefill); the tokens each
        user appends: accepted drafts plus one from the target."""
        if prefill:
            fed, start_pos = contexts, [0] * len(users)
        else:
            fed = [[ctx[-1]] + d.tokens for ctx, d in zip(contexts, drafts)]
            start_pos = [len(ctx) - 1 for ctx in contexts]
        if self.sampling.greedy:
            scores = self.target.argmax(fed, start_pos, users, last_only=prefill)
            return [verify_greedy(d.tokens, s) for d, s in zip(drafts, scores)]
        logits = self.target.logits(fed, start_pos, users, last_only=prefill)
        return [verify_rejection(d.tokens, d.probs, probabilities(lg, self.sampling),
                                 self.streams(u, lg.device))
                for u, d, lg in zip(users, drafts, logits)]

    def _draft_cap(self, result: UserResult, context: list[int], max_generated_tokens: int) -> int:
        """Drafts this iteration: never more than could be kept, nor past the end of the KV cache."""
        remaining = max_generated_tokens - len(result.output_tokens)
        room = self.target.max_seq_len - len(context)
        return max(0, min(self.n_draft_tokens, remaining - 1, room - 1))

    def _keep(self, new: list[int], result: UserResult, max_generated_tokens: int, stop_at_eos: bool) -> list[int]:
        """Cut the accepted tokens at an EOS (kept, as Hugging Face does) and at the token budget."""
        new = new[: max_generated_tokens - len(result.output_tokens)]
        if stop_at_eos:
            for i, t in enumerate(new):
                if t in self.eos_token_ids:
                    return new[: i + 1]
        return new

    def _finished(self, result: UserResult, context: list[int], max_generated_tokens: int, stop_at_eos: bool) -> bool:
        return (len(result.output_tokens) >= max_generated_tokens
                or len(context) >= self.target.max_seq_len
                or (stop_at_eos and result.output_tokens[-1] in self.eos_token_ids))
