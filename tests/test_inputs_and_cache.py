# SPDX-License-Identifier: Apache-2.0
"""Bad input gets a clear error naming the problem and the fix; converted weights are cached."""
import json
import time

import pytest

from models.tt_transformers.torch_backend import checkpoint
from models.tt_transformers.torch_backend.checkpoint import CheckpointError, resolve_checkpoint
from models.tt_transformers.torch_backend.model_config import ModelArgs, ModelConfigError
from models.tt_transformers.demo.speculative_decoding.speculative_demo import (
    DemoConfig,
    DemoInputError,
    load_prompts,
    main,
    run_demo,
    split_batches,
)

from .conftest import save_tiny_hf_checkpoint, write_json


def test_prompts_tt_json_and_jsonl(tmp_path):
    assert load_prompts(str(write_json(tmp_path / "p.json", [{"prompt": "a"}, {"prompt": "b"}]))) == ["a", "b"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "x", "id": 1}\n\n{"prompt": "y"}\n')
    assert load_prompts(str(jsonl)) == ["x", "y"]


@pytest.mark.parametrize("content,message", [
    ("not json at all {", "neither JSON nor JSON Lines"),
    ("[]", "non-empty list"),
    ('[{"text": "a"}]', 'no string "prompt"'),
    ('[{"prompt": "  "}]', "empty prompt"),
])
def test_malformed_prompts_file(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(DemoInputError, match=message):
        load_prompts(str(path))


def test_missing_prompts_file():
    with pytest.raises(DemoInputError, match="does not exist"):
        load_prompts("/nonexistent/prompts.json")


def test_batch_split_repeats_to_fill():
    assert split_batches(5, 2) == [[0, 1], [2, 3], [4, 0]]
    assert split_batches(2, 4) == [[0, 1, 0, 1]]
    with pytest.raises(DemoInputError, match="batch_size 3 is not supported"):
        split_batches(5, 3)


def test_missing_checkpoint_and_missing_weights(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("HF_MODEL", str(tmp_path))
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        resolve_checkpoint(None)


def test_unsupported_model_type():
    with pytest.raises(ModelConfigError, match="model_type 'gpt2' is not supported"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_hf_checkpoint(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.2.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.down_proj.weight"):
        checkpoint.load_model(resolve_checkpoint(str(tmp_path)), checkpoint.torch.float32, 64)


def demo(tmp_path, **kw):
    cfg = dict(input_prompts=str(write_json(tmp_path / "p.json", [{"prompt": "Hello"}])), max_generated_tokens=6,
               compare_baseline=0)
    cfg.update(kw)
    return DemoConfig(**cfg)


@pytest.mark.parametrize("overrides,message", [
    ({"draft_layers": 30}, "--draft_layers 30 must be between 1 and 29"),
    ({"draft_layers": 0}, "--draft_layers 0 must be between 1 and 29"),
    ({"draft_layers": 6, "target_layers": 6}, "--draft_layers 6 must be between 1 and 5"),
    ({"target_layers": 31}, "--target_layers 31 is out of range"),
    ({"n_draft_tokens": -1}, "--n_draft_tokens must be between 0 and 64"),
    ({"n_draft_tokens": 1000}, "--n_draft_tokens must be between 0 and 64"),
    ({"max_seq_len": 8}, "leaves no room to generate within max_seq_len=8"),
    ({"batch_size": 5}, "--batch_size 5 is not supported"),
    ({"dtype": "int4"}, "--dtype 'int4' is not supported"),
    ({"draft_mode": "ngram"}, "--draft_mode 'ngram' is not one of model, suffix, hybrid"),
    ({"sa_threshold": 0}, "--sa_threshold must be >= 1"),
    ({"temperature": -0.5}, "bad sampling flags: temperature must be >= 0"),
    ({"top_p": 0.0}, "bad sampling flags: top_p must be in"),
    ({"top_k": -3}, "bad sampling flags: top_k must be >= 0"),
])
def test_demo_rejects_bad_flags(tmp_path, embedded_checkpoint, overrides, message):
    with pytest.raises(ValueError, match=message):
        run_demo(demo(tmp_path, **overrides))


def test_mismatched_draft_tokenizer(tmp_path, embedded_checkpoint):
    from transformers import AutoTokenizer

    draft = tmp_path / "draft"
    save_tiny_hf_checkpoint(draft, vocab_size=49152)
    tok = AutoTokenizer.from_pretrained(embedded_checkpoint.folder)
    tok.add_tokens(["<an_extra_token>"])
    tok.save_pretrained(draft)
    with pytest.raises(DemoInputError, match="different tokenizer"):
        run_demo(demo(tmp_path, draft_model=str(draft)))


def test_cli_prints_clear_error_without_traceback(tmp_path, embedded_checkpoint, capsys):
    assert main(["--input_prompts", str(tmp_path / "missing.json")]) == 2


def test_gguf_conversion_is_cached_and_atomic(tmp_path, monkeypatch):
    """Second resolve is instant and reuses the stamp; no temporary folder is left behind."""
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path))
    calls = []
    real = checkpoint._convert_gguf
    monkeypatch.setattr(checkpoint, "_convert_gguf", lambda *a: (calls.append(a), real(*a)))
    first = resolve_checkpoint(None)
    start = time.perf_counter()
    second = resolve_checkpoint(None)
    assert time.perf_counter() - start < 1.0 and first == second and len(calls) == 1
    assert json.loads((first.folder / "source.json").read_text())["gguf"].endswith(checkpoint.EMBEDDED_GGUF)
    assert [p.name for p in first.folder.parent.iterdir()] == ["hf"]


def test_suffix_mode_needs_no_draft_layers(tmp_path, embedded_checkpoint):
    """--draft_mode suffix builds no draft model, so an out-of-range --draft_layers does not matter."""
    report = run_demo(demo(tmp_path, draft_mode="suffix", draft_layers=99, compare_baseline=1))
    assert report["summary"]["identical_to_baseline"]
    assert {it["draft_source"] for p in report["prompts"] for it in p["iterations"]} <= {"suffix", "none"}


def test_demo_batch_4_sampling(tmp_path, embedded_checkpoint):
    """--batch_size 4 --temperature 0.7: one prompt fills the batch by repetition and is reported once; a seeded
    run repeats itself exactly."""
    cfg = dict(batch_size=4, temperature=0.7, seed=0, max_generated_tokens=12, draft_mode="suffix",
               stop_at_eos=0, compare_baseline=1)
    first = run_demo(demo(tmp_path, **cfg, output_json=str(tmp_path / "r.json")))
    assert len(first["prompts"]) == 1 and len(first["prompts"][0]["output_tokens"]) == 12
    assert "identical_to_baseline" not in first["summary"] and first["summary"]["speedup"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["config"]["temperature"] == 0.7
    assert run_demo(demo(tmp_path, **cfg))["prompts"][0]["output_tokens"] == first["prompts"][0]["output_tokens"]
