# SPDX-License-Identifier: Apache-2.0
"""Long end-to-end runs (marked slow: `make test-slow`, or pytest --run_slow): generation up to the end of the KV
cache with the longest drafts (the demo at its defaults in every draft mode: tests/demo/test_draft_modes.py)."""
import pytest

pytestmark = pytest.mark.slow


def test_generation_to_the_end_of_the_cache(embedded_bf16, embedded_tokenizer):
    """n_draft_tokens 64 on a copy task until max_seq_len (512) stops generation: identical to plain."""
    from models.tt_transformers.prompts import encode

    from .test_lossless_greedy import run, run_results

    words = " ".join(f"item{i}" for i in range(60))
    prompt = encode(embedded_tokenizer, f"Repeat this list three times: {words}", True)
    plain = run(embedded_bf16, [prompt], 0, 0, 1000)[0]
    assert len(prompt) + len(plain) == embedded_bf16.max_seq_len  # stopped by the cache, not by the budget
    results = run_results(embedded_bf16, [prompt], 64, 0, 1000, mode="suffix", sa_threshold=2)
    assert results[0].output_tokens == plain
