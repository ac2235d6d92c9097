# SPDX-License-Identifier: Apache-2.0
"""The benchmarks measure what they say: their generators stop at EOS (they once never did, and every figure
included text generated past the end of the answer), each run starts from a fresh drafter, and interleaving the
methods prompt by prompt keeps each one's outputs."""
import argparse
import sys

from .conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import bench_suffix  # noqa: E402
from common import run_interleaved_by_prompt  # noqa: E402

from models.tt_transformers.demo.speculative_decoding.build import eos_token_ids
from models.tt_transformers.demo.speculative_decoding.inputs import encode


def test_bench_suffix_runs_stop_at_eos(embedded_checkpoint, embedded_tokenizer, embedded_bf16):
    eos = eos_token_ids(embedded_checkpoint, embedded_tokenizer)
    args = argparse.Namespace(n_draft_tokens=16, sa_threshold=1)
    factories = bench_suffix.generator_factories(embedded_bf16, embedded_checkpoint.name, eos, args)
    prompt = encode(embedded_tokenizer, "What is the capital of France? Answer in one sentence.", True)
    methods = ("plain", "suffix", "suffix (request only)", "head", "hybrid")
    runs = run_interleaved_by_prompt({m: factories[m] for m in methods}, [prompt, prompt], 64, 1, stop_at_eos=True)
    for method in methods:
        (run,) = runs[method]
        for output in run["outputs"]:
            assert output[-1] in eos and len(output) < 64, method
        assert run["outputs"] == runs["plain"][0]["outputs"], method  # every method is lossless
    alone = run_interleaved_by_prompt({"suffix": factories["suffix"]}, [prompt, prompt], 64, 1, stop_at_eos=True)
    suffix_steps = [[(it.draft_source, it.drafted, it.accepted) for r in run["results"] for it in r.iterations]
                    for run in (runs["suffix"][0], alone["suffix"][0])]
    assert suffix_steps[0] == suffix_steps[1]  # interleaved with others or alone, the same drafts and steps
    first, second = factories["suffix"]().drafter, factories["suffix"]().drafter
    assert first.memory is not second.memory  # nothing carried between runs: not even the memory of responses
