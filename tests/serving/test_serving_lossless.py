# SPDX-License-Identifier: Apache-2.0
"""The contract's loop as vllm-tt-plugin's runner drives it (serving/reference_runner.py), over the torch backend
through the serving adapter, on vLLM's paged KV cache with the runner's block pool: requests arrive and finish
mid-batch, padding rows, a preempted request replayed, an EOS inside a multi-token commit, rows compacted by
slot_remap, blocks freed and taken by later requests. Every request's output equals plain greedy decoding of the same
target with the same recomputes (tests/serving/plain.py; uninterrupted plain decoding for a request never
preempted), token for token, at 1, 3 and 8 concurrent requests; the adapter's vLLM counters equal the ones the runner
counts the way vLLM's scheduler does."""
import dataclasses
import random

import pytest
import torch

from models.tt_transformers.prompts import encode
from models.tt_transformers.speculative.generator import SpeculativeGenerator
from models.tt_transformers.serving.contract import SpecPlan
from models.tt_transformers.serving.plan import plan_speculation
from models.tt_transformers.serving.reference_runner import ReferenceRunner
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import random_model
from .helpers import generator, paged_torch_model, served_references

HELD_PROMPTS = ["List the days of the week, one per line.",
                "Repeat this sentence exactly twice: The quick brown fox jumps over the lazy dog.",
                "Write the numbers from 1 to 12 separated by commas."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer, sample_prompt_tokens):
    """The sample prompts' five chat questions (r0 is the one-word capital of France) and three held ones."""
    return sample_prompt_tokens + [encode(embedded_tokenizer, p, True) for p in HELD_PROMPTS]


@pytest.fixture(scope="module")
def plain(embedded_bf16, embedded_tokenizer, prompts):
    """Plain greedy decoding, one prompt at a time."""
    lm = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
    eos = [embedded_tokenizer.eos_token_id]
    return [SpeculativeGenerator(lm, None, 0, eos).generate([p], MAX_TOKENS)[0].output_tokens for p in prompts]


def serve(target: TorchCausalLM, plan: SpecPlan, concurrency: int, arrivals, preemptions, eos, narrow_verify=True,
          block_size=16):
    """The runner's loop over the torch model on a paged KV cache (helpers.paged_torch_model)."""
    model, kv_cache, blocks = paged_torch_model(target, plan.effective_k, concurrency, block_size)
    runner = ReferenceRunner(model, plan, target.max_batch_size, concurrency, eos, target.max_seq_len,
                             target.vocab_size, narrow_verify=narrow_verify, blocks=blocks, kv_cache=kv_cache)
    return runner.run(arrivals, preemptions), runner, model


@pytest.mark.parametrize("concurrency,rows,k,narrow", [(1, 1, 8, "verify"), (3, 4, 9, "ordinary"), (3, 4, 9, "verify"),
                                                       (3, 4, 7, None), (8, 8, 3, "ordinary")])
