# SPDX-License-Identifier: Apache-2.0
"""Seeded sampling on the embedded model: a speculative run samples the very tokens plain sampling samples with the
same seed and flags (each token is the target's keyed draw at its position, sampling.py), in every draft mode and
batch size, against the written-out reference loop (test_lossless_greedy.reference_decode)."""
from collections import Counter

import pytest

from models.tt_transformers.prompts import encode
from models.tt_transformers.checkpoints.eagle3_format import DRAFT_HEADS
from models.tt_transformers.speculative import SpeculativeConfig, make_drafter
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams
from models.tt_transformers.torch_backend.eagle3_head import load_draft_head
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from .test_lossless_greedy import head_drafter, head_runner, reference_decode

SETTINGS = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7)  # issue 32's flags
N_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer, sample_prompt_tokens):
    """Three chat questions and a code edit (copied drafts accept there)."""
    code = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    return sample_prompt_tokens[:3] + [encode(embedded_tokenizer, f"Rename w to width and h to height:\n{code}", True)]


@pytest.fixture(scope="module")
def eos(embedded_tokenizer):
    return [embedded_tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def plain(embedded_bf16, prompts, eos):
    """Each prompt alone (request id: its index), through the reference loop."""
    return [reference_decode(TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1), [p], N_TOKENS, eos,
                             KeyedSampler(SETTINGS, [i]))[0] for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def shipped(embedded_bf16):
    return load_draft_head(DRAFT_HEADS / "SmolLM2-135M-Instruct", embedded_bf16)


def drafter(mode, target, head):
    """As the demo builds them: copied drafts (memory, recycling, trees where the target verifies them); the shipped
    head alone, trusted so it drafts at every step (chains: drawn from q with the target's keys; trees: its top
    tokens); hybrid with the head priced by measured time (choices that vary from run to run); a draft model (the
    first 20 layers), alone or in the hybrid."""
    if mode in ("head-chains", "head-trees"):
        return head_drafter(target, head)
    config = SpeculativeConfig(draft_mode={"hybrid-chains": "hybrid", "hybrid-model": "hybrid"}.get(mode, mode),
                               sa_threshold=1, draft_memory=4096, recycle_top_k=4, draft_layers=20,
                               draft_head="none" if mode == "hybrid-model" else None)
    if mode in ("hybrid", "hybrid-chains"):
        return make_drafter(config, target, head=head_runner(target, head))
    return make_drafter(config, target)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", ["suffix", "head-chains", "head-trees", "hybrid", "hybrid-chains", "model",
                                  "hybrid-model"])
def test_seeded_speculative_sampling_equals_plain(embedded_bf16, prompts, eos, plain, shipped, mode, batch):
    """--temperature 0.8 --top_k 50 --top_p 0.9 --seed 7: every user's tokens are the reference's for its prompt, at
    batch 1 and with all four prompts in one batch (request ids key the draws, not cache rows), and drafts were
    accepted (the mode's own, where it has one source)."""
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, batch)
    gen = SpeculativeGenerator(target, drafter(mode, target, shipped), 4, eos, SETTINGS,
                               trees=not mode.endswith("chains"))
    results = [r for start in range(0, len(prompts), batch)
               for r in gen.generate(prompts[start : start + batch], N_TOKENS, requests=range(start, start + batch))]
    assert [r.output_tokens for r in results] == plain
    accepted = Counter()
    for it in (it for r in results for it in r.iterations):
        accepted[it.draft_source] += it.accepted
    source = {"head-chains": "head", "head-trees": "head", "model": "model"}.get(mode)  # the hybrids' pick varies
    assert (accepted[source] if source else sum(accepted.values())) > 0, accepted


def test_seed_and_request_key_the_draws(embedded_bf16, prompts, eos, plain):
    """Another seed, or the same prompt as another request, samples other tokens; plain decoding through the
    generator is the reference's."""
    lm = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
    other_seed = SamplingParams(SETTINGS.temperature, SETTINGS.top_k, SETTINGS.top_p, seed=8)
    assert reference_decode(lm, prompts[:1], N_TOKENS, eos, KeyedSampler(other_seed, [0]))[0] != plain[0]
    assert reference_decode(lm, prompts[:1], N_TOKENS, eos, KeyedSampler(SETTINGS, [1]))[0] != plain[0]
    assert SpeculativeGenerator(lm, None, 0, eos, SETTINGS).generate(prompts[:1], N_TOKENS)[0].output_tokens == plain[0]
