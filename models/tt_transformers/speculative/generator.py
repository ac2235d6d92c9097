# SPDX-License-Identifier: Apache-2.0
"""The speculative decoding loop: draft, verify all drafts in one target forward, accept, repeat.

It speaks only to the `CausalLM` backend interface and the `Drafter` interface: the same loop runs the torch
backend and the ttnn backend on a Tenstorrent device. With no drafter (or n_draft_tokens 0) it is plain
autoregressive decoding on the same backend, which is what speed is compared against. A draft token is accepted iff
it equals the target's own token at its position: the argmax when greedy (all a device sends back), else the keyed
draw from the target's logits for that row, seeded by (seed, request, position) alone (sampling.py). Either way
every token appended is the one plain decoding appends there, so both paths are lossless. Each step's drafts are
sized across users to the backend's row budget (`CausalLM.max_step_rows`: one 32-row tile on a TT device), and
priced by its `step_cost`.

One iteration reads top to bottom in `generate`: `_draft` (each active user's draft, sized to the row budget),
`_verify` (one target step over every user's rows, each draft checked against the target's own tokens) and
`_append` (the accepted tokens kept, the drafter told); `_prefill` comes before, `IterationLog` times and logs.
"""
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from loguru import logger

from ..errors import (
    UserError,
    check_bool,
    check_implements,
    check_instance,
    check_int,
    check_sequence,
    check_token_ids,
    check_token_lists,
)
from .backend import CausalLM, StepOutput, UserRows, extra_cost_curve
from .config import check_n_draft_tokens
from .drafters import Draft, Drafter, Verified
from .results import IterationStats, UserResult
from .sampling import KeyedSampler, SamplingParams, TargetSamples
from .verification import verify_chain, verify_tree

# What the loop calls on its target and drafter (a test double or a user's own drafter may leave out the rest).
TARGET_USES = ("prefill", "step", "commit_path", "step_cost", "max_seq_len", "max_batch_size", "vocab_size",
               "max_step_rows", "supports_trees")
DRAFTER_USES = ("start", "propose", "accept", "top_k", "taps")
MAKE_TARGET = "wrap the model: TorchCausalLM(model, model.args.n_layers, max_batch_size), or TtnnCausalLM on a TT mesh"


def describe_sources(drafts: Sequence[Draft]) -> str:
    """Which source drafted: ', suffix (match 12)' for one user, ', suffix 3, model 1' for a batch (the iteration line
    stays within a 120-column terminal)."""
    if len(drafts) == 1:
        d = drafts[0]
        return f", {d.source}" + (f" (match {d.match_len})" if d.source == "suffix" else "")
    counts = Counter(d.source for d in drafts)
    return ", " + ", ".join(f"{source} {n}" for source, n in sorted(counts.items()))


class IterationLog:
    """The `Iteration` lines of one generate() call: the first `limit` logged (None: every one, as TT's text
    generation logs them), the rest counted into one line at the end."""

    def __init__(self, limit: Optional[int]):
        self.limit, self.iteration = limit, 0
        self.unlogged_accepted = self.unlogged_drafted = 0

    def iteration_done(self, ms: float, n_users: int, produced: int, accepted: int, drafts: Sequence[Draft]) -> None:
        drafted = sum(len(d.tokens) for d in drafts)
        tok_s = produced / (ms / 1e3)
        if self.limit is None or self.iteration < self.limit:
            logger.info(f"Iteration {self.iteration}: {ms:.0f}ms @ {tok_s / n_users:.1f} tok/s/user "
                        f"({tok_s:.1f} tok/s throughput), accepted {accepted}/{drafted}{describe_sources(drafts)}")
        else:
            self.unlogged_accepted += accepted
            self.unlogged_drafted += drafted
        self.iteration += 1

    def close(self) -> None:
        unlogged = 0 if self.limit is None else self.iteration - self.limit
        if unlogged > 0:
            logger.info(f"... {unlogged} more iteration{'s' * (unlogged > 1)}, accepted "
                        f"{self.unlogged_accepted}/{self.unlogged_drafted} (--log_iterations -1 logs each)")


