# SPDX-License-Identifier: Apache-2.0
"""How much a draft head's bfloat8_b weights (as a Tenstorrent device stores them: ttnn_backend/bfp8.py, checked
against ttnn's own conversion by `make tt-mock`) change what it drafts, against the same head in bfloat16 on the host:
over whole chains drafted from the same states, the share of chains identical to the bf16 head's and the mean agreed
prefix. The first measurement of issue 31's finding 1 (the device head's matmul weights are all bfloat8_b today);
compute-kernel fidelity is not modelled here (the host computes in bf16).

    .venv/bin/python tools/head_precision.py [--chain 8] [--stride 4] [--json docs/head_precision.json]

Heads: the shipped SmolLM2-135M-Instruct head on the embedded target's real tapped states (the sample prompts and
their greedy responses), and a random EAGLE-3 head of Llama-3.1-8B's shape with a 32k draft vocabulary on random
states (no 8B target here: its agreement says how sensitive that shape is, not what a trained head would do).
Variants: every matmul weight bfloat8_b; every one but fc and the LM head (kept bf16, as the issue proposes).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.tt_transformers.ttnn_backend.bfp8 import bfp8_round  # noqa: E402
from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, build_draft_head  # noqa: E402

KEEP_BF16 = ("fc.weight", "lm_head.weight")


def device_weights(weights: dict, keep=()) -> dict:
    """The head's matmul weights as the device stores them (transposed [in, out] tiles, as draft_head.head_weights
    lays them out), norms, embeddings and id maps untouched; `keep` stays bf16."""
    def stored(name, w):
        if w.dim() != 2 or "norm" in name or "embed" in name or name in keep:
            return w
        return bfp8_round(w.float().t()).t().to(w.dtype)
    return {name: stored(name, w) for name, w in weights.items()}


def chains(head, target, states: torch.Tensor, tokens: list[int], starts, k: int) -> list[list[int]]:
    """From each start p: the head fed rows 0..p-1 (state i with token i + 1), then k drafts, each fed back."""
    runner = HeadRunner(build_draft_head(*head, target), 1, len(tokens) + k + 1, target.args)
    out = []
    for p in starts:
        state, logits = runner.run([0], [0], [states[:p]], [tokens[1 : p + 1]])[0]
        chain = []
        for j in range(k):
            chain.append(int(logits.argmax()))
            state, logits = runner.run([0], [p + j], [state[-1:]], [[int(runner.vocab[chain[-1]])]])[0]
        out.append(chain)
    return out


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefixes = []
    for a, b in zip(reference, other):
        n = 0
        while n < len(a) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    k = len(reference[0])
    return {"chains": len(prefixes), "identical": round(sum(n == k for n in prefixes) / len(prefixes), 4),
            "mean_agreed_prefix": round(sum(prefixes) / len(prefixes), 3), "first_draft_same": round(
                sum(n > 0 for n in prefixes) / len(prefixes), 4)}


def shipped_head_case(stride: int) -> tuple[dict, list]:
    from models.tt_transformers.prompts import encode, load_prompts
    from models.tt_transformers.checkpoints.eagle3_format import DRAFT_HEADS
    from models.tt_transformers.speculative.generator import SpeculativeGenerator
    from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint
    from models.tt_transformers.torch_backend.load import load_model
    from models.tt_transformers.checkpoints.eagle3_format import read_draft_head
    from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    ckpt = resolve_checkpoint(None)
    args = ModelShape.from_hf_config(ckpt.config)
    target = load_model(ckpt, torch.bfloat16, 1024, "cpu")
    lm = TorchCausalLM(target, args.n_layers, 1)
    head = read_draft_head(DRAFT_HEADS / ckpt.name, args)
    tokenizer = load_tokenizer(ckpt)
    sequences = []
    for prompt in load_prompts(REPO / "sample_prompts.json")[:4]:
        tokens = encode(tokenizer, prompt, True)
        response = SpeculativeGenerator(lm, None, 0).generate([tokens], 64)[0].output_tokens
        whole = tokens + response
        states = lm.prefill(0, whole, taps=head[0].taps).hidden[0].to(torch.bfloat16)
        sequences.append((whole, states, range(len(tokens), len(whole) - 1, stride)))
    return {"bf16": head, "bfloat8_b": (head[0], device_weights(head[1])),
            "bfloat8_b, fc and LM head bf16": (head[0], device_weights(head[1], KEEP_BF16))}, \
        [(target, states, whole, starts) for whole, states, starts in sequences]


def llama8b_case() -> tuple[dict, list]:
    from models.tt_transformers.checkpoints.eagle3_format import random_head
    from models.tt_transformers.torch_backend.model import Transformer
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    from tests.tt_mock.run import LLAMA_8B  # the 8B shapes make tt-mock runs at

    args = ModelShape.from_hf_config(LLAMA_8B)
    config, weights = random_head(args, draft_vocab=32000)
    weights = {name: w.to(torch.bfloat16) for name, w in weights.items()}
    target = Transformer(ModelShape(**{**vars(args), "n_layers": 0}), torch.bfloat16, 128)
    torch.manual_seed(1)
    target.tok_embeddings.weight.data.normal_(0, 0.02)
    n = 64
    states = torch.randn(n, len(config.taps) * args.dim, dtype=torch.bfloat16)
    tokens = torch.randint(0, args.vocab_size, (n + 1,)).tolist()
    return {"bf16": (config, weights), "bfloat8_b": (config, device_weights(weights)),
            "bfloat8_b, fc and LM head bf16": (config, device_weights(weights, KEEP_BF16))}, \
        [(target, states, tokens, range(8, n, 4))]


def measure(heads: dict, sequences: list, k: int) -> dict:
    drafted = {name: [c for target, states, tokens, starts in sequences
                      for c in chains(head, target, states, tokens, starts, k)] for name, head in heads.items()}
    return {name: agreement(drafted["bf16"], drafted[name]) for name in heads if name != "bf16"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain", type=int, default=8, help="drafts per chain")
    parser.add_argument("--stride", type=int, default=4, help="positions between chain starts in each response")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = {"chain": args.chain,
              "SmolLM2-135M-Instruct shipped head": measure(*shipped_head_case(args.stride), args.chain),
              "Llama-3.1-8B-shaped random head (32k draft vocabulary)": measure(*llama8b_case(), args.chain)}
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
