# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding demo, in the shape of TT-Transformers' simple_text_demo.

    pytest models/tt_transformers/demo/speculative_decoding/speculative_demo.py::test_speculative_demo \
        --n_draft_tokens 4 --draft_layers 8
    python models/tt_transformers/demo/speculative_decoding/speculative_demo.py --n_draft_tokens 4 --draft_layers 8

With no flags it runs the embedded default model (SmolLM2-135M-Instruct) on sample_prompts.json; HF_MODEL
(or --model) points at a local Llama/Mistral checkpoint folder or GGUF file instead.
"""
import argparse
import json
import os
import sys
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # `python path/to/speculative_demo.py` from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from loguru import logger

from models.tt_transformers.demo.speculative_decoding.speculative_generator import (
    SpeculativeGenerator,
    UserResult,
    check_n_draft_tokens,
)
from models.tt_transformers.speculative.drafters import DEFAULT_SA_THRESHOLD
from models.tt_transformers.speculative.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_PROMPTS = REPO_ROOT / "sample_prompts.json"
SUPPORTED_BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # as TT-Transformers demos
DRAFT_MODES = ("model", "suffix", "hybrid")

# (name, type, default, help): the pytest options (root conftest.py) and the CLI flags come from this one table.
DEMO_OPTIONS = [
    ("input_prompts", str, str(DEFAULT_PROMPTS), "prompts file: JSON list of {\"prompt\": ...} or JSON Lines"),
    ("instruct", int, 1, "1: wrap prompts in the tokenizer's chat template"),
    ("max_seq_len", int, 1024, "maximum context (prompt + generated tokens) per user"),
    ("batch_size", int, 1, "users decoded together (1, 2, 4, 8, 16, 32)"),
    ("max_generated_tokens", int, 128, "tokens to generate per user"),
    ("stop_at_eos", int, 1, "1: stop a user at the end-of-sequence token"),
    ("n_draft_tokens", int, 4, "draft tokens verified per target forward; 0 = plain decoding"),
    ("draft_mode", str, "hybrid", "model: draft model only; suffix: suffix automaton only (no draft model); "
                                  "hybrid: suffix draft when its match is long enough, else the draft model"),
    ("sa_threshold", int, DEFAULT_SA_THRESHOLD, "minimum suffix match length (tokens) for a suffix draft"),
    ("draft_layers", int, 8, "layers of the target used as the draft model (weights shared)"),
    ("target_layers", int, None, "truncate the target to its first N layers (default: all)"),
    ("draft_model", str, None, "separate draft checkpoint (folder or .gguf) with the same tokenizer"),
    ("temperature", float, 0.0, "sampling temperature; 0 = greedy (output identical to plain greedy decoding)"),
    ("top_k", int, 0, "sample from the k most likely tokens only; 0 = off"),
    ("top_p", float, 1.0, "sample from the smallest set of tokens with this much probability; 1 = off"),
    ("seed", int, None, "random seed for sampling: a seeded run is reproducible"),
    ("compare_baseline", int, 1, "1: also run plain decoding, check identical tokens and report the speedup"),
    ("output_json", str, None, "write a JSON report here"),
    ("model", str, None, "target checkpoint folder or .gguf file (default: HF_MODEL, else the embedded model)"),
    ("dtype", str, "bfloat16", "bfloat16 or float32"),
]


class DemoInputError(ValueError):
    """Bad demo input; the message names the problem and the fix."""


# The demo's settings, one field per option, with the same defaults.
DemoConfig = make_dataclass("DemoConfig", [(name, Optional[type_], field(default=default))
                                           for name, type_, default, _ in DEMO_OPTIONS])


def load_prompts(path: str) -> list[str]:
    """TT format (a JSON list of {"prompt": ...}) or JSON Lines with a "prompt" field."""
    p = Path(path)
    if not p.is_file():
        raise DemoInputError(f"prompts file {path!r} does not exist; pass --input_prompts with a JSON or JSONL file")
    text = p.read_text()
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        try:
            entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise DemoInputError(f"{path} is neither JSON nor JSON Lines ({e}); expected "
                                 '[{"prompt": "..."}] or one {"prompt": "..."} per line') from None
    if not isinstance(entries, list) or not entries:
        raise DemoInputError(f"{path} must hold a non-empty list of {{\"prompt\": ...}} entries")
    prompts = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("prompt"), str):
            raise DemoInputError(f"{path}: entry {i} has no string \"prompt\" field")
        if not e["prompt"].strip():
            raise DemoInputError(f"{path}: entry {i} has an empty prompt")
        prompts.append(e["prompt"])
    return prompts


def split_batches(n_prompts: int, batch_size: int) -> list[list[int]]:
    """Prompt indices per batch; the last batch is filled by repeating prompts, as TT demos do."""
    if batch_size not in SUPPORTED_BATCH_SIZES:
        raise DemoInputError(f"--batch_size {batch_size} is not supported; use one of {SUPPORTED_BATCH_SIZES}")
    n_batches = -(-n_prompts // batch_size)
    return [[(b * batch_size + i) % n_prompts for i in range(batch_size)] for b in range(n_batches)]


def encode(tokenizer, prompt: str, instruct: bool) -> list[int]:
    if instruct and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, return_dict=True)["input_ids"])
    return tokenizer(prompt).input_ids


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise DemoInputError(f"draft model {draft_name!r} has a different tokenizer from the target "
                             f"(vocabularies differ); speculative decoding needs one shared vocabulary")


def build(config: DemoConfig):
    """Load target, draft and tokenizer on the torch backend; validate every flag first."""
    import torch

    from models.tt_transformers.speculative.drafters import HybridDrafter, ModelDrafter, SuffixDrafter
    from models.tt_transformers.torch_backend.checkpoint import load_model, load_tokenizer, resolve_checkpoint
    from models.tt_transformers.torch_backend.generator import TorchCausalLM

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if config.dtype not in dtypes:
        raise DemoInputError(f"--dtype {config.dtype!r} is not supported; use bfloat16 or float32")
    check_n_draft_tokens(config.n_draft_tokens)  # before any loading
    sampling_params(config)
    if config.draft_mode not in DRAFT_MODES:
        raise DemoInputError(f"--draft_mode {config.draft_mode!r} is not one of {', '.join(DRAFT_MODES)}")
    if config.sa_threshold < 1:
        raise DemoInputError(f"--sa_threshold must be >= 1 (tokens of matched suffix), got {config.sa_threshold}")
    if config.max_generated_tokens < 1:
        raise DemoInputError(f"--max_generated_tokens must be >= 1, got {config.max_generated_tokens}")
    if config.max_seq_len < 2:
        raise DemoInputError(f"--max_seq_len must be >= 2, got {config.max_seq_len}")
    prompts = load_prompts(config.input_prompts)
    split_batches(len(prompts), config.batch_size)  # validates --batch_size before any loading

    ckpt = resolve_checkpoint(config.model)
    dtype = dtypes[config.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(ckpt, dtype, config.max_seq_len, device)
    n_layers = model.args.n_layers
    target_layers = config.target_layers or n_layers
    if not 1 <= target_layers <= n_layers:
        raise DemoInputError(f"--target_layers {target_layers} is out of range: {ckpt.name} has {n_layers} layers")
    target = TorchCausalLM(model, target_layers, config.batch_size)
    tokenizer = load_tokenizer(ckpt)

    drafter = None
    if config.n_draft_tokens > 0 and config.draft_mode == "suffix":
        drafter = SuffixDrafter(config.sa_threshold)  # no draft model at all
    elif config.n_draft_tokens > 0:
        if config.draft_model:
            draft_ckpt = resolve_checkpoint(config.draft_model)
            check_same_tokenizer(tokenizer, load_tokenizer(draft_ckpt), config.draft_model)
            draft_model = load_model(draft_ckpt, dtype, config.max_seq_len, device)
            draft_lm = TorchCausalLM(draft_model, draft_model.args.n_layers, config.batch_size)
        else:
            if not 1 <= config.draft_layers < target_layers:
                raise DemoInputError(f"--draft_layers {config.draft_layers} must be between 1 and {target_layers - 1} "
                                     f"(the target runs {target_layers} layers); lower --draft_layers")
            draft_lm = TorchCausalLM(model, config.draft_layers, config.batch_size)
        if config.draft_mode == "model":
            drafter = ModelDrafter(draft_lm)  # every draft has the full n_draft_tokens
        else:  # hybrid: the model drafts only while its acceptance pays for its cost
            draft_cost = draft_lm.weight_bytes_per_token() / target.weight_bytes_per_token()
            drafter = HybridDrafter(SuffixDrafter(config.sa_threshold), ModelDrafter(draft_lm, draft_cost))
    eos = sorted(set(ckpt.eos_token_ids) | {tokenizer.eos_token_id} - {None})
    tokens = [encode(tokenizer, p, bool(config.instruct)) for p in prompts]
    return ckpt, tokenizer, target, drafter, prompts, tokens, eos


def sampling_params(config: DemoConfig) -> SamplingParams:
    try:
        return SamplingParams(config.temperature, config.top_k, config.top_p, config.seed)
    except ValueError as e:
        raise DemoInputError(f"bad sampling flags: {e}") from None


def describe_drafter(config: DemoConfig) -> str:
    if config.n_draft_tokens == 0:
        return "plain decoding"
    model = config.draft_model or f"first {config.draft_layers} layers"
    suffix = f"suffix automaton (threshold {config.sa_threshold})"
    return {"model": f"draft model {model}", "suffix": suffix,
            "hybrid": f"hybrid: {suffix}, else draft model {model}"}[config.draft_mode]


def summarize(batches: list[list[UserResult]]) -> dict:
    """Figures over all users; users of one batch share each iteration's time."""
    users = [r for batch in batches for r in batch]
    drafted = sum(it.drafted for r in users for it in r.iterations)
    accepted = sum(it.accepted for r in users for it in r.iterations)
    steps = sum(len(r.iterations) for r in users)
    produced = sum(len(r.output_tokens) - 1 for r in users)
    decode_s = sum(max(r.decode_s for r in batch) for batch in batches)
    tok_s = produced / decode_s if decode_s else 0.0
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_step": produced / steps if steps else 0.0,
        "decode_tok_s": tok_s,
        "decode_tok_s_u": tok_s * len(batches) / len(users),
        "ttft_ms": sum(r.ttft_ms for r in users) / len(users),
    }