def test_served_output_is_plain_greedy(embedded_bf16, embedded_tokenizer, prompts, plain, concurrency, rows, k,
                                       narrow):
    """Five requests at step 0, three more at step 4, r0's question again at step 12 (its first answer is then in
    the draft memory, EOS included), r1 preempted at step 6 (or once it runs) and replayed: the others equal plain
    greedy decoding, r1 plain decoding with the same recompute; `rows` decode rows (4 for 3 requests: a padding row
    always); finished requests' blocks are taken by later ones. narrow: draftless steps are one-column verifies as
    model_runner.py@02f45e5f sends them ("verify"), ordinary [B, 1] decodes as SPEC_DECODE_CONTRACT.md@00d62588
    states them ("ordinary"), or full-width verifies (None: no supports_narrow_decode). At 8 the last requests to
    finish leave holes below running ones: rows are compacted (at 3, waiting requests mostly fill them)."""
    plan = plan_speculation(None, concurrency, k)
    plan = dataclasses.replace(plan, supports_narrow_decode=narrow is not None)
    arrivals = {0: [(f"r{i}", prompts[i], MAX_TOKENS) for i in range(5)],
                4: [(f"r{i}", prompts[i], MAX_TOKENS) for i in range(5, 8)],
                12: [("again", prompts[0], MAX_TOKENS)]}
    target = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, rows)
    eos = [embedded_tokenizer.eos_token_id]
    outputs, runner, model = serve(target, plan, concurrency, arrivals, {6: ["r1"]}, eos,
                                   narrow_verify=narrow == "verify")
    assert {req: out for req, out in outputs.items() if req != "r1"} == \
        {**{f"r{i}": plain[i] for i in range(8) if i != 1}, "again": plain[0]}
    lm = TorchCausalLM(embedded_bf16, embedded_bf16.args.n_layers, 1)
    assert outputs["r1"] == served_references(generator(lm, eos), runner)["r1"] and runner.done["r1"].preempted_at
    assert runner.blocks.reused > 0
    s = runner.stats
    assert s.preemptions == 1 and s.resumed == 1 and s.max_running == concurrency
    assert s.eos_in_multi_token_commits >= 1 and s.dropped_after_stop >= 1 and s.multi_token_commits >= 1
    assert s.verify_steps > s.narrow_verifies and (s.plain_steps > 0) == (narrow == "ordinary")
    assert (s.narrow_verifies > 0) == (narrow == "verify")
    # at 8 rows are compacted; at 3 a hole stays unless no request waits when one finishes, which depends on the
    # draft lengths the policy picks (its step costs), so only the 8's moves are asserted
    assert (s.padding_rows > 0) == (concurrency > 1) and (s.slot_moves > 0 or concurrency != 8)
    counters = model.spec_decode_metrics()
    assert counters == runner.counters.as_dict() and counters["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert counters["vllm:spec_decode_num_drafts_total"] == s.drafted_rows


@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_on_a_small_model(seed):
    """Random arrivals, preemptions, EOS token, K, concurrency and narrow steps (none, the pinned runner's one-column
    verifies, the document's ordinary decodes) on a small random model with a 40-token cache (so requests also stop
    at its end): outputs equal plain greedy decoding with the same recomputes. Repetitive prompts make copied drafts
    that are accepted (counted)."""
    rng = random.Random(seed)
    model = random_model(torch.float32, max_seq_len=40, seed=seed)
    concurrency = rng.choice([1, 2, 3, 5])
    rows = concurrency + rng.choice([0, 1])
    plan = plan_speculation(None, concurrency, rng.randint(1, min(6, 32 // concurrency - 1)))
    narrow = rng.choice([None, "verify", "ordinary"])
    plan = dataclasses.replace(plan, supports_narrow_decode=narrow is not None)
    eos = [rng.randrange(64)]
    prompts = []
    for _ in range(7):
        unit = [rng.randrange(64) for _ in range(rng.randint(1, 4))]
        prompts.append((unit * 8)[: rng.randint(2, 20)])
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    arrivals = {}
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        arrivals.setdefault(rng.randint(0, 12), []).append((f"r{i}", p, n))
    preemptions = {rng.randint(1, 15): [f"r{rng.randrange(7)}"] for _ in range(3)}
    target = TorchCausalLM(model, model.args.n_layers, rows)
    outputs, runner, served = serve(target, plan, concurrency, arrivals, preemptions, eos, narrow == "verify")
    assert outputs == served_references(generator(TorchCausalLM(model, model.args.n_layers, 1), eos), runner)
    assert served.spec_decode_metrics() == runner.counters.as_dict()
    assert runner.counters.accepted_tokens > 0


def test_rows_compacted_after_a_departure_keep_their_requests():
    """Three requests; the one in slot 0 stops after 3 tokens while the others run on: they move down a row each
    (slot_remap, then note_state_slots_moved) with their drafter state, their page-table rows with them, and still
    decode exactly what plain decoding does."""
    model = random_model(torch.float32, max_seq_len=40, seed=3)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 1, 9, 1, 9], [3, 3, 4, 3, 3, 4]]
    max_tokens = [3, 20, 25]
    plan = plan_speculation(None, 3, 4)
    target = TorchCausalLM(model, model.args.n_layers, 4)
    arrivals = {0: [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]}
    outputs, runner, served = serve(target, plan, 3, arrivals, {}, [])
    lm = TorchCausalLM(model, model.args.n_layers, 1)
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        assert outputs[f"r{i}"] == SpeculativeGenerator(lm, None, 0).generate([p], n)[0].output_tokens
    assert runner.stats.slot_moves >= 2 and runner.stats.padding_rows > 0


@pytest.mark.parametrize("narrow", [True, False], ids=["narrow-verify", "ordinary-decode"])
def test_a_recompute_equals_plain_decoding_with_that_recompute(narrow):
    """A request preempted after 10 tokens and replayed: its 70-token prompt and 10 tokens are prefilled in one pass,
    whose numerics are not the decode steps' (a prefill past EXACT_ATTENTION_MAX_TOKENS is one masked attention
    call), and on a near tie this small bf16 model then leaves its uninterrupted run (on the 2-core Zen 4 at its 11th
    token; where is the CPU's business). The served tokens equal plain decoding with the same recompute on every
    CPU."""
    model = random_model(torch.bfloat16, max_seq_len=160, seed=36, std=0.08)
    rng = random.Random(36)
    prompt = [rng.randrange(64) for _ in range(70)]
    target = TorchCausalLM(model, model.args.n_layers, 1)
    outputs, runner, _ = serve(target, plan_speculation(None, 1, 3), 1, {0: [("r", prompt, 40)]}, {10: ["r"]}, [],
                               narrow_verify=narrow)
    assert runner.done["r"].preempted_at == [10]
    assert outputs == served_references(generator(TorchCausalLM(model, model.args.n_layers, 1)), runner)
