# SPDX-License-Identifier: Apache-2.0
"""Torch implementation of the `CausalLM` backend interface over a `Transformer` and a KV cache."""
import time
from itertools import accumulate
from typing import NamedTuple, Optional, Sequence

import torch

from ..checkpoints.eagle3_format import HeadConfig, find_draft_head
from ..errors import check_instance, check_int
from ..speculative.backend import MAX_DRAFT_TOKENS, StepOutput, UserRows
from .attention import ExactToken
from .cpu_threads import fit_threads
from .eagle3_head import HeadRunner, build_draft_head
from .model import KVCache, Transformer


class StepCost(NamedTuple):
    """What a step costs beyond streaming the weights once, in units of that (TorchCausalLM.step_cost): `token` per
    row computed, `key` per row per cached position it attends to (the scores and the weighing of the values), and
    `read` per user per cached position (reading its K and V: the CPU kernels read a user's cache once for all of
    its rows, attend_rows in cpu_kernels.c)."""

    token: float
    key: float
    read: float


# Step costs by CPU path (cpu_isa.PATHS; torch ops and CUDA take avx512bf16's). `make bench-verify-cost`
# (TT_CPU_ISA=<path>) fits all three from steps of 1 user x 1-17 rows and 4 users x 1-4 rows over 128-8,000 cached
# positions; one quiet run per path on the 2-core AMD Zen 4 (2026-11-29, after the split-K verify attention;
# docs/results.md) gave weights 6.5 / 6.9 / 4.8 / 5.7 ms (avx512bf16 / avx512 / avx2 / portable), a row 0.51 / 0.79 /
# 1.21 / 4.49 ms plus 0.27 / 0.31 / 0.75 / 3.21 ms per 1,000 cached positions, and a user's cache read 0.46 / 0.38 /
# 0.17 / 0.14 ms per 1,000. neon takes avx2's (no aarch64 machine measured).
STEP_COSTS = {"avx512bf16": StepCost(0.079, 4.1e-5, 7.1e-5), "avx512": StepCost(0.115, 4.5e-5, 5.5e-5),
              "avx2": StepCost(0.255, 1.6e-4, 3.7e-5), "neon": StepCost(0.255, 1.6e-4, 3.7e-5),
              "portable": StepCost(0.795, 5.7e-4, 2.4e-5)}

# Steps of up to this many tokens per user (decode, verification of the longest draft, draft catch-up) are packed
# and attend token by token, so a token's result is bit-identical whatever else shares the step; longer ones
# (prefill) are padded.
EXACT_ATTENTION_MAX_TOKENS = MAX_DRAFT_TOKENS + 1