@dataclass
class Batch:
    """One generate() call's users: their results and contexts (prompt + tokens so far), the sampler keyed on their
    requests, and when each is done."""

    results: list[UserResult]
    contexts: list[list[int]]
    sampler: KeyedSampler
    max_generated_tokens: int
    stop_at_eos: bool
    eos_token_ids: set
    max_seq_len: int
    arrival: float = field(default_factory=time.perf_counter)  # when generate() was called: tokens are timed from it

    def keep(self, user: int, new: list[int]) -> list[int]:
        """Cut the accepted tokens at an EOS (kept, as Hugging Face does) and at the token budget."""
        new = new[: self.max_generated_tokens - len(self.results[user].output_tokens)]
        if self.stop_at_eos:
            for i, t in enumerate(new):
                if t in self.eos_token_ids:
                    return new[: i + 1]
        return new

    def finished(self, user: int) -> bool:
        """Whether the user is done; if so its result's finish_reason says why (an EOS first, as vLLM's "stop")."""
        result = self.results[user]
        if self.stop_at_eos and result.output_tokens[-1] in self.eos_token_ids:
            result.finish_reason = "stop"
        elif len(result.output_tokens) >= self.max_generated_tokens:
            result.finish_reason = "length"
        elif len(self.contexts[user]) >= self.max_seq_len:
            result.finish_reason = "cache_end"
        return result.finish_reason is not None


