# SPDX-License-Identifier: Apache-2.0
"""Acceptance counters under vLLM's names, so a run here and a vLLM server report the same figures.

vLLM counts in its scheduler, per request and step that carried drafts (`SpecDecodingStats.observe_draft`): one
draft, its draft tokens, the accepted ones (the committed tokens less the correction or bonus), and for each accepted
token its draft position (0 = the first draft token). TT's benchmark harness reads the Prometheus counters those
feed: `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position="j"}` for j < num_speculative_tokens. A step without
drafts is not a draft. Mean acceptance length, as vLLM logs it, is 1 + accepted / drafts.
"""

NUM_DRAFTS = "vllm:spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # labelled by "position"


class SpecDecodeCounters:
    """The four counters for drafts of up to `num_spec_tokens` tokens."""

    def __init__(self, num_spec_tokens: int):
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        self.num_spec_tokens = num_spec_tokens
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos = [0] * num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified draft in one step; nothing for a step without one."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"a draft of {num_draft_tokens} tokens with {num_accepted_tokens} accepted: need 0 <= "
                             f"accepted <= drafted <= num_spec_tokens ({self.num_spec_tokens})")
        if num_draft_tokens == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.accepted_per_pos[pos] += 1

    def as_dict(self) -> dict:
        """The counters under vLLM's Prometheus names; the per-position one as {"0": n, "1": n, ...}."""
        return {NUM_DRAFTS: self.drafts, NUM_DRAFT_TOKENS: self.draft_tokens, NUM_ACCEPTED_TOKENS: self.accepted_tokens,
                NUM_ACCEPTED_TOKENS_PER_POS: {str(pos): n for pos, n in enumerate(self.accepted_per_pos)}}


def summary_lines(counters: dict, shown_positions: int = 12) -> list[str]:
    """The counters (as_dict) as vLLM logs them, in two short lines: drafts, tokens and mean acceptance length; the
    acceptance rate of the first `shown_positions` draft positions (accepted there / drafts)."""
    drafts, per_pos = counters[NUM_DRAFTS], list(counters[NUM_ACCEPTED_TOKENS_PER_POS].values())
    if not drafts:
        return ["Drafts: none verified"]
    rates = " ".join(f"{n / drafts:.2f}" for n in per_pos[:shown_positions])
    more = " ..." if len(per_pos) > shown_positions else ""
    return [f"Drafts: {drafts}, {counters[NUM_DRAFT_TOKENS]} tokens, {counters[NUM_ACCEPTED_TOKENS]} accepted (mean "
            f"acceptance length {1 + counters[NUM_ACCEPTED_TOKENS] / drafts:.2f})",
            f"Accepted by draft position: {rates}{more}"]
