# SPDX-License-Identifier: Apache-2.0
"""How much a draft head's device numerics change what it drafts, against the same head in bfloat16 on the host: over
whole chains drafted from the same states, the share of chains identical to the bf16 head's and the mean agreed
prefix. Two effects are modelled: the matmul weights stored in bfloat8_b (as a Tenstorrent device stores them:
ttnn_backend/bfp8.py via draft_head.stored_weights, checked against ttnn's own conversion by `make tt-mock`), and the
matmuls' math fidelity. A Wormhole matmul multiplies in fidelity phases over its operands' mantissa bits (tt-llk's
golden model, tests/python_tests/helpers/golden_generators.py FidelityMasking: srcA, the weight, in two 5-bit halves;
srcB, the activation, in its top 7 of 8 significant bits then its last): HiFi4 runs all four phases (exact products,
fp32 accumulation here), HiFi2 the first two, which is the activation with its last bf16 mantissa bit dropped times
the whole weight. The rest of the host compute is bf16 for every variant (norms, attention, softmax on the device are
not modelled).

    .venv/bin/python tools/head_precision.py [--chain 8] [--stride 4] [--json docs/head_precision.json]

Heads: the shipped SmolLM2-135M-Instruct head on the embedded target's real tapped states (the sample prompts and
their greedy responses), and a random EAGLE-3 head of Llama-3.1-8B's shape with a 32k draft vocabulary on random
states (no 8B target here: its agreement says how sensitive that shape is, not what a trained head would do).
Variants: bfloat8_b weights with every matmul in HiFi4, in HiFi2, and in HiFi2 but the LM head; each against the bf16
head and against the HiFi4 one.

First logits (`make tt-smoke`'s random-head gate, demo/speculative_decoding/tt_smoke.py FIRST_LOGITS_TOLERANCE): the smoke compares the
device head's first logits with a host reference whose weights are rounded to bfloat8_b but whose KV cache is
bfloat16; the device's KV cache is bfloat8_b (ttnn_backend/eagle3_head.py: with bfloat8_b weights), and its matmuls run in HiFi2.
From every chain start, the first logits of the head with bfloat8_b weights and its KV cache stored as bfloat8_b
(bfp8_round at each write: each 16-value row of a cache tile, one position's head, shares an exponent), alone and with
HiFi2 matmuls, against that reference: the largest relative difference (max |a - b| / max |b|, the smoke's measure).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.tt_transformers.ttnn_backend.bfp8 import bfp8_round  # noqa: E402
from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, build_draft_head  # noqa: E402
from models.tt_transformers.ttnn_backend.eagle3_head import stored_weights  # noqa: E402

# the head's matmuls: its parameter -> its module (draft_head.PARAMETERS)
MATMULS = {"fc.weight": "fc", "layer.attention.wqkv.weight": "layer.attention.wqkv",
           "layer.attention.wo.weight": "layer.attention.wo",
           "layer.feed_forward.w_gate_up.weight": "layer.feed_forward.w_gate_up",
           "layer.feed_forward.w_down.weight": "layer.feed_forward.w_down", "lm_head.weight": "lm_head"}


def hifi2_activation(x: torch.Tensor) -> torch.Tensor:
    """A matmul's activation as HiFi2's two phases read it: bf16 with its last mantissa bit dropped (srcB's top 7 of
    8 significant bits, truncated toward zero)."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    return (bits & ~1).view(torch.bfloat16).to(x.dtype)


