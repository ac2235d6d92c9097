# SPDX-License-Identifier: Apache-2.0
"""The demo's options: one table gives the pytest options (conftest.py), the CLI flags and DemoConfig's fields, so
the three cannot drift apart."""
import argparse
from dataclasses import field, make_dataclass
from pathlib import Path
from typing import Optional

from models.tt_transformers.speculative.config import DEFAULT_DRAFT_LAYERS, NO_DRAFT_HEAD, SpeculativeConfig

DEFAULT_PROMPTS = Path(__file__).resolve().with_name("sample_prompts.json")  # beside the demo, as TT demos keep them
SPEC = SpeculativeConfig()  # the drafting flags' defaults are the library's

# (name, type, default, help): the pytest options (root conftest.py) and the CLI flags come from this one table.
DEMO_OPTIONS = [
    ("input_prompts", str, str(DEFAULT_PROMPTS), "prompts file: JSON list of {\"prompt\": ...} or JSON Lines (a "
                                                 "relative path is tried from the working directory, then from the "
                                                 "folder holding models/)"),
    ("instruct", int, 1, "1: wrap prompts in the tokenizer's chat template"),
    ("max_seq_len", int, 1024, "maximum context (prompt + generated tokens) per user"),
    ("batch_size", int, 1, "users decoded together (1, 2, 4, 8, 16, 32)"),
    ("max_generated_tokens", int, 128, "tokens to generate per user"),
    ("stop_at_eos", int, 1, "1: stop a user at the end-of-sequence token"),
    ("n_draft_tokens", int, SPEC.n_draft_tokens, "draft tokens verified per target forward; 0 = plain decoding"),
    ("draft_mode", str, SPEC.draft_mode, "model: draft model only; suffix: copied drafts only (no model); head: the "
                                  "trained draft head only; hybrid: per step, the copied draft or the head's (the "
                                  "draft model's where no head is given or shipped), whichever is expected to bring "
                                  "more accepted tokens"),
    ("sa_threshold", int, SPEC.sa_threshold, "minimum match length (tokens) a copied draft may start from"),
    ("draft_memory", int, SPEC.draft_memory, "tokens of earlier responses kept to draft from (cross-request memory); "
                                             "0 = off"),
    ("draft_corpus", str, None, "a text file to draft from as well (logs, a code base): a static corpus"),
    ("recycle_top_k", int, SPEC.recycle_top_k, "the target's top next tokens kept per token to draft from (token "
                                               "recycling); 0 = off"),
    ("draft_trees", int, int(SPEC.trees), "1: verify token trees (several candidates at once) where the backend can"),
    ("draft_head", str, None, "EAGLE-3 draft head: a folder or hub id (the EAGLE authors' or speculators' layout), or "
                              f"{NO_DRAFT_HEAD} (hybrid: the draft model); default: the one shipped for the target in "
                              "models/tt_transformers/draft_heads/<model>"),
    ("draft_layers", int, None, "the draft model is the target's first N layers (weights and cache shared); read by "
                                "--draft_mode model, and hybrid without a draft head (default: "
                                f"{DEFAULT_DRAFT_LAYERS}, or half a target of {DEFAULT_DRAFT_LAYERS} layers or fewer)"),
    ("target_layers", int, None, "truncate the target to its first N layers (default: all)"),
    ("draft_model", str, None, "separate draft checkpoint (folder or .gguf) with the same tokenizer"),
    ("temperature", float, 0.0, "sampling temperature; 0 = greedy (output identical to plain greedy decoding)"),
    ("top_k", int, 0, "sample from the k most likely tokens only; 0 = off (needs --temperature above 0)"),
    ("top_p", float, 1.0, "sample from the smallest set of tokens with this much probability; 1 = off (needs "
                          "--temperature above 0)"),
    ("seed", int, None, "random seed for sampling: a seeded run is reproducible (needs --temperature above 0)"),
    ("compare_baseline", int, 1, "1: also run plain decoding, check identical tokens and report the speedup"),
    ("output_json", str, None, "write a JSON report here (config, environment, every iteration, summary)"),
    ("log_iterations", int, 5, "Iteration lines logged per batch, the rest counted in one line; -1 logs every one"),
    ("model", str, None, "target checkpoint folder or .gguf file (default: HF_MODEL, else the embedded model)"),
    ("dtype", str, None, "weights: torch bfloat16 (default) or float32; ttnn bfloat8_b (default, as tt-metal's "
                         "text demo) or bfloat16"),
    ("precision", str, "performance", "ttnn: TT-Transformers' decoder precision preset, performance (bfp4 MLP, LoFi; "
                                      "tt-metal's text demo default) or accuracy"),
    ("device", str, "auto", "torch device: auto (the faster of cpu and cuda for this model, logged), cpu or cuda"),
    ("backend", str, "auto", "torch, ttnn (a Tenstorrent mesh through TT-Transformers) or auto: ttnn when "
                             "MESH_DEVICE is set"),
    ("tap_gather", str, "device", "ttnn on N300/T3K, a draft head's taps: device (one all-gather in each traced step) "
                                  "or host (read back and written to the tap tile after each step: slower, no "
                                  "collective of ours in a trace; the first thing to rule out when a mesh hangs)"),
    ("grouped_verify", int, 0, "ttnn: 1 runs a verify step's attention as one cache scan per user (ttnn's "
                               "spec_multi_pos_tiles, where its limits allow); 0 one scan per row, the op a plain step "
                               "runs, so verify rows stay bit-identical to plain decoding. 1 is faster at long "
                               "context but not shown bit-identical on silicon: check it with make tt-smoke "
                               "ARGS=--grouped_verify"),
    ("trace_region_size", int, None, "ttnn: bytes of trace region to open the mesh with (default: sized for this run's "
                                     "traces, ttnn_backend/trace_plan.py; a run whose traces outgrow the region names the "
                                     "size to pass here)"),
    ("enable_trace", int, 1, "ttnn: 1 traces every decode step and draft-head replay (as TT's demos' enable_trace); 0 "
                             "runs them op by op (slower; a failure names the op, not the trace). The CLI also takes "
                             "--trace (pytest's own --trace is its debugger)"),
]