class TorchCausalLM:
    """The first `n_layers` layers of `model` (all of them for a target) with a KV cache.

    Two instances over one Transformer share every weight tensor: that is how a layer-truncated draft costs no
    extra weight memory. `draft_view` goes further and shares the target's cache for those layers too.
    """

    def __init__(self, model: Transformer, n_layers: int, max_batch_size: int, cache: Optional[KVCache] = None):
        check_instance("model", model, Transformer, "load one with load_model(resolve_checkpoint(folder), "
                       "torch.bfloat16, max_seq_len)")
        check_int("n_layers", n_layers, 1, len(model.layers), fix="the model's layers to run; all for a target")
        check_int("max_batch_size", max_batch_size, 1, fix="users decoded together")
        self.model = model
        self.cache = cache if cache is not None else model.new_cache(n_layers, max_batch_size)
        self.shares_target_cache = cache is not None
        self.n_layers, self.max_batch_size = n_layers, max_batch_size
        self.max_seq_len, self.vocab_size = model.max_seq_len, model.args.vocab_size
        self.max_step_rows = max_batch_size * (MAX_DRAFT_TOKENS + 1)  # no tile to fill: any step the loop makes
        self.supports_trees = True
        self.costs = STEP_COSTS[model.kernels.path.name if model.kernels else "avx512bf16"]
        self.device = model.device
        self.device_name = str(model.device)

    def warm_up(self, max_rows_per_user: int, top_k: int, taps: Sequence[int], logits: bool = False) -> dict:
        """A prefill and a step of the longest shape on user 0 (its cache is rewritten by the next prefill): the
        kernels and torch's first-call set-up, outside any timed run."""
        start = time.perf_counter()
        self.prefill(0, [0], taps=taps)
        prefill_s = time.perf_counter() - start
        rows = min(max_rows_per_user, EXACT_ATTENTION_MAX_TOKENS, self.max_seq_len - 1)
        self.step([UserRows(0, [0] * rows, 0)], logits=logits, top_k=top_k, taps=taps)
        return {"compile_prefill": prefill_s, "compile_decode": time.perf_counter() - start - prefill_s}

    def prepare_traces(self) -> float:
        """Nothing is traced here (warm_up compiled everything)."""
        return 0.0

    def release(self) -> None:
        """Nothing to give back: the cache is host (or CUDA) memory, freed with the object."""

    def draft_view(self, n_layers: int) -> "TorchCausalLM":
        """The first n_layers layers reading and writing this backend's cache for those layers."""
        if not 1 <= n_layers < self.n_layers:
            raise ValueError(f"a draft view needs 1 to {self.n_layers - 1} layers, got {n_layers}")
        return TorchCausalLM(self.model, n_layers, self.max_batch_size, self.cache.first_layers(n_layers))

    def draft_head(self, draft_head, chain_len: int, required: bool) -> dict:
        """The EAGLE-3 head make_drafter drafts with beside this model (CausalLM.draft_head)."""
        checkpoint = self.model.checkpoint
        head = find_draft_head(draft_head, checkpoint.name if checkpoint else None, self.model.args, self.n_layers,
                               True, required)
        return {} if head is None else {"head": self.build_head(*head, chain_len)}

    def build_head(self, config: HeadConfig, weights: dict, chain_len: int) -> HeadRunner:
        """A read head (eagle3_format.read_draft_head) beside this model, on its embedding unless the head ships one,
        for its users and positions (chain_len: any): make_drafter's `head`."""
        return HeadRunner(build_draft_head(config, weights, self.model), self.max_batch_size, self.max_seq_len,
                          self.model.args)

    def step_cost(self, n_users: int, n_rows: int, context_len: float) -> float:
        costs = self.costs
        return 1 + n_users * costs.read * context_len + n_rows * (costs.token + costs.key * context_len)

    def prefill(self, user: int, tokens: Sequence[int], logits: bool = False, taps: Sequence[int] = (),
                start_pos: int = 0) -> StepOutput:
        """start_pos: the tokens follow start_pos positions already in the user's cache (a prefix computed before)."""
        out, states = self._run([tokens], [start_pos], [user], True, None, taps)
        return self._output(out, logits, 0, states)

    def step(self, rows: Sequence[UserRows], logits: bool = False, top_k: int = 0, taps: Sequence[int] = ()
             ) -> StepOutput:
        out, states = self._run([r.tokens for r in rows], [r.start_pos for r in rows], [r.user for r in rows], False,
                                [r.parents for r in rows], taps)
        return self._output(out, logits, top_k, states)

    def commit_path(self, user: int, start_pos: int, path: Sequence[int]) -> None:
        moved = [(depth, row) for depth, row in enumerate(path) if row != depth]
        if moved:  # a path's rows only ever move to earlier slots, in depth order: no copy overwrites a later source
            dst = torch.tensor([start_pos + d for d, _ in moved], device=self.device)
            src = torch.tensor([start_pos + r for _, r in moved], device=self.device)
            for k, v in zip(self.cache.k, self.cache.v):
                k[user][:, dst] = k[user][:, src]
                v[user][:, dst] = v[user][:, src]

    def _output(self, per_user: list[torch.Tensor], logits: bool, top_k: int, hidden) -> StepOutput:
        """Each user's greedy ids (and top-k ids) after each of its rows: on the CPU kernels in one pass over its
        logits, else torch's argmax and topk."""
        kernels = self.model.kernels
        if kernels is not None:
            ids, top = map(list, zip(*(kernels.argmax_topk(row, top_k) for row in per_user)))
            top = top if top_k else None
        else:
            ids = [row.argmax(dim=-1).tolist() for row in per_user]
            top = [row.topk(top_k, dim=-1).indices.tolist() for row in per_user] if top_k else None
        return StepOutput(ids, [row.float() for row in per_user] if logits else None, top, hidden)

    def forward_logits(self, tokens: Sequence[Sequence[int]], start_pos: Sequence[int], users: Sequence[int],
                       last_only: bool = False, parents: Optional[Sequence[Optional[Sequence[int]]]] = None
                       ) -> list[torch.Tensor]:
        """Logits [len(tokens[u]) or 1, V] per user: the ragged call behind prefill and step (parents: see
        UserRows)."""
        return self._run(tokens, start_pos, users, last_only, parents, ())[0]

    def _run(self, tokens, start_pos, users, last_only, parents, taps):
        """(logits per user, tapped states per user [len(tokens[u]), len(taps) * dim] when `taps`, else None)."""
        if self.model.device.type == "cpu":
            fit_threads()  # the threads other processes leave free (cpu_threads.py)
        lengths = [len(t) for t in tokens]
        if not len(tokens) == len(start_pos) == len(users) or min(lengths) < 1:
            raise ValueError("a step needs one start position, one cache row and at least one token per user")
        bad = [u for u in users if not 0 <= u < self.max_batch_size]
        if bad or len(set(users)) != len(users) or min(start_pos) < 0:
            raise IndexError(f"cache rows {list(users)} / start positions {list(start_pos)}: rows must be distinct "
                             f"and in [0, {self.max_batch_size}), positions >= 0")
        kv_len = max(p + n for p, n in zip(start_pos, lengths))
        if kv_len > self.max_seq_len:
            raise ValueError(f"forward would write position {kv_len - 1} past max_seq_len {self.max_seq_len}")
        parents = parents or [None] * len(tokens)
        taps = tuple(taps)
        if any(not 0 <= i <= self.n_layers for i in taps):
            raise ValueError(f"taps {list(taps)}: layer ids must be in [0, {self.n_layers}] ({self.n_layers}: the last "
                             "layer's output)")
        if max(lengths) <= EXACT_ATTENTION_MAX_TOKENS:
            logits, states = self._packed_step(tokens, start_pos, users, lengths, last_only, parents, taps)
        elif any(p is not None for p in parents):
            raise ValueError(f"a token tree has at most {EXACT_ATTENTION_MAX_TOKENS} nodes")
        else:
            logits, states = self._padded_step(tokens, start_pos, users, lengths, kv_len, last_only, taps)
        ends = list(accumulate(lengths))
        hidden_states = [states[end - n : end] for n, end in zip(lengths, ends)] if taps else None
        if last_only:
            return list(logits), hidden_states  # [1, V] each
        return [logits[end - n : end] for n, end in zip(lengths, ends)], hidden_states

    def _exact_tokens(self, start: int, row: int, n: int, parents: Optional[Sequence[int]], first_index: int):
        """ExactToken for each of a user's n tokens: a chain at start, start + 1, ..., or a tree rooted at start."""
        window = self.model.args.sliding_window or self.max_seq_len
        if parents is None:
            return [ExactToken(first_index + i, row, start + i, start + i, max(0, start + i + 1 - window), start + i + 1)
                    for i in range(n)]
        if len(parents) != n or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError(f"tree parents {list(parents)}: parents[0] must be -1 and each parent an earlier row")
        paths, out = [], []
        for i in range(n):
            path = [i] if i == 0 else paths[parents[i]] + [i]  # rows from the root
            paths.append(path)
            pos = start + len(path) - 1
            first = max(0, pos + 1 - window)
            ancestors = tuple(start + r for depth, r in enumerate(path) if start + depth >= first)
            out.append(ExactToken(first_index + i, row, start + i, pos, first, max(first, start), ancestors))
        return out

    def _packed_step(self, tokens, start_pos, users, lengths, last_only, parents, taps):
        """Decode, verification and draft catch-up: every user's tokens packed into one row, each with its own
        cache row and slot, and each attending through its own call over exactly its visible keys. A token's
        result is then bit-identical whatever else shares the step, with no padding between ragged users."""
        flat = [t for seq in tokens for t in seq]
        exact = []
        for start, row, n, par in zip(start_pos, users, lengths, parents):
            exact += self._exact_tokens(start, row, n, par, len(exact))
        rows, slots, positions = [t.row for t in exact], [t.slot for t in exact], [t.pos for t in exact]
        if len(flat) == 1 and self.model.kernels is None:
            # oneDNN's bf16 matmul is row-invariant for M >= 2 but takes another kernel for M == 1, so a lone token
            # gets a padding partner that writes the scratch slot and attends to nothing
            # (tests/torch_backend/test_row_invariance.py checks this on the installed torch; the CPU kernels need no partner).
            flat, rows = flat + [0], rows + rows
            slots, positions = slots + [self.cache.scratch_slot], positions + [self.cache.scratch_slot]
        dev = self.device
        step = self.model.step_inputs(positions=torch.tensor([slots], device=dev), query_pos=None,
                                      rows=torch.tensor([rows], device=dev), kv_len=0, all_rows=False,
                                      exact_tokens=exact, rope_positions=torch.tensor([positions], device=dev))
        last = torch.tensor([end - 1 for end in accumulate(lengths)], device=dev) if last_only else None
        out = self.model(torch.tensor([flat], device=dev), step, self.cache, output_index=last, taps=taps)
        out, states = out if taps else (out, None)
        return (out if last_only else out[0, : len(exact)]), (states[0, : len(exact)] if taps else None)

    def _padded_step(self, tokens, start_pos, users, lengths, kv_len, last_only, taps):
        """Prefill: users right-padded to one width and one masked attention call per layer. Padding writes the
        scratch slot and attends like the last real token."""
        width = max(lengths)
        scratch = self.cache.scratch_slot
        padded = [list(t) + [0] * (width - len(t)) for t in tokens]
        slots = [[p + i if i < n else scratch for i in range(width)] for p, n in zip(start_pos, lengths)]
        query = [[p + i if i < n else kv_len - 1 for i in range(width)] for p, n in zip(start_pos, lengths)]
        dev = self.device
        step = self.model.step_inputs(
            positions=torch.tensor(slots, device=dev),
            query_pos=torch.tensor(query, device=dev),
            rows=torch.tensor(users, device=dev).view(-1, 1),
            kv_len=kv_len,
            all_rows=list(users) == list(range(self.max_batch_size)),
            exact_tokens=None,
        )
        last = torch.tensor([b * width + n - 1 for b, n in enumerate(lengths)], device=dev) if last_only else None
        out = self.model(torch.tensor(padded, device=dev), step, self.cache, output_index=last, taps=taps)
        out, states = out if taps else (out, None)
        states = torch.cat([states[b, :n] for b, n in enumerate(lengths)]) if taps else None
        if last_only:
            return out, states
        return torch.cat([out[b, :n] for b, n in enumerate(lengths)]), states
