# SPDX-License-Identifier: Apache-2.0
"""llama.cpp on the embedded model's own GGUF, for bench_cpu.py: run by the interpreter of the venv llama-cpp-python
was built in (`make bench-cpu` builds it from source; that venv has no torch, so nothing of this package is imported).

Reads a request (the GGUF, prompt token ids, tokens per answer, end-of-sequence ids, threads) and writes, for plain
greedy decoding and for llama-cpp-python's prompt-lookup drafting (LlamaPromptLookupDecoding, its defaults: n-grams
up to 2, 10 tokens): decode-only ms per token (each answer's time after its first token, over the tokens after the
first, as benchmarks/common.py times transformers) and every answer's token ids.

    python benchmarks/llama_cpp_peer.py request.json answer.json
"""
import json
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def answer(llm: Llama, prompt: list[int], n_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy tokens after `prompt` (the end-of-sequence token included) and the seconds after the first one."""
    tokens, first = [], None
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        first = first or time.perf_counter()
        if token in eos or len(tokens) == n_tokens:
            break
    return tokens, time.perf_counter() - first


def run(request: dict, **drafting) -> dict:
    llm = Llama(model_path=request["gguf"], n_ctx=2048, n_threads=request["threads"],
                n_threads_batch=request["threads"], verbose=False, **drafting)
    eos = set(request["eos"])
    answer(llm, request["prompts"][0], 8, eos)  # warm-up
    outputs, seconds = [], 0.0
    for prompt in request["prompts"]:
        tokens, s = answer(llm, prompt, request["n_tokens"], eos)
        outputs.append(tokens)
        seconds += s
    return {"ms_per_token": 1e3 * seconds / sum(len(t) - 1 for t in outputs), "outputs": outputs}


def main():
    request = json.loads(open(sys.argv[1]).read())
    result = {"llama.cpp": run(request),
              "llama.cpp prompt lookup": run(request, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