class Bfp8Cache(torch.Tensor):
    """A head KV-cache tensor [users, kv heads, slots, head_dim] whose writes are stored as the device's bfloat8_b cache
    stores them: the device's cache tile is 32 positions of one head x 32 of head_dim, each 16-value row of a face
    (one position's head) sharing an exponent (bfp8.py), so rounding each written [.., heads, head_dim] row block
    alone is the same. Reads are plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __setitem__(self, index, value):
        super().__setitem__(index, bfp8_round(value).to(value.dtype))


def runner_for(head, target, max_seq_len: int, hifi2=(), kv_bfp8: bool = False) -> HeadRunner:
    """The head on the host: hifi2, the matmuls (MATMULS' names) that run in HiFi2; kv_bfp8, its KV cache stored as
    bfloat8_b."""
    module = build_draft_head(*head, target)
    for name in hifi2:
        module.get_submodule(MATMULS[name]).register_forward_pre_hook(
            lambda _, args: (hifi2_activation(args[0]), *args[1:]))
    runner = HeadRunner(module, 1, max_seq_len, target.args)
    if kv_bfp8:
        runner.cache.k[0] = torch.Tensor._make_subclass(Bfp8Cache, runner.cache.k[0])
        runner.cache.v[0] = torch.Tensor._make_subclass(Bfp8Cache, runner.cache.v[0])
    return runner


def first_logits(head, target, states: torch.Tensor, tokens: list[int], starts, hifi2=(), kv_bfp8=False) -> list:
    """From each start p, the logits after the head is fed rows 0..p-1 (its first draft's)."""
    runner = runner_for(head, target, len(tokens) + 1, hifi2, kv_bfp8)
    return [runner.run([0], [0], [states[:p]], [tokens[1 : p + 1]])[0][1] for p in starts]


def chains(head, target, states: torch.Tensor, tokens: list[int], starts, k: int, hifi2=()) -> list[list[int]]:
    """From each start p: the head fed rows 0..p-1 (state i with token i + 1), then k drafts, each fed back. hifi2: the
    matmuls (MATMULS' names) that run in HiFi2."""
    runner = runner_for(head, target, len(tokens) + k + 1, hifi2)
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


def shipped_head_case(stride: int) -> tuple[tuple, list]:
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
    return head, [(target, states, whole, starts) for whole, states, starts in sequences]


# Llama-class residual streams carry a few channels far above the rest (Sun et al. 2024, "Massive Activations in
# Large Language Models": about 1,000x the median at the first token, in fixed channels, from the early layers on)
# and wider channels throughout; an EAGLE-3 head feeds them to its fc un-normed. The smoke's random head reads
# Llama-3.1-8B's real taps, which this machine cannot produce: these states stand in for their shape.
OUTLIER_CHANNELS, OUTLIER_SCALE, MASSIVE_SCALE = 4, 20.0, 1000.0


def with_outlier_channels(states: torch.Tensor, taps: int) -> torch.Tensor:
    """Random states with, in each tap's part, OUTLIER_CHANNELS channels at OUTLIER_SCALE x and, at the first
    position, those channels at MASSIVE_SCALE x."""
    states = states.float().clone()
    width = states.shape[1] // taps
    generator = torch.Generator().manual_seed(2)
    for t in range(taps):
        channels = t * width + torch.randperm(width, generator=generator)[:OUTLIER_CHANNELS]
        states[:, channels] *= OUTLIER_SCALE
        states[0, channels] = MASSIVE_SCALE
    return states.to(torch.bfloat16)


def llama8b_case(outliers: bool = False) -> tuple[tuple, list]:
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
    if outliers:
        states = with_outlier_channels(states, len(config.taps))
    tokens = torch.randint(0, args.vocab_size, (n + 1,)).tolist()
    return (config, weights), [(target, states, tokens, range(8, n, 4))]


VARIANTS = {"bfloat8_b, HiFi4": (), "bfloat8_b, HiFi2": tuple(MATMULS),
            "bfloat8_b, HiFi2 but the LM head": tuple(name for name in MATMULS if name != "lm_head.weight")}


# the device head's KV cache and matmuls beside the smoke's reference (bfloat8_b weights, bf16 cache, exact matmuls)
DEVICE_LIKE = {"KV cache bfloat8_b": {"kv_bfp8": True},
               "KV cache bfloat8_b, HiFi2 matmuls (the device head's configs)": {"kv_bfp8": True,
                                                                                 "hifi2": tuple(MATMULS)}}


def largest_relative_difference(reference: list, other: list) -> float:
    """max over starts of max |a - b| / max |b| (demo/speculative_decoding/tt_smoke.py's first-logits measure)."""
    return max(((a - b).abs().max() / b.abs().max()).item() for b, a in zip(reference, other))


def first_logits_differences(head: tuple, sequences: list) -> dict:
    """The first logits of the device-like variants against the smoke's reference (bfloat8_b weights, bf16 cache,
    exact matmuls): the largest relative difference over every chain start."""
    stored = stored_weights(*head)

    def logits(**kwargs):
        return [x for target, states, tokens, starts in sequences
                for x in first_logits((head[0], stored), target, states, tokens, starts, **kwargs)]
    smoke_reference = logits()
    return {name: round(largest_relative_difference(smoke_reference, logits(**kwargs)), 5)
            for name, kwargs in DEVICE_LIKE.items()}


FIRST_LOGITS = "first logits, max relative difference from the smoke's reference"


def measure(head: tuple, sequences: list, k: int) -> dict:
    """Every variant's chains against the bf16 head's and against the all-HiFi4 one's; the first logits of the
    device-like variants against the smoke's reference."""
    def drafted(weights, hifi2=()):
        return [c for target, states, tokens, starts in sequences
                for c in chains((head[0], weights), target, states, tokens, starts, k, hifi2)]
    reference, stored = drafted(head[1]), stored_weights(*head)
    variants = {name: drafted(stored, hifi2) for name, hifi2 in VARIANTS.items()}
    report = {name: {"vs bf16": agreement(reference, out), "vs bfloat8_b, HiFi4": agreement(
        variants["bfloat8_b, HiFi4"], out)} for name, out in variants.items()}
    report[FIRST_LOGITS] = first_logits_differences(head, sequences)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain", type=int, default=8, help="drafts per chain")
    parser.add_argument("--stride", type=int, default=4, help="positions between chain starts in each response")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    report = {"chain": args.chain,
              "SmolLM2-135M-Instruct shipped head": measure(*shipped_head_case(args.stride), args.chain),
              "Llama-3.1-8B-shaped random head (32k draft vocabulary)": measure(*llama8b_case(), args.chain),
              "same, states with massive-activation channels": {
                  FIRST_LOGITS: first_logits_differences(*llama8b_case(outliers=True))}}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
