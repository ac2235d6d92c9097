# SPDX-License-Identifier: Apache-2.0
"""The contract's model on the torch backend: what the plugin's runner would call, on a TorchCausalLM.

This is where the contract is proven without a device (tests/serving/test_serving_lossless.py drives it with the
reference runner and its block pool). As a TT model does, it serves from vLLM's paged KV cache: `allocate_kv_cache`
gives the runner per layer [k, v] blocks [num_blocks, n_kv_heads, block_size, head_dim], and every prefill and decode
reads a row's keys and values from the blocks its page-table row names and writes the positions it computes back into
them. The backend attends over one contiguous cache row per user (torch_backend/model.py KVCache; cpu_kernels.c reads
it so), so the paging is done here: before a step, each live row's blocks up to its first position are copied into its
working cache row (decode row r is cache row r; a prefill uses its empty slot's), and after it the positions the step
wrote are copied to their blocks. That costs a copy of each live row's whole context per step (2 x layers x context x
kv heads x head_dim values) beside the step itself. The working rows keep nothing between calls: the tokens depend on
the blocks the page table names and on nothing else, and a slot_remap moves only the drafter (as on TT, the page
table moves with its request). The verify mapping, the drafter and the counters are the shared SpecDecodeCore that the
ttnn model (docs/serving.md) uses too.
"""
from typing import Optional, Sequence

import torch

from ..speculative.backend import StepOutput, UserRows
from ..torch_backend.causal_lm import TorchCausalLM
from .contract import DraftOutput, check_page_table
from .core import SpecDecodeCore
from .plan import SPEC_CAPABILITIES, plan_speculation
from .proposer import CopiedDraftProposer