# 0 or 1, as in TT's demos
SWITCHES = ("instruct", "stop_at_eos", "draft_trees", "compare_baseline", "enable_trace", "grouped_verify")

# The demo's settings, one field per option, with the same defaults.
DemoConfig = make_dataclass("DemoConfig", [(name, Optional[type_], field(default=default))
                                           for name, type_, default, _ in DEMO_OPTIONS])


def speculative_config(config: DemoConfig) -> SpeculativeConfig:
    """The library's settings from the demo's flags (their defaults are SpeculativeConfig's)."""
    return SpeculativeConfig(n_draft_tokens=config.n_draft_tokens, draft_mode=config.draft_mode,
                             sa_threshold=config.sa_threshold, draft_memory=config.draft_memory,
                             recycle_top_k=config.recycle_top_k, trees=bool(config.draft_trees),
                             draft_layers=config.draft_layers, draft_head=config.draft_head)


def add_demo_options(parser) -> None:
    """Register the demo's pytest options (read as getoption(...) or default). Inside a tt-metal checkout, tt-metal's
    models/tt_transformers/demo/conftest.py has already registered the ones TT demos share (--input_prompts,
    --max_seq_len, --batch_size, ...), and pytest refuses a second registration ("option names ... already
    added"): theirs are kept, read the same way."""
    for name, type_, _, help_ in DEMO_OPTIONS:
        try:
            parser.addoption(f"--{name}", action="store", type=type_, default=None, help=help_)
        except ValueError as e:
            if "already added" not in str(e):
                raise


def config_from_pytest(config) -> DemoConfig:
    """Options are read as getoption(...) or default, as TT-Transformers demos do (`config`: pytest's)."""
    values = {}
    for name, _, default, _ in DEMO_OPTIONS:
        value = config.getoption(f"--{name}")
        values[name] = default if value is None else value
    return DemoConfig(**values)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors (a flag misspelt, `--temperature abc`) as one line, as the demo's own, not after the usage of
    thirty flags."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}; --help lists the flags\n")


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The CLI's flags, from the same table; --help shows each default."""
    parser = OneLineErrorParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, type_, default, help_ in DEMO_OPTIONS:
        parser.add_argument(f"--{name}", *(["--trace"] if name == "enable_trace" else []), type=type_,
                            default=default, help=help_ if default is None else f"{help_} (default: {default})")
    return parser
