# SPDX-License-Identifier: Apache-2.0
"""Shared by the serving tests: the torch model on a paged KV cache with the reference runner's block pool, and what
a served request's tokens equal (docs/serving.md, "What a served request equals"): plain greedy decoding of the same
target through the same backend, with the same recomputes. A preempted request is replayed by one prefill of
its prompt and the tokens it had (vLLM's recompute preemption); that prefill's numerics are not the decode steps' that
first computed those positions, so from a near tie on, its continuation may differ from the uninterrupted run's (and
on another CPU, another way). Plain decoding that recomputes at the same output lengths, the same way, is what it
equals on every machine; a request never preempted equals uninterrupted plain decoding."""
from typing import Callable, Sequence

from models.tt_transformers.serving.reference_runner import BlockPool
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.serving.torch_model import TorchSpecDecodeModel
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

Generate = Callable[[list[int], int], list[int]]  # (history, max_tokens) -> plain greedy decoding's new tokens


def generator(lm, eos: Sequence[int] = ()) -> Generate:
    """Plain greedy decoding on `lm` (a CausalLM), one request at a time."""
    return lambda history, n: SpeculativeGenerator(lm, None, 0, list(eos)).generate([history], n)[0].output_tokens


def plain_with_recomputes(generate: Generate, prompt: Sequence[int], max_tokens: int,
                          preempted_at: Sequence[int] = ()) -> list[int]:
    """Plain decoding of `prompt` that stops at each of preempted_at's output lengths and goes on from a prefill of
    the prompt and everything it had produced (the reference runner's Request.preempted_at)."""
    out: list[int] = []
    for length in preempted_at:
        out += generate(list(prompt) + out, length - len(out))
    return out + generate(list(prompt) + out, max_tokens - len(out))


def served_references(generate: Generate, runner) -> dict[str, list[int]]:
    """Every request the reference runner finished, as plain decoding with its recomputes gives it."""
    return {req_id: plain_with_recomputes(generate, r.prompt, r.max_tokens, r.preempted_at)
            for req_id, r in runner.done.items()}


def paged_torch_model(target: TorchCausalLM, num_drafts: int, requests: int, block_size: int = 16
                      ) -> tuple[TorchSpecDecodeModel, list, BlockPool]:
    """The torch model, its paged KV cache (allocate_kv_cache) and a pool of just enough blocks for `requests`
    requests at the cache's length, so finished requests' blocks are taken by later ones."""
    model = TorchSpecDecodeModel(target, num_drafts)
    args, width = target.model.args, -(-target.max_seq_len // block_size)
    kv_cache = model.allocate_kv_cache((1 + requests * width, args.n_kv_heads, block_size, args.head_dim),
                                       target.cache.k[0].dtype, target.n_layers)
    return model, kv_cache, BlockPool(1 + requests * width, block_size, width)