class TorchSpecDecodeModel:
    model_capabilities = dict(SPEC_CAPABILITIES)

    @classmethod
    def spec_plan(cls, vllm_config, max_num_seqs, requested_k):
        return plan_speculation(vllm_config, max_num_seqs, requested_k)

    def __init__(self, target: TorchCausalLM, num_drafts: int, proposer: Optional[CopiedDraftProposer] = None):
        """target: its cache rows are the working rows, one per decode slot (its max_batch_size is the padded decode
        batch); num_drafts: the plan's effective K."""
        self.target = target
        self.core = SpecDecodeCore(target, num_drafts, proposer)
        self.kv_cache: Optional[list[list[torch.Tensor]]] = None

    def allocate_kv_cache(self, kv_cache_shape, dtype, num_layers) -> list[list[torch.Tensor]]:
        """vLLM's paged KV cache as TT-Transformers' allocate_vllm_kv_cache lays it out (the runner's
        initialize_kv_cache calls it with vLLM's block shape): per layer [k, v], each [num_blocks, n_kv_heads,
        block_size, head_dim], in the model's dtype (the copies into the working rows are then exact)."""
        args, cache = self.target.model.args, self.target.cache
        num_blocks, heads, block_size, head_dim = kv_cache_shape
        want = (heads, head_dim, num_layers, dtype)
        if want != (args.n_kv_heads, args.head_dim, self.target.n_layers, cache.k[0].dtype) or num_blocks < 2 \
                or block_size < 1:
            raise ValueError(f"allocate_kv_cache({tuple(kv_cache_shape)}, {dtype}, {num_layers}): this model needs "
                             f"[num_blocks >= 2, {args.n_kv_heads}, block_size >= 1, {args.head_dim}] blocks of "
                             f"{cache.k[0].dtype} for {self.target.n_layers} layers")
        self.kv_cache = [[torch.zeros(tuple(kv_cache_shape), dtype=dtype, device=self.target.device) for _ in "kv"]
                         for _ in range(num_layers)]
        return self.kv_cache

    def prefill_forward(self, tokens, page_table=None, kv_cache=None, prompt_lens=None, empty_slots=None,
                        start_pos=None, enable_trace=False, sampling_params=None) -> torch.Tensor:
        """Prefill row r's tokens[r, start_pos[r]:prompt_lens[r]] (the positions before start_pos are in its blocks
        already: a prefix computed earlier) into slot empty_slots[r] (default r), with page-table row r; the greedy
        next token per row, [n] int32, as TT's prefill returns it when it samples on the device. The runner's keywords
        (model_runner.py@02f45e5f submit_prefill); enable_trace: nothing is traced on torch."""
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2 or prompt_lens is None:
            raise ValueError(f"prefill tokens must be [n, max_len] with prompt_lens, got tokens "
                             f"{list(tokens.shape)} and prompt_lens {prompt_lens}")
        rows = tokens.shape[0]
        lengths = [int(n) for n in prompt_lens]
        slots = list(range(rows)) if empty_slots is None else [int(s) for s in empty_slots]
        starts = [0] * rows if start_pos is None else [int(p) for p in torch.as_tensor(start_pos).reshape(-1)]
        if not len(lengths) == len(slots) == len(starts) == rows:
            raise ValueError(f"prefill tokens [n, max_len] needs one prompt_lens, empty_slots and start_pos entry per "
                             f"row, got tokens {list(tokens.shape)}, {len(lengths)} prompt_lens, {len(slots)} "
                             f"empty_slots, {len(starts)} start_pos")
        bad = [s for s in slots if not 0 <= s < self.target.max_batch_size]
        longest = min(tokens.shape[1], self.target.max_seq_len)
        if bad or len(set(slots)) != len(slots) or not all(1 <= n <= longest for n in lengths):
            raise ValueError(f"prefill empty_slots {slots} must be distinct slots in [0, {self.target.max_batch_size}) "
                             f"and prompt_lens {lengths} within 1..{longest}")
        if not all(0 <= p < n for p, n in zip(starts, lengths)):
            raise ValueError(f"prefill start_pos {starts} must each be in [0, prompt_lens) for prompt_lens {lengths}")
        check_greedy(sampling_params, range(rows), "prefill")
        table = self.checked_table(page_table, kv_cache, [(r, p, n) for r, (p, n) in enumerate(zip(starts, lengths))],
                                   "prefill")
        self.core.prefilled(slots, [tokens[r, :n].tolist() for r, n in enumerate(lengths)])
        first = []
        for r, (slot, p, n) in enumerate(zip(slots, starts, lengths)):
            self.load(table, r, slot, p)
            first.append(self.target.prefill(slot, tokens[r, p:n].tolist(), start_pos=p).ids[0][-1])
            self.store(table, r, slot, p, n)
        return torch.tensor(first, dtype=torch.int32)

    def decode_forward(self, tokens, start_pos, *, page_table=None, kv_cache=None, num_valid_drafts=None,
                       accepted_counts=None, spec_mode=None, slot_remap=None, enable_trace=False,
                       read_from_device=True, sampling_params=None, reset_batch=False):
        """A verify when the three speculative arguments come (VerifyOutput), else the ordinary [B, 1] decode
        (greedy ids [B, 1] int32). slot_remap, applied once everything is checked: row i reads the state slot
        slot_remap[i] held. The runner's other keywords (async_decode.py submit_decode): enable_trace (nothing is
        traced on torch), read_from_device (the output is on the host either way), reset_batch (no inputs stay
        resident between steps)."""
        given = [name for name, v in (("num_valid_drafts", num_valid_drafts), ("accepted_counts", accepted_counts),
                                      ("spec_mode", spec_mode)) if v is not None]
        if given and len(given) != 3:
            raise ValueError(f"decode_forward got {given} alone: num_valid_drafts, accepted_counts and spec_mode come "
                             "together (a verify) or not at all (an ordinary decode)")
        rows = tokens.shape[0] if isinstance(tokens, torch.Tensor) else len(tokens)
        if rows > self.target.max_batch_size:
            raise ValueError(f"decode tokens has {rows} rows, more than the {self.target.max_batch_size} decode slots")
        first = torch.as_tensor(start_pos).reshape(rows, -1)[:, 0]
        check_greedy(sampling_params, [r for r in range(rows) if first[r] >= 0], "decode")

        def check(user_rows: Sequence[UserRows], top_k: int) -> None:
            self.checked_table(page_table, kv_cache, [(r.user, r.start_pos, r.start_pos + len(r.tokens))
                                                      for r in user_rows], "decode")

        def step(user_rows: Sequence[UserRows], top_k: int) -> StepOutput:
            return self.paged_step(user_rows, top_k, self.checked_table(page_table, kv_cache, [], "decode"))
        if given:
            return self.core.verify(tokens, start_pos, num_valid_drafts, accepted_counts, spec_mode, step, slot_remap,
                                    check)
        return self.core.plain_decode(tokens, start_pos, step, slot_remap, check)

    def paged_step(self, rows: Sequence[UserRows], top_k: int, table: torch.Tensor) -> StepOutput:
        """One step of the target over `rows` (decode row = working cache row = page-table row), read from and
        written to the blocks the table names."""
        for r in rows:
            self.load(table, r.user, r.user, r.start_pos)
        out = self.target.step(rows, top_k=top_k)
        for r in rows:
            self.store(table, r.user, r.user, r.start_pos, r.start_pos + len(r.tokens))
        return out

    def checked_table(self, page_table, kv_cache, spans: Sequence[tuple[int, int, int]], call: str) -> torch.Tensor:
        """The page table as block ids, after every check that can be made of it: the kv_cache is the one allocated,
        and the blocks of each span (page-table row, first position written, end) pass contract.check_page_table."""
        if self.kv_cache is None or kv_cache is not self.kv_cache:
            raise ValueError(f"{call} kv_cache must be the one allocate_kv_cache returned (the runner allocates it "
                             "once, then passes it to every prefill and decode)")
        num_blocks, _, block_size, _ = self.kv_cache[0][0].shape
        return check_page_table(page_table, spans, num_blocks, block_size, call)

    def load(self, table: torch.Tensor, row: int, cache_row: int, end: int) -> None:
        """Working cache row `cache_row`, positions [0, end): from the blocks page-table row `row` names."""
        if end == 0:
            return
        cache, block_size = self.target.cache, self.kv_cache[0][0].shape[2]
        blocks = table[row, : -(-end // block_size)].to(self.target.device)
        for layer, pools in enumerate(self.kv_cache):
            for pool, rows in zip(pools, (cache.k[layer], cache.v[layer])):
                gathered = pool[blocks].transpose(0, 1)  # [heads, blocks, block_size, head_dim]
                rows[cache_row, :, :end] = gathered.reshape(gathered.shape[0], -1, gathered.shape[-1])[:, :end]

    def store(self, table: torch.Tensor, row: int, cache_row: int, start: int, end: int) -> None:
        """Working cache row `cache_row`, positions [start, end): into the blocks page-table row `row` names."""
        cache, block_size = self.target.cache, self.kv_cache[0][0].shape[2]
        positions = torch.arange(start, end)
        blocks, offsets = table[row, positions // block_size], positions % block_size
        for layer, pools in enumerate(self.kv_cache):
            for pool, rows in zip(pools, (cache.k[layer], cache.v[layer])):
                pool[blocks, :, offsets] = rows[cache_row, :, start:end].transpose(0, 1)

    def propose_draft_tokens(self, num_drafts, committed_tokens, committed_positions, accepted_counts,
                             hidden=None) -> DraftOutput:
        """The copied drafts for the next step (hidden: not read; this drafter reads the committed block only)."""
        return self.core.propose(num_drafts, committed_tokens, committed_positions, accepted_counts)

    def release_request(self, slot) -> None:
        """The slot's request finished or was preempted (SpecDecodeCore.release)."""
        self.core.release(slot)

    def note_state_slots_moved(self, old_to_new) -> None:
        self.core.slots_moved(old_to_new)

    def spec_decode_metrics(self) -> dict:
        """Drafts, draft tokens, accepted tokens and accepted tokens per position, under vLLM's counter names."""
        return self.core.counters.as_dict()


def check_greedy(sampling_params, rows: Sequence[int], call: str) -> None:
    """This model decodes greedily (the plan's argmax_ids accept mode): a live row whose sampling_params (TT's
    SamplingParams, a value or one per row) carry a temperature is refused."""
    temperature = getattr(sampling_params, "temperature", None)
    if temperature is None:
        return
    values = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1).tolist()
    hot = [r for r in rows if values[r if len(values) > 1 else 0] != 0]
    if hot:
        raise ValueError(f"{call} sampling_params.temperature is not 0 on rows {hot}: this model serves greedy "
                         "requests only (its plan's accept mode is argmax_ids)")