class SpeculativeGenerator:
    """Speculative decoding of `target` with `drafter`: up to n_draft_tokens drafts per user verified per target
    forward, as token trees where `trees` and the target allow (CausalLM.supports_trees); plain decoding on the same
    target with n_draft_tokens 0 (no drafter needed). Sampling follows `sampling_params` (default greedy), each draw
    keyed on (seed, request, position): lossless and batch-invariant either way. `log_iterations`: the `Iteration`
    lines logged per generate() call, the rest counted in one line (None: every one, as TT's text generation logs
    them); each iteration is in the results either way.

    Raises:
        UserError: an argument of the wrong type or out of range, naming it (check_prompts and generate: prompts the
            target cannot take).
    """

    def __init__(self, target: CausalLM, drafter: Optional[Drafter], n_draft_tokens: int,
                 eos_token_ids: Sequence[int] = (), sampling_params: Optional[SamplingParams] = None,
                 log_iterations: Optional[int] = None, trees: bool = True):
        check_implements("target", target, CausalLM, TARGET_USES, MAKE_TARGET)
        n_draft_tokens = check_n_draft_tokens(n_draft_tokens)
        if n_draft_tokens > 0 and drafter is None:
            raise UserError(f"n_draft_tokens={n_draft_tokens} needs a drafter: pass make_drafter(config, target), or "
                            "n_draft_tokens=0 for plain decoding", "drafter")
        if n_draft_tokens > 0:
            check_implements("drafter", drafter, Drafter, DRAFTER_USES, "build one with make_drafter(config, target)")
        eos = check_token_ids("eos_token_ids", eos_token_ids, target.vocab_size,
                              "pass the tokenizer's end-of-sequence ids, e.g. [tokenizer.eos_token_id]")
        if sampling_params is not None:
            check_instance("sampling_params", sampling_params, SamplingParams,
                           "pass SamplingParams(temperature=..., top_k=..., top_p=..., seed=...), or None for greedy")
        if log_iterations is not None:
            check_int("log_iterations", log_iterations, 0, fix="None logs every one")
        check_bool("trees", trees)
        self.target, self.n_draft_tokens = target, n_draft_tokens
        self.drafter = drafter if n_draft_tokens > 0 else None
        self.eos_token_ids = set(eos)
        self.sampling = sampling_params or SamplingParams()
        self.log_iterations = log_iterations
        self.trees = trees and target.supports_trees

    def check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Raises UserError for prompts the target cannot take (not lists of token ids, too many, empty, outside its
        vocabulary, too long); returns them as lists of ints (a 2-d tensor, numpy ids are taken)."""
        prompts = check_token_lists("prompts", prompts, self.target.vocab_size, "pass a list of prompts, each a list "
                                    "of token ids from the target's tokenizer")
        if not prompts:
            raise UserError("prompts is empty: pass at least one prompt (a list of token ids)", "prompts")
        if len(prompts) > self.target.max_batch_size:
            raise UserError(f"{len(prompts)} prompts but the target was built for max_batch_size "
                            f"{self.target.max_batch_size}; raise max_batch_size or pass fewer prompts",
                            "max_batch_size")
        for i, p in enumerate(prompts):
            if not p:
                raise UserError(f"prompts[{i}] is empty; a prompt needs at least one token (the BOS token for an empty "
                                "text)", "prompts")
            if len(p) >= self.target.max_seq_len:
                raise UserError(f"prompts[{i}] has {len(p)} tokens, which leaves no room to generate within "
                                f"max_seq_len={self.target.max_seq_len}; raise max_seq_len or shorten the prompt",
                                "max_seq_len")
        return prompts

    def warm_up(self) -> dict[str, float]:
        """Compile (on a TT device also trace) every program this generator's runs can use, the target's and the
        drafter's, before anything is timed; TT's compile_prefill / compile_decode keys, in seconds. May write user 0's
        cache; no drafter learns anything here (a memory of earlier responses would otherwise hold part of the first
        answer)."""
        times = {"compile_prefill": 0.0, "compile_decode": 0.0}
        top_k = self.drafter.top_k if self.drafter is not None else 0
        rows = min(self.n_draft_tokens + 1, self.target.max_step_rows)
        logits = not self.sampling.greedy  # sampled steps return logits (the target's to sample from, a draft's too)
        for key, seconds in self.target.warm_up(rows, top_k, self.taps, logits=logits).items():
            times[key] += seconds
        for key, seconds in (self.drafter.warm_up(logits) if self.drafter is not None else {}).items():
            times[key] += seconds
        times["compile_decode"] += self.target.prepare_traces()  # on a TT mesh: every model planned, captured once
        return times

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose input the drafter reads (a draft head drafts from them)."""
        return self.drafter.taps if self.drafter is not None else ()

    def generate(self, prompts: Sequence[Sequence[int]], max_generated_tokens: int, stop_at_eos: bool = True,
                 requests: Optional[Sequence[int]] = None) -> list[UserResult]:
        """requests: an id per prompt that keys its random draws (default: its index), so a prompt samples the same
        tokens whatever batch it runs in. Every argument is checked before anything runs: a refused call changes
        nothing. Each result's finish_reason says why it ended ("stop", "length" or "cache_end": UserResult)."""
        prompts = self.check_prompts(prompts)
        max_generated_tokens = check_int("max_generated_tokens", max_generated_tokens, 1)
        check_bool("stop_at_eos", stop_at_eos)
        if requests is not None:
            requests = [check_int(f"requests[{i}]", r, 0) for i, r in enumerate(
                check_sequence("requests", requests, "pass one request id per prompt, or None"))]
            if len(requests) != len(prompts):
                raise UserError(f"requests has {len(requests)} ids for {len(prompts)} prompts; pass one per prompt, "
                                "or None", "requests")
        batch = Batch([UserResult(list(p)) for p in prompts], [list(p) for p in prompts],
                      KeyedSampler(self.sampling, requests), max_generated_tokens, stop_at_eos, self.eos_token_ids,
                      self.target.max_seq_len)
        self._prefill(batch, prompts)
        active = [u for u in range(len(prompts)) if not batch.finished(u)]
        log = IterationLog(self.log_iterations)
        while active:
            start = time.perf_counter()
            drafts = self._draft(batch, active)
            verified = self._verify(batch, active, drafts)
            done = time.perf_counter()
            ms = (done - start) * 1e3
            produced, accepted = self._append(batch, active, drafts, verified, ms, done)
            log.iteration_done(ms, len(active), produced, accepted, drafts)
            active = [u for u in active if not batch.finished(u)]
        log.close()
        return batch.results

    def _prefill(self, batch: Batch, prompts: Sequence[Sequence[int]]) -> None:
        """The target's prefill, one user at a time as TT-Transformers does (the first token comes from it), then
        the drafter's start."""
        users, taps = list(range(len(prompts))), self.taps
        prompt_hidden = []
        for u in users:
            start = time.perf_counter()
            context = batch.contexts[u]
            out = self.target.prefill(u, context, logits=not self.sampling.greedy, taps=taps)
            prompt_hidden.append(out.hidden[0] if taps else None)
            first = self._target_tokens(batch.sampler, UserRows(u, context[-1:], len(context) - 1), out, 0)[0]
            done = time.perf_counter()
            batch.results[u].ttft_ms = (done - start) * 1e3
            batch.results[u].token_times_s.append(done - batch.arrival)
            context.append(first)
            batch.results[u].output_tokens.append(first)
        if self.drafter is not None:
            # The draft model's prefill (or the automaton's build) happens after the first token and before the
            # second, so it is decode time: every user waits for it, as for an iteration.
            start = time.perf_counter()
            self.drafter.start(users, prompts, batch.sampler, prompt_hidden if taps else None)
            draft_prefill_s = time.perf_counter() - start
            for r in batch.results:
                r.decode_s += draft_prefill_s

    def _draft(self, batch: Batch, active: list[int]) -> list[Draft]:
        """Each active user's draft, within its cap (_draft_caps), priced by what verifying it costs this step."""
        if self.drafter is None:
            return [Draft([], "none") for _ in active]
        contexts = [batch.contexts[u] for u in active]
        caps = self._draft_caps([batch.results[u] for u in active], contexts, batch.max_generated_tokens)
        context_len = sum(len(c) for c in contexts) / len(active)
        return self.drafter.propose(active, contexts, caps, extra_cost_curve(self.target, len(active), context_len),
                                    self.trees)

    def _verify(self, batch: Batch, active: list[int], drafts: list[Draft]) -> list[Verified]:
        """One target step over every user's last token and draft; each user's chain or tree verified against the
        target's own tokens, a tree's accepted path then moved to its true positions."""
        rows = [UserRows(u, [batch.contexts[u][-1]] + d.tokens, len(batch.contexts[u]) - 1,
                         None if d.parents is None else [-1] + [p + 1 for p in d.parents])
                for u, d in zip(active, drafts)]
        top_k = self.drafter.top_k if self.drafter is not None else 0
        out = self.target.step(rows, logits=not self.sampling.greedy, top_k=top_k, taps=self.taps)
        verified = []
        for i, (d, r) in enumerate(zip(drafts, rows)):
            target = self._target_tokens(batch.sampler, r, out, i)
            if d.parents is None:
                new = verify_chain(d.tokens, target)
                path = list(range(len(new) - 1))
            else:
                new, path = verify_tree(d.tokens, d.parents, target)
                self.target.commit_path(r.user, r.start_pos, [0] + [j + 1 for j in path])
            verified.append(Verified(new, path, r.tokens, out.top_ids[i] if out.top_ids else None,
                                     out.hidden[i] if out.hidden else None))
        return verified

    def _append(self, batch: Batch, active: list[int], drafts: list[Draft], verified: list[Verified], ms: float,
                done: float) -> tuple[int, int]:
        """The drafter learns from each verification; each user keeps its new tokens (up to an EOS and its budget) and
        the iteration's record. Returns the tokens kept and the drafts accepted (up to an EOS), over all users."""
        produced = accepted = 0
        for u, draft, v in zip(active, drafts, verified):
            if self.drafter is not None:
                self.drafter.accept(u, v)
            new = batch.keep(u, v.new_tokens)
            n_accepted = min(v.n_accepted, len(new))  # drafts verified past an EOS: neither kept nor counted
            batch.contexts[u].extend(new)
            result = batch.results[u]
            result.output_tokens.extend(new)
            result.decode_s += ms / 1e3
            result.token_times_s.append(done - batch.arrival)
            result.iterations.append(IterationStats(draft.source, len(draft.tokens), n_accepted, ms, draft.match_len))
            produced += len(new)
            accepted += n_accepted
        return produced, accepted

    def _target_tokens(self, sampler: KeyedSampler, rows: UserRows, out: StepOutput, i: int):
        """The target's own token after each of the user's rows (the i-th user of `out`): its argmax, or its keyed
        draw for the position the row predicts (a tree node sits at its depth)."""
        if self.sampling.greedy:
            return out.ids[i]
        depth = [0] * len(rows.tokens)
        for r, parent in enumerate(rows.parents or range(-1, len(rows.tokens) - 1)):
            depth[r] = depth[parent] + 1 if parent >= 0 else 0
        return TargetSamples(sampler, rows.user, out.logits[i], [rows.start_pos + d + 1 for d in depth])

    def _draft_caps(self, results: list[UserResult], contexts: list[list[int]], max_generated_tokens: int) -> list[int]:
        """Drafts each user may have verified this iteration: never more than could be kept, nor past the end of the
        KV cache, and all users' rows (one + drafts each) within the backend's row budget."""
        caps = [max(0, min(self.n_draft_tokens, max_generated_tokens - len(r.output_tokens) - 1,
                           self.target.max_seq_len - len(ctx) - 1)) for r, ctx in zip(results, contexts)]
        return share_rows(caps, self.target.max_step_rows - len(caps))


def share_rows(caps: Sequence[int], spare: int) -> list[int]:
    """Split `spare` draft rows across users, none above its own cap (water-filling: users who want fewer leave
    their share to the others), so a step never carries more rows than the backend's budget."""
    out = [0] * len(caps)
    for j, i in enumerate(sorted(range(len(caps)), key=lambda i: caps[i])):
        out[i] = min(caps[i], spare // (len(caps) - j))
        spare -= out[i]
    return out
