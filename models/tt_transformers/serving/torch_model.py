# SPDX-License-Identifier: Apache-2.0
"""The contract's model on the torch backend: what the plugin's runner would call, on a TorchCausalLM.

This is where the contract is proven without a device (tests/serving/test_serving_lossless.py drives it with the reference
runner). Unlike a TT model it owns its KV cache, one cache row per decode slot, so vLLM's kv_cache and page_table
arguments are not read and a slot_remap gathers cache rows; the verify mapping, the drafter and the counters are the
shared SpecDecodeCore that the ttnn model (docs/serving.md) uses too.
"""
from typing import Optional

import torch

from ..torch_backend.causal_lm import TorchCausalLM
from .contract import DraftOutput
from .core import SpecDecodeCore
from .plan import SPEC_CAPABILITIES, plan_speculation
from .proposer import CopiedDraftProposer


class TorchSpecDecodeModel:
    model_capabilities = dict(SPEC_CAPABILITIES)

    @classmethod
    def spec_plan(cls, vllm_config, max_num_seqs, requested_k):
        return plan_speculation(vllm_config, max_num_seqs, requested_k)

    def __init__(self, target: TorchCausalLM, num_drafts: int, proposer: Optional[CopiedDraftProposer] = None):
        """target: decode slots are its cache rows (its max_batch_size is the padded decode batch); num_drafts: the
        plan's effective K."""
        self.target = target
        self.core = SpecDecodeCore(target, num_drafts, proposer)

    def prefill_forward(self, tokens, prompt_lens, empty_slots, page_table=None, kv_cache=None) -> torch.Tensor:
        """Prefill row r's first prompt_lens[r] tokens into slot empty_slots[r]; the greedy next token per row, [n]
        int32 (as TT's prefill returns it when it samples on the device)."""
        tokens, lengths, slots = torch.as_tensor(tokens), list(map(int, prompt_lens)), list(map(int, empty_slots))
        if tokens.dim() != 2 or not len(lengths) == len(slots) == tokens.shape[0]:
            raise ValueError(f"prefill tokens [n, max_len] needs one prompt_lens and one empty_slots entry per row, "
                             f"got tokens {list(tokens.shape)}, {len(lengths)} prompt_lens, {len(slots)} empty_slots")
        bad = [s for s in slots if not 0 <= s < self.target.max_batch_size]
        if bad or len(set(slots)) != len(slots) or not all(1 <= n <= tokens.shape[1] for n in lengths):
            raise ValueError(f"prefill empty_slots {slots} must be distinct slots in [0, {self.target.max_batch_size}) "
                             f"and prompt_lens {lengths} within 1..{tokens.shape[1]}")
        prompts = [tokens[r, :n].tolist() for r, n in enumerate(lengths)]
        self.core.prefilled(slots, prompts)
        return torch.tensor([self.target.prefill(s, p).ids[0][-1] for s, p in zip(slots, prompts)], dtype=torch.int32)

    def decode_forward(self, tokens, start_pos, *, num_valid_drafts=None, accepted_counts=None, spec_mode=None,
                       slot_remap=None, page_table=None, kv_cache=None):
        """A verify when the three speculative arguments come (VerifyOutput), else the ordinary [B, 1] decode
        (ids [B, 1]). slot_remap, applied once the values are checked: row i reads the state slot slot_remap[i]
        held."""
        given = [name for name, v in (("num_valid_drafts", num_valid_drafts), ("accepted_counts", accepted_counts),
                                      ("spec_mode", spec_mode)) if v is not None]
        if given and len(given) != 3:
            raise ValueError(f"decode_forward got {given} alone: num_valid_drafts, accepted_counts and spec_mode come "
                             "together (a verify) or not at all (an ordinary decode)")
        rows = tokens.shape[0] if isinstance(tokens, torch.Tensor) else len(tokens)
        if rows > self.target.max_batch_size:
            raise ValueError(f"decode tokens has {rows} rows, more than the {self.target.max_batch_size} decode slots")
        step = lambda user_rows, top_k: self.target.step(user_rows, top_k=top_k)  # noqa: E731
        if given:
            return self.core.verify(tokens, start_pos, num_valid_drafts, accepted_counts, spec_mode, step, slot_remap,
                                    self.gather_cache_rows)
        return self.core.plain_decode(tokens, start_pos, step, slot_remap, self.gather_cache_rows)

    def gather_cache_rows(self, remap: list[int]) -> None:
        """Cache row i takes row remap[i]'s keys and values: the torch cache is indexed by slot (on TT the page
        table, which the scheduler sends every step, says where a request's blocks are)."""
        index = torch.tensor(remap, device=self.target.device)
        for cache in self.target.cache.k + self.target.cache.v:
            cache[: len(remap)] = cache[index]

    def propose_draft_tokens(self, num_drafts, committed_tokens, committed_positions, accepted_counts,
                             hidden=None) -> DraftOutput:
        """The copied drafts for the next step (hidden: not read; this drafter reads the committed block only)."""
        return self.core.propose(num_drafts, committed_tokens, committed_positions, accepted_counts)

    def release_request(self, slot) -> None:
        """The slot's request finished or was preempted."""
        self.core.release(slot)

    def note_state_slots_moved(self, old_to_new) -> None:
        self.core.slots_moved(old_to_new)

    def spec_decode_metrics(self) -> dict:
        """Drafts, draft tokens, accepted tokens and accepted tokens per position, under vLLM's counter names."""
        return self.core.counters.as_dict()

