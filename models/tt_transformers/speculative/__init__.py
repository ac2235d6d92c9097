# SPDX-License-Identifier: Apache-2.0
"""Lossless speculative decoding over any `CausalLM` (the torch backend, TT-Transformers on a mesh): the public API.

    from models.tt_transformers.speculative import SpeculativeConfig, SpeculativeGenerator, make_drafter

    config = SpeculativeConfig(draft_mode="suffix", n_draft_tokens=8)
    generator = SpeculativeGenerator(target, make_drafter(config, target), config.n_draft_tokens, eos_token_ids)
    results = generator.generate([prompt_ids], max_generated_tokens=64)  # one UserResult per prompt

Anything not named here is internal and may change.
"""
from ..errors import UserError
from .backend import MAX_DRAFT_TOKENS, CausalLM, StepOutput, UserRows
from .config import SpeculativeConfig
from .drafters import Draft, Drafter, Verified
from .factory import make_drafter
from .generator import SpeculativeGenerator
from .results import UserResult, summarize
from .sampling import SamplingParams

__all__ = [
    "CausalLM",
    "Draft",
    "Drafter",
    "MAX_DRAFT_TOKENS",
    "SamplingParams",
    "SpeculativeConfig",
    "SpeculativeGenerator",
    "StepOutput",
    "UserError",
    "UserResult",
    "UserRows",
    "Verified",
    "make_drafter",
    "summarize",
]
