# SPDX-License-Identifier: Apache-2.0
"""vllm-tt-plugin's greedy verify-then-propose loop, written from the contract, to drive a model where the plugin
cannot run (it needs vLLM and a TT device): the proof that a model meets the contract without one.

Per decode step, as the runner does it: build the [B, 1+K] block (padding rows token 0 / position -1, padded draft
columns PLACEHOLDER_TOKEN_ID / -1), or, when the plan allows narrow steps, a one-column step: as the pinned runner
(model_runner.py@02f45e5f, _prepare_model_inputs) sends it, a [B, 1] verify with spec_mode and both side tensors
whenever no row has a draft; or as the contract document (SPEC_DECODE_CONTRACT.md@00d62588, section 4d) states it,
the ordinary [B, 1] decode when no row has a draft or a multi-token commit to resolve; call decode_forward; walk
greedy acceptance over the argmax ids; commit; call propose_draft_tokens with the committed block and keep each
request's offered drafts (trimmed to the context) for its next step. Around it a scheduler as small as a server's
can be: requests arrive at any step and are prefilled into free slots (empty_slots), finish at an EOS or max_tokens
(committed tokens past the stop are dropped, as vLLM's stop check drops them) or at max_model_len, can be preempted
(release_request; later they re-prefill their whole history, and drafting starts over), and the survivors of a
departure are compacted to the lowest rows (slot_remap on the next decode, then note_state_slots_moved). Given a
BlockPool it also plays vLLM's KV cache manager: each request's block table grows to cover every position a step
writes, its blocks go back to the pool when it finishes or is preempted (the next request takes them), and every
prefill and decode carries the page table of its rows and the kv_cache (model_runner.py@02f45e5f, submit_prefill and
async_decode.py's submit_decode pass them by keyword).

It also counts what vLLM's scheduler counts (speculative.metrics), independently of the model's own counters.
"""
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..speculative.metrics import SpecDecodeCounters
from .contract import ACCEPT_MODE_ARGMAX_IDS, PLACEHOLDER_TOKEN_ID, SpecPlan, accept_greedy_drafts, check_draft_output


@dataclass
class Request:
    req_id: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    slot: Optional[int] = None
    drafts: list[int] = field(default_factory=list)  # offered by the last proposal, to verify next
    accepted_count: int = 1  # tokens its last step committed (1 after a prefill or a plain step)
    finish_reason: Optional[str] = None  # "stop" (EOS), "length" (max_tokens or max_model_len)
    preempted_at: list[int] = field(default_factory=list)  # its output's length at each preemption (recompute)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class RunStats:
    """What the loop went through, so a test can tell that a run exercised what it claims."""

    prefill_steps: int = 0
    verify_steps: int = 0
    narrow_verifies: int = 0  # of the verify steps, one column wide (model_runner.py@02f45e5f)
    plain_steps: int = 0  # ordinary decodes (SPEC_DECODE_CONTRACT.md@00d62588)
    padding_rows: int = 0  # padding rows sent, over all decode steps
    drafted_rows: int = 0  # rows that carried drafts
    multi_token_commits: int = 0
    eos_in_multi_token_commits: int = 0  # an EOS committed with other tokens in one step
    dropped_after_stop: int = 0  # committed tokens past an EOS or max_tokens, dropped
    preemptions: int = 0
    resumed: int = 0
    slot_moves: int = 0
    max_running: int = 0