def log_performance(label: str, s: dict) -> None:
    logger.info(f"=== Performance metrics ({label}) ===")
    logger.info(f"Time to first token: {s['ttft_ms']:.1f}ms")
    ms = 1e3 / s["decode_tok_s_u"] if s["decode_tok_s_u"] else 0.0
    logger.info(f"Average speed: {ms:.1f}ms @ {s['decode_tok_s_u']:.1f} tok/s/user ({s['decode_tok_s']:.1f} tok/s throughput)")
    logger.info(f"Acceptance rate: {100 * s['acceptance_rate']:.1f}%, mean tokens per target forward: "
                f"{s['mean_tokens_per_step']:.2f}")


def generate_all(generator: SpeculativeGenerator, tokens: list[list[int]], batches: list[list[int]],
                 config: DemoConfig) -> list[list[UserResult]]:
    return [generator.generate([tokens[i] for i in batch], config.max_generated_tokens, bool(config.stop_at_eos))
            for batch in batches]


def run_demo(config: DemoConfig) -> dict:
    ckpt, tokenizer, target, drafter, prompts, tokens, eos = build(config)
    sampling = sampling_params(config)
    spec = SpeculativeGenerator(target, drafter, config.n_draft_tokens, eos, sampling)
    batches = split_batches(len(prompts), config.batch_size)
    for batch in batches:  # every prompt fits before anything runs
        spec.check_prompts([tokens[i] for i in batch])
    spec.generate(tokens[:1], 4, bool(config.stop_at_eos))  # warm-up (first-call kernel set-up), not timed

    logger.info(f"Speculative decoding: {ckpt.name}, {target.n_layers} target layers, batch {config.batch_size}, "
                f"n_draft_tokens={config.n_draft_tokens}, {describe_drafter(config)}, "
                f"{'greedy' if sampling.greedy else f'sampling {sampling}'}")
    results = generate_all(spec, tokens, batches, config)
    summary = summarize(results)
    log_performance("speculative", summary)

    baseline = None
    if config.compare_baseline and config.n_draft_tokens > 0:
        logger.info("Plain decoding on the same backend (baseline)")
        baseline = generate_all(SpeculativeGenerator(target, None, 0, eos, sampling), tokens, batches, config)
        base_summary = summarize(baseline)
        log_performance("plain decoding", base_summary)
        summary["baseline_decode_tok_s"] = base_summary["decode_tok_s"]
        summary["speedup"] = summary["decode_tok_s"] / base_summary["decode_tok_s"]
        same = ""
        if sampling.greedy:  # sampled outputs follow the same distribution, not the same random draws
            summary["identical_to_baseline"] = all(
                r.output_tokens == b.output_tokens for rb, bb in zip(results, baseline) for r, b in zip(rb, bb))
            same = f"; outputs identical: {summary['identical_to_baseline']}"
        logger.info(f"Speedup over plain decoding: {summary['speedup']:.2f}x{same}")

    report = {"config": {**vars(config), "model_name": ckpt.name, "target_layers": target.n_layers}, "prompts": [],
              "summary": summary}
    seen = set()
    for b, batch in enumerate(batches):
        for u, i in enumerate(batch):
            if i in seen:  # a repeat that only filled the last batch
                continue
            seen.add(i)
            r = results[b][u]
            text = tokenizer.decode(r.output_tokens, skip_special_tokens=True)
            logger.info(f"User {i} prompt: {prompts[i]!r}\nOutput: {text}")
            entry = {"prompt": prompts[i], "output_text": text, "output_tokens": r.output_tokens,
                     "iterations": [vars(it) for it in r.iterations], "ttft_ms": r.ttft_ms,
                     "decode_tok_s": r.decode_tok_s}
            if baseline is not None:
                entry["baseline_output_tokens"] = baseline[b][u].output_tokens
                entry["baseline_decode_tok_s"] = baseline[b][u].decode_tok_s
            report["prompts"].append(entry)
    if config.output_json:
        write_json_atomic(Path(config.output_json), report)
        logger.info(f"Report written to {config.output_json}")
    return report


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def config_from_pytest(request) -> DemoConfig:
    """Options are read as getoption(...) or default, as TT-Transformers demos do."""
    values = {}
    for name, _, default, _ in DEMO_OPTIONS:
        value = request.config.getoption(f"--{name}")
        values[name] = default if value is None else value
    return DemoConfig(**values)


def test_speculative_demo(request):
    config = config_from_pytest(request)
    report = run_demo(config)
    assert all(p["output_tokens"] for p in report["prompts"])
    if "identical_to_baseline" in report["summary"]:
        assert report["summary"]["identical_to_baseline"], "speculative output differs from plain greedy decoding"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, type_, default, help_ in DEMO_OPTIONS:
        parser.add_argument(f"--{name}", type=type_, default=default, help=help_)
    config = DemoConfig(**vars(parser.parse_args(argv)))
    try:
        report = run_demo(config)
    except ValueError as e:  # DemoInputError, CheckpointError, ModelConfigError: clear messages, no traceback
        logger.error(str(e))
        return 2
    return 0 if report["summary"].get("identical_to_baseline", True) else 1


if __name__ == "__main__":
    sys.exit(main())