class BlockPool:
    """vLLM's KV blocks as a runner hands them out (vllm/v1/core/block_pool.py BlockPool, KVCacheManager): block 0 is
    the null block, never a request's and the padding of every table; the free blocks start shuffled (seed: no table
    is the identity) and the last freed go first, so a finished or preempted request's blocks are the next one's."""

    def __init__(self, num_blocks: int, block_size: int, blocks_per_request: int, seed: int = 0):
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size, self.width = block_size, blocks_per_request
        self.tables: dict = {}  # owner -> its blocks, in position order
        self.handed: set[int] = set()
        self.reused = 0  # blocks handed out again after another owner gave them back

    def cover(self, owner, positions: int) -> None:
        """The owner's blocks grown to hold positions [0, positions)."""
        blocks = self.tables.setdefault(owner, [])
        need = -(-positions // self.block_size)
        if need > self.width or need - len(blocks) > len(self.free):
            raise RuntimeError(f"{owner!r} needs {need} blocks of {self.block_size} (at most {self.width} a request); "
                               f"{len(self.free)} are free: give the pool more blocks")
        while len(blocks) < need:
            blocks.append(self.free.pop())
            self.reused += blocks[-1] in self.handed
            self.handed.add(blocks[-1])

    def release(self, owner) -> None:
        self.free.extend(reversed(self.tables.pop(owner, [])))

    def table(self, owners: Sequence) -> torch.Tensor:
        """[len(owners), blocks_per_request] int32 block ids (an owner None, or a row past its blocks: the null
        block 0)."""
        table = torch.zeros(len(owners), self.width, dtype=torch.int32)
        for row, owner in enumerate(owners):
            blocks = self.tables.get(owner, [])
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table


class ReferenceRunner:
    def __init__(self, model, plan: SpecPlan, batch_rows: int, max_num_seqs: int, eos_ids: Sequence[int],
                 max_model_len: int, vocab_size: int, compact: bool = True, narrow_verify: bool = True,
                 blocks: Optional[BlockPool] = None, kv_cache=None):
        """model: the contract's model side (prefill_forward, decode_forward, propose_draft_tokens, release_request,
        note_state_slots_moved); batch_rows: the padded decode batch B; max_num_seqs: most requests running;
        narrow_verify: a plan's narrow steps are the pinned runner's one-column verifies (else ordinary decodes);
        blocks, kv_cache: the paged KV cache (the model's allocate_kv_cache) and its pool, passed with every call."""
        if not 1 <= max_num_seqs <= batch_rows:
            raise ValueError(f"max_num_seqs {max_num_seqs} must be in [1, batch_rows {batch_rows}]")
        self.model, self.plan, self.rows, self.max_num_seqs = model, plan, batch_rows, max_num_seqs
        self.k = plan.effective_k
        self.eos_ids, self.max_model_len, self.vocab_size = set(eos_ids), max_model_len, vocab_size
        self.compact, self.narrow_verify = compact, narrow_verify
        self.blocks, self.kv_cache = blocks, kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.done: dict[str, Request] = {}
        self.to_release: list[int] = []  # slots of requests that left after the last step, released at the next
        self.preempt_next: list[str] = []
        self.counters = SpecDecodeCounters(self.k)
        self.stats = RunStats()

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        if not prompt or len(prompt) >= self.max_model_len or max_tokens < 1:
            raise ValueError(f"request {req_id}: a prompt of 1 to {self.max_model_len - 1} tokens and max_tokens >= 1")
        self.waiting.append(Request(req_id, list(prompt), max_tokens))

    def preempt(self, req_id: str) -> None:
        """Preempt a request at the next step it runs at (vLLM's recompute preemption: it re-prefills later)."""
        self.preempt_next.append(req_id)

    def run(self, arrivals: dict[int, list[tuple[str, list[int], int]]] = None,
            preemptions: dict[int, list[str]] = None, max_steps: int = 100000) -> dict[str, list[int]]:
        """Steps until every request is done; arrivals / preemptions: step -> requests arriving / preempted there.
        Returns each request's output tokens."""
        arrivals, preemptions = dict(arrivals or {}), dict(preemptions or {})
        for step in range(max_steps):
            for req_id, prompt, max_tokens in arrivals.pop(step, []):
                self.add_request(req_id, prompt, max_tokens)
            for req_id in preemptions.pop(step, []):
                self.preempt(req_id)
            if not (self.waiting or self.running or arrivals):
                break
            self.step()
        else:
            raise RuntimeError(f"requests still running after {max_steps} steps")
        self.release_departed()
        return {req_id: r.output for req_id, r in self.done.items()}

    def step(self) -> None:
        self.release_departed()
        pending = []
        for req_id in self.preempt_next:
            req = next((r for r in self.running if r.req_id == req_id), None)
            if req is not None:  # preempted: its slot is freed now, it re-prefills its history when readmitted
                self.model.release_request(req.slot)
                self.running.remove(req)
                self.release_blocks(req)
                req.preempted_at.append(len(req.output))
                req.slot, req.drafts, req.accepted_count = None, [], 1
                self.waiting.appendleft(req)
                self.stats.preemptions += 1
            elif req_id not in self.done:
                pending.append(req_id)  # not running yet: preempted once it runs
        self.preempt_next = pending
        if self.waiting and len(self.running) < self.max_num_seqs:
            self.prefill_step()
        elif self.running:
            self.decode_step()

    def release_departed(self) -> None:
        """Finished requests' slots are released at the step after they finished (vLLM's finished_req_ids)."""
        for slot in self.to_release:
            self.model.release_request(slot)
        self.to_release = []

    def prefill_step(self) -> None:
        used = {r.slot for r in self.running}
        free = [s for s in range(self.rows) if s not in used]
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            req = self.waiting.popleft()
            req.slot = free.pop(0)
            self.stats.resumed += bool(req.output)
            admitted.append(req)
        histories = [r.history for r in admitted]
        width = max(len(h) for h in histories)
        tokens = torch.tensor([h + [0] * (width - len(h)) for h in histories], dtype=torch.int32)
        paging = {}
        if self.blocks is not None:
            for req in admitted:
                self.blocks.cover(req.req_id, len(req.history))
            paging = dict(page_table=self.blocks.table([r.req_id for r in admitted]), kv_cache=self.kv_cache,
                          start_pos=torch.zeros(len(admitted), dtype=torch.int32))
        first = self.model.prefill_forward(tokens=tokens, prompt_lens=[len(h) for h in histories],
                                           empty_slots=[r.slot for r in admitted], **paging)
        self.stats.prefill_steps += 1
        for req, token in zip(admitted, torch.as_tensor(first).reshape(-1).tolist()):
            self.running.append(req)
            self.commit(req, [token])
        self.stats.max_running = max(self.stats.max_running, len(self.running))

    def compaction(self) -> Optional[list[int]]:
        """Move requests above a freed row into the lowest free rows: the permutation slot_remap[i] = j (row i takes
        slot j's state), or None when nothing moves."""
        if not self.compact:
            return None
        slots = sorted(r.slot for r in self.running)
        if slots == list(range(len(slots))):
            return None
        remap = slots + [s for s in range(self.rows) if s not in slots]  # row i takes slot remap[i]'s state
        for req in self.running:
            req.slot = remap.index(req.slot)
        return remap

    def decode_step(self) -> None:
        remap = self.compaction()
        running = sorted(self.running, key=lambda r: r.slot)
        self.stats.padding_rows += self.rows - len(running)
        if not self.plan.supports_narrow_decode:
            narrow = False
        elif self.narrow_verify:  # model_runner.py@02f45e5f widens only for drafts
            narrow = not any(r.drafts for r in running)
        else:  # SPEC_DECODE_CONTRACT.md@00d62588 section 4d: a multi-token commit is resolved by a verify
            narrow = not any(r.drafts or r.accepted_count > 1 for r in running)
        width = 1 if narrow else 1 + self.k
        tokens = torch.full((self.rows, width), 0, dtype=torch.int32)
        start_pos = torch.full((self.rows, width), -1, dtype=torch.int32)
        num_valid = torch.zeros(self.rows, dtype=torch.int32)
        counts = torch.ones(self.rows, dtype=torch.int32)
        for r in running:
            p = len(r.history) - 1
            n = len(r.drafts)
            tokens[r.slot, : n + 1] = torch.tensor([r.history[-1]] + r.drafts, dtype=torch.int32)
            tokens[r.slot, n + 1:] = PLACEHOLDER_TOKEN_ID
            start_pos[r.slot, : n + 1] = torch.arange(p, p + n + 1, dtype=torch.int32)
            num_valid[r.slot], counts[r.slot] = n, r.accepted_count
        paging = {}
        if self.blocks is not None:
            for r in running:  # every position the step writes
                self.blocks.cover(r.req_id, len(r.history) + len(r.drafts))
            by_slot = {r.slot: r.req_id for r in running}
            paging = dict(page_table=self.blocks.table([by_slot.get(i) for i in range(self.rows)]),
                          kv_cache=self.kv_cache)
        if narrow:
            start_pos = start_pos[:, 0].contiguous()  # one-column steps carry [B] positions
        if narrow and not self.narrow_verify:
            ids = self.model.decode_forward(tokens, start_pos, slot_remap=remap, **paging)
            if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (self.rows, 1):
                raise ValueError(f"an ordinary decode must return [B, 1] ids, got {type(ids).__name__}")
            committed, step_counts = ids.to(torch.int32), torch.ones(self.rows, dtype=torch.int32)
            self.stats.plain_steps += 1
        else:
            out = self.model.decode_forward(tokens, start_pos, num_valid_drafts=num_valid, accepted_counts=counts,
                                            spec_mode=ACCEPT_MODE_ARGMAX_IDS, slot_remap=remap, **paging)
            argmax = getattr(out, "argmax_ids", None)
            if getattr(out, "spec_mode", None) != ACCEPT_MODE_ARGMAX_IDS or not isinstance(argmax, torch.Tensor) \
                    or argmax.dtype != torch.int32 or tuple(argmax.shape) != (self.rows, width):
                raise ValueError(f"a verify must return VerifyOutput(spec_mode='argmax_ids', argmax_ids [B, {width}] "
                                 f"int32), got {out!r:.200}")
            committed, step_counts = accept_greedy_drafts(argmax, tokens[:, 1:], num_valid)
            self.stats.verify_steps += 1
            self.stats.narrow_verifies += narrow
            for r in running:
                if r.drafts:
                    self.stats.drafted_rows += 1
                    self.counters.observe_draft(len(r.drafts), int(step_counts[r.slot]) - 1)
        if remap is not None:
            moves = {old: new for new, old in enumerate(remap) if old != new and any(r.slot == new for r in running)}
            self.model.note_state_slots_moved(moves)
            self.stats.slot_moves += len(moves)
        block = torch.full((self.rows, 1 + self.k), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        positions = torch.full((self.rows, 1 + self.k), -1, dtype=torch.int32)
        for r in running:
            count = int(step_counts[r.slot])
            p = len(r.history)
            block[r.slot, :count] = committed[r.slot, :count]
            positions[r.slot, :count] = torch.arange(p, p + count, dtype=torch.int32)
            r.accepted_count = count
            self.stats.multi_token_commits += count > 1
            self.commit(r, committed[r.slot, :count].tolist())
        drafted = self.model.propose_draft_tokens(self.k, block, positions, step_counts.clone(), hidden=None)
        offered = check_draft_output(drafted, self.rows, self.k, self.vocab_size)
        for r in self.running:
            room = max(0, self.max_model_len - len(r.history))  # the drafts' positions must be in the context
            n = min(int(offered[r.slot]), room)
            r.drafts = drafted.draft_token_ids[r.slot, :n].tolist()

    def commit(self, req: Request, tokens: list[int]) -> None:
        """Append committed tokens up to a stop; a finished request leaves the batch (its slot is released next
        step)."""
        for i, t in enumerate(tokens):
            req.output.append(t)
            if t in self.eos_ids:
                req.finish_reason = "stop"
            elif len(req.output) >= req.max_tokens or len(req.history) >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason:
                self.stats.eos_in_multi_token_commits += req.finish_reason == "stop" and len(tokens) > 1
                self.stats.dropped_after_stop += len(tokens) - 1 - i
                self.running.remove(req)
                self.release_blocks(req)
                self.done[req.req_id] = req
                self.to_release.append(req.slot)
                req.drafts = []
                return

    def release_blocks(self, req: Request) -> None:
        """A request that finished or was preempted gives its blocks back at once (vLLM's scheduler frees them when
        it finishes or preempts it; the model hears of it at the next step)."""
        if self.blocks is not None:
            self.blocks.release(req.req_id)
